"""bfloat16 in registers: the rounding (`round_bf16`), the widening load and the rounding store
the other kernels inline (`load_f32`, `store_f32`, `put_bits`), and the row writers that round
on the way (`to_bfloat16`, `scatter_rows`).

The rounding is IEEE round to nearest, ties to even, of each float32 to bfloat16 (the top 16
bits): NaN stays NaN (quieted, sign kept), inf stays inf, a finite value past the largest
bfloat16 rounds to inf, subnormals round like any other value. `comm.quant.round_combine` (the
reference's side, ml_dtypes) is bit-equal to it (tests/unit/test_bf16.py).
"""

from __future__ import annotations

import llvmlite.ir
import numba
import numba.extending
import numpy as np

from comm.kernels.common import describe, ro
from comm.quant import BF16

_t = numba.types


@numba.njit(inline="always")
def round_bf16(u):  # pragma: no cover - compiled into its callers
    """The bfloat16 bits of float32 bits `u`: NaN kept NaN (sign kept, quieted), else add half an
    ulp of bfloat16, plus one if the kept part is odd (round to nearest, ties to even)."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16(
        (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    )


@numba.extending.intrinsic
def _f32_bits(typingctx, x):  # pragma: no cover - compiled into its callers
    """The bits of float32 `x` as uint32: an LLVM bitcast, no memory round trip. Taking a
    computed value's bits through a one-element array instead (a store and a load per element)
    kept the dedup reduce from vectorizing: 76 against 45 us for 64 rows of two entries at
    hidden 7168."""
    if x != numba.types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvmlite.ir.IntType(32))

    return numba.types.uint32(numba.types.float32), codegen


@numba.extending.intrinsic
def _bits_f32(typingctx, x):  # pragma: no cover - compiled into its callers
    """The float32 whose bits are uint32 `x`: an LLVM bitcast (the widening of bfloat16 bits
    in registers; through a scratch array view it kept the reduce from vectorizing)."""
    if x != numba.types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], llvmlite.ir.FloatType())

    return numba.types.float32(numba.types.uint32), codegen


def load_f32(r, c):  # pragma: no cover - only its compiled overload runs
    """float32 r[c], widened exactly (bits << 16) if r holds bfloat16 bits."""


@numba.extending.overload(load_f32)
def _load_overload(r, c):  # pragma: no cover - compiled into its callers
    """The load chosen by r's dtype at compile time (one loop without a branch per dtype)."""
    if r.dtype == numba.types.uint16:

        def impl(r, c):
            return _bits_f32(np.uint32(np.uint32(r[c]) << np.uint32(16)))

    else:

        def impl(r, c):
            return r[c]

    return impl


_SIG_SCATTER = _t.void(ro(_t.uint32, 2), ro(_t.int64, 1), _t.uint16[::1], ro(_t.int64, 1), _t.int64)


@numba.njit(_SIG_SCATTER, cache=True, nogil=True, boundscheck=False)
def _scatter_round(src, sel, dst, lin, stride):  # pragma: no cover - compiled
    """Row src[sel[i]] (float32 bits) rounded to bfloat16 straight into dst's row lin[i] (rows
    `stride` elements apart): one pass, no rounded temporary. Each row is a contiguous slice on
    both sides, so LLVM vectorizes the loop (0.1 ms for [128, 7168]; indexing dst[r * stride +
    c] directly, or a select instead of the branch, ran 2-8x slower)."""
    h = src.shape[1]
    for i in range(sel.shape[0]):
        s = src[sel[i]]
        base = lin[i] * stride
        d = dst[base : base + h]
        for c in range(h):
            u = s[c]
            d[c] = round_bf16(u)


def to_bfloat16(
    rows: np.ndarray, out: np.ndarray | None = None, order: np.ndarray | None = None
) -> np.ndarray:
    """float32 `[m, hidden]` -> bfloat16 `[n, hidden]`, row i from `rows[order[i]]` (default
    all rows in order, n = m), one pass. `out`: where to write, any bfloat16 `[n, hidden]` view
    whose rows are contiguous and evenly spaced (e.g. the first `hidden` columns of a buffer's
    rows); default a new array."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2:
        raise TypeError(f"rows: expected float32 [n, hidden], got {describe(rows)}")
    m, h = rows.shape
    if order is None:
        order = np.arange(m, dtype=np.int64)
    else:
        order = np.ascontiguousarray(order, dtype=np.int64)
        if order.ndim != 1 or (order.size and not (order.min() >= 0 and order.max() < m)):
            raise ValueError(f"order: expected row indices in [0, {m}), got {describe(order)}")
    n = len(order)
    if out is None:
        out = np.empty((n, h), BF16)
    if not isinstance(out, np.ndarray) or out.dtype != BF16 or out.shape != (n, h):
        raise TypeError(f"out: expected bfloat16 {[n, h]}, got {describe(out)}")
    if not n or not h:
        return out
    if out.strides[1] != 2 or out.strides[0] % 2 or out.strides[0] < 2 * h:
        raise ValueError(f"out: rows must be contiguous and apart, got strides {out.strides}")
    stride = out.strides[0] // 2
    flat = np.lib.stride_tricks.as_strided(out.view(np.uint16), ((n - 1) * stride + h,), (2,))
    _scatter_round(np.ascontiguousarray(rows).view(np.uint32), order, flat,
                   np.arange(n, dtype=np.int64), stride)  # fmt: skip
    return out


_SIG_COPY = _t.void(ro(_t.uint8, 2), ro(_t.int64, 1), _t.uint8[::1], ro(_t.int64, 1), _t.int64)


@numba.njit(_SIG_COPY, cache=True, nogil=True, boundscheck=False)
def _scatter_copy(src, sel, dst, lin, stride):  # pragma: no cover - compiled
    """Row src[sel[i]] (bytes) straight into dst's row lin[i] (rows `stride` bytes apart)."""
    h = src.shape[1]
    for i in range(sel.shape[0]):
        s = src[sel[i]]
        base = lin[i] * stride
        d = dst[base : base + h]
        for c in range(h):
            d[c] = s[c]


def scatter_rows(rows: np.ndarray, sel: np.ndarray, buf: np.ndarray, lin: np.ndarray) -> None:
    """buf[lin[i], :hidden] = rows[sel[i]] for every i, one pass, no gathered temporary; float32
    rows into a bfloat16 buffer are rounded on the way (`to_bfloat16`'s rounding).

    rows: float32 or bfloat16 `[n, hidden]`; buf: `[m, stride]` C-contiguous, bfloat16 or the
    dtype of rows, stride >= hidden (a combine buffer, possibly a peer's); sel, lin: int indices
    (checked: in range of rows and of buf)."""
    n, h = rows.shape
    sel = np.ascontiguousarray(sel, np.int64)
    lin = np.ascontiguousarray(lin, np.int64)
    if sel.shape != lin.shape or sel.ndim != 1:
        raise ValueError(f"sel {sel.shape} and lin {lin.shape} must be one 1-D shape")
    if not sel.size:
        return
    if sel.min() < 0 or sel.max() >= n or lin.min() < 0 or lin.max() >= buf.shape[0]:
        raise ValueError(f"sel / lin out of range: rows {n}, buffer rows {buf.shape[0]}")
    if not buf.flags.c_contiguous or buf.ndim != 2 or buf.shape[1] < h:
        raise ValueError(f"buf: expected C-contiguous [rows, >= {h}], got {describe(buf)}")
    rows = np.ascontiguousarray(rows)
    if rows.dtype == np.float32 and buf.dtype == BF16:
        _scatter_round(rows.view(np.uint32), sel, buf.reshape(-1).view(np.uint16), lin,
                       buf.shape[1])  # fmt: skip
    elif rows.dtype == buf.dtype and rows.dtype in (BF16, np.float32):
        item = rows.dtype.itemsize
        _scatter_copy(rows.view(np.uint8), sel, buf.reshape(-1).view(np.uint8), lin,
                      buf.shape[1] * item)  # fmt: skip
    else:
        raise TypeError(f"rows {rows.dtype} cannot go into a {buf.dtype} buffer")


def store_f32(d, c, v):  # pragma: no cover - only its compiled overload runs
    """d[c] = float32 v, rounded to bfloat16 (as `_scatter_round`) if d holds bfloat16 bits."""


@numba.extending.overload(store_f32)
def _store_overload(d, c, v):  # pragma: no cover - compiled into its callers
    """The store chosen by d's dtype at compile time: one kernel source, a loop without a
    branch for each target dtype (a runtime `bf16` flag tested in the loops kept LLVM from
    vectorizing them once a kernel had several: 8.5 ms against 30 us for 64 rows)."""
    if d.dtype == numba.types.uint16:

        def impl(d, c, v):
            d[c] = round_bf16(_f32_bits(v))

    else:

        def impl(d, c, v):
            d[c] = v

    return impl


def put_bits(v, like):  # pragma: no cover - only its compiled overload runs
    """The element stored for row value v in a buffer of `like`'s dtype: float32 bits (uint32)
    into bfloat16 (uint16) rounded as `_scatter_round` does, anything else as it is."""


@numba.extending.overload(put_bits)
def _put_overload(v, like):  # pragma: no cover - compiled into its callers
    if v == numba.types.uint32 and like.dtype == numba.types.uint16:
        return lambda v, like: round_bf16(v)
    return lambda v, like: v
