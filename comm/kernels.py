"""Compiled per-element kernels of the all-to-all (numba), like the AIV vector kernels of the paper.

numpy runs a pass that is one ufunc at memory speed, but a pass that needs several (a rounding
of float32 to bfloat16 is five integer ufuncs, or ml_dtypes' scalar C loop at ~4x a copy here)
costs several trips over the bytes. A numba kernel does it in one trip, at copy speed:

| float32 [128, 7168] -> bfloat16, this machine | ms |
| --- | --- |
| `np.copyto` of the float32 rows (the floor) | 0.08 |
| this kernel | 0.09 |
| ml_dtypes `astype(bfloat16)` | 0.38-0.50 |
| the same rounding in numpy integer ufuncs | 0.75-0.87 |

The others: `weighted_sum`, the combine's reduce in ascending k (0.17 ms for EP8 b16 against
0.39 ms of numpy passes), and `quantize_int8`, comm.quant's INT8 quantization in two passes
(0.045 ms for [16, 7168] against 0.145 ms). Every kernel is bit-equal to the numpy it replaces
(tests/unit/test_kernels.py); comm.reference keeps the numpy versions.

Kernels are compiled once and cached on disk next to this file (`cache=True`; `make` warms the
cache, so dies load it instead of compiling: ~0.6 s once, then ~0.05 s per process).
`warm()` compiles or loads every kernel of the pod's types.

The rounding is IEEE round to nearest, ties to even, of each float32 to bfloat16 (the top 16
bits): NaN stays NaN (quieted, sign kept), inf stays inf, a finite value past the largest
bfloat16 rounds to inf, subnormals round like any other value. `comm.quant.round_combine` (the
reference's side, ml_dtypes) is bit-equal to it (tests/unit/test_bf16.py).
"""

from __future__ import annotations

import numba
import numpy as np

from comm.quant import BF16

__all__ = [
    "pack_rows",
    "quantize_int8",
    "scatter_rows",
    "to_bfloat16",
    "warm",
    "weighted_sum",
]


_SIG_SCATTER = "void(uint32[:, ::1], int64[::1], uint16[::1], int64[::1], int64)"


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
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):  # NaN: sign kept, quieted
                d[c] = np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
            else:  # add half an ulp of bfloat16, plus one if the kept part is odd (ties to even)
                d[c] = np.uint16(
                    (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
                )


def to_bfloat16(
    rows: np.ndarray, out: np.ndarray | None = None, order: np.ndarray | None = None
) -> np.ndarray:
    """float32 `[m, hidden]` -> bfloat16 `[n, hidden]`, row i from `rows[order[i]]` (default
    all rows in order, n = m), one pass. `out`: where to write, any bfloat16 `[n, hidden]` view
    whose rows are contiguous and evenly spaced (e.g. the first `hidden` columns of a buffer's
    rows); default a new array."""
    if not isinstance(rows, np.ndarray) or rows.dtype != np.float32 or rows.ndim != 2:
        raise TypeError(f"rows: expected float32 [n, hidden], got {_describe(rows)}")
    m, h = rows.shape
    if order is None:
        order = np.arange(m, dtype=np.int64)
    else:
        order = np.ascontiguousarray(order, dtype=np.int64)
        if order.ndim != 1 or (order.size and not (order.min() >= 0 and order.max() < m)):
            raise ValueError(f"order: expected row indices in [0, {m}), got {_describe(order)}")
    n = len(order)
    if out is None:
        out = np.empty((n, h), BF16)
    if not isinstance(out, np.ndarray) or out.dtype != BF16 or out.shape != (n, h):
        raise TypeError(f"out: expected bfloat16 {[n, h]}, got {_describe(out)}")
    if not n or not h:
        return out
    if out.strides[1] != 2 or out.strides[0] % 2 or out.strides[0] < 2 * h:
        raise ValueError(f"out: rows must be contiguous and apart, got strides {out.strides}")
    stride = out.strides[0] // 2
    flat = np.lib.stride_tricks.as_strided(out.view(np.uint16), ((n - 1) * stride + h,), (2,))
    _scatter_round(np.ascontiguousarray(rows).view(np.uint32), order, flat,
                   np.arange(n, dtype=np.int64), stride)  # fmt: skip
    return out


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype} {list(a.shape)}"
    return type(a).__name__


_SIG_REDUCE = (
    "void(uint16[::1], float32[::1], boolean, int64, int64[:, ::1], float32[:, ::1],"
    " float32[:, ::1])"
)


@numba.njit(_SIG_REDUCE, cache=True, nogil=True, boundscheck=False)
def _reduce(rows16, rows32, bf16, stride, idx, w, out):  # pragma: no cover - compiled
    """out[b] = sum over routed k, ascending, of w[b, k] * row(b, k), in float32; row (b, k) is
    at [(b * K + k) * stride:][:H] of rows16 (bfloat16 bits, widened exactly: bits << 16) when
    `bf16`, else of rows32. Each product and each sum rounded to float32, no fused multiply-add
    (numba leaves fastmath off): the order of comm.reference.combine_ref, bit for bit."""
    nb, nk = idx.shape
    h = out.shape[1]
    wide = np.empty(h, np.uint32)
    widened = wide.view(np.float32)
    for b in range(nb):
        o = out[b]
        for c in range(h):
            o[c] = np.float32(0.0)
        for k in range(nk):
            if idx[b, k] < 0:
                continue
            wk = w[b, k]
            base = (b * nk + k) * stride
            if bf16:
                r = rows16[base : base + h]
                for c in range(h):
                    wide[c] = np.uint32(r[c]) << np.uint32(16)
                f = widened
            else:
                f = rows32[base : base + h]
            for c in range(h):
                o[c] = o[c] + wk * f[c]


def weighted_sum(contrib: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out[slot] = sum over routed k (idx >= 0), ascending, of w[slot, k] * contrib[slot, k],
    in float32 (comm.reference.combine_ref's order, bit for bit), in one pass over the rows.

    contrib: bfloat16 or float32 `[batch, k, hidden]`, any view whose rows (slot, k) are
    contiguous and evenly spaced in slot-major order (a combine buffer's rows); unrouted entries
    are never read. idx: int `[batch, k]`; w: float32 `[batch, k]`. Returns float32
    `[batch, hidden]`."""
    if contrib.dtype not in (BF16, np.float32) or contrib.ndim != 3:
        raise TypeError(f"contrib: expected bfloat16 or float32 [batch, k, hidden], got"
                        f" {_describe(contrib)}")  # fmt: skip
    nb, nk, h = contrib.shape
    if idx.shape != (nb, nk) or w.shape != (nb, nk):
        raise ValueError(f"idx {idx.shape} and w {w.shape} must be {[nb, nk]}")
    out = np.empty((nb, h), np.float32)
    if not nb or not h:
        out[:] = 0
        return out
    item = contrib.dtype.itemsize
    s2, s1, s0 = contrib.strides[2], contrib.strides[1], contrib.strides[0]
    if s2 != item or s1 % item or s1 < h * item or (nk > 1 and s0 != nk * s1):
        raise ValueError(f"contrib: rows must be contiguous and evenly spaced: {contrib.strides}")
    stride = s1 // item
    span = (nb * nk - 1) * stride + h
    bf16 = contrib.dtype == BF16
    base = contrib.view(np.uint16 if bf16 else np.float32)
    flat = np.lib.stride_tricks.as_strided(base, (span,), (item,))
    idx = np.ascontiguousarray(idx, np.int64)
    w = np.ascontiguousarray(w, np.float32)
    rows16, rows32 = (flat, _NO_F32) if bf16 else (_NO_U16, flat)
    _reduce(rows16, rows32, bf16, stride, idx, w, out)
    return out


_NO_U16, _NO_F32 = np.zeros(0, np.uint16), np.zeros(0, np.float32)  # the unused rows argument


@numba.njit("void(uint32[:, ::1], uint32[::1])", cache=True, nogil=True, boundscheck=False)
def _row_amax(bits, amax):  # pragma: no cover - compiled
    """amax[r] = the float32 bits of max |x[r]| (0 for an empty row), from x's bits: with the
    sign cleared, float order is integer order, and an integer max vectorizes (a float max
    reduction would need fast-math); bits >= 0x7F800000 mean the row holds inf or NaN."""
    n, h = bits.shape
    mag = np.uint32(0x7FFFFFFF)
    for r in range(n):
        row = bits[r]
        m = np.uint32(0)
        for c in range(h):
            m = max(m, row[c] & mag)
        amax[r] = m


@numba.njit("void(float32[:, ::1], float32[::1], int8[:, ::1])", cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
def _quantize_rows(x, scale, q):  # pragma: no cover - compiled
    """q[r, c] = clip(rint(x[r, c] / scale[r]), -127, 127): float32 division, round half to
    even, as comm.quant.quantize_int8."""
    n, h = x.shape
    lo, hi = np.float32(-127.0), np.float32(127.0)
    for r in range(n):
        row, out, s = x[r], q[r], scale[r]
        for c in range(h):
            v = np.rint(row[c] / s)
            out[c] = np.int8(min(max(v, lo), hi))


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`comm.quant.quantize_int8` of float32 `[n, hidden]` rows in two compiled passes (the row
    maxima, then the quantization), bit for bit its result; a row with inf or NaN is handed to
    it, which raises its ValueError naming the element."""
    from comm.quant import _row_scales
    from comm.quant import quantize_int8 as reference

    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        return reference(x)  # its checks and messages
    x = np.ascontiguousarray(x)
    amax = np.empty(len(x), np.float32)
    _row_amax(x.view(np.uint32), amax.view(np.uint32))
    if not np.isfinite(amax).all():
        return reference(x)  # raises, naming the first non-finite element
    scale = _row_scales(amax)
    q = np.empty(x.shape, np.int8)
    _quantize_rows(x, scale, q)
    return q, scale


_SIG_COPY = "void(uint8[:, ::1], int64[::1], uint8[::1], int64[::1], int64)"


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
        raise ValueError(f"buf: expected C-contiguous [rows, >= {h}], got {_describe(buf)}")
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


_RO_I64 = numba.types.Array(numba.types.int64, 1, "C", readonly=True)
_PACK_SIG = numba.types.void(
    numba.types.uint8[:, ::1], numba.types.int32[::1], _RO_I64, _RO_I64, _RO_I64,
    numba.types.uint8[::1], numba.types.int32[::1], numba.types.int64,
)  # fmt: skip


@numba.njit(_PACK_SIG, cache=True, nogil=True, boundscheck=False)
def _pack(payload, scale_bits, slots, ks, locs, dst8, dst32, stride):  # pragma: no cover
    """Row i of dst (rows `stride` bytes apart): payload[slots[i]]'s bytes, then in its last
    16 bytes scale | slot | k | local expert (int32s): the dispatch packet, one pass."""
    pb = payload.shape[1]
    for i in range(slots.shape[0]):
        s = payload[slots[i]]
        base = i * stride
        d = dst8[base : base + pb]
        for c in range(pb):
            d[c] = s[c]
        m = (base + stride - 16) // 4
        dst32[m] = scale_bits[slots[i]]
        dst32[m + 1] = np.int32(slots[i])
        dst32[m + 2] = np.int32(ks[i])
        dst32[m + 3] = np.int32(locs[i])


def pack_rows(payload: np.ndarray, scale: np.ndarray, slots: np.ndarray, ks: np.ndarray,
              locs: np.ndarray, rows: np.ndarray) -> None:  # fmt: skip
    """The dispatch packets, written once: rows[i, :pb] = payload[slots[i]] (int8 or float32
    bytes), rows[i, -16:] = scale[slots[i]], slots[i], ks[i], locs[i] as int32 (PULL_ROW_META).

    payload: `[batch, hidden]` int8 or float32; scale: float32 `[batch]`; slots, ks, locs: int64
    `[n]` (a DispatchLayout's, read-only is fine); rows: uint8 `[n, stride]` C-contiguous, a
    send area or a peer's receive block, stride a multiple of 4 with room for both."""
    n = len(slots)
    if not n:
        return
    payload = np.ascontiguousarray(payload)
    pb = payload.shape[1] * payload.dtype.itemsize
    stride = rows.shape[1]
    if rows.dtype != np.uint8 or not rows.flags.c_contiguous or rows.shape[0] < n:
        raise ValueError(f"rows: expected C-contiguous uint8 [>= {n}, stride]: {_describe(rows)}")
    if stride % 4 or stride < pb + 16:
        raise ValueError(f"rows: stride {stride} cannot hold {pb} payload bytes and 16 of meta")
    if len(ks) != n or len(locs) != n or slots.min() < 0 or slots.max() >= len(payload):
        raise ValueError(f"slots / ks / locs: {n} rows of {len(payload)} tokens expected")
    flat = rows[:n].reshape(-1)
    _pack(payload.view(np.uint8).reshape(len(payload), pb), scale.view(np.int32),
          slots.astype(np.int64, copy=False), ks.astype(np.int64, copy=False),
          locs.astype(np.int64, copy=False), flat, flat.view(np.int32), stride)  # fmt: skip


def warm() -> None:
    """Load every kernel (compiled at import from the on-disk cache, or compiled there once)
    and run it once, so that a die forked afterwards starts with it ready."""
    to_bfloat16(np.zeros((2, 64), np.float32), np.empty((2, 96), BF16)[:, :64])
    idx, w = np.zeros((1, 2), np.int64), np.ones((1, 2), np.float32)
    weighted_sum(np.zeros((1, 2, 8), BF16), idx, w)
    weighted_sum(np.zeros((1, 2, 8), np.float32), idx, w)
    quantize_int8(np.ones((2, 8), np.float32))
    one, b16, b32 = np.zeros(1, np.int64), np.zeros((2, 16), BF16), np.zeros((2, 16), np.float32)
    scatter_rows(np.zeros((1, 8), np.float32), one, b16, one)
    scatter_rows(np.zeros((1, 8), BF16), one, b16, one)
    scatter_rows(np.zeros((1, 8), np.float32), one, b32, one)
    ro = np.zeros(1, np.int64)
    ro.flags.writeable = False
    pack_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, ro, ro,
              np.zeros((1, 64), np.uint8))  # fmt: skip
