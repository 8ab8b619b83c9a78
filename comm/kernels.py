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

import llvmlite.ir
import numba
import numba.extending
import numpy as np

from comm.quant import BF16


def _ro(dtype, ndim: int):
    """A read-only C-contiguous array type: kernel inputs are declared so, which takes
    writeable arrays too (numba converts), while a writeable-only signature refuses a caller's
    read-only array (valid input) with a TypeError."""
    return numba.types.Array(dtype, ndim, "C", readonly=True)


_t = numba.types


__all__ = [
    "assemble_count",
    "assemble_place",
    "dedup_count",
    "dedup_layout",
    "dedup_plan",
    "dispatch_layout",
    "first_bad_source",
    "fused_assemble",
    "fused_cflags",
    "fused_counts",
    "fused_pack",
    "fused_scatter",
    "fused_seq",
    "first_pending",
    "group_by_dest",
    "dedup_place",
    "pack_dedup_rows",
    "pack_dedup_rows_raw",
    "pack_rows",
    "pull_reduce",
    "quantize_int8",
    "reduce_groups",
    "reduce_groups_raw",
    "scatter_rows",
    "to_bfloat16",
    "warm",
    "weighted_sum",
    "weighted_sum_flat",
]


@numba.njit(inline="always")
def _bf16(u):  # pragma: no cover - compiled into its callers
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


def _load(r, c):  # pragma: no cover - only its compiled overload runs
    """float32 r[c], widened exactly (bits << 16) if r holds bfloat16 bits."""


@numba.extending.overload(_load)
def _load_overload(r, c):  # pragma: no cover - compiled into its callers
    """The load chosen by r's dtype at compile time (one loop without a branch per dtype)."""
    if r.dtype == numba.types.uint16:

        def impl(r, c):
            return _bits_f32(np.uint32(np.uint32(r[c]) << np.uint32(16)))

    else:

        def impl(r, c):
            return r[c]

    return impl


_SIG_SCATTER = _t.void(
    _ro(_t.uint32, 2), _ro(_t.int64, 1), _t.uint16[::1], _ro(_t.int64, 1), _t.int64
)


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
            d[c] = _bf16(u)


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


_SIG_REDUCE = [
    _t.void(_ro(dt, 1), _t.int64, _ro(_t.int64, 2), _ro(_t.float32, 2), _t.float32[:, ::1])
    for dt in (_t.uint16, _t.float32)
]


@numba.njit(inline="always")
def _add_weighted(o, wk, r):  # pragma: no cover - compiled into its callers
    """o[c] = o[c] + wk * row[c] over the row, float32 product and sum (no fused multiply-add),
    the row widened as `_load` reads it."""
    for c in range(o.shape[0]):
        o[c] = o[c] + wk * _load(r, c)


@numba.njit(_SIG_REDUCE, cache=True, nogil=True, boundscheck=False)
def _reduce(rows, stride, idx, w, out):  # pragma: no cover - compiled
    """out[b] = sum over routed k, ascending, of w[b, k] * row(b, k), in float32; row (b, k) is
    at [(b * K + k) * stride:][:H] of rows, bfloat16 bits (uint16, widened exactly: bits << 16)
    or float32. Each product and each sum rounded to float32, no fused multiply-add (numba
    leaves fastmath off): the order of comm.reference.combine_ref, bit for bit. The widening is
    a register bitcast inside the one loop per row (`_load`), which vectorizes: 69 -> 35 us for
    EP8 b16 (a widening pass into a scratch row first, then the sum, was two trips)."""
    nb, nk = idx.shape
    h = out.shape[1]
    for b in range(nb):
        o = out[b]
        for c in range(h):
            o[c] = np.float32(0.0)
        for k in range(nk):
            if idx[b, k] < 0:
                continue
            base = (b * nk + k) * stride
            _add_weighted(o, w[b, k], rows[base : base + h])


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
    base = contrib.view(np.uint16 if contrib.dtype == BF16 else np.float32)
    flat = np.lib.stride_tricks.as_strided(base, (span,), (item,))
    idx = np.ascontiguousarray(idx, np.int64)
    w = np.ascontiguousarray(w, np.float32)
    _reduce(flat, stride, idx, w, out)
    return out


def weighted_sum_flat(flat: np.ndarray, stride: int, idx: np.ndarray, w: np.ndarray,
                      hidden: int) -> np.ndarray:  # fmt: skip
    """`weighted_sum` over rows (slot, k) at `(slot * k_max + k) * stride` of a flat uint16
    (bfloat16 bits) or float32 buffer that holds every row of `idx`'s shape: the fused
    combine's own buffer, whose flat view the caller makes once. Same result, bit for bit."""
    nb = idx.shape[0]
    out = np.empty((nb, hidden), np.float32)
    if not nb:
        return out
    idx = np.ascontiguousarray(idx, np.int64)
    w = np.ascontiguousarray(w, np.float32)
    _reduce(flat, stride, idx, w, out)
    return out


@numba.njit(_t.void(_ro(_t.uint32, 2), _t.uint32[::1]), cache=True, nogil=True,
            boundscheck=False)  # fmt: skip
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


@numba.njit(_t.void(_ro(_t.float32, 2), _ro(_t.float32, 1), _t.int8[:, ::1]), cache=True,
            nogil=True, boundscheck=False)  # fmt: skip
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


_SIG_COPY = _t.void(_ro(_t.uint8, 2), _ro(_t.int64, 1), _t.uint8[::1], _ro(_t.int64, 1), _t.int64)


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


def _packet_shape(payload, rows, n: int) -> tuple[np.ndarray, int, int]:
    """(payload C-contiguous, its bytes per token, the rows' stride): the checks the packet
    writers share; ValueError unless rows is C-contiguous uint8 [>= n, stride]."""
    if rows.dtype != np.uint8 or not rows.flags.c_contiguous or rows.shape[0] < n:
        raise ValueError(f"rows: expected C-contiguous uint8 [>= {n}, stride]: {_describe(rows)}")
    payload = np.ascontiguousarray(payload)
    return payload, payload.shape[1] * payload.dtype.itemsize, rows.shape[1]


_RO_I64 = numba.types.Array(numba.types.int64, 1, "C", readonly=True)
_PACK_SIG = numba.types.void(
    _ro(_t.uint8, 2), _ro(_t.int32, 1), _RO_I64, _RO_I64, _RO_I64,
    numba.types.uint8[::1], numba.types.int32[::1], numba.types.int64,
)  # fmt: skip


@numba.njit(inline="always")
def _packet(payload, scale_bits, slot, k, loc, dst8, dst32, base, stride):  # pragma: no cover
    """One dispatch packet at byte `base` of dst (`stride` bytes long): payload[slot]'s bytes,
    then in its last 16 bytes scale | slot | k | local expert (int32s)."""
    pb = payload.shape[1]
    s = payload[slot]
    d = dst8[base : base + pb]
    for c in range(pb):
        d[c] = s[c]
    m = (base + stride - 16) // 4
    dst32[m] = scale_bits[slot]
    dst32[m + 1] = np.int32(slot)
    dst32[m + 2] = np.int32(k)
    dst32[m + 3] = np.int32(loc)


@numba.njit(_PACK_SIG, cache=True, nogil=True, boundscheck=False)
def _pack(payload, scale_bits, slots, ks, locs, dst8, dst32, stride):  # pragma: no cover
    """Row i of dst (rows `stride` bytes apart) = the packet of message i, one pass."""
    for i in range(slots.shape[0]):
        _packet(payload, scale_bits, slots[i], ks[i], locs[i], dst8, dst32, i * stride, stride)


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
    payload, pb, stride = _packet_shape(payload, rows, n)
    if stride % 4 or stride < pb + 16:
        raise ValueError(f"rows: stride {stride} cannot hold {pb} payload bytes and 16 of meta")
    if len(ks) != n or len(locs) != n or slots.min() < 0 or slots.max() >= len(payload):
        raise ValueError(f"slots / ks / locs: {n} rows of {len(payload)} tokens expected")
    flat = rows[:n].reshape(-1)
    _pack(payload.view(np.uint8).reshape(len(payload), pb), scale.view(np.int32),
          slots.astype(np.int64, copy=False), ks.astype(np.int64, copy=False),
          locs.astype(np.int64, copy=False), flat, flat.view(np.int32), stride)  # fmt: skip


_RO_I32 = numba.types.Array(numba.types.int32, 1, "C", readonly=True)
_RO_F32 = numba.types.Array(numba.types.float32, 1, "C", readonly=True)
_PACK_DEDUP_SIG = numba.types.int64(
    numba.types.Array(numba.types.uint8, 2, "C", readonly=True), _RO_I32, _RO_I64, _RO_I64,
    _RO_I64, _RO_I64, _RO_F32, numba.types.uint8[::1], numba.types.int32[::1],
    numba.types.int64, numba.types.int64, numba.types.int64,
)  # read-only inputs: a caller's read-only x (quant None) is the payload  # fmt: skip


def _readonly(a, dtype) -> np.ndarray:
    """A read-only C-contiguous view of `a` as `dtype` (a copy only if needed): the kernels'
    signatures take read-only index arrays, as a DedupLayout's are."""
    ok = isinstance(a, np.ndarray) and a.dtype == dtype and a.flags.c_contiguous
    if ok and not a.flags.writeable:
        return a
    v = np.ascontiguousarray(a, dtype).view()
    v.flags.writeable = False
    return v


@numba.njit(_PACK_DEDUP_SIG, cache=True, nogil=True, boundscheck=False)
def _pack_dedup(payload, scale_bits, slots, start, ks, locs, w, dst8, dst32, stride, eoff,
                most):  # fmt: skip  # pragma: no cover - compiled
    """Row i of dst: payload[slots[i]]'s bytes, at byte eoff its entries j in [start[i],
    start[i+1]) as (k, local expert, weight bits) int32 triples, and in its last 16 bytes
    scale | slot | number of entries | -1: a dedup dispatch packet, one pass. Returns 0, or
    -1 (nothing written) if an index is out of range or a row has more than `most` entries."""
    n_ent, batch = ks.shape[0], payload.shape[0]
    for i in range(slots.shape[0]):  # validate everything before the first write
        a, b = start[i], start[i + 1]
        if slots[i] < 0 or slots[i] >= batch or a < 0 or b > n_ent or b - a > most or b < a:
            return -1
    pb = payload.shape[1]
    wb = w.view(np.int32)
    for i in range(slots.shape[0]):
        s = payload[slots[i]]
        base = i * stride
        d = dst8[base : base + pb]
        for c in range(pb):
            d[c] = s[c]
        e = (base + eoff) // 4
        a, b = start[i], start[i + 1]
        for j in range(a, b):
            dst32[e] = np.int32(ks[j])
            dst32[e + 1] = np.int32(locs[j])
            dst32[e + 2] = wb[j]
            e += 3
        m = (base + stride - 16) // 4
        dst32[m] = scale_bits[slots[i]]
        dst32[m + 1] = np.int32(slots[i])
        dst32[m + 2] = np.int32(b - a)
        dst32[m + 3] = np.int32(-1)
    return 0


def pack_dedup_rows(payload: np.ndarray, scale: np.ndarray, slots: np.ndarray,
                    start: np.ndarray, ks: np.ndarray, locs: np.ndarray, w: np.ndarray,
                    rows: np.ndarray, eoff: int) -> None:  # fmt: skip
    """The dedup dispatch packets (one per token and destination die), written once:
    rows[i, :pb] = payload[slots[i]]; at byte `eoff` the entries j in [start[i], start[i+1])
    of ks / locs / w as int32 k, int32 local expert, float32 weight (memory.layout.DEDUP_ENTRY
    bytes each); rows[i, -16:] = scale[slots[i]], slots[i], the entry count, -1
    (PULL_ROW_META).

    payload: `[batch, hidden]` int8 or float32; scale: float32 `[batch]`; slots: int `[n]`;
    start: int `[n + 1]` (indices into ks / locs / w, not necessarily from 0); ks, locs: int,
    w: float32, one per entry; rows: uint8 `[>= n, stride]` C-contiguous with room for
    payload, entries and meta. ValueError (nothing written) for anything out of range."""
    n = len(slots)
    if not n:
        return
    payload, pb, stride = _packet_shape(payload, rows, n)
    if len(start) != n + 1 or len(locs) != len(ks) or len(w) != len(ks):
        raise ValueError("start / ks / locs / w: the entries of the rows do not line up")
    if stride % 4 or eoff % 4 or eoff < pb or eoff + 16 > stride:
        raise ValueError(f"rows: stride {stride} cannot hold {pb} payload bytes at 0, entries"
                         f" at {eoff} and 16 of meta")  # fmt: skip
    flat = rows[:n].reshape(-1)
    i64 = [_readonly(a, np.int64) for a in (slots, start, ks, locs)]
    most = (stride - 16 - eoff) // 12
    got = _pack_dedup(payload.view(np.uint8).reshape(len(payload), pb), scale.view(np.int32),
                      *i64, _readonly(w, np.float32), flat, flat.view(np.int32), stride, eoff,
                      most)  # fmt: skip
    if got:
        raise ValueError(
            f"slots / start: a slot outside [0, {len(payload)}), entries outside the {len(ks)}"
            f" given, or a row of more entries than a stride of {stride} holds ({most});"
            " nothing written"
        )


pack_dedup_rows_raw = _pack_dedup
"""`pack_dedup_rows` without the wrapper's checks and conversions (the compiled pass, which
still proves every index in range and returns -1, nothing written, otherwise): for callers
that pass payload as uint8 [batch, bytes], scales as int32 bits, a DedupLayout's arrays, the
destination rows as flat uint8 and int32 views, and `most` = entries a row has room for."""


_SIG_GROUPS = [  # read-only inputs (a caller's expert_out may be read-only), two target dtypes
    numba.types.int64(
        numba.types.Array(numba.types.float32, 2, "C", readonly=True), _RO_I64, _RO_I64,
        _RO_F32, numba.types.int64, dst[::1], _RO_I64, numba.types.int64, numba.types.int64,
    )
    for dst in (numba.types.uint16, numba.types.float32)
]  # fmt: skip


def _store(d, c, v):  # pragma: no cover - only its compiled overload runs
    """d[c] = float32 v, rounded to bfloat16 (as `_scatter_round`) if d holds bfloat16 bits."""


@numba.extending.overload(_store)
def _store_overload(d, c, v):  # pragma: no cover - compiled into its callers
    """The store chosen by d's dtype at compile time: one kernel source, a loop without a
    branch for each target dtype (a runtime `bf16` flag tested in the loops kept LLVM from
    vectorizing them once a kernel had several: 8.5 ms against 30 us for 64 rows)."""
    if d.dtype == numba.types.uint16:

        def impl(d, c, v):
            d[c] = _bf16(_f32_bits(v))

    else:

        def impl(d, c, v):
            d[c] = v

    return impl


@numba.njit(_SIG_GROUPS, cache=True, nogil=True, boundscheck=False)
def _reduce_groups(src, pos, start, w, g0, dst, lin, stride,
                   n_dst):  # fmt: skip  # pragma: no cover - compiled
    """For each group g = g0 + i: acc = sum over j in [start[g], start[g+1]), in that order, of
    w[j] * src[pos[j]] in float32 (from +0.0, no fused multiply-add), written to dst's row
    lin[i] (rows `stride` elements apart, n_dst rows), rounded to bfloat16 as `_scatter_round`
    when dst holds bfloat16 bits (uint16): the dedup combine's pre-reduced row, one pass.
    Returns 0, or -1 (nothing written) if an index is out of range.

    A group of up to two entries (most of them: a token's top-8 over 8 dies) is one loop from
    its rows to the target, rounding on the way; a longer one sums all but its last entry in
    a chunk of `ch` columns that stays in L1, and adds the last on the way out. Every path does
    the same operations in the same order, ((0 + w0 r0) + w1 r1) + ..., each rounded to
    float32, so the result is that of the plain loop over j (and of comm.reference)."""
    h, n_src, n_pos = src.shape[1], src.shape[0], pos.shape[0]
    cnt = lin.shape[0]
    if g0 < 0 or g0 + cnt >= start.shape[0] or w.shape[0] != n_pos:
        return -1
    for i in range(cnt):  # validate everything before the first write
        a, b = start[g0 + i], start[g0 + i + 1]
        if lin[i] < 0 or lin[i] >= n_dst or a < 0 or b > n_pos or b < a:
            return -1
        for j in range(a, b):
            if pos[j] < 0 or pos[j] >= n_src:
                return -1
    ch = 512  # columns per chunk: acc (2 KiB) stays in L1 while the entries are added
    acc = np.empty(ch, np.float32)
    zero = np.float32(0.0)
    for i in range(cnt):
        g = g0 + i
        a, b = start[g], start[g + 1]
        base = lin[i] * stride
        # the target row as a slice: an index base + c in the loop is 6x slower (it may be
        # negative for all numba knows, so it is wrapped)
        d = dst[base : base + h]
        if b - a == 0:  # no entry: the sum from +0.0 is +0.0
            for c in range(h):
                _store(d, c, zero)
            continue
        w0, r0 = w[a], src[pos[a]]
        if b - a == 1:
            for c in range(h):
                _store(d, c, zero + w0 * r0[c])
            continue
        w1, r1 = w[a + 1], src[pos[a + 1]]
        if b - a == 2:
            for c in range(h):
                _store(d, c, (zero + w0 * r0[c]) + w1 * r1[c])
            continue
        wl, rl = w[b - 1], src[pos[b - 1]]
        for c0 in range(0, h, ch):
            m = min(ch, h - c0)
            q0, q1, ql = r0[c0 : c0 + m], r1[c0 : c0 + m], rl[c0 : c0 + m]
            for c in range(m):
                acc[c] = (zero + w0 * q0[c]) + w1 * q1[c]
            for j in range(a + 2, b - 1):
                wj = w[j]
                r = src[pos[j], c0 : c0 + m]
                for c in range(m):
                    acc[c] = acc[c] + wj * r[c]
            e = d[c0 : c0 + m]
            for c in range(m):
                _store(e, c, acc[c] + wl * ql[c])
    return 0


def reduce_groups(rows: np.ndarray, pos: np.ndarray, start: np.ndarray, w: np.ndarray,
                  g0: int, buf: np.ndarray, lin: np.ndarray) -> None:  # fmt: skip
    """buf[lin[i], :hidden] = sum over j in [start[g], start[g + 1]), in that order, of
    w[j] * rows[pos[j]] (float32, from +0.0), g = g0 + i; rounded to bfloat16 on the way
    into a bfloat16 buffer. One pass; the dedup combine's row per (token, die).

    rows: float32 `[n, hidden]`; pos: int `[m]` row indices; start: int `[groups + 1]`; w:
    float32 `[m]`; buf: `[rows, stride]` C-contiguous bfloat16 or float32, stride >= hidden
    (a combine area or buffer, possibly a peer's); lin: int `[count]` target rows.
    ValueError (nothing written) for an index out of range."""
    rows = np.ascontiguousarray(rows)
    if rows.dtype != np.float32 or rows.ndim != 2:
        raise TypeError(f"rows: expected float32 [n, hidden], got {_describe(rows)}")
    if buf.dtype not in (BF16, np.float32) or buf.ndim != 2 or not buf.flags.c_contiguous:
        raise TypeError(f"buf: expected C-contiguous bfloat16 or float32 [rows, stride],"
                        f" got {_describe(buf)}")  # fmt: skip
    if buf.shape[1] < rows.shape[1]:
        raise ValueError(f"buf: rows of {buf.shape[1]} cannot hold {rows.shape[1]} columns")
    lin = np.ascontiguousarray(lin, np.int64)
    if not len(lin):
        return
    flat = buf.reshape(-1).view(np.uint16 if buf.dtype == BF16 else np.float32)
    got = _reduce_groups(rows, np.ascontiguousarray(pos, np.int64),
                         np.ascontiguousarray(start, np.int64), np.ascontiguousarray(w, np.float32),
                         int(g0), flat, lin, buf.shape[1], buf.shape[0])  # fmt: skip
    if got:
        raise ValueError(
            f"reduce_groups: groups [{g0}, {g0 + len(lin)}) of {len(start) - 1}, row indices of"
            f" {len(rows)} rows or target rows of {buf.shape[0]}: something out of range;"
            " nothing written"
        )


reduce_groups_raw = _reduce_groups
"""`reduce_groups` without the wrapper's conversions (the compiled pass, which proves every
index in range and returns -1, nothing written, otherwise): rows float32 C-contiguous, the
target buffer as a flat uint16 (bfloat16 bits) or float32 view, its stride in elements and
its row count."""


@numba.njit(cache=True, nogil=True, boundscheck=False)
def dedup_count(flat, n, stride, eoff, most, topk, counts):  # pragma: no cover - compiled
    """Check n dedup dispatch rows (uint8 `flat`, rows `stride` bytes apart: meta scale | slot
    | entries | -1, entries (k, local, weight) at byte `eoff`) and add each entry's local expert
    to `counts`. Returns the number of entries, or -1 if a row is malformed (entry count
    outside [1, most], k outside [0, topk), local outside counts): nothing counted then."""
    w32 = flat.view(np.int32)
    n_local = counts.shape[0]
    total = 0
    for r in range(n):
        m = (r * stride + stride - 16) // 4
        ne = w32[m + 2]
        if w32[m + 3] != -1 or ne < 1 or ne > most:
            return -1
        e = (r * stride + eoff) // 4
        for j in range(ne):
            kk, loc = w32[e + 3 * j], w32[e + 3 * j + 1]
            if kk < 0 or kk >= topk or loc < 0 or loc >= n_local:
                return -1
        total += ne
    for r in range(n):
        m = (r * stride + stride - 16) // 4
        e = (r * stride + eoff) // 4
        for j in range(w32[m + 2]):
            counts[w32[e + 3 * j + 1]] += 1
    return total


@numba.njit(cache=True, nogil=True, boundscheck=False)
def dedup_place(flat, n, stride, eoff, src, cursor, g0, x8, bits, meta, groups,
                start):  # fmt: skip  # pragma: no cover - compiled
    """Expand n dedup rows checked by `dedup_count` (source die `src`, groups g0..g0+n-1): each
    entry's payload straight to output row p = cursor[local] (then cursor[local] += 1), with
    bits[0, p] its scale bits and meta[0:4, p] its source, slot, k and local expert; per group
    groups[0:3, g] its source, slot and first k, and its entry range (start[g + 1] = start[g]
    + entries); per entry q, meta[4, q] its output row and bits[1, q] its weight bits. Rows are
    walked in order, so each expert's rows stay in (src, slot, k) order. (The outputs are rows
    of three 2-D arrays, not twelve 1-D ones: a numba call costs ~60 ns per argument.)"""
    w32 = flat.view(np.int32)
    pb = x8.shape[1]
    for r in range(n):
        g = g0 + r
        base = r * stride
        m = (base + stride - 16) // 4
        ne, slot = w32[m + 2], w32[m + 1]
        groups[0, g] = src
        groups[1, g] = slot
        e = (base + eoff) // 4
        groups[2, g] = w32[e]
        a = start[g]
        start[g + 1] = a + ne
        row = flat[base : base + pb]
        for j in range(ne):
            loc = w32[e + 3 * j + 1]
            p = cursor[loc]
            cursor[loc] = p + 1
            meta[4, a + j] = p
            bits[1, a + j] = w32[e + 3 * j + 2]
            d = x8[p]
            for c in range(pb):
                d[c] = row[c]
            bits[0, p] = w32[m]
            meta[0, p] = src
            meta[1, p] = slot
            meta[2, p] = w32[e + 3 * j]
            meta[3, p] = loc


# -- the bookkeeping of a dispatch: layout and grouping, one compiled pass each --------------------
#
# At decode sizes (a few tokens per die) a dispatch moves a few KB and its cost is the numpy calls
# around the bytes (~40 per collective, 1-5 us each): the routing's sort, the grouping by expert.
# These kernels do each in one call; their results are equal to the numpy they replace
# (`comm.routing.get_dispatch_layout` and `get_dedup_layout`, the stable argsort of
# `comm.alltoall.packets.assemble`, the dedup combine's cuts by source), tests/unit/test_kernels.py.


_I64 = numba.types.int64[::1]
_LAYOUT_SIG = numba.types.int64(
    numba.types.Array(numba.types.int64, 2, "C", readonly=True), _RO_I64, _RO_I64, _RO_I64,
    numba.types.int64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64,
)  # fmt: skip
_RO_U8 = numba.types.Array(numba.types.uint8, 1, "C", readonly=True)


@numba.njit(_LAYOUT_SIG, cache=True, nogil=True, boundscheck=False)
def _layout(
    topk,
    pos_of,
    local_of,
    die_of,
    n_pos,
    slot,
    kk,
    dest,
    loc,
    per_die,
    per_expert,
    offsets,
    bucket_start,
):  # pragma: no cover - compiled
    """Counting sort of the routed (slot, k) by (destination position, local expert), then
    (slot, k) ascending. Returns the message count, or -1 for an id outside [-1, E), -2 for an
    expert named twice in one row (nothing usable is written then)."""
    b, k_n = topk.shape
    n_exp = pos_of.shape[0]
    for e in range(n_exp):
        per_expert[e] = 0
    for p in range(n_pos):
        per_die[p] = 0
    for i in range(b):
        for j in range(k_n):
            e = topk[i, j]
            if e < -1 or e >= n_exp:
                return -1
            if e >= 0:
                for jj in range(j):
                    if topk[i, jj] == e:
                        return -2
                per_expert[e] += 1
                per_die[pos_of[e]] += 1
    # bucket of expert e = experts on earlier positions + its local index
    offsets[0] = 0
    for p in range(n_pos):
        offsets[p + 1] = offsets[p] + per_die[p]
    for p in range(n_pos + 1):
        bucket_start[p] = 0
    for e in range(n_exp):
        bucket_start[pos_of[e] + 1] += 1  # experts per position
    for p in range(n_pos):
        bucket_start[p + 1] += bucket_start[p]
    cursor = np.zeros(n_exp, np.int64)
    for e in range(n_exp):  # rows before bucket (pos, local): bucket index -> first message
        cursor[bucket_start[pos_of[e]] + local_of[e]] = per_expert[e]
    acc = 0
    for q in range(n_exp):
        c = cursor[q]
        cursor[q] = acc
        acc += c
    for i in range(b):
        for j in range(k_n):
            e = topk[i, j]
            if e >= 0:
                q = bucket_start[pos_of[e]] + local_of[e]
                at = cursor[q]
                cursor[q] = at + 1
                slot[at] = i
                kk[at] = j
                dest[at] = die_of[e]
                loc[at] = local_of[e]
    return acc


def dispatch_layout(topk: np.ndarray, pos_of: np.ndarray, local_of: np.ndarray,
                    die_of: np.ndarray, n_pos: int) -> tuple | int:  # fmt: skip
    """`comm.routing.get_dispatch_layout`'s arrays in one compiled pass: (num_tokens_per_die,
    num_tokens_per_expert, msg_slot, msg_k, msg_dest, msg_local_expert, dest_offsets), each
    int64, read-only, equal to the numpy version's; or -1 / -2 for an id out of range / named
    twice in a row (the caller raises `check_topk_idx`'s error).

    topk: int64 [batch, k] C-contiguous; pos_of, local_of, die_of: a Placement's int64 tables."""
    b, k_n = topk.shape
    cap = b * k_n
    n_exp = len(pos_of)
    out = np.empty(4 * cap + n_exp + 2 * n_pos + 2 + n_pos, np.int64)
    slot, kk, dest, loc = (out[i * cap : (i + 1) * cap] for i in range(4))
    at = 4 * cap
    per_expert = out[at : at + n_exp]
    per_die = out[at + n_exp : at + n_exp + n_pos]
    offsets = out[at + n_exp + n_pos : at + n_exp + 2 * n_pos + 1]
    scratch = out[at + n_exp + 2 * n_pos + 1 :]
    n = _layout(topk, pos_of, local_of, die_of, n_pos, slot, kk, dest, loc, per_die,
                per_expert, offsets, scratch)  # fmt: skip
    if n < 0:
        return int(n)
    out.flags.writeable = False  # views taken from here on are read-only too
    at = 4 * cap
    return (out[at + n_exp : at + n_exp + n_pos], out[at : at + n_exp], out[:n],
            out[cap : cap + n], out[2 * cap : 2 * cap + n], out[3 * cap : 3 * cap + n],
            out[at + n_exp + n_pos : at + n_exp + 2 * n_pos + 1])  # fmt: skip


_DEDUP_LAYOUT_SIG = numba.types.int64(
    numba.types.Array(numba.types.int64, 2, "C", readonly=True),
    numba.types.Array(numba.types.float32, 2, "C", readonly=True), _RO_I64, _RO_I64,
    numba.types.int64, _I64, _I64, _I64, _I64, _I64, _I64, numba.types.float32[::1],
    numba.types.int64[:, ::1], _I64, _I64,
)  # fmt: skip


@numba.njit(_DEDUP_LAYOUT_SIG, cache=True, nogil=True, boundscheck=False)
def _dedup_layout(
    topk,
    w,
    pos_of,
    local_of,
    n_pos,
    row_slot,
    row_kfirst,
    offsets,
    ent_start,
    ent_k,
    ent_local,
    ent_w,
    idx_first,
    per_expert,
    scratch,
):  # pragma: no cover - compiled
    """Counting sort of the routed (slot, k) into rows by (destination position, slot), a row's
    entries in ascending k; per_expert: entries per expert. Returns the row count, or -1 for an
    id outside [-1, E), -2 for an expert named twice in one row (nothing usable is written
    then). scratch: >= 3 x n_pos."""
    b, k_n = topk.shape
    n_exp = pos_of.shape[0]
    for e in range(n_exp):
        per_expert[e] = 0
    last = scratch[:n_pos]  # the slot that opened the latest row of each position
    rows = scratch[n_pos : 2 * n_pos]  # rows, then the next row, of each position
    ents = scratch[2 * n_pos : 3 * n_pos]  # entries, then the next entry, of each position
    for p in range(n_pos):
        last[p] = -1
        rows[p] = 0
        ents[p] = 0
    for i in range(b):
        for j in range(k_n):
            e = topk[i, j]
            idx_first[i, j] = -1
            if e < -1 or e >= n_exp:
                return -1
            if e >= 0:
                for jj in range(j):
                    if topk[i, jj] == e:
                        return -2
                p = pos_of[e]
                if last[p] != i:
                    last[p] = i
                    rows[p] += 1
                ents[p] += 1
                per_expert[e] += 1
    offsets[0] = 0
    n_ent = 0
    for p in range(n_pos):  # counts -> first row / first entry of each position
        offsets[p + 1] = offsets[p] + rows[p]
        rows[p] = offsets[p]
        c = ents[p]
        ents[p] = n_ent
        n_ent += c
        last[p] = -1
    for i in range(b):  # slots ascending, so each position's rows come out in slot order
        for j in range(k_n):
            e = topk[i, j]
            if e < 0:
                continue
            p = pos_of[e]
            q = ents[p]
            ents[p] = q + 1
            if last[p] != i:  # the token's first expert on this die opens its row
                last[p] = i
                r = rows[p]
                rows[p] = r + 1
                row_slot[r] = i
                row_kfirst[r] = j
                ent_start[r] = q
                idx_first[i, j] = e
            ent_k[q] = j
            ent_local[q] = local_of[e]
            ent_w[q] = w[i, j]
    n_rows = offsets[n_pos]
    ent_start[n_rows] = n_ent
    return n_rows


def dedup_layout(topk: np.ndarray, w: np.ndarray, pos_of: np.ndarray, local_of: np.ndarray,
                 n_pos: int) -> tuple | int:  # fmt: skip
    """`comm.routing.get_dedup_layout`'s arrays in one compiled pass, a counting sort:
    (row_slot, row_kfirst, dest_offsets, ent_start, ent_k, ent_local, ent_w, idx_first,
    num_tokens_per_expert), in `DedupLayout`'s field order, read-only, equal to the numpy
    version's (int64, ent_w float32); or -1 / -2 for an id out of range / named twice in a row
    (the caller raises `comm.routing.check_topk_idx`'s error).

    Why equal: the numpy version sorts the routed (slot, k) by (position, slot, k) and opens a
    row where (slot, position) changes. Here pass 1 counts each position's rows (a token's
    first expert there) and entries; their prefix sums place each position's block; pass 2
    walks slots ascending, k ascending, so within a position rows come in slot order and a
    row's entries in k order: the same sort, without comparisons. A row's entries are
    contiguous because every entry of (slot, position) is placed while that slot is walked.

    topk: int64 [batch, k] C-contiguous; w: float32 [batch, k] C-contiguous (the caller
    converts); pos_of, local_of: a Placement's int64 tables; n_pos: len(placement.dies)."""
    b, k_n = topk.shape
    cap, n_exp = b * k_n, len(pos_of)
    at = 5 * cap + n_pos + 2  # then per_expert, then scratch
    out = np.empty(at + n_exp + 3 * n_pos, np.int64)
    row_slot, row_kfirst, ent_k, ent_local = (out[i * cap : (i + 1) * cap] for i in range(4))
    ent_start = out[4 * cap : 5 * cap + 1]
    offsets = out[5 * cap + 1 : at]
    per_expert = out[at : at + n_exp]
    ent_w = np.empty(cap, np.float32)
    idx_first = np.empty((b, k_n), np.int64)
    n = _dedup_layout(topk, w, pos_of, local_of, n_pos, row_slot, row_kfirst, offsets,
                      ent_start, ent_k, ent_local, ent_w, idx_first, per_expert,
                      out[at + n_exp :])  # fmt: skip
    if n < 0:
        return int(n)
    m = int(ent_start[n])
    for a in (out, ent_w, idx_first):
        a.flags.writeable = False  # views taken from here on are read-only too
    return (out[:n], out[cap : cap + n], out[5 * cap + 1 : at], out[4 * cap : 4 * cap + n + 1],
            out[2 * cap : 2 * cap + m], out[3 * cap : 3 * cap + m], ent_w[:m], idx_first,
            out[at : at + n_exp])  # fmt: skip


@numba.njit(numba.types.int64(_RO_I32, numba.types.int64, numba.types.int64, _I64), cache=True,
            nogil=True, boundscheck=False)  # fmt: skip
def assemble_count(flat32, n, stride, counts):  # pragma: no cover - compiled
    """Add the rows per local expert of n dispatch packets (`stride` bytes apart, their last 16
    bytes scale | slot | k | local as int32) to counts; -1 if a local expert is out of range."""
    n_local = counts.shape[0]
    w = stride // 4
    for i in range(n):
        loc = flat32[(i + 1) * w - 1]
        if loc < 0 or loc >= n_local:
            return -1
        counts[loc] += 1
    return 0


@numba.njit(numba.types.void(_RO_U8, _RO_I32, *[numba.types.int64] * 4, _I64,
                             numba.types.uint8[:, ::1], numba.types.int32[::1], *[_I64] * 4),
            cache=True, nogil=True, boundscheck=False)  # fmt: skip
def assemble_place(
    flat8, flat32, n, stride, pb, src, cursor, x8, scale_bits, out_src, out_slot, out_k, out_local
):  # pragma: no cover - compiled
    """Each of n packets to its place in the grouped output (cursor: the next row of each
    local expert, advanced): payload bytes, scale bits, source, slot, k, local expert. Called
    per source in source order, this is the stable sort by local expert of
    `comm.alltoall.packets.assemble`."""
    w = stride // 4
    for i in range(n):
        m = (i + 1) * w - 4
        loc = flat32[m + 3]
        p = cursor[loc]
        cursor[loc] = p + 1
        row = flat8[i * stride : i * stride + pb]
        d = x8[p]
        for c in range(pb):
            d[c] = row[c]
        scale_bits[p] = flat32[m]
        out_src[p] = src
        out_slot[p] = flat32[m + 1]
        out_k[p] = flat32[m + 2]
        out_local[p] = loc


@numba.njit(numba.types.int64(_RO_I64, _RO_I64, _RO_I64, *[numba.types.int64] * 3,
                              *[_I64] * 3), cache=True, nogil=True, boundscheck=False)  # fmt: skip
def group_by_dest(dest, slots, ks, topk, n_dies, cap, order, lin, starts):  # pragma: no cover
    """The combine's send plan, stable by destination (a counting sort): order[j] = the row
    sent j-th, lin[j] = its (slot * topk + k) in its destination's buffer, rows of die d at
    starts[d]:starts[d + 1]. Returns 0, or -1 if a destination or a (slot, k) is out of range
    (nothing is sent then)."""
    n = dest.shape[0]
    for d in range(n_dies + 1):
        starts[d] = 0
    for i in range(n):
        d = dest[i]
        q = slots[i] * topk + ks[i]
        if d < 0 or d >= n_dies or ks[i] < 0 or ks[i] >= topk or q < 0 or q >= cap:
            return -1
        starts[d + 1] += 1
    for d in range(n_dies):
        starts[d + 1] += starts[d]
    cursor = starts[:n_dies].copy()
    for i in range(n):
        d = dest[i]
        j = cursor[d]
        cursor[d] = j + 1
        order[j] = i
        lin[j] = slots[i] * topk + ks[i]
    return 0


@numba.njit(numba.types.int64(*[_RO_I64] * 3, *[numba.types.int64] * 3, *[_I64] * 2),
            cache=True, nogil=True, boundscheck=False)  # fmt: skip
def dedup_plan(src, slots, kfirst, topk, n_dies, cap, lin, starts):  # pragma: no cover
    """The dedup combine's send plan: lin[g] = slots[g] * topk + kfirst[g], the combine row of
    group g in its source's buffer, and the groups of die d at starts[d]:starts[d + 1]. Groups
    come in source order (`dedup_place` is called per source, ascending), so no reordering:
    the plan is their order. Returns 0, or -1 if a source is out of range or out of order, or
    a (slot, k) outside the combine buffer of `cap` rows (nothing is sent then). The numpy it
    replaces: `lin = slot * topk + kfirst` with the bounds check of `comm.alltoall.refuse`, and
    np.flatnonzero cuts of src."""
    n = src.shape[0]
    for d in range(n_dies + 1):
        starts[d] = 0
    prev = 0
    for i in range(n):
        d, k = src[i], kfirst[i]
        q = slots[i] * topk + k
        if d < prev or d >= n_dies or k < 0 or k >= topk or q < 0 or q >= cap:
            return -1
        prev = d
        starts[d + 1] += 1
        lin[i] = q
    for d in range(n_dies):
        starts[d + 1] += starts[d]
    return 0


_FLAG_SIG = numba.types.int64(_RO_I64, _RO_I64, _RO_I64, numba.types.int64, numba.types.int64)


@numba.njit(_FLAG_SIG, cache=True, nogil=True, boundscheck=False)
def first_pending(flags, slots, ks, topk, op):  # pragma: no cover - compiled
    """Index i of the first (slots[i], ks[i]) whose completion word flags[slot * topk + k] is
    below op, or -1 if every one carries op: the fused combine's readiness test in one call
    (numpy's gather, compare and flatnonzero were three)."""
    for i in range(slots.shape[0]):
        if flags[slots[i] * topk + ks[i]] < op:
            return i
    return -1


@numba.njit(_FLAG_SIG, cache=True, nogil=True, boundscheck=False)
def first_bad_source(owners, refuse, events, op, event_id):  # pragma: no cover - compiled
    """After a fused combine's completion words: 2 * d for the lowest die d of `owners` whose
    refusal word is `op`, else 2 * d + 1 for the lowest one whose event id word is not
    `event_id`, else -1."""
    n = refuse.shape[0]
    owed = np.zeros(n, np.bool_)
    for i in range(owners.shape[0]):
        owed[owners[i]] = True
    for d in range(n):
        if owed[d] and refuse[d] == op:
            return 2 * d
    for d in range(n):
        if owed[d] and events[d] != event_id:
            return 2 * d + 1
    return -1


# -- the fused protocol over every die's region in one call -------------------------------------
# `addrs` is int64 [dies]: where every region of the pod is mapped in this process
# (`comm.alltoall.state.region_addrs`, made once per die), `nbytes` a region's size; `_region`
# makes a flat array of any dtype over die d's region, so one call writes into every destination
# instead of a Python loop of calls per die (~5-15 us per destination at decode sizes). (Numba
# typed lists of views did the same, but compiling their machinery cost every launcher ~1 s.)
# Every polled word a reader waits on is written by a LATER call than the data it guards: a call
# boundary keeps the compiler from moving stores across it, and x86's total store order keeps
# them in program order for the other cores (docs/protocols.md §3).


@numba.extending.intrinsic
def _as_ptr(typingctx, addr, like):  # pragma: no cover - compiled into its callers
    """A pointer to `like`'s dtype at the integer address `addr` (an LLVM inttoptr)."""
    if not isinstance(addr, numba.types.Integer) or not isinstance(like, numba.types.Array):
        return None
    ptype = numba.types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptype))

    return ptype(addr, like), codegen


@numba.njit(inline="always")
def _region(addrs, d, nbytes, like):  # pragma: no cover - compiled into its callers
    """Die d's whole region as a flat array of `like`'s dtype (the mapping outlives every call:
    an endpoint unmaps its regions only when its die ends)."""
    return numba.carray(_as_ptr(addrs[d], like), nbytes // like.itemsize)


_U8, _U16, _I32, _I64 = (np.zeros(0, t) for t in (np.uint8, np.uint16, np.int32, np.int64))


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_pack(addrs, nbytes, dies, offs, base, payload8, scale_bits, slots, ks, locs,
               stride):  # pragma: no cover - compiled  # fmt: skip
    """FusedDispatch step 1 for every destination: the packets of layout rows
    offs[p]:offs[p + 1] into die dies[p]'s block for this source (byte `base` of its region),
    row by row as `pack_rows` writes them (payload, then scale | slot | k | local as int32)."""
    for p in range(dies.shape[0]):
        d8 = _region(addrs, dies[p], nbytes, _U8)
        d32 = _region(addrs, dies[p], nbytes, _I32)
        for i in range(offs[p], offs[p + 1]):
            row = base + (i - offs[p]) * stride
            _packet(payload8, scale_bits, slots[i], ks[i], locs[i], d8, d32, row, stride)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_counts(addrs, nbytes, pos_of, offs, per_expert, exp_flat, exp_start, counts_word,
                 flag_word, event, code):  # pragma: no cover - compiled  # fmt: skip
    """FusedDispatch step 2 for every die d, all but the polled word: the rows per local
    expert into d's counts block for this source (word `counts_word`), then the flag's event
    id, row count and quant code (words from `flag_word`). `fused_seq` stores the operation
    number afterwards, in a later call."""
    for d in range(pos_of.shape[0]):
        w = _region(addrs, d, nbytes, _I64)
        p = pos_of[d]
        a = exp_start[d]
        for j in range(a, exp_start[d + 1]):
            w[counts_word + j - a] = per_expert[exp_flat[j]]
        w[flag_word + 0] = event  # FLAG_EVENT
        w[flag_word + 1] = offs[p + 1] - offs[p] if p >= 0 else 0  # FLAG_COUNT
        w[flag_word + 3] = code  # FLAG_QUANT


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_seq(addrs, nbytes, word, op):  # pragma: no cover - compiled
    """The polled word of every die, LAST: word `word` of every region = op."""
    for d in range(addrs.shape[0]):
        _region(addrs, d, nbytes, _I64)[word] = op


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_assemble(m8, m32, m64, srcs, cnts, block0, block_bytes, cw0, cw_stride, stride, pb,
                   counts, x8, scale_bits, out_src, out_slot, out_k, out_local):  # fmt: skip
    """FusedDispatch step 3 over this die's own receive area (pragma: no cover - compiled):
    source srcs[j]'s cnts[j] packets at byte block0 + src * block_bytes, counted by local
    expert into `counts` (zeros in), checked against the per-expert counts each source wrote
    (words cw0 + src * cw_stride), then placed grouped by local expert, stable in (source,
    slot, k) order: `assemble_count` / `assemble_place` per source, in one call. Returns 0;
    -1 - src for a packet naming a local expert outside [0, len(counts)); -(1 << 40) when the
    packets disagree with the counts words."""
    n_local = counts.shape[0]
    for j in range(srcs.shape[0]):
        a = block0 + srcs[j] * block_bytes
        if assemble_count(m32[a // 4 : (a + cnts[j] * stride) // 4], cnts[j], stride, counts):
            return -1 - srcs[j]
    for e in range(n_local):
        t = 0
        for j in range(srcs.shape[0]):
            t += m64[cw0 + srcs[j] * cw_stride + e]
        if t != counts[e]:
            return -(1 << 40)
    cursor = np.empty(n_local, np.int64)
    acc = 0
    for e in range(n_local):
        cursor[e] = acc
        acc += counts[e]
    for j in range(srcs.shape[0]):
        a = block0 + srcs[j] * block_bytes
        b = a + cnts[j] * stride
        assemble_place(m8[a:b], m32[a // 4 : b // 4], cnts[j], stride, pb, srcs[j], cursor, x8,
                       scale_bits, out_src, out_slot, out_k, out_local)  # fmt: skip
    return 0


def _put(v, like):  # pragma: no cover - only its compiled overload runs
    """The element stored for row value v in a buffer of `like`'s dtype: float32 bits (uint32)
    into bfloat16 (uint16) rounded as `_scatter_round` does, anything else as it is."""


@numba.extending.overload(_put)
def _put_overload(v, like):  # pragma: no cover - compiled into its callers
    if v == numba.types.uint32 and like.dtype == numba.types.uint16:
        return lambda v, like: _bf16(v)
    return lambda v, like: v


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_scatter(rows, order, lin, starts, addrs, nbytes, like, base, stride, cevent_word, me,
                  event):  # pragma: no cover - compiled  # fmt: skip
    """FusedCombine step 1 for every destination d: this die's event id word (cevent_word +
    me), then row order[j] into d's combine buffer row lin[j] (`base` / `stride` in elements of
    `like`'s dtype), for j in starts[d]:starts[d + 1]: float32 bits (uint32) into a bfloat16
    buffer rounded to nearest even on the way (as `_scatter_round`), bfloat16 or float32 bits
    into their own buffer as they are. `fused_cflags` stores the completion words afterwards."""
    h = rows.shape[1]
    for d in range(starts.shape[0] - 1):
        if starts[d] == starts[d + 1]:
            continue
        _region(addrs, d, nbytes, _I64)[cevent_word + me] = event
        dst = _region(addrs, d, nbytes, like)
        for j in range(starts[d], starts[d + 1]):
            s = rows[order[j]]
            at = base + lin[j] * stride
            o = dst[at : at + h]
            for c in range(h):
                o[c] = _put(s[c], like)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_cflags(addrs, nbytes, lin, starts, cflag_word, op):  # pragma: no cover - compiled
    """FusedCombine step 2, LAST: the completion word of every row sent, op."""
    for d in range(starts.shape[0] - 1):
        w = _region(addrs, d, nbytes, _I64)
        for j in range(starts[d], starts[d + 1]):
            w[cflag_word + lin[j]] = op


@numba.njit(cache=True, nogil=True, boundscheck=False)
def pull_reduce(addrs, nbytes, like, dies, offs, first, base, stride, slots, ks, idx, w,
                out):  # pragma: no cover - compiled  # fmt: skip
    """The pull combine's reduce, reading every source's rows where they are: message m of
    this die's layout (position p: offs[p] <= m < offs[p + 1]) came back as row
    first[p] + m - offs[p] of die dies[p]'s combine rows (element `base` of its region, rows
    `stride` elements apart, of `like`'s dtype: bfloat16 bits or float32), for (slots[m],
    ks[m]); out[b] is the sum over routed k, ascending, of w[b, k] * that row: `_reduce`'s
    arithmetic, bit for bit. Returns 0, or -1 (nothing read) if a routed (b, k) has no row: a
    layout out of step."""
    nb, nk = idx.shape
    h = out.shape[1]
    src_die = np.full((nb, nk), -1, np.int64)
    src_at = np.empty((nb, nk), np.int64)
    for p in range(dies.shape[0]):
        for m in range(offs[p], offs[p + 1]):
            src_die[slots[m], ks[m]] = dies[p]
            src_at[slots[m], ks[m]] = base + (first[p] + m - offs[p]) * stride
    for b in range(nb):
        for k in range(nk):
            if idx[b, k] >= 0 and src_die[b, k] < 0:
                return -1
    for b in range(nb):
        o = out[b]
        for c in range(h):
            o[c] = np.float32(0.0)
        for k in range(nk):
            if idx[b, k] < 0:
                continue
            at = src_at[b, k]
            _add_weighted(o, w[b, k], _region(addrs, src_die[b, k], nbytes, like)[at : at + h])
    return 0


def warm() -> None:
    """Load every kernel (compiled at import from the on-disk cache, or compiled there once)
    and run it once, so that a die forked afterwards starts with it ready."""
    to_bfloat16(np.zeros((2, 64), np.float32), np.empty((2, 96), BF16)[:, :64])
    idx, w = np.zeros((1, 2), np.int64), np.ones((1, 2), np.float32)
    weighted_sum(np.zeros((1, 2, 8), BF16), idx, w)
    weighted_sum(np.zeros((1, 2, 8), np.float32), idx, w)
    weighted_sum_flat(np.zeros(16, np.uint16), 8, idx, w, 8)
    weighted_sum_flat(np.zeros(16, np.float32), 8, idx, w, 8)
    z = np.zeros(1, np.int64)
    first_pending(z, z, z, 1, 0)
    first_bad_source(z, z, z, 0, 0)
    _warm_fused()
    quantize_int8(np.ones((2, 8), np.float32))
    one, b16, b32 = np.zeros(1, np.int64), np.zeros((2, 16), BF16), np.zeros((2, 16), np.float32)
    scatter_rows(np.zeros((1, 8), np.float32), one, b16, one)
    scatter_rows(np.zeros((1, 8), BF16), one, b16, one)
    scatter_rows(np.zeros((1, 8), np.float32), one, b32, one)
    ro = np.zeros(1, np.int64)
    ro.flags.writeable = False
    pack_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, ro, ro,
              np.zeros((1, 64), np.uint8))  # fmt: skip
    two = np.array([0, 1], np.int64)
    pack_dedup_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, two, ro, ro,
                    np.ones(1, np.float32), np.zeros((1, 64), np.uint8), 8)  # fmt: skip
    reduce_groups(np.zeros((1, 8), np.float32), one, two, np.ones(1, np.float32), 0, b16, one)
    reduce_groups(np.zeros((1, 8), np.float32), one, two, np.ones(1, np.float32), 0, b32, one)
    packed = np.zeros((1, 64), np.uint8)
    pack_dedup_rows(np.zeros((1, 8), np.int8), np.ones(1, np.float32), ro, two, ro, ro,
                    np.ones(1, np.float32), packed, 8)  # fmt: skip
    flat, counts = packed.reshape(-1), np.zeros(1, np.int64)
    dedup_count(flat, 1, 64, 8, 3, 1, counts)
    i64 = [np.zeros(1, np.int64) for _ in range(8)]
    dedup_place(flat, 1, 64, 8, 0, np.zeros(1, np.int64), 0, np.zeros((1, 8), np.uint8),
                np.zeros((2, 1), np.int32), np.zeros((5, 1), np.int64), np.zeros((3, 1), np.int64),
                np.zeros(2, np.int64))  # fmt: skip
    tables = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.int64)
    group_by_dest(*tables, 1, 1, 2, np.zeros(2, np.int64), np.zeros(2, np.int64),
                  np.zeros(2, np.int64))  # fmt: skip
    dedup_plan(*tables, 1, 1, 2, np.zeros(2, np.int64), np.zeros(2, np.int64))
    dispatch_layout(np.zeros((1, 2), np.int64) - 1, *tables, 1)
    dedup_layout(np.zeros((1, 2), np.int64) - 1, np.ones((1, 2), np.float32), *tables[:2], 1)
    assemble_count(packed.reshape(-1).view(np.int32), 1, 64, counts)
    assemble_place(flat, flat.view(np.int32), 0, 64, 8, 0, np.zeros(1, np.int64),
                   np.zeros((1, 8), np.uint8), np.zeros(1, np.int32), *i64[:4])  # fmt: skip


def _warm_fused() -> None:
    """The fused protocol's many-region kernels, for the types the protocol passes (region
    addresses; read-only layout arrays; writeable payloads and outputs)."""
    region = np.zeros(4096, np.uint8)
    addrs = np.array([region.ctypes.data], np.int64)
    nbytes = len(region)
    ro = np.zeros(2, np.int64)
    ro.flags.writeable = False
    one = np.zeros(1, np.int64)
    fused_pack(addrs, nbytes, one, ro, 0, np.zeros((1, 16), np.uint8), np.zeros(1, np.int32),
               ro, ro, ro, 32)  # fmt: skip
    fused_counts(addrs, nbytes, one, ro, ro, one, np.zeros(2, np.int64), 0, 8, 0, 0)
    fused_seq(addrs, nbytes, 10, 0)
    counts = np.zeros(1, np.int64)
    fused_assemble(region, region.view(np.int32), region.view(np.int64), one,
                   np.zeros(1, np.int64), 0, 64, 16, 1, 32, 16, counts,
                   np.zeros((1, 16), np.uint8), np.zeros(1, np.int32), one.copy(), one.copy(),
                   one.copy(), one.copy())  # fmt: skip
    starts = np.array([0, 0], np.int64)
    for rows, like in ((np.zeros((1, 4), np.uint32), _U16), (np.zeros((1, 4), np.uint16), _U16),
                       (np.zeros((1, 4), np.int32), _I32)):  # fmt: skip
        fused_scatter(rows, one, one, starts, addrs, nbytes, like, 0, 8, 0, 0, 0)
    fused_cflags(addrs, nbytes, one, starts, 0, 0)
    idx, w, out = np.full((1, 1), -1), np.ones((1, 1), np.float32), np.zeros((1, 4), np.float32)
    for like in (_U16, np.zeros(0, np.float32)):
        pull_reduce(addrs, nbytes, like, one, ro, one, 0, 8, ro, ro, idx, w, out)
