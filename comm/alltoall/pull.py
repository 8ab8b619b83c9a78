"""XCCL pull-based dispatch / combine (docs/protocols.md §6, 001 §3.2), and the entry points.

`dispatch` and `combine` are the entry points of both protocols: they check the input (a die
with bad input refuses, `comm.alltoall.refuse`), hand protocol="fused" to `comm.alltoall.fused`
and run the pull protocol themselves.

Fields: in every die's meta area, `pull[kind][half][src]` (kind 0 dispatch, 1 combine), written
only by `src`: | event_id | off (row) | count | seq |, seq (the per-kind operation number, the
same on every die) stored LAST (`comm.alltoall.fields`). Areas: in every die's managed area, per
kind, two halves of send rows; operation n uses half n % 2 (the paper alternates by event-id
parity; caller event ids need not be consecutive here, so the internal operation number decides).

Dispatch steps (the trace records each):
1-2. load tokens (MTE2) and, with quant="int8", quantize per token (scales travel with them);
3.   write every (token, expert) message into this die's OWN send area, blocks by destination in
     the canonical send order (`comm.routing.get_dispatch_layout`), one vectorized gather;
4.   write offset and count, then seq, into each destination's field for this source;
5.   poll this die's own fields until every source's seq is the operation number;
6.   pull (remote read) every source's block for this die (a source on another host: `pull`
     the block into its mirror, then read it there);
7.   write it to the output, rows grouped by local expert, then (src_rank, batch_slot, k_index).
Combine mirrors it: expert rows into this die's own combine area, blocks by source, fields to
every source, poll, pull, and reduce `out[slot] = sum_k w[slot, k] * row(slot, k)` in ascending
k in float32, the exact operation order of `comm.reference.combine_ref`. Combine rows travel in
the pod's `a2a_combine_dtype`: bfloat16 by default (the paper's 16-bit combine message; each
float32 expert row is rounded to nearest even once, on the expert die, and widened exactly on
the token's die), or float32.

Reuse of a half: a die starts operation n+2 (overwriting half n % 2) only after step 5 of n+1,
which needs every peer's step 4 of n+1, which each peer does only after finishing its pulls of
n. Dispatch and combine have separate fields and areas. A die that finds a problem (a peer's
refusal, a mis-paired event id) still waits for every peer's field of the operation before it
raises, so this argument holds after errors too.
"""

from __future__ import annotations

import numpy as np

from comm.alltoall.areas import area_check, comb_dtype, flat_elems, pull_rows
from comm.alltoall.fields import (
    COMBINE,
    DEDUP_CODE,
    DISPATCH,
    OP_CODE_MASK,
    QUANT_CODE,
    poll_fields,
    publish,
)
from comm.alltoall.fused import fused_combine, fused_dispatch
from comm.alltoall.handles import DedupGroups, DispatchHandle, DispatchResult
from comm.alltoall.inputs import (
    check_capacity,
    check_event,
    check_expert_out,
    check_handle,
    check_inputs,
    check_placement,
    check_protocol,
    dedup_layout_of,
    describe,
    layout_of,
    make_payload,
    refusal_event,
)
from comm.alltoall.packets import assemble, assemble_dedup, dedup_packer, payload_bits
from comm.alltoall.refuse import refuse_combine, refuse_dispatch
from comm.alltoall.remote import pull_blocks
from comm.alltoall.state import a2a_state, kernels, place_info, region_addrs
from comm.capture import captured
from comm.endpoint import Endpoint
from comm.quant import BF16
from comm.routing import Placement
from comm.trace import now_ns
from memory.errors import ProtocolError


@captured("dispatch")
def dispatch(
    ep: Endpoint,
    x: np.ndarray,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    protocol: str = "pull",
    quant: str | None = None,
    event_id: int = 0,
    placement: Placement | None = None,
    dedup: bool = False,
) -> DispatchResult:
    """Send every (token, expert) pair to the die that hosts the expert; every die calls it.

    Arguments:
        ep: the calling die.
        x: float32 [batch, hidden], batch <= PodConfig.a2a_max_batch (0 allowed).
        topk_idx: int [batch, a2a_topk] expert ids, -1 = not routed; a token's routed ids must
            be distinct.
        topk_weights: float [batch, a2a_topk] (kept for `combine`).
        protocol: "pull" (XCCL, §6) or "fused" (AIV-Direct, §7).
        quant: None or "int8" (per-token scales; the output keeps INT8 + scales).
        event_id: int in [0, 2**62) naming the operation; every die must pass the same.
        placement: expert -> die table (default expert // experts_per_die).
        dedup: DeepEP's layout (docs/protocols.md §6.3): one row per (token, destination die)
            carrying its list of (k, local expert, weight), expanded on the expert die; the
            combine then returns one row per (token, die), pre-reduced over that die's experts
            (`comm.reference.combine_ref(..., dedup=True)`). Every die must pass the same.
    Returns:
        DispatchResult with the rows this die's experts must process (the same with and
        without dedup).
    Raises:
        ValueError / TypeError for this die's bad input (after taking part as a refusing die,
        so the pod stays in step); PeerRefused if another die refused its input; ProtocolError
        for mis-paired calls; PeerTimeout / PodAborted from the waits.
    """
    st = a2a_state(ep)
    check_protocol(protocol)
    t0 = now_ns()
    try:
        event_id = check_event(event_id)
        check_inputs(ep, x, topk_idx, topk_weights, quant)
        quant = None if quant == "none" else quant
        placement = check_placement(ep, placement)
        if not isinstance(dedup, bool | np.bool_):
            raise TypeError(f"dedup must be a bool, got {describe(dedup)}")
        dedup = bool(dedup)
        if dedup:  # its own layout only; at most batch rows a die, which a block always holds
            lay, dl = None, dedup_layout_of(topk_idx, topk_weights, placement)
        else:
            lay, dl = layout_of(topk_idx, placement), None
            check_capacity(ep, lay, placement)
        # steps 1-2, load and quantize, before the operation starts: a row INT8 cannot take
        # (not finite) is this die's bad input too
        payload, scale = make_payload(x, quant)
    except (ValueError, TypeError) as e:
        refuse_dispatch(ep, protocol, refusal_event(event_id), e)
        raise
    t1 = now_ns()
    if ep.cap is not None and quant == "int8":  # the hardware's: bf16 in, int8 + scale out
        b, h = x.shape
        ep.cap.op("quantize", 3 * b * h, 2 * b * h, b * h + 4 * b, t0, unit="aiv", rows=b, hidden=h)
    code = QUANT_CODE[quant] + (DEDUP_CODE if dl is not None else 0)
    if protocol == "fused":
        res = fused_dispatch(
            ep, payload, scale, topk_idx, topk_weights, quant, event_id, placement, lay, t0, dl
        )
        st.last = res.handle
        return res
    op = st.pull_ops[DISPATCH] = st.pull_ops[DISPATCH] + 1
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    pb = payload.shape[1] * payload.dtype.itemsize
    # step 3: every message into this die's own send rows, blocks by destination
    n = lay.num_msgs if dl is None else dl.num_rows
    rows = pull_rows(ep, ep.die_id, DISPATCH, half, 0, n)
    stride = rows.shape[1]
    if dl is None:
        kernels().pack_rows(payload, scale, lay.msg_slot, lay.msg_k, lay.msg_local_expert, rows)
    else:
        flat8 = rows.reshape(-1)
        pack = dedup_packer(*payload_bits(payload, pb, scale), dl, stride)
        pack(0, n, flat8, flat8.view(np.int32))
    offs = (lay if dl is None else dl).dest_offsets.tolist()
    t2 = now_ns()
    if ep.cap is not None:  # step 3: this die's own send rows, a local write
        ep.cap.copy(n * stride, t1)
    # step 4: tell every destination where its block is
    for p, d in enumerate(placement.dies):
        publish(ep, DISPATCH, half, d, event_id, offs[p], offs[p + 1] - offs[p], op, code)
    for d in range(ep.num_dies):
        if d not in placement.dies:
            publish(ep, DISPATCH, half, d, event_id, 0, 0, op, code)
    t3 = now_ns()
    # step 5: poll own fields; steps 6-7: pull every source's block, then group by expert
    where = poll_fields(ep, DISPATCH, half, op, event_id, code)
    t4 = now_ns()
    parts = [
        (src, pull_rows(ep, src, DISPATCH, half, off, count))
        for src, (off, count) in enumerate(where)
    ]
    if ep.fab.any_remote:  # a source on another host: its block into its mirror first
        pull_blocks(ep, ep.layout.pull_block_off(DISPATCH, half), stride, where)
    t5 = now_ns()
    args = (ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "pull")
    result = assemble(*args) if dl is None else assemble_dedup(*args, dl)
    if ep.cap is not None:
        total = sum(c for _, c in where)
        ep.cap.op("assemble", 0, total * stride, len(result.x) * stride, t5, unit="aiv",
                  rows=total)  # fmt: skip
    st.last = result.handle
    if tr:
        t5 = now_ns()
        for step, a, b in ((2, t0, t1), (3, t1, t2), (4, t2, t3), (5, t3, t4), (6, t4, t5)):
            tr.rec(a, b - a, "pull_dispatch", step, -1, 0, event_id, n * stride if step == 3 else 0)
    return result


@captured("combine")
def combine(
    ep: Endpoint, expert_out: np.ndarray, handle: DispatchHandle, event_id: int = 0
) -> np.ndarray:
    """Return every expert row to its token's die and reduce; every die calls it.

    Arguments:
        ep: the calling die.
        expert_out: float32 [n_rows, hidden], row i the output for row i of the dispatch result.
        handle: `DispatchResult.handle` of the dispatch being reversed.
        event_id: int in [0, 2**62) naming the operation; every die must pass the same.
    Returns:
        float32 [batch, hidden]: out[slot] = sum over routed k, ascending, of
        topk_weights[slot, k] * row(slot, k), accumulated in float32 (zeros if none routed).
        After a dedup dispatch: each expert die first sums its experts' weighted rows of a
        token (ascending k, float32), rounds that once to the combine dtype and returns it;
        out[slot] adds those rows in ascending order of each die's first k (docs §6.3).
    Raises:
        as `dispatch`: this die's bad input after taking part as a refusing die, PeerRefused if
        a die this die's tokens depend on refused.
    """
    st = a2a_state(ep)
    try:
        check_handle(st, handle)
        event_id = check_event(event_id)
        check_expert_out(ep, expert_out, len(handle.recv_src_rank))
    except (ValueError, TypeError) as e:
        # refuse the combine of the dispatch this die's peers reverse: its latest
        owed = handle if isinstance(handle, DispatchHandle) and handle is st.last else st.last
        if owed is None:
            e.add_note("no dispatch ran on this die: its peers time out or are aborted")
            raise
        refuse_combine(ep, owed, refusal_event(event_id), e)
        raise
    if handle.protocol == "fused":
        return fused_combine(ep, expert_out, handle, event_id)
    hidden = ep.layout.a2a_hidden
    op = st.pull_ops[COMBINE] = st.pull_ops[COMBINE] + 1
    half = op & 1
    t0 = now_ns()
    # step 3: own combine rows, blocks by source die in each source's send order
    cdt = comb_dtype(ep)
    g = handle.groups
    if g is None:  # a row per received row, rounded here and gathered in the same pass
        dest = handle.recv_src_rank
        order = np.argsort(dest, kind="stable")
        rows = pull_rows(ep, ep.die_id, COMBINE, half, 0, len(dest))
        dst = rows[:, : cdt.itemsize * hidden].view(cdt)
        if cdt == BF16:
            kernels().to_bfloat16(expert_out, dst, order)
        else:
            dst[:] = expert_out[order]
    else:  # dedup: a pre-reduced row per received group, groups already in receive order
        dest = g.src
        _pull_reduce_groups(
            ep, expert_out, g, pull_rows(ep, ep.die_id, COMBINE, half, 0, len(dest))
        )
    t1 = now_ns()
    if ep.cap is not None:  # this die's own combine rows, a local write
        ep.cap.copy(len(dest) * ep.layout.pull_comb_stride, t0)
    counts = np.bincount(dest, minlength=ep.num_dies)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    code = handle.op & OP_CODE_MASK
    for src in range(ep.num_dies):  # step 4
        publish(ep, COMBINE, half, src, event_id, int(starts[src]), int(counts[src]), op, code)
    t2 = now_ns()
    where = poll_fields(ep, COMBINE, half, op, event_id, code)  # step 5
    t3 = now_ns()
    out = _reduce(ep, handle, where, half)  # steps 6-7
    if ep.cap is not None:
        rows = sum(c for _, c in where)
        ep.cap.op("weighted_sum", 2 * rows * hidden, rows * ep.layout.pull_comb_stride,
                  out.shape[0] * hidden * 2, t3, unit="aiv", rows=rows)  # fmt: skip
    if ep.trace.enabled:
        t4 = now_ns()
        for step, a, b in ((3, t0, t1), (4, t1, t2), (5, t2, t3), (6, t3, t4)):
            ep.trace.rec(a, b - a, "pull_combine", step, -1, 0, event_id, 0)
    return out


def _pull_reduce_groups(ep: Endpoint, expert_out, g: DedupGroups, rows: np.ndarray) -> None:
    """Step 3 of a pull combine after a dedup dispatch: group i's pre-reduced row into row i
    of `rows` (this die's own combine rows), one compiled pass (`reduce_groups_raw`)."""
    n = len(g.src)
    if not n:
        return
    views = ep.a2a.views
    lin = views.get("arange")
    if lin is None:
        lin = views["arange"] = np.arange(ep.layout.pull_comb_rows, dtype=np.int64)
    stride = ep.layout.pull_comb_stride // ep.layout.a2a_combine_bytes
    dst = flat_elems(ep, rows.reshape(-1))
    if kernels().reduce_groups_raw(np.ascontiguousarray(expert_out), g.pos, g.start, g.w, 0, dst,
                                   lin[:n], stride, n):  # fmt: skip
        raise ProtocolError(
            f"die {ep.die_id}: dedup combine: an entry range or row index outside this die's"
            f" {len(expert_out)} expert rows; nothing written"
        )


def weighted_sum(contrib: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out[slot] = sum over routed k, ascending, of w[slot, k] * contrib[slot, k], in float32:
    the operation order of `comm.reference.combine_ref`, so results are bit for bit the same.
    One compiled pass over the rows (`comm.kernels.weighted_sum`: bfloat16 rows widened
    exactly on the way; what it costs: docs/benchmarks.md); unrouted entries are never read."""
    return kernels().weighted_sum(contrib, idx, w)


_NO_ROWS = {2: np.zeros(0, np.uint16), 4: np.zeros(0, np.float32)}  # combine rows, by size


def _reduce(ep: Endpoint, handle: DispatchHandle, where: list[tuple], half: int) -> np.ndarray:
    """Steps 6-7 of a pull combine: each expert die's rows of this die's tokens, read where
    they are (remote), summed per token in ascending k: `weighted_sum`'s arithmetic in one
    compiled pass over every source (`comm.kernels.pull_reduce`; gathering the rows into a
    [batch, k, hidden] array first was one more trip over the combine bytes). After a dedup
    dispatch the rows are pre-reduced, one per (token, die), at (slot, first k of that die),
    added in ascending k with weight 1."""
    placement, dl = handle.placement, handle.dedup
    if dl is None:
        lay = handle.layout
        offs, slots, ks = lay.dest_offsets, lay.msg_slot, lay.msg_k
        idx, w = handle.topk_idx, handle.topk_weights
    else:
        offs, slots, ks = dl.dest_offsets, dl.row_slot, dl.row_kfirst
        idx, w = dl.idx_first, np.ones(dl.idx_first.shape, np.float32)
    lo = ep.layout
    cdt = comb_dtype(ep)
    first = np.empty(len(placement.dies), np.int64)  # each source's first row of ours
    bounds = offs.tolist()
    for p, d in enumerate(placement.dies):
        a, b = bounds[p], bounds[p + 1]
        off, count = where[d]
        if count != b - a:
            raise ProtocolError(
                f"die {ep.die_id}: combine from die {d} returns {count} rows, this die sent it"
                f" {b - a} (expert_out rows out of step with the dispatch)"
            )
        area_check(ep, f"pull combine rows of die {d}", off, count, lo.pull_comb_rows)
        first[p] = off
    if ep.fab.any_remote:  # an expert die on another host: its rows into its mirror first
        checked = [(0, 0)] * ep.num_dies  # the rows of placement.dies, checked above
        for d in placement.dies:
            checked[d] = where[d]
        pull_blocks(ep, lo.pull_block_off(COMBINE, half), lo.pull_comb_stride, checked)
    mem = region_addrs(ep)
    item = cdt.itemsize
    out = np.empty((idx.shape[0], lo.a2a_hidden), np.float32)
    like = _NO_ROWS[item]  # the rows' element type: bfloat16 bits or float32
    if kernels().pull_reduce(
        mem.addrs, mem.nbytes, like, place_info(ep, placement).dies_arr, offs, first,
        lo.pull_block_off(COMBINE, half) // item, lo.pull_comb_stride // item, slots, ks,
        np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(w, np.float32), out,
    ):  # fmt: skip
        raise ProtocolError(
            f"die {ep.die_id}: pull combine: a routed (slot, k) of this die has no row in the"
            " layout (handle out of step with the dispatch); nothing read"
        )
    return out
