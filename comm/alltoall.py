"""Expert-parallel all-to-all: XCCL pull-based dispatch and combine (PROTOCOLS.md §6, 001 §3.2).

```python
d = comm.dispatch(die, x, topk_idx, topk_weights, protocol="pull", quant="int8", event_id=n)
expert_out = run_my_experts(d)             # d.x rows grouped by local expert, d.expert_counts
out = comm.combine(die, expert_out, d.handle, event_id=n)
```

Fields: in every die's meta area, `pull[kind][half][src]` (kind 0 dispatch, 1 combine), written
only by `src`: | event_id | off (row) | count | seq |, seq (the per-kind operation number, the
same on every die) stored LAST. Areas: in every die's managed area, per kind, two halves of send
rows; operation n uses half n % 2 (the paper alternates by event-id parity; caller event ids need
not be consecutive here, so the internal operation number decides).

Dispatch steps (the trace records each):
1-2. load tokens (MTE2) and, with quant="int8", quantize per token (scales travel with them);
3.   write every (token, expert) message into this die's OWN send area, blocks by destination in
     the canonical send order (`comm.routing.get_dispatch_layout`), one vectorized gather;
4.   write offset and count, then seq, into each destination's field for this source;
5.   poll this die's own fields until every source's seq is the operation number;
6.   pull (remote read) every source's block for this die;
7.   write it to the output, rows grouped by local expert, then (src_rank, batch_slot, k_index).
Combine mirrors it: expert rows into this die's own combine area, blocks by source, fields to
every source, poll, pull, and reduce `out[slot] = sum_k w[slot, k] * row(slot, k)` in ascending
k in float32, the exact operation order of `comm.reference.combine_ref`.

Reuse of a half: a die starts operation n+2 (overwriting half n % 2) only after step 5 of n+1,
which needs every peer's step 4 of n+1, which each peer does only after finishing its pulls of
n. Dispatch and combine have separate fields and areas.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.endpoint import Endpoint
from comm.quant import quantize_int8
from comm.routing import DispatchLayout, Placement, get_dispatch_layout
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ConfigError, ProtocolError

PROTOCOLS = ("pull", "fused")
QUANTS = (None, "none", "int8")
DISPATCH, COMBINE = 0, 1
F_EVENT, F_OFF, F_COUNT, F_SEQ = 0, 1, 2, 3


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs from the `dispatch` it reverses (treat as opaque).

    Attributes:
        protocol, quant: as dispatched.
        placement: the expert placement used.
        layout: this die's DispatchLayout (its messages in canonical send order).
        topk_idx: int64 [batch, k]; topk_weights: float32 [batch, k] (this die's tokens).
        recv_src_rank: int64 [n_rows], the source die of each dispatched row this die received.
        op: the dispatch operation number.
        recv_slot, recv_k: int64 [n_rows], each row's (batch_slot, k_index) at its source.
    """

    protocol: str
    quant: str | None
    placement: Placement
    layout: DispatchLayout
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    recv_src_rank: np.ndarray
    op: int
    recv_slot: np.ndarray | None = None
    recv_k: np.ndarray | None = None


@dataclass(frozen=True)
class DispatchResult:
    """Rows this die received, grouped by local expert (the order of `comm.reference`).

    Attributes:
        x: [n_rows, hidden] float32, or int8 when quantized.
        scales: float32 [n_rows] per-row INT8 scales, or None.
        src_rank, batch_slot, k_index, local_expert: int64 [n_rows], each row's origin.
        expert_counts: int64 [experts_per_die], rows per local expert.
        handle: pass to `combine`.
    """

    x: np.ndarray
    scales: np.ndarray | None
    src_rank: np.ndarray
    batch_slot: np.ndarray
    k_index: np.ndarray
    local_expert: np.ndarray
    expert_counts: np.ndarray
    handle: DispatchHandle


def _a2a_state(ep: Endpoint) -> dict:
    st = getattr(ep, "_a2a", None)
    if st is None:
        lo = ep.layout
        if not lo.a2a_max_batch:
            raise ConfigError(
                "a2a_max_batch: this pod has no all-to-all areas; launch it with"
                " PodConfig(a2a_max_batch=..., a2a_hidden=..., a2a_topk=..., num_experts=...)"
            )
        st = {"ops": [0, 0], "fused_ops": [0, 0], "placement": None}
        ep._a2a = st
    return st


def _check_inputs(ep: Endpoint, x, topk_idx, topk_weights, protocol, quant) -> None:
    lo = ep.layout
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol {protocol!r}: supported here: {', '.join(PROTOCOLS)}")
    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r}: choose None or 'int8'")
    if quant in (None, "none") and lo.a2a_dispatch_bytes == 1:
        raise ValueError(
            "quant None: this pod's dispatch rows are laid out for INT8 only"
            " (PodConfig.a2a_dispatch_dtype='int8'); pass quant='int8' or launch with 'float32'"
        )
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise TypeError(f"x must be a float32 array [batch, hidden], got {_describe(x)}")
    if x.shape[1] != lo.a2a_hidden:
        raise ValueError(f"x has hidden {x.shape[1]}, the pod was laid out for {lo.a2a_hidden}")
    if x.shape[0] > lo.a2a_max_batch:
        raise ValueError(
            f"batch {x.shape[0]} exceeds the configured maximum a2a_max_batch {lo.a2a_max_batch}"
        )
    want = (x.shape[0], lo.a2a_topk)
    for name, arr in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if not isinstance(arr, np.ndarray) or arr.shape != want:
            raise ValueError(f"{name} must have shape {want}, got {_describe(arr)}")


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}{list(a.shape)}"
    return type(a).__name__


def _placement(ep: Endpoint, placement: Placement | None) -> Placement:
    if placement is not None:
        if ep._a2a.get("checked_placement") is placement:
            return placement
        most = max(placement.num_local(d) for d in placement.dies)
        cap = ep.layout.a2a_experts_per_die
        if most > cap or max(placement.dies) >= ep.num_dies:
            raise ValueError(
                f"placement puts {most} experts on one die (or names a die outside the pod);"
                f" the pod's areas are sized for {cap} per die"
                " (PodConfig.a2a_max_local_experts)"
            )
        ep._a2a["checked_placement"] = placement
        return placement
    st = ep._a2a
    if st["placement"] is None:
        lo = ep.layout
        st["placement"] = Placement.default(lo.a2a_num_experts, tuple(range(ep.num_dies)))
    return st["placement"]


def _publish(ep: Endpoint, kind: int, half: int, dst: int, event_id, off, count, seq) -> None:
    """Step 4: offset and count, then seq LAST, into dst's field for this source."""
    w = ep.words[dst]
    f = ep.layout.pull_field_word(kind, half, ep.die_id)
    w[f + F_EVENT] = event_id
    w[f + F_OFF] = off
    w[f + F_COUNT] = count
    w[f + F_SEQ] = seq


def _poll_all(ep: Endpoint, kind: int, half: int, op: int, event_id: int) -> list[tuple]:
    """Step 5: wait for every source's field of this operation; (off, count) per source."""
    lw = ep.words[ep.die_id]
    lo = ep.layout
    out = []
    name = "dispatch" if kind == DISPATCH else "combine"
    for src in range(ep.num_dies):
        f = lo.pull_field_word(kind, half, src)
        ep.wait_ge(lw, f + F_SEQ, op, src, f"pull.{name}[{half}].seq")
        if lw[f + F_SEQ] != op:
            raise ProtocolError(
                f"die {ep.die_id}: pull {name} field of die {src} carries operation"
                f" {lw[f + F_SEQ]}, expected {op} (dispatch/combine calls out of step)"
            )
        if lw[f + F_EVENT] != event_id:
            raise ProtocolError(
                f"die {ep.die_id}: pull {name} from die {src}: expected event_id {event_id},"
                f" the source published {lw[f + F_EVENT]} (calls mis-paired)"
            )
        out.append((lw[f + F_OFF], lw[f + F_COUNT]))
    return out


def _rows(ep: Endpoint, die: int, kind: int, half: int, start: int, count: int) -> np.ndarray:
    """uint8 [count, stride] view of a die's pull send rows (its own or a peer's: remote read)."""
    lo = ep.layout
    stride = lo.pull_disp_stride if kind == DISPATCH else lo.pull_comb_stride
    base = lo.pull_block_off(kind, half) + start * stride
    arr = ep.regions[die].array
    return arr[base : base + count * stride].reshape(count, stride)


def dispatch(
    ep: Endpoint,
    x: np.ndarray,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    protocol: str = "pull",
    quant: str | None = None,
    event_id: int = 0,
    placement: Placement | None = None,
) -> DispatchResult:
    """Send every (token, expert) pair to the die that hosts the expert; every die calls it.

    Arguments:
        ep: the calling die.
        x: float32 [batch, hidden], batch <= PodConfig.a2a_max_batch (0 allowed).
        topk_idx: int [batch, a2a_topk] expert ids, -1 = not routed.
        topk_weights: float [batch, a2a_topk] (kept for `combine`).
        protocol: "pull" (XCCL, §6).
        quant: None or "int8" (per-token scales; the output keeps INT8 + scales).
        event_id: int naming the operation; every die must pass the same.
        placement: expert -> die table (default expert // experts_per_die).
    Returns:
        DispatchResult with the rows this die's experts must process.
    """
    _a2a_state(ep)
    _check_inputs(ep, x, topk_idx, topk_weights, protocol, quant)
    quant = None if quant == "none" else quant
    placement = _placement(ep, placement)
    lay = get_dispatch_layout(topk_idx, placement)
    if protocol == "fused":
        return _fused_dispatch(ep, x, topk_idx, topk_weights, quant, event_id, placement, lay)
    st = ep._a2a
    op = st["ops"][DISPATCH] = st["ops"][DISPATCH] + 1
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    # steps 1-2: load, quantize
    if quant == "int8":
        payload, scale = quantize_int8(x)
    else:
        payload, scale = x, np.ones(x.shape[0], np.float32)
    pb = payload.shape[1] * payload.dtype.itemsize
    t1 = now_ns()
    # step 3: every message into this die's own send rows, blocks by destination
    n = lay.num_msgs
    rows = _rows(ep, ep.die_id, DISPATCH, half, 0, n)
    stride = rows.shape[1]
    rows[:, :pb] = payload[lay.msg_slot].view(np.uint8).reshape(n, pb)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    meta[:, 0] = scale[lay.msg_slot].view(np.int32)
    meta[:, 1] = lay.msg_slot
    meta[:, 2] = lay.msg_k
    meta[:, 3] = lay.msg_local_expert
    t2 = now_ns()
    # step 4: tell every destination where its block is
    for p, d in enumerate(placement.dies):
        a, b = int(lay.dest_offsets[p]), int(lay.dest_offsets[p + 1])
        _publish(ep, DISPATCH, half, d, event_id, a, b - a, op)
    for d in range(ep.num_dies):
        if d not in placement.dies:
            _publish(ep, DISPATCH, half, d, event_id, 0, 0, op)
    t3 = now_ns()
    # step 5: poll own fields; steps 6-7: pull every source's block, then group by expert
    where = _poll_all(ep, DISPATCH, half, op, event_id)
    t4 = now_ns()
    parts = [
        (src, _rows(ep, src, DISPATCH, half, off, count)) for src, (off, count) in enumerate(where)
    ]
    result = _assemble(ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "pull")
    if tr:
        t5 = now_ns()
        for step, a, b in ((2, t0, t1), (3, t1, t2), (4, t2, t3), (5, t3, t4), (6, t4, t5)):
            tr.rec(a, b - a, "pull_dispatch", step, -1, 0, event_id, n * stride if step == 3 else 0)
    return result


def _assemble(ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, proto):
    """Step 7: rows grouped by local expert, stable, so (src_rank, slot, k) order stays.

    `parts` is a list of (src, uint8 [count, stride] rows), own or remote memory. Only the
    16-byte row metadata is gathered first; then each part's payloads are copied once, straight
    to their output positions (no concatenated temporary)."""
    hidden = ep.layout.a2a_hidden
    dt = np.int8 if quant == "int8" else np.float32
    counts_per_part = [len(r) for _, r in parts]
    total = sum(counts_per_part)
    stride = ep.layout.pull_disp_stride
    meta = np.empty((total, 4), np.int32)
    src_of = np.empty(total, np.int64)
    at = 0
    for (src, rows), n in zip(parts, counts_per_part, strict=True):
        meta[at : at + n] = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
        src_of[at : at + n] = src
        at += n
    local = meta[:, 3].astype(np.int64)
    order = np.argsort(local, kind="stable")
    pos = np.empty(total, np.int64)
    pos[order] = np.arange(total)
    x = np.empty((total, hidden), dt)
    xb = x.view(np.uint8).reshape(total, pb)
    at = 0
    for (_, rows), n in zip(parts, counts_per_part, strict=True):
        if n:
            xb[pos[at : at + n]] = rows[:, :pb]  # the one copy (a pull: a remote read)
        at += n
    scales = np.ascontiguousarray(meta[order, 0]).view(np.float32) if quant == "int8" else None
    counts = np.bincount(local, minlength=_place_info(ep, placement).num_local[ep.die_id])
    src_rank = src_of[order]
    slot = meta[order, 1].astype(np.int64)
    k_index = meta[order, 2].astype(np.int64)
    handle = DispatchHandle(
        protocol=proto,
        quant=quant,
        placement=placement,
        layout=lay,
        topk_idx=np.asarray(topk_idx, np.int64),
        topk_weights=np.asarray(topk_weights, np.float32),
        recv_src_rank=src_rank,
        op=op,
        recv_slot=slot,
        recv_k=k_index,
    )
    return DispatchResult(
        x=x,
        scales=scales,
        src_rank=src_rank,
        batch_slot=slot,
        k_index=k_index,
        local_expert=local[order],
        expert_counts=counts.astype(np.int64),
        handle=handle,
    )


def combine(
    ep: Endpoint, expert_out: np.ndarray, handle: DispatchHandle, event_id: int = 0
) -> np.ndarray:
    """Return every expert row to its token's die and reduce; every die calls it.

    Arguments:
        ep: the calling die.
        expert_out: float32 [n_rows, hidden], row i the output for row i of the dispatch result.
        handle: `DispatchResult.handle` of the dispatch being reversed.
        event_id: int naming the operation; every die must pass the same.
    Returns:
        float32 [batch, hidden]: out[slot] = sum over routed k, ascending, of
        topk_weights[slot, k] * row(slot, k), accumulated in float32 (zeros if none routed).
    """
    st = _a2a_state(ep)
    n_rows = len(handle.recv_src_rank)
    hidden = ep.layout.a2a_hidden
    if not isinstance(expert_out, np.ndarray) or expert_out.dtype != np.float32:
        raise TypeError(f"expert_out must be float32 [n_rows, hidden], got {_describe(expert_out)}")
    if expert_out.shape != (n_rows, hidden):
        raise ValueError(
            f"expert_out has shape {list(expert_out.shape)}, the dispatch delivered"
            f" {n_rows} rows of hidden {hidden}"
        )
    if handle.protocol == "fused":
        return _fused_combine(ep, expert_out, handle, event_id)
    op = st["ops"][COMBINE] = st["ops"][COMBINE] + 1
    half = op & 1
    t0 = now_ns()
    # step 3: own combine rows, blocks by source die in each source's send order
    order = np.argsort(handle.recv_src_rank, kind="stable")
    rows = _rows(ep, ep.die_id, COMBINE, half, 0, n_rows)
    rows[:, : 4 * hidden] = expert_out[order].view(np.uint8).reshape(n_rows, 4 * hidden)
    t1 = now_ns()
    counts = np.bincount(handle.recv_src_rank, minlength=ep.num_dies)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for src in range(ep.num_dies):  # step 4
        _publish(ep, COMBINE, half, src, event_id, int(starts[src]), int(counts[src]), op)
    t2 = now_ns()
    where = _poll_all(ep, COMBINE, half, op, event_id)  # step 5
    t3 = now_ns()
    out = _reduce(ep, handle, where, half)  # steps 6-7
    if ep.trace.enabled:
        t4 = now_ns()
        for step, a, b in ((3, t0, t1), (4, t1, t2), (5, t2, t3), (6, t3, t4)):
            ep.trace.rec(a, b - a, "pull_combine", step, -1, 0, event_id, 0)
    return out


def _weighted_sum(contrib: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out[slot] = sum over routed k, ascending, of w[slot, k] * contrib[slot, k], in float32:
    the operation order of `comm.reference.combine_ref`, so results are bit for bit the same.
    `contrib` is scratch (a receive buffer): each fully routed column is multiplied in place and
    added, so no product temporary crosses the cache; unrouted entries are never read."""
    out = np.zeros((idx.shape[0], contrib.shape[2]), np.float32)
    for k in range(idx.shape[1]):
        m = idx[:, k] >= 0
        if m.all():
            ck = contrib[:, k]
            np.multiply(w[:, k, None], ck, out=ck)
            out += ck
        elif m.any():
            out[m] = out[m] + w[m, k, None] * contrib[m, k]
    return out


def _reduce(ep: Endpoint, handle: DispatchHandle, where: list[tuple], half: int) -> np.ndarray:
    lay, placement = handle.layout, handle.placement
    idx, w = handle.topk_idx, handle.topk_weights
    batch, k_max = idx.shape
    hidden = ep.layout.a2a_hidden
    contrib = np.empty((batch, k_max, hidden), np.float32)  # unrouted entries are never read
    for p, d in enumerate(placement.dies):
        a, b = int(lay.dest_offsets[p]), int(lay.dest_offsets[p + 1])
        off, count = where[d]
        if count != b - a:
            raise ProtocolError(
                f"die {ep.die_id}: combine from die {d} returns {count} rows, this die sent it"
                f" {b - a} (expert_out rows out of step with the dispatch)"
            )
        got = _rows(ep, d, COMBINE, half, off, count)[:, : 4 * hidden]  # remote read
        contrib[lay.msg_slot[a:b], lay.msg_k[a:b]] = got.view(np.float32)
    return _weighted_sum(contrib, idx, w)


# ------------------------------------------------------------------------------------------------
# FusedDispatch / FusedCombine with AIV-Direct (PROTOCOLS.md §7, 000 §4.2.1)
# ------------------------------------------------------------------------------------------------


def _words(ep: Endpoint, die: int, off: int, n: int) -> np.ndarray:
    """int64 numpy view of n meta words of a die's region at byte offset off."""
    return ep.regions[die].array[off : off + 8 * n].view(np.int64)


def _fused_block(ep: Endpoint, die: int, half: int, src: int) -> np.ndarray:
    """uint8 [fused_disp_rows, stride]: die's pre-allocated dispatch buffer block for src."""
    lo = ep.layout
    rows, stride = lo.fused_disp_rows, lo.pull_disp_stride
    base = lo.fused_disp_off + (half * ep.num_dies + src) * rows * stride
    return ep.regions[die].array[base : base + rows * stride].reshape(rows, stride)


@dataclass(frozen=True)
class _PlaceInfo:
    """Per-die facts of a placement, computed once per placement object (hot-path lookups)."""

    placement: Placement
    pos: list[int]  # [die] position in placement.dies, -1 if the die hosts no expert
    num_local: list[int]  # [die] experts hosted


def _place_info(ep: Endpoint, placement: Placement) -> _PlaceInfo:
    info = ep._a2a.get("place_info")
    if info is None or info.placement is not placement:
        pos = [-1] * ep.num_dies
        for p, d in enumerate(placement.dies):
            pos[d] = p
        counts = np.bincount(placement.die_of, minlength=ep.num_dies).tolist()
        info = ep._a2a["place_info"] = _PlaceInfo(placement, pos, counts[: ep.num_dies])
    return info


def _fused_dispatch(ep, x, topk_idx, topk_weights, quant, event_id, placement, lay):
    """Steps 1-3 of FusedDispatch: packets written straight into each destination's buffer
    (one vectorized copy per destination), counts then the completion flag LAST, poll, gather."""
    lo = ep.layout
    st = ep._a2a
    op = st["fused_ops"][DISPATCH] = st["fused_ops"][DISPATCH] + 1
    # Two halves by operation parity: a die that finished operation n (its tokens never touched
    # some peer) may start n+1 before that peer read n; it cannot start n+2 before the peer
    # finished n, since n+1's step 3 waits for the peer's n+1 flag.
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    payload, scale = quantize_int8(x) if quant == "int8" else (x, np.ones(len(x), np.float32))
    pb = payload.shape[1] * payload.dtype.itemsize
    stride = lo.pull_disp_stride
    info = _place_info(ep, placement)
    offs = lay.dest_offsets.tolist()
    for p, d in enumerate(placement.dies):
        a, b = offs[p], offs[p + 1]
        if a == b:
            continue
        slots = lay.msg_slot[a:b]
        block = _fused_block(ep, d, half, ep.die_id)  # remote: d's buffer, this source's block
        block[: b - a, :pb] = payload[slots].view(np.uint8).reshape(b - a, pb)
        meta = block[: b - a, stride - L.PULL_ROW_META :].view(np.int32)
        meta[:, 0] = scale[slots].view(np.int32)
        meta[:, 1] = slots
        meta[:, 2] = lay.msg_k[a:b]
        meta[:, 3] = lay.msg_local_expert[a:b]
    t1 = now_ns()
    for d in range(ep.num_dies):  # step 2: counts, then the completion flag LAST
        p, n_local = info.pos[d], info.num_local[d]
        a, b = (offs[p], offs[p + 1]) if p >= 0 else (0, 0)
        if n_local:
            counts = np.bincount(lay.msg_local_expert[a:b], minlength=n_local)
            _words(ep, d, lo.fused_counts_off_of(half, ep.die_id), n_local)[:] = counts
        w = ep.words[d]
        f = lo.fused_flag_word(half, ep.die_id)
        w[f + F_EVENT] = event_id
        w[f + 1] = b - a
        w[f + 2] = op
    t2 = now_ns()
    # step 3: every source's flag, then the packets in per-expert order
    lw, parts = ep.words[ep.die_id], []
    n_mine = _place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_mine, np.int64)
    for src in range(ep.num_dies):
        f = lo.fused_flag_word(half, src)
        ep.wait_ge(lw, f + 2, op, src, f"fused.flag[{half}]")
        if lw[f + F_EVENT] != event_id:
            raise ProtocolError(
                f"die {ep.die_id}: fused dispatch from die {src}: expected event_id {event_id},"
                f" the source flagged {lw[f + F_EVENT]} (calls mis-paired)"
            )
        count = lw[f + 1]
        counts += _words(ep, ep.die_id, lo.fused_counts_off_of(half, src), n_mine)
        parts.append((src, _fused_block(ep, ep.die_id, half, src)[:count]))
    t3 = now_ns()
    res = _assemble(ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "fused")
    if not np.array_equal(res.expert_counts, counts):
        raise ProtocolError(
            f"die {ep.die_id}: fused dispatch counts {counts.tolist()} disagree with the packets"
            f" received {res.expert_counts.tolist()}"
        )
    if tr:
        t4 = now_ns()
        for step, a, b in ((1, t0, t1), (2, t1, t2), (3, t2, t4)):
            tr.rec(a, b - a, "fused_dispatch", step, -1, 0, event_id, 0)
        tr.rec(t2, t3 - t2, "fused_dispatch", 3, -1, 1, event_id, 0)
    return res


def _fused_combine(ep, expert_out, handle, event_id):
    """Steps 1-3 of FusedCombine: each row straight into its token die's buffer at
    (batch_slot, k_index), then that slot's own completion word (the emulation's stand-in for
    the hardware's atomic add, single writer per operation); wait for all routed slots."""
    lo = ep.layout
    st = ep._a2a
    op = st["fused_ops"][COMBINE] = st["fused_ops"][COMBINE] + 1
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    _write_slots_by_src(ep, expert_out, handle.recv_src_rank, handle.recv_slot, handle.recv_k, op)
    t1 = now_ns()
    idx, w = handle.topk_idx, handle.topk_weights
    r_slot, r_k = np.nonzero(idx >= 0)
    _wait_slots(ep, r_slot, r_k, op, "fused", handle.placement.die_of[idx[r_slot, r_k]])
    t2 = now_ns()
    out = _weighted_sum(_comb_rows(ep, idx.shape[0]), idx, w)
    if tr:
        t3 = now_ns()
        nbytes = 4 * lo.a2a_hidden * len(handle.recv_src_rank)
        for step, a, b, nb in ((1, t0, t1, nbytes), (3, t1, t2, 0), (4, t2, t3, 0)):
            tr.rec(a, b - a, "fused_combine", step, -1, 0, event_id, nb)
    return out


def _comb_f32(ep: Endpoint, die: int) -> np.ndarray:
    """float32 [max_batch * topk, comb_stride / 4]: die's combine buffer, row slot * topk + k."""
    views = ep._a2a.setdefault("comb_f32", {})
    v = views.get(die)
    if v is None:
        lo = ep.layout
        n, stride = lo.a2a_max_batch * lo.a2a_topk, lo.pull_comb_stride
        raw = ep.regions[die].array[lo.fused_comb_off : lo.fused_comb_off + n * stride]
        v = views[die] = raw.view(np.float32).reshape(n, stride // 4)
    return v


def _comb_rows(ep: Endpoint, batch: int) -> np.ndarray:
    """float32 [batch, topk, hidden] view of this die's own combine buffer (unrouted entries
    hold stale bytes that `_weighted_sum` never reads)."""
    lo = ep.layout
    v = _comb_f32(ep, ep.die_id)[: batch * lo.a2a_topk, : lo.a2a_hidden]
    return v.reshape(batch, lo.a2a_topk, lo.a2a_hidden)


def _write_slots_by_src(ep, rows, dest, slots, ks, op) -> None:
    """Steps 1-2 of a fused combine (and of E2A): row i straight into die dest[i]'s combine
    buffer at (slots[i], ks[i]), one row copy each and no gathered temporary; then, per
    destination, the completion words of those (slot, k) LAST."""
    n = len(dest)
    if not n:
        return
    lo = ep.layout
    hidden, topk = lo.a2a_hidden, lo.a2a_topk
    order = np.argsort(dest, kind="stable")
    ordered = dest[order]
    cuts = (np.flatnonzero(ordered[1:] != ordered[:-1]) + 1).tolist()
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        d = int(ordered[a])
        sel = order[a:b]
        lin = slots[sel] * topk + ks[sel]
        buf = _comb_f32(ep, d)
        for i, j in zip(sel.tolist(), lin.tolist(), strict=True):
            buf[j, :hidden] = rows[i]  # remote write
        _words(ep, d, lo.fused_cflag_off, lo.a2a_max_batch * topk)[lin] = op  # LAST


# ------------------------------------------------------------------------------------------------
# A2E / E2A with trampoline forwarding (PROTOCOLS.md §8, 001 §3.3, §5.2)
# ------------------------------------------------------------------------------------------------

DEST_SHIFT = 20  # a2e packets carry local_expert | dest_die << DEST_SHIFT in meta word 3


@dataclass(frozen=True)
class A2EHandle:
    """What `e2a` needs from `a2e` (treat as opaque).

    Attributes:
        n_att: attention dies (0..n_att-1); expert dies are n_att..num_dies-1 and the first
            n_att of them are the trampolines (trampoline of attention die i: n_att + i).
        role: "attention" or "expert".
        dispatch: an expert die's DispatchHandle (None on attention dies).
        topk_idx, topk_weights: an attention die's routing (None on expert dies).
        partner_slots: on a trampoline, the (batch_slot, k_index) pairs its attention die routed.
        metadata_writes: fields this die wrote in other dies' meta areas during `a2e`.
    """

    n_att: int
    role: str
    dispatch: DispatchHandle | None
    topk_idx: np.ndarray | None
    topk_weights: np.ndarray | None
    partner_slots: tuple[np.ndarray, np.ndarray] | None
    metadata_writes: int


def _a2e_rows(ep: Endpoint, die: int, half: int, count: int) -> np.ndarray:
    lo = ep.layout
    stride = lo.pull_disp_stride
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
        event_id: names the operation; every die passes the same.
    Returns:
        (DispatchResult on expert dies / None on attention dies, A2EHandle for `e2a`).
    """
    st = _a2a_state(ep)
    lo = ep.layout
    n_exp = ep.num_dies - n_att
    if not 1 <= n_att <= n_exp:
        raise ValueError(f"n_att {n_att}: need 1 <= n_att <= n_exp ({n_exp} expert dies)")
    quant = None if quant == "none" else quant
    exp_dies = tuple(range(n_att, ep.num_dies))
    placement = st.get("a2e_placement")
    if placement is None or placement.dies != exp_dies:
        if lo.a2a_num_experts % n_exp or lo.a2a_num_experts // n_exp > lo.a2a_experts_per_die:
            raise ConfigError(
                f"a2a_max_local_experts: {lo.a2a_num_experts} experts over {n_exp} expert dies"
                f" need {lo.a2a_num_experts / n_exp:g} per die (and must divide evenly); the"
                f" pod's areas are sized for {lo.a2a_experts_per_die}"
            )
        placement = st["a2e_placement"] = Placement.default(lo.a2a_num_experts, exp_dies)
    op = st["fused_ops"][DISPATCH] = st["fused_ops"][DISPATCH] + 1
    half = op & 1
    me = ep.die_id
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    if me < n_att:
        _check_inputs(ep, x, topk_idx, topk_weights, "fused", quant)
        lay = get_dispatch_layout(topk_idx, placement)
        _a2e_stage1(ep, x, lay, placement, n_att + me, half, op, quant, event_id)
        if tr:
            tr.rec(t0, now_ns() - t0, "a2e", 1, n_att + me, 0, event_id, 0)
        handle = A2EHandle(n_att, "attention", None, np.asarray(topk_idx, np.int64),
                           np.asarray(topk_weights, np.float32), None, 1)  # fmt: skip
        return None, handle
    writes, partner = 0, None
    if me < 2 * n_att:  # a trampoline: forward its attention die's packets (A2E')
        partner, writes = _a2e_stage2(ep, me - n_att, half, op, event_id, placement)
        if tr:
            tr.rec(t0, now_ns() - t0, "a2e", 2, me - n_att, 0, event_id, 0)
    t1 = now_ns()
    res = _expert_gather(ep, half, op, event_id, n_att, placement, quant)
    if tr:
        tr.rec(t1, now_ns() - t1, "a2e", 3, -1, 0, event_id, 0)
    return res, A2EHandle(n_att, "expert", res.handle, None, None, partner, writes)


def _a2e_stage1(ep, x, lay, placement, tramp, half, op, quant, event_id) -> None:
    """A2E: every packet of this attention die, and one flag, to its trampoline only."""
    lo = ep.layout
    payload, scale = quantize_int8(x) if quant == "int8" else (x, np.ones(len(x), np.float32))
    pb = payload.shape[1] * payload.dtype.itemsize
    n, stride = lay.num_msgs, lo.pull_disp_stride
    rows = _a2e_rows(ep, tramp, half, n)  # remote write into the trampoline
    rows[:, :pb] = payload[lay.msg_slot].view(np.uint8).reshape(n, pb)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    meta[:, 0] = scale[lay.msg_slot].view(np.int32)
    meta[:, 1] = lay.msg_slot
    meta[:, 2] = lay.msg_k
    meta[:, 3] = lay.msg_local_expert | lay.msg_dest << DEST_SHIFT
    w = ep.words[tramp]
    f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
    w[f + F_EVENT] = event_id
    w[f + 1] = n
    w[f + 2] = op  # LAST: the one metadata write of this attention die


def _a2e_stage2(ep, att, half, op, event_id, placement):
    """A2E': the trampoline forwards its partner's packets to the dies owning the experts."""
    lo = ep.layout
    lw = ep.words[ep.die_id]
    f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
    ep.wait_ge(lw, f + 2, op, att, f"a2e.flag[{half}]")
    if lw[f + F_EVENT] != event_id:
        raise ProtocolError(
            f"die {ep.die_id} (trampoline): a2e from die {att}: expected event_id {event_id},"
            f" got {lw[f + F_EVENT]}"
        )
    n, stride = lw[f + 1], lo.pull_disp_stride
    rows = _a2e_rows(ep, ep.die_id, half, n)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    dest = meta[:, 3] >> DEST_SHIFT
    local = meta[:, 3] & ((1 << DEST_SHIFT) - 1)
    for d in placement.dies:
        sel = np.nonzero(dest == d)[0]
        block = _fused_block(ep, d, half, att)  # the expert die's buffer block for source att
        block[: len(sel)] = rows[sel]
        block[: len(sel), stride - 4 : stride] = local[sel].view(np.uint8).reshape(-1, 4)
        n_local = placement.num_local(d)
        counts = np.bincount(local[sel], minlength=n_local)
        _words(ep, d, lo.fused_counts_off_of(half, att), n_local)[:] = counts
        w = ep.words[d]
        g = lo.fused_flag_word(half, att)
        w[g + F_EVENT] = event_id
        w[g + 1] = len(sel)
        w[g + 2] = op  # LAST
    return (meta[:, 1].astype(np.int64), meta[:, 2].astype(np.int64)), len(placement.dies)


def _expert_gather(ep, half, op, event_id, n_att, placement, quant) -> DispatchResult:
    """An expert die waits for the forwarded flags of every attention die and groups rows."""
    lo = ep.layout
    lw, parts = ep.words[ep.die_id], []
    for src in range(n_att):
        f = lo.fused_flag_word(half, src)
        ep.wait_ge(lw, f + 2, op, src, f"fused.flag[{half}] (forwarded)")
        if lw[f + F_EVENT] != event_id:
            raise ProtocolError(
                f"die {ep.die_id}: a2e from die {src}: expected event_id {event_id}, got"
                f" {lw[f + F_EVENT]}"
            )
        parts.append((src, _fused_block(ep, ep.die_id, half, src)[: lw[f + 1]]))
    pb = lo.a2a_hidden * (1 if quant == "int8" else 4)
    empty = get_dispatch_layout(np.zeros((0, lo.a2a_topk), np.int64), placement)
    none = np.zeros((0, lo.a2a_topk))
    return _assemble(ep, parts, pb, quant, placement, empty, none, none, op, "a2e")


def e2a(ep: Endpoint, expert_out: np.ndarray | None, handle: A2EHandle, event_id: int = 0):
    """Expert dies -> attention dies through trampolines (two stages); every die calls it.

    Arguments:
        ep: the calling die.
        expert_out: on expert dies, float32 [n_rows, hidden] aligned with the a2e result rows
            (None on attention dies).
        handle: the A2EHandle from `a2e`.
        event_id: names the operation; every die passes the same.
    Returns:
        float32 [batch, hidden] on attention dies (ascending-k float32 reduction, as
        `comm.reference.combine_ref`); None on expert dies.
    """
    st = _a2a_state(ep)
    lo = ep.layout
    op = st["fused_ops"][COMBINE] = st["fused_ops"][COMBINE] + 1
    n_att, me, hidden = handle.n_att, ep.die_id, lo.a2a_hidden
    if handle.role == "expert":
        d = handle.dispatch
        if not isinstance(expert_out, np.ndarray) or expert_out.shape != (
            len(d.recv_src_rank), hidden
        ) or expert_out.dtype != np.float32:  # fmt: skip
            raise ValueError(
                f"expert_out must be float32 [{len(d.recv_src_rank)}, {hidden}], got"
                f" {_describe(expert_out)}"
            )
        tr = ep.trace if ep.trace.enabled else None
        t0 = now_ns()
        tramp = n_att + d.recv_src_rank  # E2A: each row to its attention die's trampoline
        _write_slots_by_src(ep, expert_out, tramp, d.recv_slot, d.recv_k, op)
        t1 = now_ns()
        if handle.partner_slots is not None:  # E2A': a trampoline forwards to its partner
            slots, ks = handle.partner_slots
            _wait_slots(ep, slots, ks, op, "e2a")
            t2 = now_ns()
            rows = _comb_f32(ep, me)[slots * lo.a2a_topk + ks, :hidden]
            partner = np.full(len(slots), me - n_att, np.int64)
            _write_slots_by_src(ep, rows, partner, slots, ks, op)
            if tr:
                tr.rec(t1, t2 - t1, "e2a", 3, me - n_att, 0, event_id, 0)
                tr.rec(t2, now_ns() - t2, "e2a", 4, me - n_att, 0, event_id, rows.nbytes)
        if tr:
            tr.rec(t0, t1 - t0, "e2a", 1, -1, 0, event_id, expert_out.nbytes)
        return None
    idx, w = handle.topk_idx, handle.topk_weights
    r_slot, r_k = np.nonzero(idx >= 0)
    t0 = now_ns()
    _wait_slots(ep, r_slot, r_k, op, "e2a'", np.full(len(r_slot), n_att + me))
    t1 = now_ns()
    out = _weighted_sum(_comb_rows(ep, idx.shape[0]), idx, w)
    if ep.trace.enabled:
        ep.trace.rec(t0, t1 - t0, "e2a", 5, me + n_att, 0, event_id, 0)
        ep.trace.rec(t1, now_ns() - t1, "e2a", 6, -1, 0, event_id, 0)
    return out


def _wait_slots(ep, slots, ks, op, what, owners=None) -> None:
    """Wait until the completion word of every (slot, k) of this die carries `op`."""
    lo = ep.layout
    flags = _words(ep, ep.die_id, lo.fused_cflag_off, lo.a2a_max_batch * lo.a2a_topk)
    lin = slots * lo.a2a_topk + ks
    base = lo.fused_cflag_off // 8
    while True:
        pending = np.flatnonzero(flags[lin] < op)
        if not len(pending):
            return
        j = int(pending[0])
        peer = -1 if owners is None else int(owners[j])
        i = int(lin[j])
        ep.wait_ge(ep.words[ep.die_id], base + i, op, peer, f"{what}.cflag[{i}]")
