"""The combine's send plan (`group_by_dest`, `dedup_plan`) and its completion checks
(`first_pending`, `first_bad_source`), one compiled call each instead of several numpy calls
(`comm.kernels.layout` says why that pays at decode sizes).
"""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.common import I64_1D, RO_I64


@numba.njit(numba.types.int64(RO_I64, RO_I64, RO_I64, *[numba.types.int64] * 3, *[I64_1D] * 3),
            cache=True, nogil=True, boundscheck=False)  # fmt: skip
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


@numba.njit(numba.types.int64(*[RO_I64] * 3, *[numba.types.int64] * 3, *[I64_1D] * 2),
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


_FLAG_SIG = numba.types.int64(RO_I64, RO_I64, RO_I64, numba.types.int64, numba.types.int64)


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
