"""A2E / E2A with trampoline forwarding (docs/protocols.md §8, 001 §3.3, §5.2).

A pod split into attention dies and expert dies (`comm.alltoall.split.Split`: given as a Split,
or as n_att for dies 0..n_att-1 attending in one domain). Each attention die has its own
trampoline among the expert dies. A2E: an attention die writes every packet of a micro-batch to
its trampoline, which forwards them to the expert dies (A2E'); E2A reverses it, and the
trampoline ends with a done flag in the attention die's own meta area. The DP domains take turns:
the expert dies serve (domain 0, micro-batch 0), (0, 1), (1, 0), ... in order, each call numbered
pod-wide (`Split.next_op`), so an expert die runs D x m calls per MoE layer while an attention
die runs m, and neither counter desyncs. An expert die may learn the event id from the packets
(`event_id=None`): a persistent loop needs no per-step message (`A2EHandle.event_id`).
A trampoline or expert die on another host is a mirror: each stage pushes the rows and counts
it wrote there, then publishes the flag, seen or completion words (`comm.fabric`).
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.areas import (
    area_check,
    block_off,
    comb_buf,
    comb_dtype,
    comb_flat,
    fused_rows,
    meta_words,
)
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
    refused,
)
from comm.alltoall.fused import fused_gather
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
from comm.alltoall.split import Split, as_split
from comm.alltoall.state import a2a_state, kernels
from comm.capture import captured, tokens_of
from comm.endpoint import Endpoint, shifted
from comm.quant import BF16
from comm.routing import Placement, get_dispatch_layout
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ConfigError, PodError, ProtocolError

DEST_SHIFT = 20  # a2e packets carry local_expert | dest_die << DEST_SHIFT in meta word 3


def _a2e_rows(ep: Endpoint, die: int, half: int, count: int) -> np.ndarray:
    """uint8 [count, stride]: the first rows of a trampoline's inbound A2E area (bound checked)."""
    lo = ep.layout
    stride = lo.pull_disp_stride
    area_check(ep, f"a2e inbound area of die {die}", 0, count, lo.pull_disp_rows)
    base = lo.a2e_in_off + half * lo.pull_disp_rows * stride
    return ep.regions[die].array[base : base + count * stride].reshape(count, stride)


def _flag_word(ep: Endpoint, op: int) -> int:
    """The a2e flag of op's half: a trampoline's inbound flag, an attention die's done flag."""
    return (ep.layout.a2e_flag_off + (op & 1) * L.FIELD_BYTES) // L.WORD


def _split(ep: Endpoint, split: Split | int) -> Split:
    """The checked Split (kept: a decode step calls a2e once per layer and micro-batch)."""
    views = ep.a2a.views
    key = ("split", split)
    got = views.get(key)
    if got is None:
        got = views[key] = as_split(split, ep.num_dies)
    return got


def _placement(ep: Endpoint, split: Split) -> Placement:
    st, lo = ep.a2a, ep.layout
    exp_dies = split.exp_dies
    placement = st.a2e_placement
    if placement is None or placement.dies != exp_dies:
        n_exp = len(exp_dies)
        if lo.a2a_num_experts % n_exp or lo.a2a_num_experts // n_exp > lo.a2a_experts_per_die:
            raise ConfigError(
                f"a2a_max_local_experts: {lo.a2a_num_experts} experts over {n_exp} expert dies"
                f" need {lo.a2a_num_experts / n_exp:g} per die (and must divide evenly); the"
                f" pod's areas are sized for {lo.a2a_experts_per_die}"
            )
        placement = st.a2e_placement = Placement.default(lo.a2a_num_experts, exp_dies)
    return placement


def a2e_align(ep: Endpoint, split: Split | int) -> None:
    """Start a new cycle of `split`'s operation numbers on this die. Every die of the pod calls
    it with the same split before its first A2E of a run (after a resync the counters are the
    maximum over dies, and this rounds them up to one cycle base) and, to run other
    collectives after split ones, at the end of the split's last full cycle (every die's
    counters are then equal)."""
    st = a2a_state(ep)
    sp = _split(ep, split)
    base = sp.round_up(max(st.fused_ops))
    st.fused_ops[:] = [base, base]
    st.a2e_open.clear()
    st.a2e_next_mb = 0


@captured("a2e")
def a2e(
    ep: Endpoint,
    x: np.ndarray | None,
    topk_idx: np.ndarray | None,
    topk_weights: np.ndarray | None,
    split: Split | int,
    quant: str | None = None,
    event_id: int | None = 0,
    microbatch: int = 0,
    slot_base: int = 0,
) -> tuple[DispatchResult | None, A2EHandle]:
    """Attention dies -> expert dies through trampolines (two stages); every die calls it.

    Arguments:
        ep: the calling die.
        x, topk_idx, topk_weights: an attention die's tokens of this micro-batch, as for
            `dispatch` (None on expert dies).
        split: the pod's `Split`, or n_att (dies 0..n_att-1 attend; one domain, one
            micro-batch); the experts are placed over the expert dies.
        quant: None or "int8".
        event_id: int in [0, 2**62) naming the operation; the attention dies of a domain pass
            the same. An expert die may pass None: it takes the event id of the domain's
            packets (all of them must agree) and reports it in the handle.
        microbatch: an attention die's micro-batch index (0..m-1, in order each layer).
        slot_base: the batch slot of the micro-batch's first row in the die's combine buffer
            (micro-batches in flight at once need disjoint slots).
    Returns:
        (DispatchResult on expert dies / None on attention dies, A2EHandle for `e2a`; on an
        expert die it names the call's event id, domain and micro-batch).
    Raises:
        an attention die's bad input on that die (after it flagged its trampoline REFUSED);
        PeerRefused on every expert die then. Attention dies do not wait in `a2e`: a refusal
        reaches the other attention dies only through their peers' errors (in a `pod.run`,
        the launcher aborts them).
    """
    st = a2a_state(ep)
    sp = _split(ep, split)
    placement = _placement(ep, sp)
    me = ep.die_id
    attention = me in sp.att_dies
    mb_next = st.a2e_next_mb  # an attention die's calls are numbered in order, bad ones too
    bad: BaseException | None = None
    try:
        if event_id is None and attention:
            raise ValueError("event_id: an attention die names its operation (None: expert dies)")
        if event_id is not None:
            event_id = check_event(event_id)
        if quant not in QUANTS:
            raise ValueError(f"quant {quant!r}: choose None or 'int8'")
        quant = None if quant == "none" else quant
        if attention:
            _check_microbatch(ep, sp, microbatch, slot_base, x, mb_next)
            check_inputs(ep, x, topk_idx, topk_weights, quant)
            lay = get_dispatch_layout(topk_idx, placement)
            check_capacity(ep, lay, placement)
            payload, scale = make_payload(x, quant)
    except (ValueError, TypeError) as e:
        bad, event_id = e, refusal_event(event_id)
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    if ep.cap is not None and attention and bad is None and quant == "int8":
        b, h = x.shape  # the hardware's: bf16 in, int8 + scale out
        ep.cap.op("quantize", 3 * b * h, 2 * b * h, b * h + 4 * b, unit="aiv", rows=b, hidden=h)
    if attention:
        d = sp.domain_of(me)
        op = st.fused_ops[DISPATCH] = sp.next_op(st.fused_ops[DISPATCH], d, mb_next, False)
        st.a2e_next_mb = (mb_next + 1) % sp.microbatches
        tramp = sp.trampoline(me)
        if bad is not None:
            publish_flag(ep, tramp, _flag_word(ep, op), event_id, REFUSED, op)
            raise bad
        st.a2e_open[op] = (event_id, slot_base, len(x))
        _a2e_stage1(ep, payload, scale, lay, tramp, op, event_id, QUANT_CODE[quant], slot_base)
        if tr:
            tr.rec(t0, now_ns() - t0, "a2e", 1, tramp, 0, event_id, 0)
        handle = A2EHandle(sp, "attention", None, np.asarray(topk_idx, np.int64),
                           np.asarray(topk_weights, np.float32), None, 1, op, event_id,
                           slot_base, tramp, None, d, mb_next)  # fmt: skip
        return None, handle
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    half = op & 1
    d, mb = divmod((op - 1) % sp.cycle, sp.microbatches)
    writes, partner, slots = 0, None, None
    for att in sp.partners(me):
        if att in sp.domains[d]:  # a trampoline: forward its attention die's packets (A2E')
            partner = att
            slots, writes = _a2e_stage2(ep, att, half, op, placement)
            if tr:
                tr.rec(t0, now_ns() - t0, "a2e", 2, att, 0, event_id or 0, 0)
    t1 = now_ns()
    try:
        if event_id is None:
            event_id = _learn_event(ep, sp, half, op, sp.domains[d])
        res = _expert_gather(ep, sp, half, op, event_id, sp.domains[d], placement, quant)
    except PodError as e:
        if bad is not None:
            raise bad from e
        raise
    if bad is not None:
        raise bad
    if tr:
        tr.rec(t1, now_ns() - t1, "a2e", 3, -1, 0, event_id, 0)
    return res, A2EHandle(sp, "expert", res.handle, None, None, slots, writes, op, event_id, 0,
                          -1, partner, d, mb)  # fmt: skip


def _check_microbatch(ep: Endpoint, sp: Split, mb: object, slot_base: object, x,
                      expect: int) -> None:  # fmt: skip
    """An attention die's micro-batch: in order, in slots disjoint from the ones in flight."""
    st = ep.a2a
    if not isinstance(mb, int) or not 0 <= mb < sp.microbatches:
        raise ValueError(f"microbatch {mb!r}: the split has {sp.microbatches} per layer")
    if mb != expect:
        raise ValueError(
            f"microbatch {mb}: expected {expect} (a die's micro-batches go in order each layer)"
        )
    n = len(x) if isinstance(x, np.ndarray) else 0
    if not isinstance(slot_base, int) or slot_base < 0 or slot_base + n > ep.layout.a2a_max_batch:
        raise ValueError(
            f"slot_base {slot_base!r}: rows [{slot_base}, {slot_base}+{n}) outside the combine"
            f" area of {ep.layout.a2a_max_batch} slots"
        )
    for _, base, rows in st.a2e_open.values():
        if base < slot_base + n and slot_base < base + rows:
            raise ValueError(
                f"slot_base {slot_base}: rows [{slot_base}, {slot_base + n}) overlap a"
                f" micro-batch in flight at [{base}, {base + rows})"
            )


def _learn_event(ep: Endpoint, sp: Split, half: int, op: int, sources) -> int:
    """The event id of this operation, from the first source's forwarded flag (the gather
    then checks that every source agrees); the flag's writer is the source's trampoline."""
    lw = ep.words[ep.die_id]
    src = sources[0]
    f = ep.layout.fused_flag_word(half, src)
    ep.acquire(lw, f + G_SEQ, op, sp.trampoline(src), f"fused.flag[{half}] (forwarded)")
    return int(lw[f + G_EVENT])


def _a2e_stage1(ep, payload, scale, lay, tramp, op, event_id, code, slot_base) -> None:
    """A2E: every packet of this attention die, and one flag, to its trampoline only."""
    lo = ep.layout
    pb = payload.shape[1] * payload.dtype.itemsize
    n, stride = lay.num_msgs, lo.pull_disp_stride
    rows = _a2e_rows(ep, tramp, op & 1, n)  # remote write into the trampoline
    rows[:, :pb] = payload[lay.msg_slot].view(np.uint8).reshape(n, pb)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    meta[:, 0] = scale[lay.msg_slot].view(np.int32)
    meta[:, 1] = lay.msg_slot + slot_base
    meta[:, 2] = lay.msg_k
    meta[:, 3] = lay.msg_local_expert | lay.msg_dest << DEST_SHIFT
    if n and ep.fab.any_remote and ep.fab.remote[tramp]:  # its mirror: push the rows
        if ep.cap is not None:
            ep.cap.rows(tramp, n, tokens_of(lay.msg_slot), stride)
        ep.fab.push(tramp, lo.a2e_in_off + (op & 1) * lo.pull_disp_rows * stride, n * stride)
    # the one metadata write of this attention die
    publish_flag(ep, tramp, _flag_word(ep, op), event_id, n, op, code)


def _a2e_stage2(ep, att, half, op, placement):
    """A2E': the trampoline forwards its partner's packets to the dies owning the experts, with
    its partner's event id (each expert die checks it) or its refusal."""
    lo = ep.layout
    lw = ep.words[ep.die_id]
    f = _flag_word(ep, op)
    ep.acquire(lw, f + G_SEQ, op, att, f"a2e.flag[{half}]")
    if lw[f + G_SEQ] != op:
        raise ProtocolError(
            f"die {ep.die_id}: a2e flag of attention die {att} carries operation"
            f" {lw[f + G_SEQ]}, expected {op} (a2e calls out of step)"
        )
    event, n, stride = lw[f + G_EVENT], lw[f + G_COUNT], lo.pull_disp_stride
    code = lw[f + G_QUANT]
    if n == REFUSED:
        for d in placement.dies:
            publish_flag(ep, d, lo.fused_flag_word(half, att), event, REFUSED, op)
        none = np.zeros(0, np.int64)
        return (none, none, none), len(placement.dies)
    rows = _a2e_rows(ep, ep.die_id, half, n)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    dest = meta[:, 3] >> DEST_SHIFT
    local = meta[:, 3] & ((1 << DEST_SHIFT) - 1)
    remote = ep.fab.remote if ep.fab.any_remote else [False] * ep.num_dies
    cw = lo.fused_counts_off_of(half, att)
    sent = []
    for d in shifted(ep, placement.dies):  # every expert die's rows, then counts and flags
        sel = np.nonzero(dest == d)[0]
        block = fused_rows(ep, d, half, att, len(sel))  # the expert die's block for att
        block[:] = rows[sel]
        block[:, stride - 4 : stride] = local[sel].view(np.uint8).reshape(-1, 4)
        n_local = placement.num_local(d)
        meta_words(ep, d, cw, n_local)[:] = np.bincount(local[sel], minlength=n_local)
        if ep.cap is not None and len(sel):  # the forwarded rows' messages (self: local)
            ep.cap.rows(d, len(sel), tokens_of(meta[sel, 1]), stride)
            if not remote[d]:
                ep.cap.put(d, len(sel) * stride, "fused_disp")
        if remote[d] and len(sel):  # its mirror: push the rows (the flag is published)
            ep.fab.push(d, block_off(ep, half, att), len(sel) * stride)
        sent.append((d, len(sel), n_local))
    for d, n_rows, n_local in sent:
        if remote[d]:
            ep.fab.push_words(d, cw // L.WORD, n_local)
        publish_flag(ep, d, lo.fused_flag_word(half, att), event, n_rows, op, code)
    slots, ks = meta[:, 1].astype(np.int64), meta[:, 2].astype(np.int64)
    return (slots, ks, dest.astype(np.int64)), len(placement.dies)


def _expert_gather(ep, sp, half, op, event_id, sources, placement, quant) -> DispatchResult:
    """An expert die waits for the forwarded flags of the domain's attention dies (each
    written by its trampoline) and groups their rows (local expert, source, slot, k)."""
    lo = ep.layout
    t0 = now_ns()
    writers = [sp.trampoline(a) for a in sources]
    parts, _, _ = fused_gather(ep, half, op, event_id, sources, placement, " (forwarded)", quant,
                               writers=writers)  # fmt: skip
    if ep.cap is not None:
        n, stride = sum(len(r) for _, r in parts), lo.pull_disp_stride
        ep.cap.op("assemble", 0, n * stride, n * stride, t0, unit="aiv", rows=n)
    pb = lo.a2a_hidden * (1 if quant == "int8" else 4)
    empty = get_dispatch_layout(np.zeros((0, lo.a2a_topk), np.int64), placement)
    none = np.zeros((0, lo.a2a_topk))
    return assemble(ep, parts, pb, quant, placement, empty, none, none, op, "a2e")


@captured("e2a")
def e2a(
    ep: Endpoint, expert_out: np.ndarray | None, handle: A2EHandle, event_id: int | None = 0
) -> np.ndarray | None:
    """Expert dies -> attention dies through trampolines (two stages); every die calls it, once
    per `a2e`, with that call's handle (an attention die: its micro-batches in any order).

    Arguments:
        ep: the calling die.
        expert_out: on expert dies, float32 [n_rows, hidden] aligned with the a2e result rows
            (None on attention dies).
        handle: the A2EHandle from `a2e`.
        event_id: int in [0, 2**62) naming the operation; every die passes the same (None: the
            handle's, which an expert die may have learned from the packets).
    Returns:
        float32 [batch, hidden] on attention dies, the micro-batch's rows (ascending-k float32
        reduction, as `comm.reference.combine_ref`); None on expert dies.
    Raises:
        an expert die's bad `expert_out` on that die (it still marks the rows it owes as
        refused); PeerRefused on the attention dies whose trampoline forwarded a refusal.
    """
    st = a2a_state(ep)
    if not isinstance(handle, A2EHandle) or handle.role not in ("attention", "expert"):
        raise TypeError(f"handle must be the A2EHandle of a2e, got {describe(handle)}")
    bad: BaseException | None = None
    try:
        event_id = handle.event_id if event_id is None else check_event(event_id)
        if handle.role == "expert":
            check_expert_out(ep, expert_out, len(handle.dispatch.recv_src_rank))
    except (ValueError, TypeError) as e:
        bad, event_id = e, refusal_event(event_id)
    op = handle.op
    st.fused_ops[COMBINE] = max(st.fused_ops[COMBINE], op)
    if handle.role == "expert":
        _e2a_expert(ep, expert_out, handle, op, event_id, bad)
        if bad is not None:
            raise bad
        return None
    tramp, base = handle.trampoline, handle.slot_base
    idx, w = handle.topk_idx, handle.topk_weights
    t0 = now_ns()
    # the trampoline's done flag for this operation, in this die's own a2e flag (unused on an
    # attention die), written after the rows: a die with no routed row waits for it too, so
    # no attention die runs a cycle ahead of the areas
    f = _flag_word(ep, op)
    lw = ep.words[ep.die_id]
    ep.acquire(lw, f + G_SEQ, op, tramp, f"e2a'.done[{op & 1}]")
    st.a2e_open.pop(op, None)
    if bad is not None:
        raise bad
    if lw[f + G_SEQ] != op:
        raise ProtocolError(
            f"die {ep.die_id}: e2a done flag of trampoline {tramp} carries operation"
            f" {lw[f + G_SEQ]}, expected {op} (a2e / e2a calls out of step)"
        )
    if lw[f + G_COUNT] == REFUSED:
        raise refused(ep, tramp, "e2a", op)
    if lw[f + G_EVENT] != event_id:
        raise ProtocolError(
            f"die {ep.die_id}: e2a from die {tramp}: expected event_id {event_id}, its rows"
            f" carry {lw[f + G_EVENT]} (calls mis-paired)"
        )
    r_slot, r_k = np.nonzero(idx >= 0)
    wait_slots(ep, r_slot + base, r_k, op, "e2a'", np.full(len(r_slot), tramp))  # done: a check
    t1 = now_ns()
    out = _weighted_sum_at(ep, idx, w, base)
    if ep.cap is not None:
        rows, h = len(r_slot), ep.layout.a2a_hidden
        ep.cap.op("weighted_sum", 2 * rows * h, rows * ep.layout.pull_comb_stride,
                  2 * len(out) * h, t1, unit="aiv", rows=rows)  # fmt: skip
    if ep.trace.enabled:
        ep.trace.rec(t0, t1 - t0, "e2a", 5, tramp, 0, event_id, 0)
        ep.trace.rec(t1, now_ns() - t1, "e2a", 6, -1, 0, event_id, 0)
    return out


def _weighted_sum_at(ep: Endpoint, idx: np.ndarray, w: np.ndarray, base: int) -> np.ndarray:
    """`weighted_sum` over this die's own combine buffer from slot `base` on."""
    lo = ep.layout
    views = ep.a2a.views
    v = views.get("own_comb")
    if v is None:
        cdt = comb_dtype(ep)
        flat = comb_flat(ep, ep.die_id).view(np.uint16 if cdt == BF16 else np.float32)
        v = views["own_comb"] = (flat, lo.pull_comb_stride // cdt.itemsize)
    flat, stride = v
    return kernels().weighted_sum_flat(flat[base * lo.a2a_topk * stride :], stride, idx, w,
                                       lo.a2a_hidden)  # fmt: skip


def _e2a_expert(ep, expert_out, handle, op, event_id, bad) -> None:
    """E2A on an expert die: rows to the trampolines (or its refusal); a trampoline then
    forwards its partner's rows (or a refusal it received) to its attention die (E2A'), then
    the partner's done flag."""
    lo = ep.layout
    me, hidden = ep.die_id, lo.a2a_hidden
    att_dies = handle.split.att_dies
    d = handle.dispatch
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    table = _tramp_table(ep, handle.split)
    tramp = table[d.recv_src_rank]  # each row to its trampoline
    if bad is None:
        write_slots_by_src(ep, expert_out, tramp, d.recv_slot, d.recv_k, op, event_id)
    else:
        refuse_slots(ep, tramp, d.recv_slot, d.recv_k, op, event_id)
    t1 = now_ns()
    # this die finished the operation: every trampoline of the domain learns it (after the rows)
    for a in handle.split.domains[handle.domain]:
        t = int(table[a])
        if ep.fab.any_remote and ep.fab.remote[t]:  # a guard word: published after the rows
            ep.fab.publish(t, lo.a2e_seen_off // L.WORD + me, op)
        else:
            meta_words(ep, t, lo.a2e_seen_off, ep.num_dies)[me] = op
    if handle.partner is not None:  # E2A': a trampoline forwards to its partner
        att = handle.partner
        slots, ks, owners = handle.partner_slots
        wait_slots(ep, slots, ks, op, "e2a", owners)
        # and every expert die finished it: none still reads a block the next calls reuse
        lw = ep.words[me]
        base = lo.a2e_seen_off // L.WORD
        for x in handle.split.exp_dies:
            ep.acquire(lw, base + x, op, x, "a2e.seen (its E2A of the operation)")
        t2 = now_ns()
        partner = np.full(len(slots), att, np.int64)
        refuse = meta_words(ep, me, lo.fused_refuse_off, ep.num_dies)
        f = _flag_word(ep, op)
        if any(refuse[e] == op for e in range(ep.num_dies) if e not in att_dies):
            refuse_slots(ep, partner, slots, ks, op, event_id)  # pass the refusal on
            publish_flag(ep, att, f, event_id, REFUSED, op)
        else:
            rows = comb_buf(ep, me)[slots * lo.a2a_topk + ks, :hidden]
            write_slots_by_src(ep, rows, partner, slots, ks, op, event_id)
            publish_flag(ep, att, f, event_id, len(slots), op)  # done, after the rows
            if tr:
                tr.rec(t1, t2 - t1, "e2a", 3, att, 0, event_id, 0)
                tr.rec(t2, now_ns() - t2, "e2a", 4, att, 0, event_id, rows.nbytes)
    if tr and bad is None:
        tr.rec(t0, t1 - t0, "e2a", 1, -1, 0, event_id, expert_out.nbytes)


def _tramp_table(ep: Endpoint, split: Split) -> np.ndarray:
    """int64 [num_dies]: the trampoline of each attention die (by die id), made once."""
    views = ep.a2a.views
    table = views.get(("trampolines", split))
    if table is None:
        table = np.full(ep.num_dies, -1, np.int64)
        for a in split.att_dies:
            table[a] = split.trampoline(a)
        views["trampolines", split] = table
    return table
