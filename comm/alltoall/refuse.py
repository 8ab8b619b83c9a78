"""Refusal: a die with bad input still takes part, so that every die's counters stay in step.

Bad input on one die (issue 8.2): the die validates everything before it publishes. If its input
is invalid it still takes part in the operation as a *refusing* participant: it publishes
`count = COUNT_REFUSED` (no rows) to every peer, waits for every peer's field as usual, and
raises its own error (ValueError / TypeError); every peer raises `PeerRefused` naming it. Every
die's operation counter moves by one, so the next operation is in step on every die, inside the
same `pod.run` or after it. (An unknown `protocol` string cannot say which operation it is
refusing: that die raises at once and its peers time out, or are aborted by the launcher, whose
resync realigns every die's counters.)
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.areas import area_check, meta_words
from comm.alltoall.fields import COMBINE, DISPATCH, F_SEQ, G_SEQ, REFUSED, publish, publish_flag
from comm.alltoall.handles import DispatchHandle
from comm.alltoall.remote import push_combine
from comm.alltoall.scatter import wait_slots
from comm.endpoint import Endpoint


def refuse_dispatch(ep: Endpoint, protocol: str, event_word: int, err: BaseException) -> None:
    """Take part in this dispatch with no rows: COUNT_REFUSED to every die, then wait for every
    die's field or flag of the operation (as a good die would) so the halves stay safe."""
    st = ep.a2a
    lo = ep.layout
    if protocol == "pull":
        op = st.pull_ops[DISPATCH] = st.pull_ops[DISPATCH] + 1
        half = op & 1
        for d in range(ep.num_dies):
            publish(ep, DISPATCH, half, d, event_word, 0, REFUSED, op)
        _wait_fields(ep, lambda src: lo.pull_field_word(DISPATCH, half, src) + F_SEQ, op, err)
        return
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    half = op & 1
    for d in range(ep.num_dies):
        publish_flag(ep, d, lo.fused_flag_word(half, ep.die_id), event_word, REFUSED, op)
    _wait_fields(ep, lambda src: lo.fused_flag_word(half, src) + G_SEQ, op, err)


def refuse_combine(
    ep: Endpoint, handle: DispatchHandle, event_word: int, err: BaseException
) -> None:
    """Take part in this combine without rows. Pull: COUNT_REFUSED to every die and wait for
    every die's field. Fused: fused_refuse = op in every die this die owes rows, then those
    rows' completion words (no payload), then wait for this die's own tokens' words."""
    st = ep.a2a
    lo = ep.layout
    if handle.protocol == "pull":
        op = st.pull_ops[COMBINE] = st.pull_ops[COMBINE] + 1
        half = op & 1
        for d in range(ep.num_dies):
            publish(ep, COMBINE, half, d, event_word, 0, REFUSED, op)
        _wait_fields(ep, lambda src: lo.pull_field_word(COMBINE, half, src) + F_SEQ, op, err)
        return
    op = st.fused_ops[COMBINE] = st.fused_ops[COMBINE] + 1
    st.fused_combined = handle.op
    g = handle.groups
    if g is None:
        refuse_slots(ep, handle.recv_src_rank, handle.recv_slot, handle.recv_k, op, event_word)
    else:
        refuse_slots(ep, g.src, g.slot, g.kfirst, op, event_word)
    idx = handle.topk_idx if handle.dedup is None else handle.dedup.idx_first
    r_slot, r_k = np.nonzero(idx >= 0)
    wait_slots(ep, r_slot, r_k, op, "fused", handle.placement.die_of[idx[r_slot, r_k]])


def refuse_slots(
    ep: Endpoint, dest: np.ndarray, slots: np.ndarray, ks: np.ndarray, op: int, event_word: int
) -> None:
    """Mark this die refused for fused-combine operation `op` in every die of `dest`, then set
    the completion words it owes there (no rows): waiters wake, see the refusal and raise."""
    lo = ep.layout
    topk = lo.a2a_topk
    remote = ep.fab.remote if ep.fab.any_remote else [False] * ep.num_dies
    for d in np.unique(dest).tolist():
        sel = dest == d
        lin = slots[sel] * topk + ks[sel]
        _lin_check(ep, d, lin)
        meta_words(ep, d, lo.fused_cevent_off, ep.num_dies)[ep.die_id] = event_word
        meta_words(ep, d, lo.fused_refuse_off, ep.num_dies)[ep.die_id] = op
        if remote[d]:  # another host: both words pushed, then the completion words published
            push_combine(ep, d, lin, op, refusal=True)
            continue
        # after the refusal word: a waiter that sees op sees the refusal too
        meta_words(ep, d, lo.fused_cflag_off, lo.a2a_max_batch * topk)[lin] = op


def _lin_check(ep: Endpoint, d: int, lin: np.ndarray) -> None:
    """Every (slot, k) row index must lie inside die d's combine buffer."""
    cap = ep.layout.a2a_max_batch * ep.layout.a2a_topk
    if len(lin) and (lin.min() < 0 or lin.max() >= cap):
        bad = int(lin.min()) if lin.min() < 0 else int(lin.max())
        area_check(ep, f"combine buffer of die {d}", bad, 1, cap)


def _wait_fields(ep: Endpoint, word_of, op: int, err: BaseException) -> None:
    """A refusing die waits for every die's polled word of the operation, like a good die."""
    lw = ep.words[ep.die_id]
    for src in range(ep.num_dies):
        try:
            ep.wait_ge(lw, word_of(src), op, src, "all-to-all field (refusing die)")
        except Exception as e:
            raise e from err
