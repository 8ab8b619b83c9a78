"""FusedDispatch / FusedCombine with AIV-Direct (docs/protocols.md §7, 000 §4.2.1).

Dispatch: every packet written straight into its destination's receive block for this source,
then the counts and the flag, its operation number LAST; poll every source's flag, then group
the packets by local expert. Combine: every row straight into its token die's combine buffer at
(batch slot, k), then that row's completion word (`comm.alltoall.scatter`). The kernels write
a die on another host through its mirror; the packets, counts and flag words are then pushed
and the flag's operation number published (`_carry_dispatch`, MULTIHOST §4 R5).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from comm.alltoall.areas import area_check, block_off, comb_dtype, comb_flat, fused_rows, meta_words
from comm.alltoall.fields import (
    COMBINE,
    DEDUP_CODE,
    DISPATCH,
    G_COUNT,
    G_EVENT,
    G_QUANT,
    G_SEQ,
    QUANT_CODE,
    REFUSED,
    carry_flag,
    mispaired,
    refused,
)
from comm.alltoall.handles import DispatchHandle, DispatchResult, dispatch_result
from comm.alltoall.packets import assemble_dedup, dedup_packer, payload_bits
from comm.alltoall.scatter import wait_slots, write_groups_by_src, write_slots_by_src
from comm.alltoall.state import kernels, place_info, region_addrs
from comm.capture import tokens_of
from comm.endpoint import Endpoint, shifted
from comm.quant import BF16
from comm.routing import DedupLayout, DispatchLayout, Placement
from comm.trace import now_ns
from memory.errors import ProtocolError


def _fused_block(ep: Endpoint, die: int, half: int, count: int) -> tuple:
    """(uint8, int32) flat views of die's whole dispatch block for this source (made once);
    `count` rows are checked to fit, as `fused_rows` does."""
    lo = ep.layout
    area_check(ep, f"fused dispatch block of die {die} for source {ep.die_id}", 0, count,
               lo.fused_disp_rows)  # fmt: skip
    views = ep.a2a.views
    v = views.get(("block", die, half))
    if v is None:
        base = block_off(ep, half, ep.die_id)
        flat = ep.regions[die].array[base : base + lo.fused_disp_rows * lo.pull_disp_stride]
        v = views["block", die, half] = (flat, flat.view(np.int32))
    return v


def fused_dispatch(ep: Endpoint, payload: np.ndarray, scale: np.ndarray, topk_idx: np.ndarray,
                   topk_weights: np.ndarray, quant: str | None, event_id: int,
                   placement: Placement, lay: DispatchLayout | None, t0: int,
                   dl: DedupLayout | None = None) -> DispatchResult:  # fmt: skip
    """Steps 1-3 of FusedDispatch: packets written straight into each destination's buffer
    (one vectorized copy per destination), counts then the completion flag LAST, poll, gather."""
    lo = ep.layout
    st = ep.a2a
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    # Two halves by operation parity: a die that finished operation n (its tokens never touched
    # some peer) may start n+1 before that peer read n; it cannot start n+2 before the peer
    # finished n, since n+1's step 3 waits for the peer's n+1 flag.
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    pb = payload.shape[1] * payload.dtype.itemsize
    info = place_info(ep, placement)
    code = QUANT_CODE[quant] + (DEDUP_CODE if dl is not None else 0)
    if dl is None:  # steps 1-2 for every destination in three compiled calls (`_fused_send`)
        t1 = _fused_send(ep, payload, scale, lay, info, half, op, event_id, code, pb)
    else:  # a dedup row per token and destination, fewer than its messages
        pack = dedup_packer(*payload_bits(payload, pb, scale), dl, lo.pull_disp_stride)
        offs = dl.dest_offsets.tolist()
        for p, d in enumerate(placement.dies):
            a, b = offs[p], offs[p + 1]
            if a < b:  # d's block for this source: at most batch rows, which a block holds
                pack(a, b, *_fused_block(ep, d, half, b - a))
        t1 = now_ns()
        # the counts are of (token, expert) entries, those of the dedup layout (§6.3)
        _fused_flags(ep, dl, info, half, op, event_id, code)
    t2 = now_ns()
    # step 3: every source's flag, then the packets in per-expert order
    if dl is None:
        res, t3 = _fused_receive(ep, half, op, event_id, placement, quant, lay, topk_idx,
                                 topk_weights, pb)  # fmt: skip
    else:
        parts, counts, t3 = fused_gather(
            ep, half, op, event_id, range(ep.num_dies), placement, "", quant, True
        )
        args = (ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "fused")
        res = assemble_dedup(*args, dl)
        if ep.cap is not None:
            n, stride = sum(len(r) for _, r in parts), ep.layout.pull_disp_stride
            ep.cap.op("assemble", 0, n * stride, len(res.x) * stride, t3, unit="aiv", rows=n)
        if not np.array_equal(res.expert_counts, counts):
            raise ProtocolError(
                f"die {ep.die_id}: fused dispatch counts {counts.tolist()} disagree with the"
                f" packets received {res.expert_counts.tolist()}"
            )
    if tr:
        t4 = now_ns()
        for step, a, b in ((1, t0, t1), (2, t1, t2), (3, t2, t4)):
            tr.rec(a, b - a, "fused_dispatch", step, -1, 0, event_id, 0)
        tr.rec(t2, t3 - t2, "fused_dispatch", 3, -1, 1, event_id, 0)
    return res


def fused_gather(ep: Endpoint, half: int, op: int, event_id: int, sources: Iterable[int],
                 placement: Placement, what: str, quant: str | None, dedup: bool = False,
                 writers: Iterable[int] | None = None) -> tuple[list, np.ndarray, int]:  # fmt: skip
    """Wait for the flag of every source (all of them before raising anything), then return
    ([(src, rows)], per-local-expert counts, time the last flag was seen). `writers`: the die
    that writes each source's flag (A2E: its trampoline; default the source itself)."""
    lo = ep.layout
    lw, parts, problems = ep.words[ep.die_id], [], []
    n_mine = place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_mine, np.int64)
    name = "a2e" if what else "fused dispatch"
    sources = list(sources)
    writers = sources if writers is None else list(writers)
    for src, writer in zip(sources, writers, strict=True):
        f = lo.fused_flag_word(half, src)
        ep.acquire(lw, f + G_SEQ, op, writer, f"fused.flag[{half}]{what}")
        count = lw[f + G_COUNT]
        if count == REFUSED:
            problems.append(refused(ep, src, name, op))
        else:
            code = QUANT_CODE[quant] + (DEDUP_CODE if dedup else 0)
            bad = mispaired(ep, name, src, event_id, lw[f + G_EVENT], code, lw[f + G_QUANT])
            if bad is not None:
                problems.append(bad)
        if count != REFUSED and not problems:
            counts += meta_words(ep, ep.die_id, lo.fused_counts_off_of(half, src), n_mine)
            parts.append((src, fused_rows(ep, ep.die_id, half, src, count)))
    if problems:
        raise problems[0]
    return parts, counts, now_ns()


def _fused_send(ep, payload, scale, lay, info, half, op, event_id, code, pb) -> int:
    """FusedDispatch steps 1-2 for every destination: each packet written once, straight into
    its destination's block for this source (`fused_pack`; rows checked by check_capacity),
    then every die's counts, event id, row count and quant code (`fused_counts`), then every
    die's operation number LAST (`fused_seq`). Returns the time the packets were written."""
    lo = ep.layout
    k, mem = kernels(), region_addrs(ep)
    if not payload.flags.writeable:  # the kernels are compiled for writeable arrays only
        payload = payload.copy()
    src8, scale_bits = payload_bits(payload, pb, scale)
    k.fused_pack(mem.addrs, mem.nbytes, info.dies_arr, lay.dest_offsets,
                 block_off(ep, half, ep.die_id),
                 src8, scale_bits, lay.msg_slot, lay.msg_k, lay.msg_local_expert,
                 lo.pull_disp_stride)  # fmt: skip
    t1 = now_ns()
    _fused_flags(ep, lay, info, half, op, event_id, code)
    return t1


def _fused_flags(ep, lay, info, half, op, event_id, code) -> None:
    """FusedDispatch step 2 for every die: its counts per local expert (`lay`'s, a
    DispatchLayout or DedupLayout), event id, rows sent to it and quant code
    (`fused_counts`), then the operation number LAST, in a later call (`fused_seq`)."""
    lo = ep.layout
    k, mem = kernels(), region_addrs(ep)
    flag = lo.fused_flag_word(half, ep.die_id)
    k.fused_counts(mem.addrs, mem.nbytes, info.pos_arr, lay.dest_offsets, lay.num_tokens_per_expert,
                   info.exp_flat, info.exp_start, lo.fused_counts_off_of(half, ep.die_id) // 8,
                   flag, event_id, code)  # fmt: skip
    k.fused_seq(mem.addrs, mem.nbytes, flag + G_SEQ, op)
    if ep.fab.any_remote:
        _carry_dispatch(ep, lay, info, half, op)


def _carry_dispatch(ep: Endpoint, lay, info, half: int, op: int) -> None:
    """FusedDispatch steps 1-2 to the dies on other hosts, after the kernels wrote their
    mirrors, in the protocol's order: this source's packets in every one's block (step 1),
    then each one's counts and flag words, the flag's operation number LAST (step 2:
    `publish`; the mirror's copy of it is this die's shadow)."""
    lo, fab, me = ep.layout, ep.fab, ep.die_id
    stride = lo.pull_disp_stride
    block = block_off(ep, half, me)
    cw = lo.fused_counts_off_of(half, me) // 8
    flag = lo.fused_flag_word(half, me)
    offs, starts = lay.dest_offsets.tolist(), info.exp_start.tolist()
    cap = ep.cap
    order = shifted(ep, range(ep.num_dies))
    for d in order:
        p = info.pos[d]
        if p < 0 or offs[p + 1] == offs[p]:
            continue
        a, b = offs[p], offs[p + 1]
        if cap is not None:  # the rows' messages (this die's own: a local write)
            slots = getattr(lay, "msg_slot", None)  # a dedup layout: a row per token already
            cap.rows(d, b - a, b - a if slots is None else tokens_of(slots[a:b]), stride)
            if d == me:
                cap.put(me, (b - a) * stride, "fused_disp")
        if fab.remote[d]:
            fab.push(d, block, (b - a) * stride)
    for d in order:
        if fab.remote[d]:
            if starts[d + 1] > starts[d]:
                fab.push_words(d, cw, starts[d + 1] - starts[d])
            carry_flag(fab, d, flag, op)


def _fused_receive(ep, half, op, event_id, placement, quant, lay, topk_idx, topk_weights, pb):
    """FusedDispatch step 3: every source's flag (all of them before raising anything), then
    the packets of this die's receive area grouped by local expert in one compiled pass
    (`fused_assemble`, which also checks them against the counts each source wrote).
    Returns (DispatchResult, time the last flag was seen)."""
    lo = ep.layout
    lw, problems = ep.words[ep.die_id], []
    srcs, cnts = [], []
    code = QUANT_CODE[quant]
    for src in range(ep.num_dies):
        f = lo.fused_flag_word(half, src)
        ep.acquire(lw, f + G_SEQ, op, src, f"fused.flag[{half}]")
        count = lw[f + G_COUNT]
        if count == REFUSED:
            problems.append(refused(ep, src, "fused dispatch", op))
            continue
        bad = mispaired(ep, "fused dispatch", src, event_id, lw[f + G_EVENT], code,
                        lw[f + G_QUANT])  # fmt: skip
        if bad is not None:
            problems.append(bad)
            continue
        if not 0 <= count <= lo.fused_disp_rows:
            area_check(ep, f"fused dispatch block of die {ep.die_id} for source {src}", 0,
                       count, lo.fused_disp_rows)  # fmt: skip
        srcs.append(src)
        cnts.append(count)
    if problems:
        raise problems[0]
    t3 = now_ns()
    n_local = place_info(ep, placement).num_local[ep.die_id]
    total = sum(cnts)
    hidden, stride = lo.a2a_hidden, lo.pull_disp_stride
    x = np.empty((total, hidden), np.int8 if quant == "int8" else np.float32)
    scale_bits = np.empty(total, np.int32)
    src_rank, slot, k_index, local = np.empty((4, total), np.int64)
    counts = np.zeros(n_local, np.int64)
    own = ep.a2a.views.get("own")
    if own is None:  # this die's region as flat views, made once
        arr = ep.regions[ep.die_id].array
        own = ep.a2a.views["own"] = (arr, arr.view(np.int32), arr.view(np.int64))
    got = kernels().fused_assemble(
        *own, np.array(srcs, np.int64), np.array(cnts, np.int64),
        block_off(ep, half, 0), lo.fused_disp_rows * stride, lo.fused_counts_off_of(half, 0) // 8,
        lo.a2a_experts_per_die, stride, pb, counts, x.view(np.uint8).reshape(total, pb),
        scale_bits, src_rank, slot, k_index, local,
    )  # fmt: skip
    if got == -(1 << 40):
        raise ProtocolError(
            f"die {ep.die_id}: fused dispatch packets per local expert {counts.tolist()} disagree"
            " with the counts their sources wrote"
        )
    if ep.cap is not None:
        ep.cap.op("assemble", 0, total * stride, total * stride, t3, unit="aiv", rows=total)
    if got < 0:
        raise ProtocolError(
            f"die {ep.die_id}: dispatch rows from die {-1 - got} name a local expert outside"
            f" [0, {n_local}) (not dispatch packets of this placement): nothing read"
        )
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return dispatch_result("fused", quant, placement, lay, topk_idx, topk_weights, op, rows), t3


def fused_combine(
    ep: Endpoint, expert_out: np.ndarray, handle: DispatchHandle, event_id: int
) -> np.ndarray:
    """Steps 1-3 of FusedCombine: each row straight into its token die's buffer at
    (batch_slot, k_index), then that slot's own completion word (the emulation's stand-in for
    the hardware's atomic add, single writer per operation); wait for all routed slots."""
    lo = ep.layout
    st = ep.a2a
    op = st.fused_ops[COMBINE] = st.fused_ops[COMBINE] + 1
    st.fused_combined = handle.op
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    g = handle.groups
    if g is None:
        write_slots_by_src(
            ep, expert_out, handle.recv_src_rank, handle.recv_slot, handle.recv_k, op, event_id
        )
        idx, w = handle.topk_idx, handle.topk_weights
    else:
        write_groups_by_src(ep, expert_out, g, op, event_id)
        idx = handle.dedup.idx_first
        w = np.ones(idx.shape, np.float32)
    t1 = now_ns()
    if g is None:  # the routed (slot, k) and their expert dies: the dispatch's messages
        lay = handle.layout
        r_slot, r_k, owners = lay.msg_slot, lay.msg_k, lay.msg_dest
    else:
        r_slot, r_k = np.nonzero(idx >= 0)
        owners = handle.placement.die_of[idx[r_slot, r_k]]
    wait_slots(ep, r_slot, r_k, op, "fused", owners)
    check_sources(ep, owners, op, event_id, "fused combine")
    t2 = now_ns()
    out = own_weighted_sum(ep, idx, w)
    if ep.cap is not None:
        rows, h = len(r_slot), lo.a2a_hidden
        ep.cap.op("weighted_sum", 2 * rows * h, rows * lo.pull_comb_stride, 2 * len(out) * h, t2,
                  unit="aiv", rows=rows)  # fmt: skip
    if tr:
        t3 = now_ns()
        n_rows = len(handle.recv_src_rank if g is None else g.src)
        nbytes = lo.a2a_combine_bytes * lo.a2a_hidden * n_rows
        for step, a, b, nb in ((1, t0, t1, nbytes), (3, t1, t2, 0), (4, t2, t3, 0)):
            tr.rec(a, b - a, "fused_combine", step, -1, 0, event_id, nb)
    return out


def check_sources(ep: Endpoint, owners: np.ndarray, op: int, event_id: int, what: str) -> None:
    """After the completion words of `op`: PeerRefused if a die that owed rows refused,
    ProtocolError if it wrote them for another event id (calls mis-paired); the lowest such die
    is named. One compiled pass (`comm.kernels.first_bad_source`; np.unique and a scalar read
    per die cost ~4x more at decode sizes)."""
    if not len(owners):
        return
    lo = ep.layout
    refuse = meta_words(ep, ep.die_id, lo.fused_refuse_off, ep.num_dies)
    events = meta_words(ep, ep.die_id, lo.fused_cevent_off, ep.num_dies)
    bad = kernels().first_bad_source(owners, refuse, events, op, event_id)
    if bad < 0:
        return
    d = bad // 2
    if bad % 2 == 0:
        raise refused(ep, d, what, op)
    raise ProtocolError(
        f"die {ep.die_id}: {what} from die {d}: expected event_id {event_id}, its rows"
        f" carry {events[d]} (calls mis-paired)"
    )


def own_weighted_sum(ep: Endpoint, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`weighted_sum` over this die's own fused combine buffer, rows (slot, k) at slot * topk
    + k: the flat view of the buffer is made once (the general entry point re-derives it from
    strides on every call, a third of its cost at decode sizes)."""
    views = ep.a2a.views
    v = views.get("own_comb")
    if v is None:
        lo = ep.layout
        cdt = comb_dtype(ep)
        flat = comb_flat(ep, ep.die_id).view(np.uint16 if cdt == BF16 else np.float32)
        v = views["own_comb"] = (flat, lo.pull_comb_stride // cdt.itemsize)
    flat, stride = v
    return kernels().weighted_sum_flat(flat, stride, idx, w, ep.layout.a2a_hidden)
