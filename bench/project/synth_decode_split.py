"""The split decode synthesizer: a split (MoE-attention) pod's decode step for a pod this machine
cannot run, from a small split pod's captured step (docs/projection.md §6.3, "Split pods").

A split capture pod (`xpod decode --attention-dies A --expert-dies E --project`) records on each
attention die each decode step as a call `step` on `main` (the model ops, the `a2e` / `e2a`
calls on `a2a`; two micro-batches on `s0` / `s1`), and on each expert die, with no step call,
per (layer, micro-batch) an `a2e` call, an `experts` op and an `e2a` call, each call named by
its event id (`runtime.model.split`). `split_template` takes one attention die's step and one
expert die's events of that step (from its first `a2e` to the `after` that waits for its last
`e2a`), every call's body left out. `synthesize_split` writes, for a split pod of any size (one
DP domain: attention dies 0..A-1, expert dies A..A+E-1, `Split.make(A + E, A)`), the capture
whose every attention die ran the template's step with its own load (`SplitLoad`) and every
expert die the template's expert events for the pod's routing: model ops' dims recomputed as
`bench.project.synth_decode` does (micro-batches split as `runtime.model.split.microbatches`
splits them; a joined head over every micro-batch; the experts' rows per local expert from
every attention die's routing), each `after` re-pointed, each A2E / E2A body emitted by
`bench.project.synth_a2e`'s code with each micro-batch's `slot_base`. Labelled `synthesized`;
tests/integration/test_synth_decode_split.py checks it equal, event for event but the host
times, to real split captures (synthesized with their own load: contexts from their attention
ops, routing from their gates' `route`, MTP rows). It extrapolates structure, never timing.

001 §7's pod (480 attention dies in 3 DP domains of 160, 288 expert dies) is not a pod xpod
builds (`Split.check`: every attention die needs its own trampoline, 480 > 288), so ONE domain
is synthesized, 160 + 288 dies, and the three domains are composed
(`bench.project.split_scale`: `project_split`, `ASSUMPTIONS`). Its load (`split_scale_load`):
001 §5.2's EP288, routed expert e on expert die e and 32 shared-expert copies on the last 32
(every row to its top-8 and a copy: top-9); 96 requests per attention die at the context, 1 + 1
MTP rows each, in two micro-batches (001 §5.2, Fig. 19: "two microbatches per domain, each of
size 96" rows).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point
from bench.project.synth_a2e import (
    A2ERoutes,
    a2e_attention,
    a2e_expert,
    e2a_attention,
    e2a_expert,
    uncapped,
)
from bench.project.synth_common import write_die
from bench.project.synth_decode import SynthError, cut_bodies, toy_card
from comm.capture import Capture
from comm.routing import Placement
from memory import layout as L
from runtime import PodConfig
from runtime.model.card import MODEL_OPS, ModelCard, op_size
from runtime.model.forward import attention_dims
from runtime.model.split import microbatches, parse_event
from runtime.pod.capture import FORMAT, VERSION
from runtime.project import load_capture

STEP = "step"
CALLS = ("a2e", "e2a")
POD_MAX_DIES = 256
HEAD = ("lm_head", "sample")  # and `norms` of count 1: a forward's head


@dataclass(frozen=True)
class Side:
    """One die's template events (`["body", name, op, n]` marks a call's left-out body of n
    events), each stream's seq at the first event, the streams."""

    streams: list[str]
    events: list[list]
    seq0: list[int]


@dataclass(frozen=True)
class SplitTemplate:
    """A split pod's step (module docstring): an attention die's and an expert die's side; the
    template pod's attention dies, micro-batches, rows per request, the step's first call's
    operation number, MoE event slots a step, its config and workload."""

    attention: Side
    expert: Side
    attention_dies: int
    microbatches: int
    tokens: int
    first_op: int
    slots: int
    config: dict
    workload: dict
    step: int

    def toy_card(self) -> ModelCard:
        return toy_card(self.workload)


def _cut(events: list[list], lo: int, hi: int, where: str) -> tuple[list[list], list[int]]:
    """events[lo..hi] with every a2e / e2a body left out (a marker instead); the calls' ops."""
    out, ops = cut_bodies(events[lo : hi + 1], CALLS, where)
    if any(o is None for o in ops):
        raise SynthError(f"{where}: a call without a guard word")
    return out, ops


def _side(streams: list[str], events: list[list], lo: int, hi: int, where: str):
    seq0 = [0] * len(streams)
    for e in events[:lo]:
        seq0[e[1]] += 1
    out, ops = _cut(events, lo, hi, where)
    return Side(list(streams), out, seq0), ops


def step_window(streams: list[str], events: list[list], step: int) -> tuple[int, int] | None:
    """(first, last) index of an attention die's step call `step`, or None."""
    main = streams.index("main")
    b = [i for i, e in enumerate(events) if e[1] == main and e[0] == "begin" and e[4] == STEP
         and e[5] == step]  # fmt: skip
    if not b:
        return None
    e = next(i for i in range(b[0], len(events)) if events[i][1] == main
             and events[i][0] == "end" and events[i][4] == STEP)  # fmt: skip
    return b[0], e


def expert_window(streams: list[str], events: list[list], step: int,
                  slots: int) -> tuple[int, int] | None:  # fmt: skip
    """(first, last) index of an expert die's events of step `step` (module docstring)."""
    mine = [i for i, e in enumerate(events) if e[0] in ("begin", "end") and e[4] in CALLS
            and e[5] > 0 and parse_event(int(e[5]), slots)[0] == step]  # fmt: skip
    if not mine:
        return None
    main = streams.index("main")
    last = next((i for i in range(mine[-1] + 1, len(events)) if events[i][1] == main), None)
    if last is None or events[last][0] != "after":
        raise SynthError(f"expert die: no wait for the last e2a of step {step}")
    return mine[0], last


def split_template(directory: str | Path, step: int | None = None, attention: int = 0,
                   expert: int | None = None) -> SplitTemplate:  # fmt: skip
    """Attention die `attention`'s and expert die `expert`'s (default: the first) step `step`
    (default: the last) of a split decode capture (module docstring)."""
    cap = load_capture(Path(directory), L.LAYOUT_VERSION)
    wl = dict(cap.meta.get("workload", {}))
    if wl.get("bench") != "decode":
        raise SynthError(f"template {directory}: a decode capture needed")
    att = [d for d in range(cap.num_dies) if "main" in cap.streams[d] and any(
        e[0] == "begin" and e[4] == STEP for e in cap.events[d])]  # fmt: skip
    n_att = len(att)
    if att != list(range(n_att)) or not 0 < n_att < cap.num_dies:
        raise SynthError(f"template {directory}: not a split capture (step calls on {att})")
    main = cap.streams[attention].index("main")
    steps = [e[5] for e in cap.events[attention] if e[1] == main and e[0] == "begin"
             and e[4] == STEP]  # fmt: skip
    step = steps[-1] if step is None else step
    slots = int(wl["layers"]) + int(wl.get("mtp_k") or 0)
    w = step_window(cap.streams[attention], cap.events[attention], step)
    x = n_att if expert is None else expert
    v = expert_window(cap.streams[x], cap.events[x], step, slots)
    if w is None or v is None:
        raise SynthError(f"template {directory}: no step call {step}")
    a_side, a_ops = _side(cap.streams[attention], cap.events[attention], *w, str(directory))
    e_side, e_ops = _side(cap.streams[x], cap.events[x], *v, str(directory))
    if not a_ops or sorted(set(a_ops)) != sorted(set(e_ops)):
        raise SynthError(f"template {directory}: the dies' calls differ ({a_ops} / {e_ops})")
    spans = {}
    for e, key in zip(a_side.events, _phases(a_side.events), strict=True):
        if e[0] == "op" and e[4] == "mla":
            spans.setdefault(key, [int(s) for s in e[8]["req_span"]])
    main_spans = [s for k, v in spans.items() if k[0] == "main" for s in v]
    if not main_spans or len(set(main_spans)) != 1 or any(not v for v in spans.values()):
        raise SynthError(f"template {directory}: one request per die and micro-batch, one size")
    m = int(wl.get("microbatches") or 1)
    return SplitTemplate(a_side, e_side, n_att, m, main_spans[0],
                         min(a_ops), slots, dict(cap.meta.get("config", {})), wl,
                         int(step))  # fmt: skip


@dataclass(frozen=True)
class SplitLoad:
    """What every die does in the step: starts[a], attention die a's requests' cached positions
    before it; route(a, i, rows): its i-th call's routed experts, int64 [rows, topk]; placement
    over the expert dies; shared_dies > 0: the shared expert is a routed one (the attention
    dies' `shared_expert` op left out); mtp_tokens[a]: each request's rows in the MTP
    sub-forward; tokens: each request's rows in the main forward (None: the template's)."""

    starts: list[list[int]]
    route: Callable[[int, int, int], np.ndarray]
    placement: Placement
    topk: int
    shared_dies: int = 0
    mtp_tokens: list[list[int]] | None = None
    tokens: int | None = None

    @property
    def attention_dies(self) -> int:
        return len(self.starts)

    @property
    def dies(self) -> int:
        return len(self.starts) + len(self.placement.dies)


def _phases(events: list[list]) -> list[tuple[str, int]]:
    out, phase = [], "main"
    for e in events:
        if e[0] == "op" and e[4] in ("embed", "mtp_in"):
            phase = "main" if e[4] == "embed" else "mtp"
        out.append((phase, int(e[8].get("mb", 0)) if e[0] == "op" else 0))
    return out


def _is_head(e: list) -> bool:
    return e[4] in HEAD or (e[4] == "norms" and int(e[8].get("count", 0)) == 1)


def _scaled_rows(name: str, r_t: int, spans_t: list[int], spans: list[int], phase: str) -> int:
    """As `bench.project.synth_decode`: all the rows, or one per request (module docstring)."""
    if r_t == sum(spans_t) and (
        sum(spans_t) != len(spans_t) or spans == [1] * len(spans) or phase == "main"
    ):
        return sum(spans)
    if r_t == len(spans_t):
        return len(spans)
    raise SynthError(
        f"template op {name}: {r_t} rows, neither the {sum(spans_t)} rows nor the"
        f" {len(spans_t)} requests of its micro-batch (or an ambiguous template)"
    )


def _plan(tpl: SplitTemplate, load: SplitLoad, a: int):
    """Attention die a's model op dims per template event (None: not a model op), its rows and
    slot base per call."""
    m, events = tpl.microbatches, tpl.attention.events
    keys = _phases(events)
    toks = {"main": [load.tokens or tpl.tokens] * len(load.starts[a]),
            "mtp": (load.mtp_tokens[a] if load.mtp_tokens is not None
                    else [load.tokens or tpl.tokens] * len(load.starts[a]))}  # fmt: skip
    mbs = {ph: microbatches([(j, range(t), s) for j, (t, s) in
                             enumerate(zip(toks[ph], load.starts[a], strict=True))], m)
           for ph in toks}  # fmt: skip
    spans_t: dict[tuple[str, int], list[int]] = {}
    heads: dict[str, int] = {}
    for e, k in zip(events, keys, strict=True):
        if e[0] == "op" and e[4] == "mla":
            spans_t.setdefault(k, [int(x) for x in e[8]["req_span"]])
        if e[0] == "op" and e[4] == "lm_head":
            heads[k[0]] = heads.get(k[0], 0) + 1
    out, calls = [], []
    for e, (ph, mb) in zip(events, keys, strict=True):
        if e[0] != "op" or e[4] not in MODEL_OPS:
            out.append(None)
            continue
        dims, seg = dict(e[8]), mbs[ph][mb]
        if e[4] == "mla":
            dims.update(attention_dims(seg))
        elif e[4] != "experts":
            if (ph, mb) not in spans_t:
                raise SynthError(f"template op {e[4]}: no attention in its phase {(ph, mb)}")
            st, sp = spans_t[(ph, mb)], [len(t) for _, t, _ in seg]
            if _is_head(e) and m > 1 and heads.get(ph) == 1:  # one head over every micro-batch
                st = [x for i in range(m) for x in spans_t.get((ph, i), [])]
                sp = [len(t) for s in mbs[ph] for _, t, _ in s]
            dims["rows"] = _scaled_rows(e[4], int(dims.get("rows", 0)), st, sp, ph)
            if e[4] == "gate":
                base = sum(len(t) for s in mbs[ph][:mb] for _, t, _ in s)
                calls.append((dims["rows"], base))
        out.append(dims)
    return out, calls


class _Die:
    """One synthesized die: its recorder with the template side's streams, the seq map from
    the template's events to its own."""

    def __init__(self, d: int, lo: L.RegionLayout, side: Side):
        self.d = d
        self.cap = Capture(d, lo)
        self.sid = [self.cap.stream(n) for n in side.streams]
        self.seq = list(side.seq0)
        self.map: dict[tuple[int, int], int] = {}

    def emit(self, s: int, ev: list) -> None:
        sid = self.sid[s]
        new = self.cap.seq[sid]
        self.cap.seq[sid] = new + 1
        self.cap.events.append([ev[0], sid, 0, 0, *ev[4:]])
        self.map[(s, self.seq[s])] = new
        self.seq[s] += 1

    def drop(self, s: int) -> None:
        self.map[(s, self.seq[s])] = self.cap.seq[self.sid[s]] - 1
        self.seq[s] += 1

    def after(self, ev: list) -> list:
        key = (ev[4], ev[5])
        if key not in self.map:
            raise SynthError(f"template: an after on event {key} outside the step")
        return [*ev[:4], self.sid[ev[4]], self.map[key]]


def _expert_dims(r: A2ERoutes, d: int) -> dict:
    p = r.placement
    counts = np.zeros(p.num_local(d), np.int64)
    for idx in r.idx:
        e = idx[idx >= 0]
        e = e[p.die_of[e] == d]
        np.add.at(counts, p.local_of[e], 1)
    return {"rows": int(counts.sum()), "counts": counts.tolist()}


def split_config(tpl: SplitTemplate, load: SplitLoad) -> PodConfig:
    """The template pod's config for the load's pod (a config for a layout, never a launch)."""
    rows = max(max(sum(load.mtp_tokens[a]) if load.mtp_tokens else 0,
                   len(s) * (load.tokens or tpl.tokens))
               for a, s in enumerate(load.starts))  # fmt: skip
    names = {f.name for f in dataclasses.fields(PodConfig)}
    base = {k: v for k, v in tpl.config.items() if k in names}
    base.update(num_dies=min(load.dies, POD_MAX_DIES), capture=True, a2a_topk=load.topk,
                a2a_max_batch=max(rows, int(base.get("a2a_max_batch", 0))), hosts=(),
                host_names=(), die_cpus=())  # fmt: skip
    p = load.placement
    local = max(p.num_local(d) for d in p.dies)
    return uncapped(PodConfig.from_dict(base), num_dies=load.dies, num_experts=p.num_experts,
                    a2a_max_local_experts=local)  # fmt: skip


def synthesize_split(tpl: SplitTemplate, load: SplitLoad, directory: str | Path,
                     cfg: PodConfig | None = None, first_op: int | None = None,
                     workload: dict | None = None) -> Path:  # fmt: skip
    """Write the capture of a split pod of `load.attention_dies` + the placement's expert dies
    running `tpl`'s step with `load` (module docstring), labelled `synthesized`. One die at a
    time: a die's file is written, and its events dropped, before the next die's are made."""
    cfg = cfg or split_config(tpl, load)
    lo, card, n_att, n = cfg.layout(), tpl.toy_card(), load.attention_dies, load.dies
    if load.placement.dies != tuple(range(n_att, n)):
        raise SynthError(f"load: the experts must live on dies {n_att}..{n - 1}")
    shift = (tpl.first_op if first_op is None else first_op) - tpl.first_op
    plans = [_plan(tpl, load, a) for a in range(n_att)]
    calls = [list(c) for c in zip(*(p[1] for p in plans), strict=True)]  # per call, per die
    hidden = int(tpl.config.get("a2a_hidden", card.hidden))
    pt = Point(n, max(max(r for r, _ in c) for c in calls), hidden, load.topk,
               load.placement.num_experts, 0, attention_dies=n_att)  # fmt: skip
    routes = [A2ERoutes.of(pt, [load.route(a, i, c[a][0]) for a in range(n_att)], load.placement,
                           [b for _, b in c]) for i, c in enumerate(calls)]  # fmt: skip
    quant = "int8" if tpl.workload.get("quant") == "int8" else "none"
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    entries = []
    for d in range(n):
        side = tpl.attention if d < n_att else tpl.expert
        die = _Die(d, lo, side)
        a2a, call, gates = side.streams.index("a2a"), 0, 0
        for j, ev in enumerate(side.events):
            kind, s = ev[0], ev[1]
            if kind == "body":
                call, op = ev[2] - tpl.first_op, ev[2] + shift
                die.seq[a2a] += ev[3]
                with die.cap.on(die.sid[a2a]):
                    if d < n_att:
                        fn = a2e_attention if ev[1] == "a2e" else e2a_attention
                        fn(die, routes[call], lo, op, *((quant,) if ev[1] == "a2e" else ()))
                    elif ev[1] == "a2e":
                        a2e_expert(die, routes[call], lo, op, learn=True)
                    else:
                        e2a_expert(die, routes[call], lo, op)
                continue
            if kind == "op" and ev[4] == "shared_expert" and load.shared_dies:
                die.drop(s)
                continue
            dims = plans[d][0][j] if d < n_att else (
                {**ev[8], **_expert_dims(routes[call], d)} if kind == "op" and ev[4] == "experts"
                else None)  # fmt: skip
            if dims is not None:
                if ev[4] == "gate":
                    dims["route"] = routes[gates].idx[d].ravel().tolist()
                    gates += 1
                sized = {k: v for k, v in dims.items() if k not in ("unit", "dtype")}
                flops, rd, wr, _, _ = op_size(card, ev[4], sized)
                ev = [*ev[:5], int(flops), int(rd), int(wr), dict(sorted(dims.items()))]
            elif kind == "after":
                ev = die.after(ev)
            die.emit(s, ev)
        entries.append(write_die(die, out))
        del die
    wl = {**tpl.workload, "dies": n, "attention_dies": n_att, "expert_dies": n - n_att,
          "domains": 1, "steps": 1, "warmup_steps": 0, "template_step": tpl.step,
          **(workload or {})}  # fmt: skip
    meta = {"format": FORMAT, "version": VERSION, "layout_version": L.LAYOUT_VERSION,
            "num_dies": n, "dies": entries, "config": cfg.to_dict(), "workload": wl,
            "calls": [STEP], "warmup": 0, "synthesized": True, "commit": ""}  # fmt: skip
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True, default=list), encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return out


# -- at the papers' scale (docs/projection.md §6.3) ---------------------------------------------
