"""001 §7's split decode at paper scale: one DP domain synthesized (`bench.project.
synth_decode_split`), its load (`split_scale_load`: EP288, routed expert e on expert die e, 32
shared-expert copies on the last 32, 96 requests per attention die in two micro-batches), the
three domains composed (`project_split`, `ASSUMPTIONS`) and the figures the papers publish
(`SplitFigures`, `project_split_workload`)."""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point, routing
from bench.project.decode_scale import (
    ScaleFigures,
    Workload,
    compose,
    sized_capture,
    split_template_dir,
)
from bench.project.synth_decode_split import (
    CALLS,
    Side,
    SplitLoad,
    SplitTemplate,
    expert_window,
    split_config,
    split_template,
    step_window,
    synthesize_split,
)  # fmt: skip
from comm.routing import Placement
from memory import layout as L
from runtime.model.card import CARDS
from runtime.model.split import parse_event
from runtime.project import Profile, load_capture, replay

ASSUMPTIONS = (
    "ONE DP domain synthesized and replayed (its attention dies + every expert die); the other"
    " domains' interleaving on the expert dies is not replayed: a domain's MoE layer is"
    " max(the replayed layer, domains x micro-batches x the expert dies' time per call), the"
    " expert dies serving a layer's calls one after another (xpod's expert loop; 001's three"
    " persistent streams per expert die are not modelled); every MoE layer as the replayed"
    " steady one, every dense layer as the replayed one; uniform context; MTP acceptance as the"
    " share of requests whose draft is accepted"
)


@dataclass(frozen=True)
class SplitWorkload:
    """001 §7's split decode (a `bench.project.decode_points` point's workload, `layout`
    "split"): the pod's attention dies (all domains), expert dies, domains; per attention die
    its requests at `context`; MTP; two micro-batches per domain unless the workload says
    otherwise (001 §5.2, Fig. 19); `shared_copies` shared-expert copies among the expert dies
    (001: 256 routed + 32 shared on 288; 0: the shared expert stays on the attention dies)."""

    attention_dies: int
    expert_dies: int
    requests: int
    context: int
    domains: int = 1
    mtp: int = 0
    acceptance: float = 0.0
    routing: str = "uniform"
    microbatches: int = 2
    card: str = "deepseek-v3"
    shared_copies: int = 32
    seed: int = 0

    @classmethod
    def of(cls, w: dict) -> SplitWorkload:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in w.items() if k in names})

    @property
    def domain_dies(self) -> int:
        if self.attention_dies % self.domains:
            raise ValueError(f"{self.attention_dies} attention dies in {self.domains} domains:"
                             " equal domains only")  # fmt: skip
        return self.attention_dies // self.domains

    def label(self, profile: str) -> str:
        mtp = f", MTP {self.mtp} at {self.acceptance:g}" if self.mtp else ""
        return (
            f"projected ({profile}, {self.card}, routing {self.routing}, context {self.context};"
            f" split {self.attention_dies} attention dies in {self.domains} domain(s) +"
            f" {self.expert_dies} expert dies, {self.requests} requests per attention die,"
            f" {self.microbatches} micro-batch(es){mtp}; ONE domain synthesized"
            f" ({self.domain_dies} + {self.expert_dies}), the {self.domains} domains composed,"
            " their interleaving on the expert dies not replayed)"
        )


def split_scale_load(w: SplitWorkload, experts: int = 256, topk: int = 8) -> SplitLoad:
    """One domain's load: every request at the context, the MTP rows from the acceptance,
    each (attention die, call)'s routing drawn seeded (`bench.alltoall.inputs.routing`); with
    shared copies, routed expert e on expert die e and the copies on the last dies, every row
    also to its die's copy (top-9), else the block placement (top-8, the shared expert local)."""
    n, e = w.domain_dies, w.expert_dies
    dies = tuple(range(n, n + e))
    k = topk + (w.shared_copies > 0)
    if w.shared_copies:
        if e != experts + w.shared_copies:
            raise ValueError(f"{e} expert dies: {experts} routed + {w.shared_copies} shared"
                             " copies, one per die")  # fmt: skip
        place = Placement.from_table(np.asarray(dies), dies)
    else:
        place = Placement.default(experts, dies)

    def route(a: int, i: int, rows: int) -> np.ndarray:
        pt = Point(n, rows, 1, topk, experts, w.seed * 1000003 + i, routing=w.routing)
        idx = routing(pt, a)[0]
        if not w.shared_copies:
            return idx
        return np.concatenate([idx, np.full((rows, 1), experts + a % w.shared_copies)], axis=1)

    acc = round(w.acceptance * w.requests)
    return SplitLoad([[w.context] * w.requests for _ in range(n)], route, place, k,
                     shared_dies=w.shared_copies, tokens=1 + w.mtp,
                     mtp_tokens=[[2 if j < acc else 1 for j in range(w.requests)]
                                 for _ in range(n)] if w.mtp else None)  # fmt: skip


@dataclass(frozen=True)
class SplitFigures:
    """A split step at scale (µs): `domain` the replayed domain's card step composed as
    `decode_scale.compose` composes a colocated one (its MoE layer the replayed domain's,
    expert dies shared with no other domain); `calls` its steady calls' figures
    (`call_figures`); `step_us` the card's step with every MoE layer `moe_layer_us` =
    max(domain's MoE layer, domains x micro-batches x calls["x"]) (`ASSUMPTIONS`)."""

    label: str
    step_us: float
    moe_layer_us: float
    domain: ScaleFigures
    calls: dict[str, float]


def call_figures(res, attention_dies: int, slots: int, layers: range) -> dict[str, float]:
    """The mean over the A2E / E2A calls of event slots `layers` (µs) of: `a2e`, the slowest
    expert die's A2E, from the first attention die's launch (or, if later, its own call's
    start: a die busy with the previous call does not count that) to its rows assembled;
    `moe` the slowest expert die's experts op; `e2a`, the slowest attention die's E2A, from the
    last expert die's experts op end (or its own call's start) to its weighted sum done;
    `stage1` the attention die's own A2E call (its rows posted to its trampoline, its tile);
    `round_trip` the first launch to the last attention die's E2A end; `x` the slowest expert
    die's time in a call, from its first input to its E2A's end (what it cannot give another
    call: xpod's expert loop runs its calls one after another). And `calls`, their count."""
    cap, per = res.capture, {}
    for d in range(cap.num_dies):
        seq, cur = [0] * len(cap.streams[d]), None
        for ev in cap.events[d]:
            q = seq[ev[1]]
            seq[ev[1]] = q + 1
            kind = ev[0]
            if kind in ("begin", "end") and ev[4] in CALLS:
                cid = int(ev[5])
                cur = cid if cid > 0 and parse_event(cid, slots)[1] in layers else None
                if cur is None:
                    continue
                f = per.setdefault(cid, {"att": {}, "exp": {}})
                f["att" if d < attention_dies else "exp"].setdefault(d, {})[f"{ev[4]}.{kind}"] = (
                    res.times(d, ev[1], q)[1]
                )
                if d < attention_dies and kind == "end" and ev[4] == "a2e":
                    f["att"][d]["a2e.dur"] = res.durations[(d, "a2e", cid)]
            elif cur is not None and d >= attention_dies and kind in ("acq", "op"):
                t = per[cur]["exp"][d]
                ready, fin = res.times(d, ev[1], q)
                if kind == "acq":
                    t.setdefault("input", fin)
                elif ev[4] == "experts":
                    t["op"], t["op.dur"] = fin, fin - ready
    rows = []
    for f in per.values():
        att, exp = f["att"].values(), f["exp"].values()
        t0 = min(a["a2e.end"] - a["a2e.dur"] for a in att)
        t2 = max(e["op"] for e in exp)
        rows.append({
            "a2e": max(e["a2e.end"] - max(t0, e["a2e.begin"]) for e in exp),
            "moe": max(e["op.dur"] for e in exp),
            "e2a": max(a["e2a.end"] - max(t2, a["e2a.begin"]) for a in att),
            "stage1": max(a["a2e.dur"] for a in att),
            "round_trip": max(a["e2a.end"] for a in att) - t0,
            "x": max(e["e2a.end"] - e.get("input", e["a2e.begin"]) for e in exp)})  # fmt: skip
    if not rows:
        raise ValueError(f"no A2E call of slots {list(layers)} in the capture")
    out = {k: math.fsum(r[k] for r in rows) / len(rows) for k in rows[0]}
    out["calls"] = len(rows)
    return out


def project_split(w: SplitWorkload, profile: Profile, tpl: SplitTemplate,
                  work: str | Path) -> SplitFigures:  # fmt: skip
    """Synthesize one domain of `w` from `tpl`, size it by the card, replay it on `profile`,
    compose the card's step and the domains (module docstring, `ASSUMPTIONS`)."""
    card, work = CARDS[w.card], Path(work)
    if tpl.microbatches != w.microbatches or int(tpl.workload.get("mtp_k") or 0) != w.mtp:
        raise ValueError("template: another number of micro-batches or MTP tokens")
    raw = synthesize_split(tpl, split_scale_load(w), work / "raw",
                           workload={"scale": dataclasses.asdict(w)})  # fmt: skip
    cap = sized_capture(load_capture(raw, L.LAYOUT_VERSION), card, work / "sized")
    t0 = time.monotonic()
    res = replay(cap, profile)
    replay_s = time.monotonic() - t0
    cw = Workload(dies=w.domain_dies, requests=w.requests, context=w.context, mtp=w.mtp,
                  acceptance=w.acceptance, routing=w.routing, microbatches=w.microbatches,
                  card=w.card, shared="dispatched" if w.shared_copies else "local")  # fmt: skip
    base = compose(res, cw, card, profile.name, replay_s)
    n_dense = int(tpl.workload["dense_layers"])
    c = call_figures(res, w.domain_dies, tpl.slots, range(n_dense + 1, int(tpl.workload["layers"])))
    layer = max(base.moe_layer_us, w.domains * w.microbatches * c["x"])
    step = base.rest_us + card.n_dense_layers * base.dense_layer_us + (
        card.n_layers - card.n_dense_layers) * layer  # fmt: skip
    return SplitFigures(w.label(profile.name), step, layer, base, c)


def project_split_workload(w: SplitWorkload, profile: Profile,
                           templates: str | Path) -> SplitFigures:  # fmt: skip
    """`project_split` of `w` with its template (from `templates`, captured when missing)."""
    tpl = split_template(split_template_dir(templates, w.microbatches, w.mtp))
    with tempfile.TemporaryDirectory(prefix="xpod-split-scale-") as tmp:
        return project_split(w, profile, tpl, tmp)


__all__ = ["ASSUMPTIONS", "Side", "SplitFigures", "SplitLoad", "SplitTemplate", "SplitWorkload",
           "call_figures", "expert_window", "project_split",
           "project_split_workload", "split_config", "split_scale_load", "split_template",
           "step_window", "synthesize_split"]  # fmt: skip
