"""Expert-parallel all-to-all: XCCL pull-based dispatch / combine (docs/protocols.md §6, 001 §3.2).

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
k in float32, the exact operation order of `comm.reference.combine_ref`. Combine rows travel in
the pod's `a2a_combine_dtype`: bfloat16 by default (the paper's 16-bit combine message; each
float32 expert row is rounded to nearest even once, on the expert die, and widened exactly on
the token's die), or float32.

Reuse of a half: a die starts operation n+2 (overwriting half n % 2) only after step 5 of n+1,
which needs every peer's step 4 of n+1, which each peer does only after finishing its pulls of
n. Dispatch and combine have separate fields and areas. A die that finds a problem (a peer's
refusal, a mis-paired event id) still waits for every peer's field of the operation before it
raises, so this argument holds after errors too.

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

from dataclasses import dataclass, field

import numpy as np

from comm.endpoint import Endpoint
from comm.quant import BF16, combine_dtype
from comm.routing import (
    DedupLayout,
    DispatchLayout,
    Placement,
    check_topk_idx,
    get_dedup_layout,
    get_dispatch_layout,
)
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ConfigError, PeerRefused, PodError, ProtocolError

PROTOCOLS = ("pull", "fused")
QUANTS = (None, "none", "int8")
DISPATCH, COMBINE = 0, 1
EVENT_LIMIT = 1 << 62
F_EVENT, F_OFF, F_COUNT, F_SEQ = L.PULL_EVENT, L.PULL_OFF, L.PULL_COUNT, L.PULL_SEQ
G_EVENT, G_COUNT, G_SEQ, G_QUANT = L.FLAG_EVENT, L.FLAG_COUNT, L.FLAG_SEQ, L.FLAG_QUANT
QUANT_CODE = {None: 0, "int8": 1}  # what the rows of a dispatch hold, carried in its fields
DEDUP_CODE = 2  # added to the quant code: one row per (token, destination die), §6.3
QUANT_NAME = {0: "float32", 1: "int8", 2: "float32 dedup", 3: "int8 dedup"}
OFF_BITS = 48  # a pull field's off word: row offset | code << OFF_BITS
OP_CODE_MASK = (1 << 15) - 1  # a combine's code: its dispatch's operation number mod 2**15
REFUSED = L.COUNT_REFUSED
BAD_EVENT = -1  # the event_id word published by a die whose own event_id was invalid


@dataclass(frozen=True)
class DedupGroups:
    """An expert die's view of the dedup rows it received (one group per (source die, token)),
    in receive order: by source die, then the source's send order (batch slot).

    Attributes:
        src, slot, kfirst: int64 [groups], where the group's pre-reduced combine row goes: the
            source die, and the (batch slot, k) of the token's first expert on this die.
        start: int64 [groups + 1], entries of group g are start[g]:start[g + 1], ascending k.
        pos: int64 [entries], the entry's row in the dispatch output (grouped by expert).
        w: float32 [entries], the entry's routing weight, as the source sent it.
    """

    src: np.ndarray
    slot: np.ndarray
    kfirst: np.ndarray
    start: np.ndarray
    pos: np.ndarray
    w: np.ndarray


@dataclass(frozen=True)
class DispatchHandle:
    """What `combine` needs from the `dispatch` it reverses (treat as opaque).

    Attributes:
        protocol, quant: as dispatched.
        placement: the expert placement used.
        layout: this die's DispatchLayout (its messages in canonical send order); None after
            a dedup dispatch, whose rows are `dedup`'s.
        topk_idx: int64 [batch, k]; topk_weights: float32 [batch, k] (this die's tokens).
        recv_src_rank: int64 [n_rows], the source die of each dispatched row this die received.
        op: the dispatch operation number.
        recv_slot, recv_k: int64 [n_rows], each row's (batch_slot, k_index) at its source.
        dedup: with dedup, this die's DedupLayout (its rows as a source); groups: the
            DedupGroups it received (as an expert die). None without dedup.
    """

    protocol: str
    quant: str | None
    placement: Placement
    layout: DispatchLayout | None
    topk_idx: np.ndarray
    topk_weights: np.ndarray
    recv_src_rank: np.ndarray
    op: int
    recv_slot: np.ndarray | None = None
    recv_k: np.ndarray | None = None
    dedup: DedupLayout | None = None
    groups: DedupGroups | None = None


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


@dataclass(slots=True)
class A2AState:
    """A die's all-to-all state (`ep.a2a`), the same numbers on every die while in step.

    Attributes:
        pull_ops: [dispatch, combine] operation numbers of the pull protocol (field seq words).
        fused_ops: [dispatch, combine] operation numbers of fused dispatch / A2E and fused
            combine / E2A (flag seq words and combine completion words).
        placement: the default placement; a2e_placement: the A2E placement over expert dies.
        checked: the last caller placement that passed the capacity check.
        last: the handle of this die's latest dispatch (what a refusing combine owes).
        fused_combined: the fused dispatch operation this die combined last (once only).
        place_info: per-die facts of the last placement used; comb_f32: combine buffer views;
            views: word views (`_words`) and flat combine buffers, made once per area.
    """

    pull_ops: list[int] = field(default_factory=lambda: [0, 0])
    fused_ops: list[int] = field(default_factory=lambda: [0, 0])
    placement: Placement | None = None
    a2e_placement: Placement | None = None
    checked: Placement | None = None
    last: DispatchHandle | None = None
    fused_combined: int = 0
    place_info: _PlaceInfo | None = None
    comb_f32: dict = field(default_factory=dict)
    views: dict = field(default_factory=dict)

    def counters(self) -> list[int]:
        return [*self.pull_ops, *self.fused_ops]

    def realign(self, counters: list[int]) -> None:
        """Set the operation numbers (the launcher's resync passes the maximum over dies)."""
        self.pull_ops[:] = counters[:2]
        self.fused_ops[:] = counters[2:4]


def _a2a_state(ep: Endpoint) -> A2AState:
    st = getattr(ep, "a2a", None)
    if st is None:
        if not ep.layout.a2a_max_batch:
            raise ConfigError(
                "a2a_max_batch: this pod has no all-to-all areas; launch it with"
                " PodConfig(a2a_max_batch=..., a2a_hidden=..., a2a_topk=..., num_experts=...)"
            )
        st = ep.a2a = A2AState()
    return st


def a2a_counters(ep: Endpoint) -> list[int] | None:
    """This die's operation numbers (None if it never ran an all-to-all); for resync."""
    st = getattr(ep, "a2a", None)
    return None if st is None else st.counters()


def a2a_realign(ep: Endpoint, counters: list[int]) -> None:
    """Resync after a failed pod.run: every die takes the same (maximum) operation numbers, so
    the next operation is in step whatever each die had done; every field and completion word
    holds at most these numbers, so none of them can satisfy the next wait."""
    if ep.layout.a2a_max_batch:
        _a2a_state(ep).realign(counters)


def _check_event(event_id) -> int:
    """The event id as an int; ValueError (as for p2p) unless an int in [0, 2**62)."""
    ok = not isinstance(event_id, bool) and isinstance(event_id, int | np.integer)
    if not ok or not 0 <= event_id < EVENT_LIMIT:
        raise ValueError(f"event_id {event_id!r} must be an int in [0, 2**62)")
    return int(event_id)


def _event_word(event_id) -> int:
    """The event_id word a refusing die publishes: its own if valid, else BAD_EVENT."""
    try:
        return _check_event(event_id)
    except (TypeError, ValueError):
        return BAD_EVENT


def _check_protocol(protocol) -> None:
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"protocol {protocol!r}: supported here: {', '.join(PROTOCOLS)} (this die cannot"
            " take part in its peers' operation: they time out or are aborted)"
        )


def _check_inputs(ep: Endpoint, x, topk_idx, topk_weights, quant) -> None:
    lo = ep.layout
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
    if topk_weights.dtype.kind != "f":
        raise TypeError(f"topk_weights must be a float array, got {_describe(topk_weights)}")


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.dtype}{list(a.shape)}"
    return type(a).__name__


def _placement(ep: Endpoint, placement: Placement | None) -> Placement:
    st = ep.a2a
    if placement is not None:
        if st.checked is placement:
            return placement
        if not isinstance(placement, Placement):
            raise TypeError(
                f"placement must be a comm.routing.Placement, got {_describe(placement)}"
            )
        most = max(placement.num_local(d) for d in placement.dies)
        cap = ep.layout.a2a_experts_per_die
        if most > cap or max(placement.dies) >= ep.num_dies:
            raise ValueError(
                f"placement puts {most} experts on one die (or names a die outside the pod);"
                f" the pod's areas are sized for {cap} per die"
                " (PodConfig.a2a_max_local_experts)"
            )
        if placement.num_experts != ep.layout.a2a_num_experts:
            raise ValueError(
                f"placement has {placement.num_experts} experts, the pod was laid out for"
                f" {ep.layout.a2a_num_experts}"
            )
        st.checked = placement
        return placement
    if st.placement is None:
        lo = ep.layout
        st.placement = Placement.default(lo.a2a_num_experts, tuple(range(ep.num_dies)))
    return st.placement


def _layout(topk_idx: np.ndarray, placement: Placement) -> DispatchLayout:
    """`comm.routing.get_dispatch_layout` in one compiled pass (`comm.kernels.dispatch_layout`,
    equal to it); a routing the kernel refuses goes the numpy way, which raises the error
    naming the bad entry."""
    if topk_idx.dtype.kind not in "iu":
        check_topk_idx(topk_idx, placement.num_experts)  # raises its TypeError
    t = np.ascontiguousarray(topk_idx, np.int64)
    got = kernels().dispatch_layout(
        t, placement.pos_of, placement.local_of, placement.die_of, len(placement.dies)
    )
    if isinstance(got, int):  # the numpy path names the bad entry (and is the authority)
        return get_dispatch_layout(t, placement)
    return DispatchLayout(*got)


def _dedup_layout(topk_idx, topk_weights, placement: Placement) -> DedupLayout:
    """`comm.routing.get_dedup_layout` in one compiled pass (`comm.kernels.dedup_layout`, equal
    to it); input the kernel cannot take or refuses (an id out of range or repeated) goes the
    numpy way, which raises the error naming the problem, as `_layout` does."""
    t, w = np.asarray(topk_idx), np.asarray(topk_weights)
    ok = isinstance(placement, Placement) and t.dtype.kind in "iu" and t.ndim == 2
    if not ok or w.shape != t.shape or w.dtype.kind not in "fiu":
        return get_dedup_layout(topk_idx, topk_weights, placement)
    t, w = np.ascontiguousarray(t, np.int64), np.ascontiguousarray(w, np.float32)
    got = kernels().dedup_layout(t, w, placement.pos_of, placement.local_of, len(placement.dies))
    if isinstance(got, int):  # an id out of range or repeated: the numpy path names it
        return get_dedup_layout(t, w, placement)
    return DedupLayout(*got)


def _payload(x: np.ndarray, quant: str | None) -> tuple[np.ndarray, np.ndarray]:
    """(rows to send, per-row scales): INT8 + scales, or x itself with scales of 1."""
    if quant == "int8":
        return kernels().quantize_int8(x)  # comm.quant.quantize_int8, compiled, bit for bit
    return x, np.ones(len(x), np.float32)


def _check_capacity(ep: Endpoint, lay: DispatchLayout, placement: Placement) -> None:
    """Refuse a dispatch whose rows for one destination would not fit its receive area (only a
    routing that names more experts of one die per token than the layout allows could)."""
    per_src = ep.layout.fused_disp_rows
    most = int(lay.num_tokens_per_die.max()) if lay.num_tokens_per_die.size else 0
    if most > per_src:
        p = int(np.argmax(lay.num_tokens_per_die))
        raise ValueError(
            f"dispatch sends {most} rows to die {placement.dies[p]}, more than its receive area"
            f" holds per source ({per_src} = a2a_max_batch x min(a2a_topk, experts per die))"
        )


def _area_check(ep: Endpoint, what: str, start: int, count: int, capacity: int) -> None:
    """The last line of defence: never read or write rows outside an area."""
    if start < 0 or count < 0 or start + count > capacity:
        raise ProtocolError(
            f"die {ep.die_id}: {what}: rows [{start}, {start + count}) outside the area of"
            f" {capacity} rows; nothing written"
        )


def _publish(ep: Endpoint, kind: int, half: int, dst: int, event_id, off, count, seq,
             code=0) -> None:  # fmt: skip
    """Step 4: offset (with `code`: the rows' quant code in a dispatch, the reversed dispatch's
    operation number mod 2**15 in a combine) and count, then seq LAST, into dst's field for
    this source."""
    w = ep.words[dst]
    f = ep.layout.pull_field_word(kind, half, ep.die_id)
    w[f + F_EVENT] = event_id
    w[f + F_OFF] = off | code << OFF_BITS
    w[f + F_COUNT] = count
    w[f + F_SEQ] = seq


def _poll_all(ep: Endpoint, kind: int, half: int, op: int, event_id: int, code: int) -> list:
    """Step 5: wait for every source's field of this operation; (off, count) per source.

    Every source is waited for before any problem is raised (see the module docstring)."""
    lw = ep.words[ep.die_id]
    lo = ep.layout
    out, problems = [], []
    name = "dispatch" if kind == DISPATCH else "combine"
    for src in range(ep.num_dies):
        f = lo.pull_field_word(kind, half, src)
        ep.wait_ge(lw, f + F_SEQ, op, src, f"pull.{name}[{half}].seq")
        if lw[f + F_SEQ] != op:
            raise ProtocolError(
                f"die {ep.die_id}: pull {name} field of die {src} carries operation"
                f" {lw[f + F_SEQ]}, expected {op} (dispatch/combine calls out of step)"
            )
        count, off = lw[f + F_COUNT], lw[f + F_OFF]
        if count == REFUSED:
            problems.append(_refused(ep, src, f"pull {name}", op))
        else:
            bad = _mispaired(ep, f"pull {name}", src, event_id, lw[f + F_EVENT], code,
                             off >> OFF_BITS)  # fmt: skip
            if bad is not None:
                problems.append(bad)
        out.append((off & ((1 << OFF_BITS) - 1), count))
    if problems:
        raise problems[0]
    return out


def _mispaired(ep, what, src, event_id, got_event, code, got_code) -> ProtocolError | None:
    """A ProtocolError if a source's operation names another event id or code than ours (a
    dispatch: the rows' quant; a combine: the dispatch it reverses)."""
    if got_event != event_id:
        return ProtocolError(
            f"die {ep.die_id}: {what} from die {src}: expected event_id {event_id}, the source"
            f" published {got_event} (calls mis-paired)"
        )
    if got_code == code:
        return None
    if "combine" in what:
        return ProtocolError(
            f"die {ep.die_id}: {what} from die {src}: it reverses dispatch operation"
            f" {got_code} (mod 2**15), this die {code} (handles of different dispatches)"
        )
    return ProtocolError(
        f"die {ep.die_id}: {what} from die {src}: the source sent"
        f" {QUANT_NAME.get(got_code, got_code)} rows, this die asked for"
        f" {QUANT_NAME.get(code, code)} (quant differs between the dies' calls)"
    )


def _refused(ep: Endpoint, src: int, what: str, op: int) -> PeerRefused:
    return PeerRefused(
        f"die {ep.die_id}: die {src} refused its input to {what} operation {op} (its own error"
        " says why); this die's part was discarded, the pod stays in step"
    )


def _rows(ep: Endpoint, die: int, kind: int, half: int, start: int, count: int) -> np.ndarray:
    """uint8 [count, stride] view of a die's pull send rows (its own or a peer's: remote read)."""
    lo = ep.layout
    if kind == DISPATCH:
        stride, cap = lo.pull_disp_stride, lo.pull_disp_rows
    else:
        stride, cap = lo.pull_comb_stride, lo.pull_comb_rows
    _area_check(ep, f"pull {('dispatch', 'combine')[kind]} rows of die {die}", start, count, cap)
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
    st = _a2a_state(ep)
    _check_protocol(protocol)
    t0 = now_ns()
    try:
        event_id = _check_event(event_id)
        _check_inputs(ep, x, topk_idx, topk_weights, quant)
        quant = None if quant == "none" else quant
        placement = _placement(ep, placement)
        if not isinstance(dedup, bool | np.bool_):
            raise TypeError(f"dedup must be a bool, got {_describe(dedup)}")
        dedup = bool(dedup)
        if dedup:  # its own layout only; at most batch rows a die, which a block always holds
            lay, dl = None, _dedup_layout(topk_idx, topk_weights, placement)
        else:
            lay, dl = _layout(topk_idx, placement), None
            _check_capacity(ep, lay, placement)
        # steps 1-2, load and quantize, before the operation starts: a row INT8 cannot take
        # (not finite) is this die's bad input too
        payload, scale = _payload(x, quant)
    except (ValueError, TypeError) as e:
        _refuse_dispatch(ep, protocol, _event_word(event_id), e)
        raise
    t1 = now_ns()
    code = QUANT_CODE[quant] + (DEDUP_CODE if dl is not None else 0)
    if protocol == "fused":
        res = _fused_dispatch(
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
    rows = _rows(ep, ep.die_id, DISPATCH, half, 0, n)
    stride = rows.shape[1]
    if dl is None:
        kernels().pack_rows(payload, scale, lay.msg_slot, lay.msg_k, lay.msg_local_expert, rows)
    else:
        flat8 = rows.reshape(-1)
        pack = _dedup_packer(*_payload_bits(payload, pb, scale), dl, stride)
        pack(0, n, flat8, flat8.view(np.int32))
    offs = (lay if dl is None else dl).dest_offsets.tolist()
    t2 = now_ns()
    # step 4: tell every destination where its block is
    for p, d in enumerate(placement.dies):
        _publish(ep, DISPATCH, half, d, event_id, offs[p], offs[p + 1] - offs[p], op, code)
    for d in range(ep.num_dies):
        if d not in placement.dies:
            _publish(ep, DISPATCH, half, d, event_id, 0, 0, op, code)
    t3 = now_ns()
    # step 5: poll own fields; steps 6-7: pull every source's block, then group by expert
    where = _poll_all(ep, DISPATCH, half, op, event_id, code)
    t4 = now_ns()
    parts = [
        (src, _rows(ep, src, DISPATCH, half, off, count)) for src, (off, count) in enumerate(where)
    ]
    args = (ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "pull")
    result = _assemble(*args) if dl is None else _assemble_dedup(*args, dl)
    st.last = result.handle
    if tr:
        t5 = now_ns()
        for step, a, b in ((2, t0, t1), (3, t1, t2), (4, t2, t3), (5, t3, t4), (6, t4, t5)):
            tr.rec(a, b - a, "pull_dispatch", step, -1, 0, event_id, n * stride if step == 3 else 0)
    return result


def _assemble(ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, proto):
    """Step 7: rows grouped by local expert, stable, so (src_rank, slot, k) order stays.

    `parts` is a list of (src, uint8 [count, stride] rows), own or remote memory. Two compiled
    passes (`comm.kernels.assemble_count`, `assemble_place`: a counting sort by local expert);
    each payload is copied once, straight from the (possibly remote) row to its place."""
    k = kernels()
    hidden = ep.layout.a2a_hidden
    stride = ep.layout.pull_disp_stride
    n_local = _place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_local, np.int64)
    flats = []
    for src, rows in parts:
        n = len(rows)
        if not n:
            continue
        flat8 = rows.reshape(-1)
        flat32 = flat8.view(np.int32)
        if k.assemble_count(flat32, n, stride, counts) < 0:
            raise ProtocolError(
                f"die {ep.die_id}: dispatch rows from die {src} name a local expert outside"
                f" [0, {n_local}) (not dispatch packets of this placement): nothing read"
            )
        flats.append((src, n, flat8, flat32))
    total = int(counts.sum())
    cursor = np.zeros(n_local, np.int64)
    np.cumsum(counts[:-1], out=cursor[1:])
    dt = np.int8 if quant == "int8" else np.float32
    x = np.empty((total, hidden), dt)
    scale_bits = np.empty(total, np.int32)
    src_rank, slot, k_index, local = np.empty((4, total), np.int64)
    x8 = x.view(np.uint8).reshape(total, pb)
    for src, n, flat8, flat32 in flats:  # the one copy (a pull: a remote read)
        k.assemble_place(flat8, flat32, n, stride, pb, src, cursor, x8, scale_bits, src_rank,
                         slot, k_index, local)  # fmt: skip
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return _result(proto, quant, placement, lay, topk_idx, topk_weights, op, rows)


def _result(proto, quant, placement, lay, topk_idx, topk_weights, op, rows, dl=None,
            groups=None) -> DispatchResult:  # fmt: skip
    """The DispatchResult of `rows` = (x, scales, src_rank, slot, k_index, local_expert,
    expert_counts), with its handle."""
    x, scales, src_rank, slot, k_index, local, counts = rows
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
        dedup=dl,
        groups=groups,
    )
    return DispatchResult(x, scales, src_rank, slot, k_index, local, counts, handle)


def _payload_bits(payload: np.ndarray, pb: int, scale: np.ndarray) -> tuple:
    """(payload as uint8 [batch, pb], scales as int32 bits): what the raw pack kernels take."""
    src8 = np.ascontiguousarray(payload).view(np.uint8).reshape(len(payload), pb)
    return src8, np.ascontiguousarray(scale, np.float32).view(np.int32)


def _dedup_packer(src8, scale_bits, dl: DedupLayout, stride: int):
    """`pack(a, b, flat8, flat32)`: dedup rows a:b of `dl` (one per token and destination die)
    into the rows of flat8 / flat32 (a send area or a peer's block, `stride` bytes apart),
    from src8 (the payload as uint8 [batch, bytes]) and scale_bits (the scales' int32 bits).
    One compiled pass without the wrapper's per-call checks (`kernels.pack_dedup_rows_raw`):
    the layout is this die's own, each row's entries at most min(topk, its die's experts),
    which the stride holds (memory.layout sizes it; `_placement` caps the experts per die)."""
    raw = kernels().pack_dedup_rows_raw
    eoff = L.dedup_entries_off(src8.shape[1])
    most = (stride - L.PULL_ROW_META - eoff) // L.DEDUP_ENTRY
    slots, start, ks, locs, w = dl.row_slot, dl.ent_start, dl.ent_k, dl.ent_local, dl.ent_w

    def pack(a: int, b: int, flat8: np.ndarray, flat32: np.ndarray) -> None:
        if raw(src8, scale_bits, slots[a:b], start[a : b + 1], ks, locs, w, flat8, flat32, stride,
               eoff, most):  # fmt: skip
            raise ProtocolError(
                f"dedup rows [{a}, {b}): a slot, an entry range or more than {most} entries a"
                f" row (stride {stride}) outside what the layout allows; nothing written"
            )

    return pack


def _assemble_dedup(ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, proto,
                    dl):  # fmt: skip
    """Step 7 of a dedup dispatch: each received row is expanded into one output row per entry
    of its list, grouped by local expert as `_assemble` (entries ascend in k within a row, rows
    in slot order within a source, so the output is the same as without dedup). Two compiled
    passes (`comm.kernels.dedup_count`, `dedup_place`: a counting sort by local expert); each
    payload is copied once per entry, straight from the (possibly remote) row to its place."""
    lo = ep.layout
    k = kernels()
    hidden, stride, topk = lo.a2a_hidden, lo.pull_disp_stride, lo.a2a_topk
    most = min(topk, lo.a2a_experts_per_die)
    eoff = L.dedup_entries_off(pb)
    n_local = _place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_local, np.int64)
    flats = [(src, rows.reshape(-1), len(rows)) for src, rows in parts if len(rows)]
    m = 0
    for src, flat, n in flats:
        got = k.dedup_count(flat, n, stride, eoff, most, topk, counts)
        if got < 0:
            raise ProtocolError(
                f"die {ep.die_id}: dedup dispatch rows from die {src} carry entry counts outside"
                f" [1, {most}], k outside [0, {topk}) or local experts outside [0, {n_local}) (or"
                " are not dedup rows): out of step with the protocol; nothing read"
            )
        m += got
    total = sum(n for _, _, n in flats)
    cursor = np.zeros(n_local, np.int64)
    np.cumsum(counts[:-1], out=cursor[1:])
    dt = np.int8 if quant == "int8" else np.float32
    x = np.empty((m, hidden), dt)
    bits = np.empty((2, m), np.int32)  # per output row its scale, per entry its weight
    meta = np.empty((5, m), np.int64)  # per output row its origin; per entry its output row
    grp = np.empty((3, total), np.int64)  # per group its source, slot and first k
    src_rank, slot, k_index, local, pos = meta
    start = np.zeros(total + 1, np.int64)
    x8 = x.view(np.uint8).reshape(m, pb)
    g0 = 0
    for src, flat, n in flats:
        k.dedup_place(flat, n, stride, eoff, src, cursor, g0, x8, bits, meta, grp, start)
        g0 += n
    scale_bits, w_bits = bits
    g_src, g_slot, g_kfirst = grp
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    groups = DedupGroups(src=g_src, slot=g_slot, kfirst=g_kfirst, start=start, pos=pos,
                         w=w_bits.view(np.float32))  # fmt: skip
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return _result(proto, quant, placement, lay, topk_idx, topk_weights, op, rows, dl, groups)


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
    st = _a2a_state(ep)
    try:
        _check_handle(st, handle)
        event_id = _check_event(event_id)
        _check_expert_out(ep, expert_out, len(handle.recv_src_rank))
    except (ValueError, TypeError) as e:
        # refuse the combine of the dispatch this die's peers reverse: its latest
        owed = handle if isinstance(handle, DispatchHandle) and handle is st.last else st.last
        if owed is None:
            e.add_note("no dispatch ran on this die: its peers time out or are aborted")
            raise
        _refuse_combine(ep, owed, _event_word(event_id), e)
        raise
    if handle.protocol == "fused":
        return _fused_combine(ep, expert_out, handle, event_id)
    hidden = ep.layout.a2a_hidden
    op = st.pull_ops[COMBINE] = st.pull_ops[COMBINE] + 1
    half = op & 1
    t0 = now_ns()
    # step 3: own combine rows, blocks by source die in each source's send order
    cdt = _comb_dtype(ep)
    g = handle.groups
    if g is None:  # a row per received row, rounded here and gathered in the same pass
        dest = handle.recv_src_rank
        order = np.argsort(dest, kind="stable")
        rows = _rows(ep, ep.die_id, COMBINE, half, 0, len(dest))
        dst = rows[:, : cdt.itemsize * hidden].view(cdt)
        if cdt == BF16:
            kernels().to_bfloat16(expert_out, dst, order)
        else:
            dst[:] = expert_out[order]
    else:  # dedup: a pre-reduced row per received group, groups already in receive order
        dest = g.src
        _pull_reduce_groups(ep, expert_out, g, _rows(ep, ep.die_id, COMBINE, half, 0, len(dest)))
    t1 = now_ns()
    counts = np.bincount(dest, minlength=ep.num_dies)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    code = handle.op & OP_CODE_MASK
    for src in range(ep.num_dies):  # step 4
        _publish(ep, COMBINE, half, src, event_id, int(starts[src]), int(counts[src]), op, code)
    t2 = now_ns()
    where = _poll_all(ep, COMBINE, half, op, event_id, code)  # step 5
    t3 = now_ns()
    out = _reduce(ep, handle, where, half)  # steps 6-7
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
    dst = _flat_elems(ep, rows.reshape(-1))
    if kernels().reduce_groups_raw(np.ascontiguousarray(expert_out), g.pos, g.start, g.w, 0, dst,
                                   lin[:n], stride, n):  # fmt: skip
        raise ProtocolError(
            f"die {ep.die_id}: dedup combine: an entry range or row index outside this die's"
            f" {len(expert_out)} expert rows; nothing written"
        )


def _ones(shape) -> np.ndarray:
    return np.ones(shape, np.float32)


def _check_handle(st: A2AState, handle) -> None:
    if not isinstance(handle, DispatchHandle) or handle.protocol not in PROTOCOLS:
        raise TypeError(
            f"handle must be the DispatchHandle of a dispatch (a2e's goes to e2a), got"
            f" {_describe(handle)}"
        )
    if handle.protocol == "fused" and (
        handle.op != st.fused_ops[DISPATCH] or handle.op == st.fused_combined
    ):
        again = " again" if handle.op == st.fused_combined else ""
        raise ValueError(
            f"handle: a fused combine reverses the latest fused dispatch or a2e of this die"
            f" (operation {st.fused_ops[DISPATCH]}) once; this is operation {handle.op}{again}"
            " (the fused combine buffer is single: fused dispatch and combine must alternate;"
            " the pull protocol allows several outstanding handles)"
        )


def _check_expert_out(ep: Endpoint, expert_out, n_rows: int) -> None:
    hidden = ep.layout.a2a_hidden
    if n_rows > ep.layout.pull_comb_rows:
        raise ValueError(
            f"combine would return {n_rows} rows, more than this die's combine area holds"
            f" ({ep.layout.pull_comb_rows} = dies x a2a_max_batch x min(a2a_topk, experts per"
            " die)): the dispatch routed a token to one expert more than once"
        )
    if not isinstance(expert_out, np.ndarray) or expert_out.dtype != np.float32:
        raise TypeError(f"expert_out must be float32 [n_rows, hidden], got {_describe(expert_out)}")
    if expert_out.shape != (n_rows, hidden):
        raise ValueError(
            f"expert_out has shape {list(expert_out.shape)}, the dispatch delivered"
            f" {n_rows} rows of hidden {hidden}"
        )


# ------------------------------------------------------------------------------------------------
# Refusal: a die with bad input still takes part, so that every die's counters stay in step
# ------------------------------------------------------------------------------------------------


def _refuse_dispatch(ep: Endpoint, protocol: str, event_word: int, err: BaseException) -> None:
    """Take part in this dispatch with no rows: COUNT_REFUSED to every die, then wait for every
    die's field or flag of the operation (as a good die would) so the halves stay safe."""
    st = ep.a2a
    lo = ep.layout
    if protocol == "pull":
        op = st.pull_ops[DISPATCH] = st.pull_ops[DISPATCH] + 1
        half = op & 1
        for d in range(ep.num_dies):
            _publish(ep, DISPATCH, half, d, event_word, 0, REFUSED, op)
        _wait_fields(ep, lambda src: lo.pull_field_word(DISPATCH, half, src) + F_SEQ, op, err)
        return
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    half = op & 1
    for d in range(ep.num_dies):
        _flag(ep, d, lo.fused_flag_word(half, ep.die_id), event_word, REFUSED, op)
    _wait_fields(ep, lambda src: lo.fused_flag_word(half, src) + G_SEQ, op, err)


def _refuse_combine(ep: Endpoint, handle: DispatchHandle, event_word: int, err) -> None:
    """Take part in this combine without rows. Pull: COUNT_REFUSED to every die and wait for
    every die's field. Fused: fused_refuse = op in every die this die owes rows, then those
    rows' completion words (no payload), then wait for this die's own tokens' words."""
    st = ep.a2a
    lo = ep.layout
    if handle.protocol == "pull":
        op = st.pull_ops[COMBINE] = st.pull_ops[COMBINE] + 1
        half = op & 1
        for d in range(ep.num_dies):
            _publish(ep, COMBINE, half, d, event_word, 0, REFUSED, op)
        _wait_fields(ep, lambda src: lo.pull_field_word(COMBINE, half, src) + F_SEQ, op, err)
        return
    op = st.fused_ops[COMBINE] = st.fused_ops[COMBINE] + 1
    st.fused_combined = handle.op
    g = handle.groups
    if g is None:
        _refuse_slots(ep, handle.recv_src_rank, handle.recv_slot, handle.recv_k, op, event_word)
    else:
        _refuse_slots(ep, g.src, g.slot, g.kfirst, op, event_word)
    idx = handle.topk_idx if handle.dedup is None else handle.dedup.idx_first
    r_slot, r_k = np.nonzero(idx >= 0)
    _wait_slots(ep, r_slot, r_k, op, "fused", handle.placement.die_of[idx[r_slot, r_k]])


def _refuse_slots(ep: Endpoint, dest, slots, ks, op: int, event_word: int) -> None:
    """Mark this die refused for fused-combine operation `op` in every die of `dest`, then set
    the completion words it owes there (no rows): waiters wake, see the refusal and raise."""
    lo = ep.layout
    topk = lo.a2a_topk
    for d in np.unique(dest).tolist():
        sel = dest == d
        lin = slots[sel] * topk + ks[sel]
        _lin_check(ep, d, lin)
        _words(ep, d, lo.fused_cevent_off, ep.num_dies)[ep.die_id] = event_word
        _words(ep, d, lo.fused_refuse_off, ep.num_dies)[ep.die_id] = op
        # after the refusal word: a waiter that sees op sees the refusal too
        _words(ep, d, lo.fused_cflag_off, lo.a2a_max_batch * topk)[lin] = op


def _lin_check(ep: Endpoint, d: int, lin: np.ndarray) -> None:
    """Every (slot, k) row index must lie inside die d's combine buffer."""
    cap = ep.layout.a2a_max_batch * ep.layout.a2a_topk
    if len(lin) and (lin.min() < 0 or lin.max() >= cap):
        bad = int(lin.min()) if lin.min() < 0 else int(lin.max())
        _area_check(ep, f"combine buffer of die {d}", bad, 1, cap)


def _wait_fields(ep: Endpoint, word_of, op: int, err: BaseException) -> None:
    """A refusing die waits for every die's polled word of the operation, like a good die."""
    lw = ep.words[ep.die_id]
    for src in range(ep.num_dies):
        try:
            ep.wait_ge(lw, word_of(src), op, src, "all-to-all field (refusing die)")
        except Exception as e:
            raise e from err


def _flag(ep: Endpoint, dst: int, f: int, event_word: int, count: int, op: int, code=0) -> None:
    """A fused / a2e flag: event id, count, quant code, then the operation number LAST."""
    w = ep.words[dst]
    w[f + G_EVENT] = event_word
    w[f + G_COUNT] = count
    w[f + G_QUANT] = code
    w[f + G_SEQ] = op


def _weighted_sum(contrib: np.ndarray, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """out[slot] = sum over routed k, ascending, of w[slot, k] * contrib[slot, k], in float32:
    the operation order of `comm.reference.combine_ref`, so results are bit for bit the same.
    One compiled pass over the rows (`comm.kernels.weighted_sum`: bfloat16 rows widened
    exactly on the way; 2.4x faster than the numpy passes it replaced); unrouted entries are
    never read."""
    return kernels().weighted_sum(contrib, idx, w)


_NO_ROWS = {2: np.zeros(0, np.uint16), 4: np.zeros(0, np.float32)}  # combine rows, by size
_NO_BITS = {2: np.zeros(0, np.uint16), 4: np.zeros(0, np.int32)}  # their bits, by size


def _reduce(ep: Endpoint, handle: DispatchHandle, where: list[tuple], half: int) -> np.ndarray:
    """Steps 6-7 of a pull combine: each expert die's rows of this die's tokens, read where
    they are (remote), summed per token in ascending k: `_weighted_sum`'s arithmetic in one
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
        idx, w = dl.idx_first, _ones(dl.idx_first.shape)
    lo = ep.layout
    cdt = _comb_dtype(ep)
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
        _area_check(ep, f"pull combine rows of die {d}", off, count, lo.pull_comb_rows)
        first[p] = off
    mem = _mem(ep)
    item = cdt.itemsize
    out = np.empty((idx.shape[0], lo.a2a_hidden), np.float32)
    like = _NO_ROWS[item]  # the rows' element type: bfloat16 bits or float32
    if kernels().pull_reduce(
        mem.addrs, mem.nbytes, like, _place_info(ep, placement).dies_arr, offs, first,
        lo.pull_block_off(COMBINE, half) // item, lo.pull_comb_stride // item, slots, ks,
        np.ascontiguousarray(idx, np.int64), np.ascontiguousarray(w, np.float32), out,
    ):  # fmt: skip
        raise ProtocolError(
            f"die {ep.die_id}: pull combine: a routed (slot, k) of this die has no row in the"
            " layout (handle out of step with the dispatch); nothing read"
        )
    return out


# ------------------------------------------------------------------------------------------------
# FusedDispatch / FusedCombine with AIV-Direct (docs/protocols.md §7, 000 §4.2.1)
# ------------------------------------------------------------------------------------------------


def _words(ep: Endpoint, die: int, off: int, n: int) -> np.ndarray:
    """int64 numpy view of n meta words of a die's region at byte offset off (made once)."""
    views = ep.a2a.views
    v = views.get((die, off, n))
    if v is None:
        v = views[die, off, n] = ep.regions[die].array[off : off + 8 * n].view(np.int64)
    return v


def _fused_rows(ep: Endpoint, die: int, half: int, src: int, count: int) -> np.ndarray:
    """uint8 [count, stride]: the first `count` rows of die's pre-allocated dispatch buffer
    block for src (the bound is checked: never a row outside the block)."""
    lo = ep.layout
    _area_check(ep, f"fused dispatch block of die {die} for source {src}", 0, count,
                lo.fused_disp_rows)  # fmt: skip
    base, stride = _block_off(ep, half, src), lo.pull_disp_stride
    return ep.regions[die].array[base : base + count * stride].reshape(count, stride)


def _block_off(ep: Endpoint, half: int, src: int) -> int:
    """Byte offset of the dispatch block for source src in a die's fused receive area."""
    lo = ep.layout
    return lo.fused_disp_off + (half * ep.num_dies + src) * lo.fused_disp_rows * lo.pull_disp_stride


def _fused_block(ep: Endpoint, die: int, half: int, count: int) -> tuple:
    """(uint8, int32) flat views of die's whole dispatch block for this source (made once);
    `count` rows are checked to fit, as `_fused_rows` does."""
    lo = ep.layout
    _area_check(ep, f"fused dispatch block of die {die} for source {ep.die_id}", 0, count,
                lo.fused_disp_rows)  # fmt: skip
    views = ep.a2a.views
    v = views.get(("block", die, half))
    if v is None:
        base = _block_off(ep, half, ep.die_id)
        flat = ep.regions[die].array[base : base + lo.fused_disp_rows * lo.pull_disp_stride]
        v = views["block", die, half] = (flat, flat.view(np.int32))
    return v


@dataclass(frozen=True)
class _PlaceInfo:
    """Per-die facts of a placement, computed once per placement object (hot-path lookups)."""

    placement: Placement
    pos: list[int]  # [die] position in placement.dies, -1 if the die hosts no expert
    num_local: list[int]  # [die] experts hosted
    experts: list  # [die] its logical experts in local order (int64; empty if none)
    pos_arr: np.ndarray  # int64 [die]: pos, for the kernels
    dies_arr: np.ndarray  # int64 [position]: placement.dies
    exp_flat: np.ndarray  # int64: every die's experts, die after die
    exp_start: np.ndarray  # int64 [die + 1]: die d's are exp_flat[exp_start[d]:exp_start[d + 1]]


def _place_info(ep: Endpoint, placement: Placement) -> _PlaceInfo:
    st = ep.a2a
    info = st.place_info
    if info is None or info.placement is not placement:
        pos = [-1] * ep.num_dies
        for p, d in enumerate(placement.dies):
            pos[d] = p
        counts = np.bincount(placement.die_of, minlength=ep.num_dies).tolist()
        experts = [placement.experts_on(d) if pos[d] >= 0 else np.zeros(0, np.int64)
                   for d in range(ep.num_dies)]  # fmt: skip
        sizes = [len(e) for e in experts]
        info = st.place_info = _PlaceInfo(
            placement, pos, counts[: ep.num_dies], experts,
            np.array(pos, np.int64), np.array(placement.dies, np.int64),
            np.concatenate([np.asarray(e, np.int64) for e in experts]),
            np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        )  # fmt: skip
    return info


@dataclass(frozen=True)
class _Mem:
    """Where every region of the pod is mapped in this die (int64 [dies] addresses) and a
    region's size, made once per die: the fused protocol's kernels address any die's region
    through them (`comm.kernels._region`), so one call writes into every destination. The
    endpoint keeps every region mapped while it lives, so the addresses stay valid."""

    addrs: np.ndarray
    nbytes: int


def _mem(ep: Endpoint) -> _Mem:
    views = ep.a2a.views
    m = views.get("mem")
    if m is None:
        arrays = [r.array for r in ep.regions]
        m = views["mem"] = _Mem(np.array([a.ctypes.data for a in arrays], np.int64),
                                len(arrays[0]))  # fmt: skip
    return m


def _fused_dispatch(ep, payload, scale, topk_idx, topk_weights, quant, event_id, placement, lay,
                    t0, dl=None):  # fmt: skip
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
    info = _place_info(ep, placement)
    code = QUANT_CODE[quant] + (DEDUP_CODE if dl is not None else 0)
    if dl is None:  # steps 1-2 for every destination in three compiled calls (`_fused_send`)
        t1 = _fused_send(ep, payload, scale, lay, info, half, op, event_id, code, pb)
    else:  # a dedup row per token and destination, fewer than its messages
        pack = _dedup_packer(*_payload_bits(payload, pb, scale), dl, lo.pull_disp_stride)
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
        parts, counts, t3 = _fused_gather(
            ep, half, op, event_id, range(ep.num_dies), placement, "", quant, True
        )
        args = (ep, parts, pb, quant, placement, lay, topk_idx, topk_weights, op, "fused")
        res = _assemble_dedup(*args, dl)
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


def _fused_gather(ep, half, op, event_id, sources, placement, what, quant, dedup=False):
    """Wait for the flag of every source (all of them before raising anything), then return
    ([(src, rows)], per-local-expert counts, time the last flag was seen)."""
    lo = ep.layout
    lw, parts, problems = ep.words[ep.die_id], [], []
    n_mine = _place_info(ep, placement).num_local[ep.die_id]
    counts = np.zeros(n_mine, np.int64)
    name = "a2e" if what else "fused dispatch"
    for src in sources:
        f = lo.fused_flag_word(half, src)
        ep.wait_ge(lw, f + G_SEQ, op, src, f"fused.flag[{half}]{what}")
        count = lw[f + G_COUNT]
        if count == REFUSED:
            problems.append(_refused(ep, src, name, op))
        else:
            code = QUANT_CODE[quant] + (DEDUP_CODE if dedup else 0)
            bad = _mispaired(ep, name, src, event_id, lw[f + G_EVENT], code, lw[f + G_QUANT])
            if bad is not None:
                problems.append(bad)
        if count != REFUSED and not problems:
            counts += _words(ep, ep.die_id, lo.fused_counts_off_of(half, src), n_mine)
            parts.append((src, _fused_rows(ep, ep.die_id, half, src, count)))
    if problems:
        raise problems[0]
    return parts, counts, now_ns()


def _fused_send(ep, payload, scale, lay, info, half, op, event_id, code, pb) -> int:
    """FusedDispatch steps 1-2 for every destination: each packet written once, straight into
    its destination's block for this source (`fused_pack`; rows checked by _check_capacity),
    then every die's counts, event id, row count and quant code (`fused_counts`), then every
    die's operation number LAST (`fused_seq`). Returns the time the packets were written."""
    lo = ep.layout
    k, mem = kernels(), _mem(ep)
    if not payload.flags.writeable:  # the kernels are compiled for writeable arrays only
        payload = payload.copy()
    src8, scale_bits = _payload_bits(payload, pb, scale)
    k.fused_pack(mem.addrs, mem.nbytes, info.dies_arr, lay.dest_offsets,
                 _block_off(ep, half, ep.die_id),
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
    k, mem = kernels(), _mem(ep)
    flag = lo.fused_flag_word(half, ep.die_id)
    k.fused_counts(mem.addrs, mem.nbytes, info.pos_arr, lay.dest_offsets, lay.num_tokens_per_expert,
                   info.exp_flat, info.exp_start, lo.fused_counts_off_of(half, ep.die_id) // 8,
                   flag, event_id, code)  # fmt: skip
    k.fused_seq(mem.addrs, mem.nbytes, flag + G_SEQ, op)


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
        ep.wait_ge(lw, f + G_SEQ, op, src, f"fused.flag[{half}]")
        count = lw[f + G_COUNT]
        if count == REFUSED:
            problems.append(_refused(ep, src, "fused dispatch", op))
            continue
        bad = _mispaired(ep, "fused dispatch", src, event_id, lw[f + G_EVENT], code,
                         lw[f + G_QUANT])  # fmt: skip
        if bad is not None:
            problems.append(bad)
            continue
        if not 0 <= count <= lo.fused_disp_rows:
            _area_check(ep, f"fused dispatch block of die {ep.die_id} for source {src}", 0,
                        count, lo.fused_disp_rows)  # fmt: skip
        srcs.append(src)
        cnts.append(count)
    if problems:
        raise problems[0]
    t3 = now_ns()
    n_local = _place_info(ep, placement).num_local[ep.die_id]
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
        _block_off(ep, half, 0), lo.fused_disp_rows * stride, lo.fused_counts_off_of(half, 0) // 8,
        lo.a2a_experts_per_die, stride, pb, counts, x.view(np.uint8).reshape(total, pb),
        scale_bits, src_rank, slot, k_index, local,
    )  # fmt: skip
    if got == -(1 << 40):
        raise ProtocolError(
            f"die {ep.die_id}: fused dispatch packets per local expert {counts.tolist()} disagree"
            " with the counts their sources wrote"
        )
    if got < 0:
        raise ProtocolError(
            f"die {ep.die_id}: dispatch rows from die {-1 - got} name a local expert outside"
            f" [0, {n_local}) (not dispatch packets of this placement): nothing read"
        )
    scales = scale_bits.view(np.float32) if quant == "int8" else None
    rows = (x, scales, src_rank, slot, k_index, local, counts)
    return _result("fused", quant, placement, lay, topk_idx, topk_weights, op, rows), t3


def _fused_combine(ep, expert_out, handle, event_id):
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
        _write_slots_by_src(
            ep, expert_out, handle.recv_src_rank, handle.recv_slot, handle.recv_k, op, event_id
        )
        idx, w = handle.topk_idx, handle.topk_weights
    else:
        _write_groups_by_src(ep, expert_out, g, op, event_id)
        idx = handle.dedup.idx_first
        w = _ones(idx.shape)
    t1 = now_ns()
    if g is None:  # the routed (slot, k) and their expert dies: the dispatch's messages
        lay = handle.layout
        r_slot, r_k, owners = lay.msg_slot, lay.msg_k, lay.msg_dest
    else:
        r_slot, r_k = np.nonzero(idx >= 0)
        owners = handle.placement.die_of[idx[r_slot, r_k]]
    _wait_slots(ep, r_slot, r_k, op, "fused", owners)
    _check_sources(ep, owners, op, event_id, "fused combine")
    t2 = now_ns()
    out = _own_weighted_sum(ep, idx, w)
    if tr:
        t3 = now_ns()
        n_rows = len(handle.recv_src_rank if g is None else g.src)
        nbytes = lo.a2a_combine_bytes * lo.a2a_hidden * n_rows
        for step, a, b, nb in ((1, t0, t1, nbytes), (3, t1, t2, 0), (4, t2, t3, 0)):
            tr.rec(a, b - a, "fused_combine", step, -1, 0, event_id, nb)
    return out


def _check_sources(ep: Endpoint, owners: np.ndarray, op: int, event_id: int, what: str) -> None:
    """After the completion words of `op`: PeerRefused if a die that owed rows refused,
    ProtocolError if it wrote them for another event id (calls mis-paired); the lowest such die
    is named. One compiled pass (`comm.kernels.first_bad_source`; np.unique and a scalar read
    per die cost ~4x more at decode sizes)."""
    if not len(owners):
        return
    lo = ep.layout
    refuse = _words(ep, ep.die_id, lo.fused_refuse_off, ep.num_dies)
    events = _words(ep, ep.die_id, lo.fused_cevent_off, ep.num_dies)
    bad = kernels().first_bad_source(owners, refuse, events, op, event_id)
    if bad < 0:
        return
    d = bad // 2
    if bad % 2 == 0:
        raise _refused(ep, d, what, op)
    raise ProtocolError(
        f"die {ep.die_id}: {what} from die {d}: expected event_id {event_id}, its rows"
        f" carry {events[d]} (calls mis-paired)"
    )


_KERNELS = None


def kernels():
    """`comm.kernels` (numba), imported on first use: a pod with bfloat16 combine rows loads it
    in the launcher before its dies fork (`runtime.pod`), so they start with it compiled. Kept
    in a global: an import statement costs ~2.4 us, and a collective looks it up ~5 times."""
    global _KERNELS
    if _KERNELS is None:
        from comm import kernels as k

        _KERNELS = k
    return _KERNELS


def _comb_dtype(ep: Endpoint) -> np.dtype:
    """The dtype of this pod's combine rows (PodConfig.a2a_combine_dtype)."""
    return combine_dtype(ep.layout.a2a_combine_bytes)


def _comb_buf(ep: Endpoint, die: int) -> np.ndarray:
    """[max_batch * topk, comb_stride / element] of the combine dtype: die's fused combine
    buffer, row slot * topk + k."""
    views = ep.a2a.comb_f32
    v = views.get(die)
    if v is None:
        lo = ep.layout
        n, stride = lo.a2a_max_batch * lo.a2a_topk, lo.pull_comb_stride
        raw = ep.regions[die].array[lo.fused_comb_off : lo.fused_comb_off + n * stride]
        cdt = _comb_dtype(ep)
        v = views[die] = raw.view(cdt).reshape(n, stride // cdt.itemsize)
    return v


def _own_weighted_sum(ep: Endpoint, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`_weighted_sum` over this die's own fused combine buffer, rows (slot, k) at slot * topk
    + k: the flat view of the buffer is made once (the general entry point re-derives it from
    strides on every call, a third of its cost at decode sizes)."""
    views = ep.a2a.views
    v = views.get("own_comb")
    if v is None:
        lo = ep.layout
        cdt = _comb_dtype(ep)
        flat = _comb_flat(ep, ep.die_id).view(np.uint16 if cdt == BF16 else np.float32)
        v = views["own_comb"] = (flat, lo.pull_comb_stride // cdt.itemsize)
    flat, stride = v
    return kernels().weighted_sum_flat(flat, stride, idx, w, ep.layout.a2a_hidden)


def _write_slots_by_src(ep, rows, dest, slots, ks, op, event_id) -> None:
    """Steps 1-2 of a fused combine (and of E2A): per destination, this die's event id word,
    then row i straight into die dest[i]'s combine buffer at (slots[i], ks[i]), one row copy
    each and no gathered temporary, then the completion words of those (slot, k) LAST. Rows in
    float32 are rounded to bfloat16 in the same pass (a bfloat16 pod; bfloat16 rows, forwarded
    by a trampoline, go as they are). Three compiled calls: the send plan
    (`comm.kernels.group_by_dest`, which also proves every index in range), the event words and
    rows of every destination (`fused_scatter`), then every
    completion word (`fused_cflags`)."""
    n = len(dest)
    if not n:
        return
    lo = ep.layout
    k = kernels()
    topk, cap = lo.a2a_topk, lo.a2a_max_batch * lo.a2a_topk
    order, lin = np.empty((2, n), np.int64)
    starts = np.empty(ep.num_dies + 1, np.int64)
    if k.group_by_dest(dest, slots, ks, topk, ep.num_dies, cap, order, lin, starts):
        _bad_plan(ep, dest, slots, ks, cap)
    cdt = _comb_dtype(ep)
    rows = np.ascontiguousarray(rows)
    if rows.dtype != cdt and not (rows.dtype == np.float32 and cdt == BF16):
        raise TypeError(f"rows {rows.dtype} cannot go into a {cdt} combine buffer")
    if not rows.flags.writeable:  # the kernels are compiled for writeable arrays only
        rows = rows.copy()
    mem = _mem(ep)
    item = cdt.itemsize
    args = (order, lin, starts)
    place = (lo.fused_comb_off // item, lo.pull_comb_stride // item, lo.fused_cevent_off // 8,
             ep.die_id, event_id)  # fmt: skip
    # float32 rows into a bfloat16 buffer are rounded on the way; other rows go as they are
    bits = np.uint32 if rows.dtype != cdt else (np.uint16 if item == 2 else np.int32)
    k.fused_scatter(rows.view(bits), *args, mem.addrs, mem.nbytes, _NO_BITS[item], *place)
    k.fused_cflags(mem.addrs, mem.nbytes, lin, starts, lo.fused_cflag_off // 8, op)  # LAST


def _bad_plan(ep: Endpoint, dest, slots, ks, cap: int) -> None:
    """Raise the ProtocolError of a combine send plan `group_by_dest` refused; nothing sent."""
    topk = ep.layout.a2a_topk
    lin = slots * topk + ks
    bad = (dest < 0) | (dest >= ep.num_dies) | (ks < 0) | (ks >= topk) | (lin < 0) | (lin >= cap)
    i = int(np.flatnonzero(bad)[0])
    raise ProtocolError(
        f"die {ep.die_id}: combine row for die {int(dest[i])} at (slot {int(slots[i])}, k"
        f" {int(ks[i])}): outside the pod's {ep.num_dies} dies or the combine area of {cap}"
        " rows; nothing written"
    )


def _comb_flat(ep: Endpoint, die: int) -> np.ndarray:
    """uint8 flat view of die's fused combine buffer (rows pull_comb_stride bytes apart)."""
    views = ep.a2a.views
    v = views.get(("comb", die))
    if v is None:
        lo = ep.layout
        n = lo.a2a_max_batch * lo.a2a_topk * lo.pull_comb_stride
        v = views["comb", die] = ep.regions[die].array[lo.fused_comb_off : lo.fused_comb_off + n]
    return v


def _write_groups_by_src(ep, rows, g: DedupGroups, op, event_id) -> None:
    """The fused combine after a dedup dispatch: per source die (groups are in source order),
    this die's event id word, then each group's pre-reduced row (rounded in the same pass)
    straight into the source's combine buffer at (slot, first k of this die), then those
    completion words LAST. The send plan is one compiled pass (`comm.kernels.dedup_plan`,
    which proves every row inside its buffer), then one compiled reduce per destination
    (`reduce_groups_raw`)."""
    n = len(g.src)
    if not n:
        return
    lo = ep.layout
    k = kernels()
    cap = lo.a2a_max_batch * lo.a2a_topk
    lin = np.empty(n, np.int64)
    starts = np.empty(ep.num_dies + 1, np.int64)
    if k.dedup_plan(g.src, g.slot, g.kfirst, lo.a2a_topk, ep.num_dies, cap, lin, starts):
        _bad_dedup_plan(ep, g, cap)
    rows = np.ascontiguousarray(rows)
    stride = lo.pull_comb_stride // lo.a2a_combine_bytes
    starts = starts.tolist()
    for d in range(ep.num_dies):
        a, b = starts[d], starts[d + 1]
        if a == b:
            continue
        _words(ep, d, lo.fused_cevent_off, ep.num_dies)[ep.die_id] = event_id
        dst = _comb_flat_elems(ep, d)
        if k.reduce_groups_raw(rows, g.pos, g.start, g.w, a, dst, lin[a:b], stride, cap):  # remote
            raise ProtocolError(
                f"die {ep.die_id}: dedup combine groups [{a}, {b}) for die {d}: an entry"
                f" range or row index outside this die's {len(rows)} expert rows; nothing"
                " written"
            )
        _words(ep, d, lo.fused_cflag_off, cap)[lin[a:b]] = op  # LAST


def _bad_dedup_plan(ep: Endpoint, g: DedupGroups, cap: int) -> None:
    """Raise the ProtocolError of a dedup send plan `dedup_plan` refused; nothing sent."""
    topk = ep.layout.a2a_topk
    lin = g.slot * topk + g.kfirst
    bad = (g.src < 0) | (g.src >= ep.num_dies) | (g.kfirst < 0) | (g.kfirst >= topk)
    bad |= (lin < 0) | (lin >= cap)
    bad[1:] |= g.src[1:] < g.src[:-1]
    i = int(np.flatnonzero(bad)[0])
    raise ProtocolError(
        f"die {ep.die_id}: dedup combine row for die {int(g.src[i])} at (slot"
        f" {int(g.slot[i])}, k {int(g.kfirst[i])}): outside the pod's {ep.num_dies} dies, out"
        f" of source order, or outside the combine area of {cap} rows; nothing written"
    )


def _comb_flat_elems(ep: Endpoint, die: int) -> np.ndarray:
    """Flat view of die's fused combine buffer in elements, as `reduce_groups_raw` takes it:
    uint16 (bfloat16 bits) or float32 (made once)."""
    views = ep.a2a.views
    v = views.get(("comb_elems", die))
    if v is None:
        v = views["comb_elems", die] = _flat_elems(ep, _comb_flat(ep, die))
    return v


def _flat_elems(ep: Endpoint, flat8: np.ndarray) -> np.ndarray:
    """A flat uint8 view of combine rows as uint16 (bfloat16 bits) or float32 elements."""
    return flat8.view(np.uint16 if ep.layout.a2a_combine_bytes == 2 else np.float32)


# ------------------------------------------------------------------------------------------------
# A2E / E2A with trampoline forwarding (docs/protocols.md §8, 001 §3.3, §5.2)
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
    """uint8 [count, stride]: the first rows of a trampoline's inbound A2E area (bound checked)."""
    lo = ep.layout
    stride = lo.pull_disp_stride
    _area_check(ep, f"a2e inbound area of die {die}", 0, count, lo.pull_disp_rows)
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
    st = _a2a_state(ep)
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
        event_id = _check_event(event_id)
        if quant not in QUANTS:
            raise ValueError(f"quant {quant!r}: choose None or 'int8'")
        quant = None if quant == "none" else quant
        if me < n_att:
            _check_inputs(ep, x, topk_idx, topk_weights, quant)
            lay = get_dispatch_layout(topk_idx, placement)
            _check_capacity(ep, lay, placement)
            payload, scale = _payload(x, quant)
    except (ValueError, TypeError) as e:
        bad, event_id = e, _event_word(event_id)
    op = st.fused_ops[DISPATCH] = st.fused_ops[DISPATCH] + 1
    half = op & 1
    tr = ep.trace if ep.trace.enabled else None
    t0 = now_ns()
    if me < n_att:
        if bad is not None:
            f = (lo.a2e_flag_off + half * L.FIELD_BYTES) // L.WORD
            _flag(ep, n_att + me, f, event_id, REFUSED, op)
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
    _flag(ep, tramp, f, event_id, n, op, code)  # the one metadata write of this attention die


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
            _flag(ep, d, lo.fused_flag_word(half, att), event, REFUSED, op)
        return (np.zeros(0, np.int64), np.zeros(0, np.int64)), len(placement.dies)
    rows = _a2e_rows(ep, ep.die_id, half, n)
    meta = rows[:, stride - L.PULL_ROW_META :].view(np.int32)
    dest = meta[:, 3] >> DEST_SHIFT
    local = meta[:, 3] & ((1 << DEST_SHIFT) - 1)
    for d in placement.dies:
        sel = np.nonzero(dest == d)[0]
        block = _fused_rows(ep, d, half, att, len(sel))  # the expert die's block for att
        block[:] = rows[sel]
        block[:, stride - 4 : stride] = local[sel].view(np.uint8).reshape(-1, 4)
        n_local = placement.num_local(d)
        counts = np.bincount(local[sel], minlength=n_local)
        _words(ep, d, lo.fused_counts_off_of(half, att), n_local)[:] = counts
        _flag(ep, d, lo.fused_flag_word(half, att), event, len(sel), op, code)
    return (meta[:, 1].astype(np.int64), meta[:, 2].astype(np.int64)), len(placement.dies)


def _expert_gather(ep, half, op, event_id, n_att, placement, quant) -> DispatchResult:
    """An expert die waits for the forwarded flags of every attention die and groups rows."""
    lo = ep.layout
    parts, _, _ = _fused_gather(
        ep, half, op, event_id, range(n_att), placement, " (forwarded)", quant
    )
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
        event_id: int in [0, 2**62) naming the operation; every die passes the same.
    Returns:
        float32 [batch, hidden] on attention dies (ascending-k float32 reduction, as
        `comm.reference.combine_ref`); None on expert dies.
    Raises:
        an expert die's bad `expert_out` on that die (it still marks the rows it owes as
        refused); PeerRefused on the attention dies whose trampoline forwarded a refusal.
    """
    st = _a2a_state(ep)
    if not isinstance(handle, A2EHandle) or handle.role not in ("attention", "expert"):
        raise TypeError(f"handle must be the A2EHandle of a2e, got {_describe(handle)}")
    bad: BaseException | None = None
    try:
        event_id = _check_event(event_id)
        if handle.role == "expert":
            _check_expert_out(ep, expert_out, len(handle.dispatch.recv_src_rank))
    except (ValueError, TypeError) as e:
        bad, event_id = e, _event_word(event_id)
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
    _wait_slots(ep, r_slot, r_k, op, "e2a'", owners)
    if bad is not None:
        raise bad
    _check_sources(ep, owners, op, event_id, "e2a")
    t1 = now_ns()
    out = _own_weighted_sum(ep, idx, w)
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
        _write_slots_by_src(ep, expert_out, tramp, d.recv_slot, d.recv_k, op, event_id)
    else:
        _refuse_slots(ep, tramp, d.recv_slot, d.recv_k, op, event_id)
    t1 = now_ns()
    if handle.partner_slots is not None:  # E2A': a trampoline forwards to its partner
        slots, ks = handle.partner_slots
        _wait_slots(ep, slots, ks, op, "e2a")
        t2 = now_ns()
        partner = np.full(len(slots), me - n_att, np.int64)
        refuse = _words(ep, me, lo.fused_refuse_off, ep.num_dies)
        if any(refuse[e] == op for e in range(n_att, ep.num_dies)):
            _refuse_slots(ep, partner, slots, ks, op, event_id)  # pass the refusal on
        else:
            rows = _comb_buf(ep, me)[slots * lo.a2a_topk + ks, :hidden]
            _write_slots_by_src(ep, rows, partner, slots, ks, op, event_id)
            if tr:
                tr.rec(t1, t2 - t1, "e2a", 3, me - n_att, 0, event_id, 0)
                tr.rec(t2, now_ns() - t2, "e2a", 4, me - n_att, 0, event_id, rows.nbytes)
    if tr and bad is None:
        tr.rec(t0, t1 - t0, "e2a", 1, -1, 0, event_id, expert_out.nbytes)


def _wait_slots(ep, slots, ks, op, what, owners=None) -> None:
    """Wait until the completion word of every (slot, k) of this die carries `op`."""
    lo = ep.layout
    topk = lo.a2a_topk
    flags = _words(ep, ep.die_id, lo.fused_cflag_off, lo.a2a_max_batch * topk)
    base = lo.fused_cflag_off // 8
    slots = np.ascontiguousarray(slots, np.int64)
    ks = np.ascontiguousarray(ks, np.int64)
    pending = kernels().first_pending
    while True:
        j = pending(flags, slots, ks, topk, op)
        if j < 0:
            return
        peer = -1 if owners is None else int(owners[j])
        i = int(slots[j] * topk + ks[j])
        ep.wait_ge(ep.words[ep.die_id], base + i, op, peer, f"{what}.cflag[{i}]")
