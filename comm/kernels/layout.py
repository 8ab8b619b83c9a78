"""The bookkeeping of a dispatch, one compiled pass each: its layout (`dispatch_layout`,
`dedup_layout`).

At decode sizes (a few tokens per die) a dispatch moves a few KB and its cost is the numpy calls
around the bytes (~40 per collective, 1-5 us each): the routing's sort, the grouping by expert,
the combine's send plan. These kernels (and those of `comm.kernels.packets` and
`comm.kernels.plan`) do each in one call; their results are equal to the numpy they replace
(`comm.routing.get_dispatch_layout` and `get_dedup_layout`, the stable argsort of
`comm.alltoall.packets.assemble`, the dedup combine's cuts by source), tests/unit/test_kernels.py.
"""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.common import I64_1D, RO_I64

_LAYOUT_SIG = numba.types.int64(
    numba.types.Array(numba.types.int64, 2, "C", readonly=True), RO_I64, RO_I64, RO_I64,
    numba.types.int64, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D,
)  # fmt: skip


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
    numba.types.Array(numba.types.float32, 2, "C", readonly=True), RO_I64, RO_I64,
    numba.types.int64, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, I64_1D, numba.types.float32[::1],
    numba.types.int64[:, ::1], I64_1D, I64_1D,
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
