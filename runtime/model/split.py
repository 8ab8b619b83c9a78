"""The toy model on a split pod (MoE-attention disaggregation, 001 §5.2, docs/architecture.md §5.4):
attention dies are the DP groups (embedding, MLA and its latent KV, dense layers, the gate, the
shared expert, the LM head), expert dies host the routed experts and run one persistent loop.

```
attention die, one step (`attention_step`), its domain d, m micro-batches:
    per layer:  dense: attention + dense FFN per micro-batch
                MoE:   per micro-batch: attention, gate, a2e (to its trampoline)   <- overlaps
                       per micro-batch: e2a, shared expert + routed sum                the experts
expert die (`expert_loop`), inside one pod.run, until the end marker:
    a2e (learns step, layer, domain, micro-batch from the event id) -> experts -> e2a
```

The expert dies serve the domains' micro-batches in the split's order ((0, 0), (0, 1), (1, 0),
...), one cycle per MoE layer; no per-step message reaches them (`Die.commands` counts what does).
An idle expert die waits inside the comm wait policy (spin, yield, then park). Event ids name
(step, layer, domain, micro-batch) (`split_event`); `END_EVENT` tells the expert dies the run is
over (one empty a2e per attention die, no e2a).

Multi-token prediction (`runtime.model.mtp`): an attention die runs the MTP module's k
sub-forwards of a step (`attention_mtp`: its attention and gate here, its experts on the expert
dies through A2E / E2A, micro-batched like a main MoE layer) after the main layers, every step,
empty or not; event ids then count `n_layers + k` slots a step (`clock.slots`), slot
`n_layers + j` being sub-forward j, and the expert dies parse them with the same count (`slots`
of `receive_call` / `expert_loop`) and run the MTP layer's experts (`ModelConfig.mtp_layer`).

A capture pod (docs/projection.md §6) records every compute op with its sizes
(`runtime.model.card.record`): an attention die the colocated forward's ops (`embed`; per layer
`mla_prolog`, `mla`, `o_proj`, `norms`, then `dense_ffn`, or `gate` before its A2E and
`shared_expert` after its E2A; the head's `norms`, `lm_head`, `sample`; an MTP sub-forward's
`mtp_in`), an expert die `experts` (rows per local expert) between its A2E and its E2A, on its
`main` stream. With one micro-batch an attention die's ops are on `main`; with two they go on
`runtime.model.pipeline`'s streams (`Streams`): `s0` the attention path (embedding, attention,
head), `s1` the gate, the A2E / E2A launches, the shared expert and the dense FFN, with `after`
edges for each micro-batch's data, `main` joining both at the end. An expert die learns a
call's event id from its packets: its A2E call is renamed after it (`_name_call`) and its E2A
named with it, so that every call of a die has its own id.

Bit-exactness: the same DieModel phases on the same micro-batches as
`runtime.model.split_reference.SplitReference`, with A2E / E2A delivering `a2e_ref` / `e2a_ref`
per (layer, domain, micro-batch), so tokens and logits are equal bit for bit.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import numpy as np

import comm
from comm.alltoall import Split
from comm.quant import dequantize_int8
from comm.routing import Placement
from comm.trace import STEP_NAMES, TRACK_NAMES
from memory.errors import ProtocolError
from runtime.model.card import record
from runtime.model.config import ModelConfig
from runtime.model.die_model import DieModel, batch_rows, last_rows
from runtime.model.forward import Clock, attend, attention_dims, record_head
from runtime.model.kv import PagedKV
from runtime.model.pipeline import ATTENTION_STREAM, MOE_STREAM, Streams
from runtime.model.weights import build_weights

END_EVENT = 0  # the a2e event id that ends an expert die's loop
# the timeline of a split pod: a track per phase on every die (001 Fig. 19)
SPLIT_OP = "split"
SPLIT_PHASES = ("attention", "gate", "A2E", "experts", "E2A", "other")
SPLIT_LANES = (90, 91, 92, 93, 94, 95)
STEP_NAMES.update({(SPLIT_OP, i): p for i, p in enumerate(SPLIT_PHASES)})
TRACK_NAMES.update({lane: p for lane, p in zip(SPLIT_LANES, SPLIT_PHASES, strict=True)})


def split_clock(die, n_layers: int) -> Clock:
    """A Clock whose spans go to a split pod's tracks: attention, gate, A2E, experts (an
    attention die's dense and shared FFN too), E2A, other."""
    clock = Clock(die, n_layers)
    clock.op, clock.lanes = SPLIT_OP, SPLIT_LANES
    return clock


_D = 16  # domains in an event id (Split's MAX_DOMAINS)
_M = 2  # micro-batches in an event id


def split_event(step: int, slot: int, domain: int, microbatch: int, slots: int) -> int:
    """The event id of (step, slot, domain, micro-batch): >= 1, so never END_EVENT. `slots`
    MoE slots a step: the model's n_layers (a slot is the layer), or with MTP `n_layers + k`
    (slot `n_layers + j`: sub-forward j)."""
    return ((step * slots + slot) * _D + domain) * _M + microbatch + 1


def parse_event(ev: int, slots: int) -> tuple[int, int, int, int]:
    """(step, slot, domain, micro-batch) of `split_event`."""
    rest, mb = divmod(ev - 1, _M)
    sl, d = divmod(rest, _D)
    step, slot = divmod(sl, slots)
    return step, slot, d, mb


def slot_layer(cfg: ModelConfig, slot: int) -> int:
    """The weights layer of an event slot: the layer itself, or MTP sub-forward j's module
    (`cfg.mtp_layer(j)`) for slot `n_layers + j`."""
    return slot if slot < cfg.n_layers else cfg.mtp_layer(slot - cfg.n_layers)


def microbatches(segments: list, m: int) -> list[list]:
    """A die's segments in m contiguous micro-batches of near-equal row counts (in order; a
    micro-batch may be empty)."""
    if m == 1:
        return [list(segments)]
    sizes = [len(t) for _, t, _ in segments]
    total, out, cur, acc = sum(sizes), [], [], 0
    for seg, n in zip(segments, sizes, strict=True):
        # a segment joins the next micro-batch once this one holds its share of the rows
        if len(out) < m - 1 and cur and acc + n / 2 > total * (len(out) + 1) / m:
            out.append(cur)
            cur = []
        cur.append(seg)
        acc += n
    out.append(cur)
    return out + [[] for _ in range(m - len(out))]


def build_split_model(die, cfg: ModelConfig, split: Split, n_blocks: int, block_size: int):
    """(DieModel, KV pool or None): an attention die builds no routed expert and a KV pool; an
    expert die builds its experts (`Placement.default` over the expert dies; an MTP module's
    MoE the same ones) and no KV."""
    if die.die_id in split.att_dies:  # the MTP modules' latent KV layers too
        pool = die.alloc((cfg.kv_layers, max(n_blocks, 1), block_size, cfg.kv_cache_dim),
                         np.float32)  # fmt: skip
        return DieModel(cfg, build_weights(cfg, []), PagedKV(pool)), pool
    placement = Placement.default(cfg.num_experts, split.exp_dies)
    experts = placement.experts_on(die.die_id).tolist()
    return DieModel(cfg, build_weights(cfg, experts), PagedKV.zeros(cfg.n_layers, 1, 1, 1)), None


def attention_step(die, model: DieModel, segments, split: Split, quant, clock: Clock,
                   counters: dict | None = None, bal=None, logit_rows: np.ndarray | None = None,
                   hidden: bool = False):  # fmt: skip
    """One step of an attention die: float32 logits [n_segments, vocab] in segment order.
    `clock.step` names the step (event ids); every attention die calls it every step (an empty
    `segments` is a dummy step: its micro-batches are empty a2e calls). `counters`, if given,
    adds "a2e_calls" and "a2e_writes" (metadata words this die wrote in other dies). `bal`: an
    EPLB router (`ExpertBalancer(router=True)`) mapping each micro-batch's logical experts to
    physical slots, or None. `logit_rows` (row indices in `batch_rows` order of `segments`) /
    `hidden`: as `runtime.model.forward.forward` (the micro-batches' rows joined, then the
    final norm and the head): logits at those rows, and with `hidden` `(logits, normed)`.
    A capture pod's die records every op (module docstring)."""
    cfg, m = model.cfg, split.microbatches
    cap = getattr(die, "cap", None)
    st = _streams(cap, m)
    t = time.perf_counter_ns()
    mbs = microbatches(list(segments), m)
    rows = [batch_rows(s) for s in mbs]
    hs = []
    for i, r in enumerate(rows):
        with st.on(i, ATTENTION_STREAM):
            t0 = time.perf_counter_ns()
            hs.append(model.embed(r[0]))
            if cap is not None:
                record(cap, cfg, "embed", t0, rows=hs[i].shape[0])
    t = clock.span(5, -1, t)
    hs, t = _layers(die, model, hs, mbs, rows, range(cfg.n_layers), split, quant, clock,
                    counters, bal, t, st)  # fmt: skip
    if logit_rows is None and not hidden:
        logits = []
        for i in range(m):
            if mbs[i]:
                with st.on(i, ATTENTION_STREAM):
                    t0 = time.perf_counter_ns()
                    logits.append(model.logits(hs[i][last_rows(mbs[i])]))
                    record_head(cap, cfg, t0, len(mbs[i]))
        out = np.concatenate(logits) if logits else np.zeros((0, cfg.vocab_size), np.float32)
        clock.span(5, -1, t)
        st.join()
        return out
    h = np.concatenate(hs)  # batch_rows order: the micro-batches are contiguous runs
    lr = last_rows(segments) if logit_rows is None else logit_rows
    with _joined(st, m):
        t0 = time.perf_counter_ns()
        if not hidden:
            logits = model.logits(h[lr])
        else:
            normed = model.final_norm(h)
            logits = model.head(normed[lr])
        record_head(cap, cfg, t0, len(lr))
    clock.span(5, -1, t)
    st.join()
    return logits if not hidden else (logits, normed)


def attention_mtp(die, model: DieModel, segments, hidden: np.ndarray, j: int, split: Split,
                  quant, clock: Clock, counters: dict | None = None):  # fmt: skip
    """MTP sub-forward j (0-based) of this step on an attention die, as
    `runtime.model.forward.forward_mtp`: `segments` `(req, next tokens, start)`, `hidden`
    float32 `[n, hidden]` the normed rows at those positions. The MTP module
    (`cfg.mtp_layer(j)`) runs per micro-batch like a main MoE layer, its experts on the expert
    dies at event slot `n_layers + j` (`clock.slots` = n_layers + k); every attention die calls
    it every busy step, empty or not. Returns (logits, normed) at each segment's last row:
    float32 `[n_segments, vocab]` and `[n_segments, hidden]`."""
    cfg, m = model.cfg, split.microbatches
    cap = getattr(die, "cap", None)
    st = _streams(cap, m)
    layer = cfg.mtp_layer(j)
    k = layer - cfg.n_layers
    t = time.perf_counter_ns()
    mbs = microbatches(list(segments), m)
    rows = [batch_rows(s) for s in mbs]
    at = np.concatenate([[0], np.cumsum([len(r[0]) for r in rows])]).tolist()
    hs = []
    for i, r in enumerate(rows):
        with st.on(i, ATTENTION_STREAM):
            t0 = time.perf_counter_ns()
            hs.append(model.mtp_in(k, r[0], hidden[at[i] : at[i + 1]]))
            if cap is not None:
                record(cap, cfg, "mtp_in", t0, rows=hs[i].shape[0])
    t = clock.span(5, layer, t)
    hs, t = _layers(die, model, hs, mbs, rows, (layer,), split, quant, clock, counters, None, t,
                    st, slot=cfg.n_layers + j)  # fmt: skip
    with _joined(st, m):
        t0 = time.perf_counter_ns()
        normed = model.mtp_norm(k, np.concatenate(hs)[last_rows(segments)])
        logits = model.head(normed)
        record_head(cap, cfg, t0, len(segments))
    clock.span(5, layer, t)
    st.join()
    return logits, normed


def _streams(cap, m: int) -> Streams:
    """The streams an attention die records a step's ops on: `main` with one micro-batch (a
    Streams that records nothing), `s0` / `s1` with two (`runtime.model.pipeline.Streams`)."""
    return Streams(cap if m > 1 else None, m)


@contextlib.contextmanager
def _joined(st: Streams, m: int):
    """Record on the attention stream after every micro-batch's latest op (the head of the
    joined rows)."""
    with contextlib.ExitStack() as stack:
        for i in range(m):
            stack.enter_context(st.on(i, ATTENTION_STREAM))
        yield


def _layers(die, model: DieModel, hs: list, mbs: list, rows: list, layers, split: Split, quant,
            clock: Clock, counters, bal, t: int, st: Streams,
            slot: int | None = None):  # fmt: skip
    """`layers` over an attention die's micro-batches `hs` (dense: attention + FFN; MoE: per
    micro-batch attention, gate, a2e, then per micro-batch e2a and the shared expert); (hs,
    the time after). An MTP module's layer takes event slot `slot` and is not routed by EPLB.
    A capture pod records each op on its micro-batch's stream of `st` (module docstring)."""
    cfg, m = model.cfg, split.microbatches
    cap = getattr(die, "cap", None)
    d = split.domain_of(die.die_id)
    slots = clock.slots or cfg.n_layers
    bases = np.concatenate([[0], np.cumsum([len(r[0]) for r in rows])]).tolist()
    att = [attention_dims(s) for s in mbs] if cap is not None else [None] * m
    for layer in layers:
        if not model.is_moe(layer):
            for i in range(m):
                with st.on(i, ATTENTION_STREAM):
                    hs[i], t = attend(die, model, hs[i], mbs[i], rows[i], layer, clock, t, att[i])
                with st.on(i, MOE_STREAM):
                    t0 = t
                    hs[i] = model.dense_ffn(layer, hs[i])
                    t = clock.span(3, layer, t)
                    if cap is not None:
                        record(cap, cfg, "dense_ffn", t0, rows=hs[i].shape[0])
            continue
        sent = []
        for i in range(m):
            with st.on(i, ATTENTION_STREAM):
                hs[i], t = attend(die, model, hs[i], mbs[i], rows[i], layer, clock, t, att[i])
            with st.on(i, MOE_STREAM):
                t0 = t
                xn, idx, w = model.gate(layer, hs[i])
                if bal is not None and layer < cfg.n_layers:
                    idx = bal.route(layer, idx)
                t = clock.span(1, layer, t)
                if cap is not None:
                    record(cap, cfg, "gate", t0, rows=hs[i].shape[0], route=idx.ravel().tolist())
                ev = split_event(clock.step, layer if slot is None else slot, d, i, slots)
                if clock.fault is not None:
                    clock.fault(clock.step, layer, "dispatch")
                _, h = comm.a2e(die, xn, idx, w, split, quant=quant, event_id=ev, microbatch=i,
                                slot_base=bases[i])  # fmt: skip
            sent.append((xn, h, ev))
            if counters is not None:
                counters["a2e_calls"] = counters.get("a2e_calls", 0) + 1
                counters["a2e_writes"] = counters.get("a2e_writes", 0) + h.metadata_writes
            t = clock.span(2, layer, t)
        for i, (xn, h, ev) in enumerate(sent):
            with st.on(i, MOE_STREAM):
                if clock.fault is not None:
                    clock.fault(clock.step, layer, "combine")
                routed = comm.e2a(die, None, h, event_id=ev)
                t = clock.span(4, layer, t)
                t0 = t
                hs[i] = model.finish_moe(layer, hs[i], xn, routed)
                t = clock.span(3, layer, t)
                if cap is not None:
                    record(cap, cfg, "shared_expert", t0, rows=hs[i].shape[0])
    return hs, t


def end_experts(die, split: Split, quant=None) -> None:
    """An attention die's last call of a run: the end marker (an empty a2e, no e2a), then the
    counters rounded up to the end of the cycle, as every expert die's."""
    lo = die.layout
    comm.a2e(die, np.zeros((0, lo.a2a_hidden), np.float32), np.zeros((0, lo.a2a_topk), np.int64),
             np.zeros((0, lo.a2a_topk), np.float32), split, quant, END_EVENT)  # fmt: skip
    comm.a2e_align(die, split)


@dataclass
class ExpertStats:
    """An expert die's own counters, per step (index = step): a2e wall and waited ns (waiting
    for input), experts ns, e2a ns, rows, a2e calls; the control messages it received while
    looping."""

    a2e_ns: list = field(default_factory=list)
    a2e_wait_ns: list = field(default_factory=list)
    experts_ns: list = field(default_factory=list)
    e2a_ns: list = field(default_factory=list)
    rows: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    control_messages: int = 0
    e2a_wait_ns: list = field(default_factory=list)
    cpu_decode_s: float = 0.0  # CPU seconds from its first call of step 1 to the end marker

    def grow(self, step: int) -> None:
        while len(self.calls) <= step:
            for f in (self.a2e_ns, self.a2e_wait_ns, self.experts_ns, self.e2a_ns, self.rows,
                      self.calls, self.e2a_wait_ns):  # fmt: skip
                f.append(0)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def receive_call(die, model: DieModel, split: Split, quant, slots: int = 0):
    """An expert die's next A2E call: (result, handle, step, layer), or None at the end marker;
    `layer` is the weights layer (an MTP slot's module, `slot_layer`). `slots`: MoE event slots
    a step (0: the model's n_layers; with MTP n_layers + k, as the attention dies' clock).
    ProtocolError if its event id names another (domain, micro-batch) than the call's position,
    or a dense layer. In a capture pod the call takes its event id's name (`_name_call`)."""
    res, h = comm.a2e(die, None, None, None, split, quant=quant, event_id=None)
    cap = getattr(die, "cap", None)
    if cap is not None:
        _name_call(cap, "a2e", int(h.event_id))
    if h.event_id == END_EVENT:
        return None
    cfg = model.cfg
    step, slot, d, mb = parse_event(h.event_id, slots or cfg.n_layers)
    layer = slot_layer(cfg, slot) if slot < cfg.n_layers or cfg.mtp_layers else slot
    if (d, mb) != (h.domain, h.microbatch) or layer >= cfg.kv_layers or not model.is_moe(layer):
        raise ProtocolError(
            f"die {die.die_id}: a2e event {h.event_id} names (step {step}, slot {slot},"
            f" domain {d}, micro-batch {mb}), the call is at domain {h.domain} micro-batch"
            f" {h.microbatch}"
        )
    return res, h, step, layer


def _name_call(cap, name: str, call: int) -> None:
    """Name the last call `name` of capture `cap` made without an id (-1: an expert die's A2E,
    whose event id comes with its packets) `call`, at its `begin` and its `end`, so that the
    die's calls stay distinct (a capture pairs a call's begin and end by die, name and id)."""
    todo = {"begin", "end"}
    for ev in reversed(cap.events):
        if ev[0] in todo and ev[4] == name and ev[5] == -1:
            ev[5] = call
            todo.discard(ev[0])
            if not todo:
                return
    raise RuntimeError(f"die {cap.die}: no unnamed call {name} to name {call}")


def run_experts(model: DieModel, layer: int, res, quant, local: list[int]) -> np.ndarray:
    """The routed experts on a call's rows (dequantized when INT8), `local`: the logical
    expert of each local slot."""
    x = dequantize_int8(res.x, res.scales) if quant == "int8" else res.x
    return model.experts(layer, x, res.expert_counts, local)


def expert_loop(die, model: DieModel, split: Split, quant, clock: Clock,
                slots: int = 0) -> ExpertStats:  # fmt: skip
    """An expert die's persistent loop: a2e -> experts -> e2a, learning (step, layer, domain,
    micro-batch) from each call's event id (`slots` a step: `receive_call`), until the
    attention dies' end marker. A capture pod records each call's `experts` op on `main`
    between its A2E and its E2A (rows, and rows per local expert)."""
    cfg = model.cfg
    placement = Placement.default(cfg.num_experts, split.exp_dies)
    local = placement.experts_on(die.die_id).tolist()
    stats = ExpertStats()
    ctx = die.ctx
    commands0 = getattr(die, "commands", 0)
    cpu1 = None
    cap = getattr(die, "cap", None)
    comm.a2e_align(die, split)
    while True:
        t0, w0 = time.perf_counter_ns(), ctx.waited_ns
        clock.mark(-1, 2, 1)
        got = receive_call(die, model, split, quant, slots)
        if got is None:
            break
        res, h, step, layer = got
        clock.step, clock.counting = step, step >= 1  # the decode steps, as attention dies
        if step >= 1 and cpu1 is None:
            cpu1 = time.process_time()
        t1 = clock.span(2, layer, t0)
        w1 = ctx.waited_ns  # waits so far: for this call's input (the serving loop's idle too)
        y = run_experts(model, layer, res, quant, local)
        t2 = clock.span(3, layer, t1)
        if cap is not None:  # a capture pod: the experts' rows, its e2a named by the a2e's id
            record(cap, cfg, "experts", t1, rows=int(len(res.x)),
                   counts=[int(x) for x in res.expert_counts])  # fmt: skip
        comm.e2a(die, y, h, event_id=None if cap is None else int(h.event_id))
        t3 = clock.span(4, layer, t2)
        stats.grow(step)
        stats.a2e_ns[step] += t1 - t0
        stats.a2e_wait_ns[step] += w1 - w0
        stats.experts_ns[step] += t2 - t1
        stats.e2a_ns[step] += t3 - t2
        stats.e2a_wait_ns[step] += ctx.waited_ns - w1
        stats.rows[step] += len(res.x)
        stats.calls[step] += 1
    comm.a2e_align(die, split)
    stats.control_messages = getattr(die, "commands", 0) - commands0
    stats.cpu_decode_s = time.process_time() - cpu1 if cpu1 is not None else 0.0
    return stats


__all__ = [
    "END_EVENT",
    "ExpertStats",
    "attention_mtp",
    "attention_step",
    "build_split_model",
    "end_experts",
    "expert_loop",
    "microbatches",
    "parse_event",
    "receive_call",
    "run_experts",
    "slot_layer",
    "split_clock",
    "split_event",
]
