"""Dispatch packets: written once on the source, checked and grouped by local expert on the
receiving die.

Writers: `pack_rows`, `pack_dedup_rows` and `packet` (one packet, which the fused protocol's
`fused_pack` inlines). Readers: `assemble_count` / `assemble_place`, `dedup_count` /
`dedup_place` (a counting sort by local expert). A packet is the payload's bytes and, in its
last 16 bytes, scale | slot | k | local expert as int32 (memory.layout.PULL_ROW_META); a dedup
packet carries its (k, local expert, weight) entries and scale | slot | entries | -1.
"""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.common import I64_1D, RO_F32, RO_I32, RO_I64, describe, ro

_t = numba.types


def _packet_shape(payload, rows, n: int) -> tuple[np.ndarray, int, int]:
    """(payload C-contiguous, its bytes per token, the rows' stride): the checks the packet
    writers share; ValueError unless rows is C-contiguous uint8 [>= n, stride]."""
    if rows.dtype != np.uint8 or not rows.flags.c_contiguous or rows.shape[0] < n:
        raise ValueError(f"rows: expected C-contiguous uint8 [>= {n}, stride]: {describe(rows)}")
    payload = np.ascontiguousarray(payload)
    return payload, payload.shape[1] * payload.dtype.itemsize, rows.shape[1]


_PACK_SIG = numba.types.void(
    ro(_t.uint8, 2), ro(_t.int32, 1), RO_I64, RO_I64, RO_I64,
    numba.types.uint8[::1], numba.types.int32[::1], numba.types.int64,
)  # fmt: skip


@numba.njit(inline="always")
def packet(payload, scale_bits, slot, k, loc, dst8, dst32, base, stride):  # pragma: no cover
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
        packet(payload, scale_bits, slots[i], ks[i], locs[i], dst8, dst32, i * stride, stride)


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


_PACK_DEDUP_SIG = numba.types.int64(
    numba.types.Array(numba.types.uint8, 2, "C", readonly=True), RO_I32, RO_I64, RO_I64,
    RO_I64, RO_I64, RO_F32, numba.types.uint8[::1], numba.types.int32[::1],
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


_RO_U8 = numba.types.Array(numba.types.uint8, 1, "C", readonly=True)


@numba.njit(numba.types.int64(RO_I32, numba.types.int64, numba.types.int64, I64_1D), cache=True,
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


@numba.njit(numba.types.void(_RO_U8, RO_I32, *[numba.types.int64] * 4, I64_1D,
                             numba.types.uint8[:, ::1], numba.types.int32[::1], *[I64_1D] * 4),
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
