"""The combine's reductions, in the order of `comm.reference.combine_ref` bit for bit.

`weighted_sum` / `weighted_sum_flat`: out[slot] = sum over routed k, ascending, of
w[slot, k] * row(slot, k) in float32; `pull_reduce` the same, reading each row in the region of
the die that returned it; `reduce_groups`: the dedup combine's pre-reduced row per (token, die).
"""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.bf16 import load_f32, store_f32
from comm.kernels.common import RO_F32, RO_I64, describe, ro
from comm.kernels.region import region
from comm.quant import BF16

_t = numba.types


_SIG_REDUCE = [
    _t.void(ro(dt, 1), _t.int64, ro(_t.int64, 2), ro(_t.float32, 2), _t.float32[:, ::1])
    for dt in (_t.uint16, _t.float32)
]


@numba.njit(inline="always")
def _add_weighted(o, wk, r):  # pragma: no cover - compiled into its callers
    """o[c] = o[c] + wk * row[c] over the row, float32 product and sum (no fused multiply-add),
    the row widened as `load_f32` reads it."""
    for c in range(o.shape[0]):
        o[c] = o[c] + wk * load_f32(r, c)


@numba.njit(_SIG_REDUCE, cache=True, nogil=True, boundscheck=False)
def _reduce(rows, stride, idx, w, out):  # pragma: no cover - compiled
    """out[b] = sum over routed k, ascending, of w[b, k] * row(b, k), in float32; row (b, k) is
    at [(b * K + k) * stride:][:H] of rows, bfloat16 bits (uint16, widened exactly: bits << 16)
    or float32. Each product and each sum rounded to float32, no fused multiply-add (numba
    leaves fastmath off): the order of comm.reference.combine_ref, bit for bit. The widening is
    a register bitcast inside the one loop per row (`load_f32`), which vectorizes: 69 -> 35 us for
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
                        f" {describe(contrib)}")  # fmt: skip
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


_SIG_GROUPS = [  # read-only inputs (a caller's expert_out may be read-only), two target dtypes
    numba.types.int64(
        numba.types.Array(numba.types.float32, 2, "C", readonly=True), RO_I64, RO_I64,
        RO_F32, numba.types.int64, dst[::1], RO_I64, numba.types.int64, numba.types.int64,
    )
    for dst in (numba.types.uint16, numba.types.float32)
]  # fmt: skip


@numba.njit(_SIG_GROUPS, cache=True, nogil=True, boundscheck=False)
def _reduce_groups(src, pos, start, w, g0, dst, lin, stride,
                   n_dst):  # fmt: skip  # pragma: no cover - compiled
    """For each group g = g0 + i: acc = sum over j in [start[g], start[g+1]), in that order, of
    w[j] * src[pos[j]] in float32 (from +0.0, no fused multiply-add), written to dst's row
    lin[i] (rows `stride` elements apart, n_dst rows), rounded to bfloat16 as `round_bf16`
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
                store_f32(d, c, zero)
            continue
        w0, r0 = w[a], src[pos[a]]
        if b - a == 1:
            for c in range(h):
                store_f32(d, c, zero + w0 * r0[c])
            continue
        w1, r1 = w[a + 1], src[pos[a + 1]]
        if b - a == 2:
            for c in range(h):
                store_f32(d, c, (zero + w0 * r0[c]) + w1 * r1[c])
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
                store_f32(e, c, acc[c] + wl * ql[c])
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
        raise TypeError(f"rows: expected float32 [n, hidden], got {describe(rows)}")
    if buf.dtype not in (BF16, np.float32) or buf.ndim != 2 or not buf.flags.c_contiguous:
        raise TypeError(f"buf: expected C-contiguous bfloat16 or float32 [rows, stride],"
                        f" got {describe(buf)}")  # fmt: skip
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
            _add_weighted(o, w[b, k], region(addrs, src_die[b, k], nbytes, like)[at : at + h])
    return 0
