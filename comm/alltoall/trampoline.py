"""A2E / E2A with trampoline forwarding (docs/protocols.md §8, 001 §3.3, §5.2).

Dies 0..n_att-1 are attention dies, the rest expert dies; the first n_att expert dies are the
trampolines (trampoline of attention die i: n_att + i). A2E: an attention die writes every
packet to its trampoline, which forwards them to the expert dies (A2E'); E2A reverses it.
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.areas import area_check, comb_buf, fused_rows, meta_words
from comm.alltoall.fields import (
    COMBINE,
    DISPATCH,
    G_COUNT,
    G_EVENT,
    G_QUANT,
    G_SEQ,
    QUANT_CODE,
    REFUSED,
    publish_flag,
)
from comm.alltoall.fused import check_sources, fused_gather, own_weighted_sum
from comm.alltoall.handles import A2EHandle, DispatchResult
from comm.alltoall.inputs import (
    QUANTS,
    check_capacity,
    check_event,
    check_expert_out,
    check_inputs,
    describe,
    make_payload,
    refusal_event,
)
from comm.alltoall.packets import assemble
from comm.alltoall.refuse import refuse_slots
from comm.alltoall.scatter import wait_slots, write_slots_by_src
from comm.alltoall.state import a2a_state
from comm.endpoint import Endpoint
from comm.routing import Placement, get_dispatch_layout
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ConfigError, PodError

DEST_SHIFT = 20  # a2e packets carry local_expert | dest_die << DEST_SHIFT in meta word 3


def _a2e_rows(ep: Endpoint, die: int, half: int, count: int) -> np.ndarray:
    """uint8 [count, stride]: the first rows of a trampoline's inbound A2E area (bound checked)."""
    lo = ep.layout
    stride = lo.pull_disp_stride
    area_check(ep, f"a2e inbound area of die {die}", 0, count, lo.pull_disp_rows)
    base = lo.a2e_in_off + half * lo.pull_disp_rows * stride
    return ep.regions[die].array[base : base + count * stride].reshape(count, stride)


def a2e(
    ep: Endpoint,
    x: np.ndarray | None,
    topk_idx: np.ndarray | None,
    topk_weights: np.ndarray | None,
    n_att: int,
    quant: str | None = None,
    event_id: int = 0,
) -> tuple[DispatchResult | None, A2EHandle]:
    """Attention dies -> expert dies through trampolines (two stages); every die calls it.

    Arguments:
        ep: the calling die. Dies 0..n_att-1 are attention dies, the rest expert dies
            (n_exp = num_dies - n_att >= n_att); experts are placed over the expert dies.
        x, topk_idx, topk_weights: an attention die's tokens, as for `dispatch` (None on
            expert dies).
        n_att: number of attention dies.
        quant: None or "int8".
        event_id: int in [0, 2**62) naming the operation; every die passes the same.
    Returns:
        (DispatchResult on expert dies / None on attention dies, A2EHandle for `e2a`).
    Raises:
        an attention die's bad input on that die (after it flagged its trampoline REFUSED);
        PeerRefused on every expert die then. Attention dies do not wait in `a2e`: a refusal
        reaches the other attention dies only through their peers' errors (in a `pod.run`,
        the launcher aborts them).
    """
    st = a2a_state(ep)
    lo = ep.layout
    n_exp = ep.num_dies - n_att
    if not isinstance(n_att, int) or not 1 <= n_att <= n_exp:
        raise ValueError(f"n_att {n_att!r}: need 1 <= n_att <= n_exp ({n_exp} expert dies)")
    exp_dies = tuple(range(n_att, ep.num_dies))
    placement = st.a2e_placement
    if placement is None or placement.dies != exp_dies:
        if lo.a2a_num_experts % n_exp or lo.a2a_num_experts // n_exp > lo.a2a_experts_per_die:
            raise ConfigError(
                f"a2a_max_local_experts: {lo.a2a_num_experts} experts over {n_exp} expert dies"
                f" need {lo.a2a_num_experts / n_exp:g} per die (and must divide evenly); the"
                f" pod's areas are sized for {lo.a2a_experts_per_die}"
            )
        placement = st.a2e_placement = Placement.default(lo.a2a_num_experts, exp_dies)
    me = ep.die_id
    bad: BaseException | None = None
    try:
        event_id = check_event(event_id)
        if quant not in QUANTS:
            raise ValueError(f"quant {quant!r}: choose None or 'int8'")
        quant = None if quant == "none" else quant
        if me < n_att:
            check_inputs(ep, x, topk_idx, topk_weights, quant)
            lay = get_dispatch_layout(topk_idx, placement)
            check_capacity(ep, lay, placement)
            payload, scale = make_payload(x, quant)
    except (ValueError, TypeError) as e:
        bad, event_id = e, refusal_event(event_id)
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    if me < n_att:
        if bad is not None:
            f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
            publish_flag(ep, n_att + me, f, event_id, REFUSED, op)
            raise bad
        _a2e_stage1(ep, payload, scale, lay, n_att + me, half, op, event_id, QUANT_CODE[quant])
        if tr:
            tr.rec(t0, now_ns() - t0, "a2e", 1, n_att + me, 0, event_id, 0)
        handle = A2EHandle(n_att, "attention", None, np.asarray(topk_idx, np.int64),
                           np.asarray(topk_weights, np.float32), None, 1)  # fmt: skip
        return None, handle
    writes, partner = 0, None
    if me < 2 * n_att:  # a trampoline: forward its attention die's packets (A2E')
        partner, writes = _a2e_stage2(ep, me - n_att, half, op, placement)
        if tr:
            tr.rec(t0, now_ns() - t0, "a2e", 2, me - n_att, 0, event_id, 0)
    t1 = now_ns()
    try:
        res = _expert_gather(ep, half, op, event_id, n_att, placement, quant)
    except PodError as e:
        if bad is not None:
            raise bad from e
        raise
    if bad is not None:
        raise bad
    if tr:
        tr.rec(t1, now_ns() - t1, "a2e", 3, -1, 0, event_id, 0)
    return res, A2EHandle(n_att, "expert", res.handle, None, None, partner, writes)


def _a2e_stage1(ep, payload, scale, lay, tramp, half, op, event_id, code) -> None:
    """A2E: every packet of this attention die, and one flag, to its trampoline only."""
    lo = ep.layout
    pb = payload.shape[1] * payload.dtype.itemsize
    n, stride = lay.num_msgs, lo.pull_disp_stride
    rows = _a2e_rows(ep, tramp, half, n)  # remote write into the trampoline
    rows[:, :pb] = payload[lay.msg_slot].view(np.uint8).reshape(n, pb)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    meta[:, 0] = scale[lay.msg_slot].view(np.int32)
    meta[:, 1] = lay.msg_slot
    meta[:, 2] = lay.msg_k
    meta[:, 3] = lay.msg_local_expert | lay.msg_dest << DEST_SHIFT
    f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
    publish_flag(
        ep, tramp, f, event_id, n, op, code
    )  # the one metadata write of this attention die


def _a2e_stage2(ep, att, half, op, placement):
    """A2E': the trampoline forwards its partner's packets to the dies owning the experts, with
    its partner's event id (each expert die checks it) or its refusal."""
    lo = ep.layout
    lw = ep.words[ep.die_id]
    f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
    ep.wait_ge(lw, f + G_SEQ, op, att, f"a2e.flag[{half}]")
    event, n, stride = lw[f + G_EVENT], lw[f + G_COUNT], lo.pull_disp_stride
    code = lw[f + G_QUANT]
    if n == REFUSED:
        for d in placement.dies:
            publish_flag(ep, d, lo.fused_flag_word(half, att), event, REFUSED, op)
        return (np.zeros(0, np.int64), np.zeros(0, np.int64)), len(placement.dies)
    rows = _a2e_rows(ep, ep.die_id, half, n)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    dest = meta[:, 3] >> DEST_SHIFT
    local = meta[:, 3] & ((1 << DEST_SHIFT) - 1)
    for d in placement.dies:
        sel = np.nonzero(dest == d)[0]
        block = fused_rows(ep, d, half, att, len(sel))  # the expert die's block for att
        block[:] = rows[sel]
        block[:, stride - 4 : stride] = local[sel].view(np.uint8).reshape(-1, 4)
        n_local = placement.num_local(d)
        counts = np.bincount(local[sel], minlength=n_local)
        meta_words(ep, d, lo.fused_counts_off_of(half, att), n_local)[:] = counts
        publish_flag(ep, d, lo.fused_flag_word(half, att), event, len(sel), op, code)
    return (meta[:, 1].astype(np.int64), meta[:, 2].astype(np.int64)), len(placement.dies)


def _expert_gather(ep, half, op, event_id, n_att, placement, quant) -> DispatchResult:
    """An expert die waits for the forwarded flags of every attention die and groups rows."""
    lo = ep.layout
    parts, _, _ = fused_gather(
        ep, half, op, event_id, range(n_att), placement, " (forwarded)", quant
    )
    pb = lo.a2a_hidden * (1 if quant == "int8" else 4)
    empty = get_dispatch_layout(np.zeros((0, lo.a2a_topk), np.int64), placement)
    none = np.zeros((0, lo.a2a_topk))
    return assemble(ep, parts, pb, quant, placement, empty, none, none, op, "a2e")


def e2a(
    ep: Endpoint, expert_out: np.ndarray | None, handle: A2EHandle, event_id: int = 0
) -> np.ndarray | None:
    """Expert dies -> attention dies through trampolines (two stages); every die calls it.

    Arguments:
        ep: the calling die.
        expert_out: on expert dies, float32 [n_rows, hidden] aligned with the a2e result rows
            (None on attention dies).
        handle: the A2EHandle from `a2e`.
        event_id: int in [0, 2**62) naming the operation; every die passes the same.
    Returns:
        float32 [batch, hidden] on attention dies (ascending-k float32 reduction, as
        `comm.reference.combine_ref`); None on expert dies.
    Raises:
        an expert die's bad `expert_out` on that die (it still marks the rows it owes as
        refused); PeerRefused on the attention dies whose trampoline forwarded a refusal.
    """
    st = a2a_state(ep)
    if not isinstance(handle, A2EHandle) or handle.role not in ("attention", "expert"):
        raise TypeError(f"handle must be the A2EHandle of a2e, got {describe(handle)}")
    bad: BaseException | None = None
    try:
        event_id = check_event(event_id)
        if handle.role == "expert":
            check_expert_out(ep, expert_out, len(handle.dispatch.recv_src_rank))
    except (ValueError, TypeError) as e:
        bad, event_id = e, refusal_event(event_id)
    op = st.fused_ops[COMBINE] = st.fused_ops[COMBINE] + 1
    if handle.role == "expert":
        _e2a_expert(ep, expert_out, handle, op, event_id, bad)
        if bad is not None:
            raise bad
        return None
    n_att, me = handle.n_att, ep.die_id
    idx, w = handle.topk_idx, handle.topk_weights
    r_slot, r_k = np.nonzero(idx >= 0)
    t0 = now_ns()
    owners = np.full(len(r_slot), n_att + me)
    wait_slots(ep, r_slot, r_k, op, "e2a'", owners)
    if bad is not None:
        raise bad
    check_sources(ep, owners, op, event_id, "e2a")
    t1 = now_ns()
    out = own_weighted_sum(ep, idx, w)
    if ep.trace.enabled:
        ep.trace.rec(t0, t1 - t0, "e2a", 5, me + n_att, 0, event_id, 0)
        ep.trace.rec(t1, now_ns() - t1, "e2a", 6, -1, 0, event_id, 0)
    return out


def _e2a_expert(ep, expert_out, handle, op, event_id, bad) -> None:
    """E2A on an expert die: rows to the trampolines (or its refusal); a trampoline then
    forwards its partner's rows (or a refusal it received) to its attention die (E2A')."""
    lo = ep.layout
    n_att, me, hidden = handle.n_att, ep.die_id, lo.a2a_hidden
    d = handle.dispatch
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    tramp = n_att + d.recv_src_rank  # E2A: each row to its attention die's trampoline
    if bad is None:
        write_slots_by_src(ep, expert_out, tramp, d.recv_slot, d.recv_k, op, event_id)
    else:
        refuse_slots(ep, tramp, d.recv_slot, d.recv_k, op, event_id)
    t1 = now_ns()
    if handle.partner_slots is not None:  # E2A': a trampoline forwards to its partner
        slots, ks = handle.partner_slots
        wait_slots(ep, slots, ks, op, "e2a")
        t2 = now_ns()
        partner = np.full(len(slots), me - n_att, np.int64)
        refuse = meta_words(ep, me, lo.fused_refuse_off, ep.num_dies)
        if any(refuse[e] == op for e in range(n_att, ep.num_dies)):
            refuse_slots(ep, partner, slots, ks, op, event_id)  # pass the refusal on
        else:
            rows = comb_buf(ep, me)[slots * lo.a2a_topk + ks, :hidden]
            write_slots_by_src(ep, rows, partner, slots, ks, op, event_id)
            if tr:
                tr.rec(t1, t2 - t1, "e2a", 3, me - n_att, 0, event_id, 0)
                tr.rec(t2, now_ns() - t2, "e2a", 4, me - n_att, 0, event_id, rows.nbytes)
    if tr and bad is None:
        tr.rec(t0, t1 - t0, "e2a", 1, -1, 0, event_id, expert_out.nbytes)
