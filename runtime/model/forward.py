"""One step of the toy model over the pod (`forward`): the die's `DieModel` phases with the
pod-wide MoE collectives in between, timed per phase (`Clock`). `xpod decode` and the serving
engine's die loop both run it; `build_model` makes what a die needs for it.

MoE event ids are `step * slots + slot`, so they agree on every die: `slots` is `n_layers`
(`slot` = the layer), or with multi-token prediction `n_layers + k` (the k MTP sub-forwards of a
step take slots `n_layers .. n_layers + k - 1`, `forward_mtp`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np

import comm
from comm.quant import dequantize_int8
from comm.routing import Placement
from comm.trace import STEP_NAMES, TRACK_NAMES
from memory.layout import progress_word
from runtime.model.card import record
from runtime.model.config import ModelConfig
from runtime.model.die_model import DieModel, batch_rows, last_rows
from runtime.model.expert_balancer import EPLBConfig, ExpertBalancer
from runtime.model.kv import PagedKV
from runtime.model.ops import kernels
from runtime.model.weights import build_weights, replicated_weights

PHASES = ("attention", "gate", "dispatch", "experts", "combine", "other")
MODEL_LANE = 99  # trace track of the model phases (comm's steps use lanes 0..)
TRACE_OP = "model"
STEP_NAMES.update({(TRACE_OP, i): p for i, p in enumerate(PHASES)})
TRACK_NAMES[MODEL_LANE] = "model"


@contextlib.contextmanager
def prepared_for_fork(cfg: ModelConfig) -> Iterator[None]:
    """What a launcher does before it forks the dies that run the model: compile (or load from
    the disk cache) the model's kernels once, so the dies start with them, and build one
    read-only copy of the tensors every die holds alike (`replicated_weights`)."""
    kernels().warm()
    with replicated_weights(cfg):
        yield


class Clock:
    """Per-phase wall-time accounting, every span also a trace record (op "model")."""

    def __init__(self, die, n_layers: int):
        """`n_layers`: the layers timed per phase (a model's `kv_layers`: its MTP module too)."""
        self.trace = die.trace
        self.step = 0
        self.slots = 0  # MoE event ids per step (0: the model's n_layers; MTP: n_layers + k)
        self.layer_ns = np.zeros((n_layers, len(PHASES)), np.int64)  # counted steps only
        self.other_ns = 0
        self.counting = False
        self.cur = [0] * len(PHASES)  # this step's ns per phase (serving: reset every step)
        self.progress = None  # serving: (words, index) of the die's progress word
        self.fault = None  # serving: an injected fault's hook(step, layer, phase), or None
        self.op, self.lanes = TRACE_OP, None  # a split pod: op "split", a track per phase

    def mark(self, layer: int, phase: int, state: int = 0) -> None:
        """Store where this die is in its progress word (serving; one int64 store)."""
        if self.progress is not None:
            words, i = self.progress
            words[i] = progress_word(self.step, layer, phase, state)

    def span(self, phase: int, layer: int, t0: int) -> int:
        t1 = time.perf_counter_ns()
        lane = MODEL_LANE if self.lanes is None else self.lanes[phase]
        self.trace.rec(t0, t1 - t0, self.op, phase, layer, lane, self.step, 0)
        self.cur[phase] += t1 - t0
        if self.progress is not None:
            words, i = self.progress
            words[i] = progress_word(self.step, layer, phase, 0)
        if self.counting:
            if layer >= 0:
                self.layer_ns[layer, phase] += t1 - t0
            else:
                self.other_ns += t1 - t0
        return t1


def forward(
    die, model: DieModel, segments, protocol: str, quant, clock: Clock, bal: ExpertBalancer,
    logit_rows: np.ndarray | None = None, hidden: bool = False,
):  # fmt: skip
    """One step of this die: DieModel's phases with pod-wide MoE collectives; float32 logits
    [n_segments, vocab] at each segment's last row (or at `logit_rows`, row indices in
    `batch_rows` order). Every die calls it at every step (an empty `segments` is a dummy
    step); `clock.step` names the step (MoE event ids). `bal` maps logical experts to
    physical slots before each dispatch, records each layer's per-slot rows and says which
    expert each local slot holds (`runtime.model.expert_balancer`; without EPLB the identity).
    `hidden`: return `(logits, normed)` with `normed` float32 `[n, hidden]` the final-normed
    rows (what the LM head sees: an MTP module's hidden input)."""
    cfg = model.cfg
    cap = getattr(die, "cap", None)
    t0 = t = time.perf_counter_ns()
    batch = batch_rows(segments)  # once for every layer
    h = model.embed(batch[0])
    t = clock.span(5, -1, t)
    if cap is not None:
        record(cap, cfg, "embed", t0, rows=h.shape[0])
    h, t = _layers(die, model, h, segments, batch, range(cfg.n_layers), protocol, quant, clock,
                   bal, t)  # fmt: skip
    rows = last_rows(segments) if logit_rows is None else logit_rows
    t0 = t
    if not hidden:
        logits = model.logits(h[rows])
        clock.span(5, -1, t)
        record_head(cap, cfg, t0, len(rows))
        return logits
    normed = model.final_norm(h)
    logits = model.head(normed[rows])
    clock.span(5, -1, t)
    record_head(cap, cfg, t0, len(rows))
    return logits, normed


def record_head(cap, cfg, t0: int, n: int) -> None:
    """The final norm, the LM head and the sampling of `n` rows (a capture pod)."""
    if cap is not None:
        record(cap, cfg, "norms", t0, rows=n, count=1)
        record(cap, cfg, "lm_head", rows=n)
        record(cap, cfg, "sample", rows=n)


def forward_mtp(
    die, model: DieModel, segments, hidden: np.ndarray, j: int, protocol: str, quant,
    clock: Clock, bal: ExpertBalancer,
):  # fmt: skip
    """MTP sub-forward j (0-based) of this step on this die: `segments` are `(req, next tokens,
    start)` (each row's token is the one after its position), `hidden` float32 `[n, hidden]`
    the normed rows the previous head saw at those positions. Runs the MTP module
    (`cfg.mtp_layer(j)`) with its MoE as pod-wide collectives at event slot `n_layers + j`
    (every die calls it, empty or not). Returns (logits, normed) at each segment's last row:
    float32 `[n_segments, vocab]` and `[n_segments, hidden]` (the next sub-forward's hidden)."""
    cfg = model.cfg
    layer = cfg.mtp_layer(j)
    m = layer - cfg.n_layers
    cap = getattr(die, "cap", None)
    t0 = t = time.perf_counter_ns()
    batch = batch_rows(segments)
    h = model.mtp_in(m, batch[0], hidden)
    t = clock.span(5, layer, t)
    if cap is not None:
        record(cap, cfg, "mtp_in", t0, rows=h.shape[0])
    h, t = _layers(die, model, h, segments, batch, (layer,), protocol, quant, clock, bal, t,
                   slot=cfg.n_layers + j)  # fmt: skip
    t0 = t
    normed = model.mtp_norm(m, h[last_rows(segments)])
    logits = model.head(normed)
    clock.span(5, layer, t)
    record_head(cap, cfg, t0, len(segments))
    return logits, normed


def _layers(die, model: DieModel, h, segments, batch, layers, protocol: str, quant,
            clock: Clock, bal: ExpertBalancer, t: int, slot: int | None = None):  # fmt: skip
    """`layers` of the model over h (attention, then the dense FFN or the MoE with its
    collectives); (h, the time after). An MTP module's layer keeps the default placement of
    its experts (EPLB balances the main layers only) at event slot `slot`. A capture pod's die
    records every op with its sizes (`runtime.model.card.record`)."""
    slots = clock.slots or model.cfg.n_layers
    att = attention_dims(segments) if getattr(die, "cap", None) is not None else None
    for layer in layers:
        h, t = attend(die, model, h, segments, batch, layer, clock, t, att)
        ev = clock.step * slots + (layer if slot is None else slot)
        h, t = feed_forward(die, model, h, layer, ev, protocol, quant, clock, bal, t)
    return h, t


def attend(die, model: DieModel, h, segments, batch, layer: int, clock: Clock, t: int,
           att: dict | None):  # fmt: skip
    """Layer `layer`'s attention over h (MLA prolog, attention core, o_proj, the layer's norms
    and residual adds); (h, the time after). `att`: the ops' `attention_dims` (a capture pod)."""
    cap = getattr(die, "cap", None)
    n = h.shape[0]
    t0 = t
    h = model.attention(layer, h, segments, batch)
    t = clock.span(0, layer, t)
    if cap is not None:
        cfg = model.cfg
        record(cap, cfg, "mla_prolog", t0, rows=n)
        record(cap, cfg, "mla", **att)
        record(cap, cfg, "o_proj", rows=n)
        record(cap, cfg, "norms", rows=n, count=4)
    return h, t


def feed_forward(die, model: DieModel, h, layer: int, ev: int, protocol: str, quant,
                 clock: Clock, bal: ExpertBalancer, t: int):  # fmt: skip
    """Layer `layer`'s dense FFN, or its MoE (gate, dispatch, routed experts, combine at MoE
    event id `ev`, shared expert); (h, the time after)."""
    cfg = model.cfg
    cap = getattr(die, "cap", None)
    n = h.shape[0]
    if not model.is_moe(layer):
        t0 = t
        h = model.dense_ffn(layer, h)
        t = clock.span(3, layer, t)
        if cap is not None:
            record(cap, cfg, "dense_ffn", t0, rows=n)
        return h, t
    main = layer < cfg.n_layers
    t0 = t
    xn, idx, w = model.gate(layer, h)
    if main:
        idx = bal.route(layer, idx)
    t = clock.span(1, layer, t)
    if cap is not None:
        record(cap, cfg, "gate", t0, rows=n, route=idx.ravel().tolist())
    if clock.fault is not None:
        clock.fault(clock.step, layer, "dispatch")
    d = comm.dispatch(die, xn, idx, w, protocol=protocol, quant=quant, event_id=ev)
    rows = dequantize_int8(d.x, d.scales) if quant == "int8" else d.x
    if main:
        bal.record(layer, d.expert_counts)
    t = clock.span(2, layer, t)
    ids = bal.local_ids(layer) if main else sorted(model.weights.experts[layer])
    t0 = t
    y = model.experts(layer, rows, d.expert_counts, ids)
    t = clock.span(3, layer, t)
    if cap is not None:
        record(cap, cfg, "experts", t0, rows=int(rows.shape[0]),
               counts=[int(x) for x in d.expert_counts])  # fmt: skip
    if clock.fault is not None:
        clock.fault(clock.step, layer, "combine")
    routed = comm.combine(die, y, d.handle, event_id=ev)
    t = clock.span(4, layer, t)
    t0 = t
    h = model.finish_moe(layer, h, xn, routed)
    t = clock.span(3, layer, t)
    if cap is not None:
        record(cap, cfg, "shared_expert", t0, rows=n)
    return h, t


def attention_dims(segments) -> dict:
    """An attention op's structural sizes (`runtime.model.card`): its rows, each row's context
    (the positions it attends to) and offset in its segment (j + 1), each request's cached rows
    read (start + tokens) and its segment's length."""
    ctx, offs, req, span = [], [], [], []
    for _, toks, start in segments:
        m = len(toks)
        ctx.extend(int(start) + j + 1 for j in range(m))
        offs.extend(j + 1 for j in range(m))
        req.append(int(start) + m)
        span.append(m)
    return {"rows": len(ctx), "ctx": ctx, "offsets": offs, "req_ctx": req, "req_span": span}


def build_model(
    die, cfg: ModelConfig, n_blocks: int, block_size: int, eplb: EPLBConfig | None = None,
    keep_history: bool = False, ep=None,
):  # fmt: skip
    """(DieModel over a PagedKV pool in the die's app area, the pool, its `ExpertBalancer`).

    Without EPLB the die builds its default experts in process memory; with EPLB the balancer's
    bank in the app area holds them (the initial map's slots of this die). `ep`: the group
    view the die's all-to-all runs over (`comm.group_view`): its ranks place the experts."""
    ep = ep or die
    placement = Placement.default(cfg.num_experts, tuple(range(ep.num_dies)))
    default = placement.experts_on(ep.die_id).tolist()
    experts = default if eplb is None else []  # with EPLB: the bank's (MTP: the default ones)
    pool = die.alloc((cfg.kv_layers, max(n_blocks, 1), block_size, cfg.kv_cache_dim), np.float32)
    pool.fill(0)  # resident now (HBM is): a page's first write is not paid by a step or a peer
    model = DieModel(cfg, build_weights(cfg, experts, default), PagedKV(pool))
    try:
        bal = ExpertBalancer(die if eplb is not None else ep, model, eplb, keep_history)
    except BaseException:
        die.free(pool)
        raise
    return model, pool, bal


__all__ = [
    "MODEL_LANE",
    "PHASES",
    "TRACE_OP",
    "Clock",
    "attend",
    "attention_dims",
    "build_model",
    "feed_forward",
    "forward",
    "forward_mtp",
    "prepared_for_fork",
    "record_head",
]
