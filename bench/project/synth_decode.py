"""The decode synthesizer: a decode step's capture for a pod this machine cannot run, from a
small pod's captured step (docs/projection.md §6.3).

A decode capture pod (`xpod decode --project`) records, per die, each step as a call `step` on
`main`: the model ops with their structural dims (`runtime.model.card.record`: rows, each
row's context, rows per local expert, a gate's routed experts; a micro-batch's `mb`), the
streams they run on with their `after` edges (`runtime.model.pipeline`), and each dispatch /
combine as a call on `a2a` whose body the fused protocol wrote (`comm.alltoall.fused`).

`template_of` takes one die's step from such a capture: its events with every collective's
body left out. `synthesize_decode` writes, for a pod of any size, the capture whose every die
ran that step with its own load (`Load`: its requests, their contexts, each collective's
routing): the template's events in the template's order on the template's streams, each model
op's dims recomputed for the die's rows (rows of a micro-batch scale with its requests; the
attention's contexts from the load; a gate's routing and the experts' rows per local expert
from the load's routing and the placement), each `after` re-pointed at the same event of the
synthesized stream, and each collective's body emitted by `bench.project.synth`'s fused
dispatch / combine (the code that is tested equal to the protocol's own captures) for the
whole pod's routing. Its output is labelled `synthesized`; tests/integration/
test_synth_decode.py checks it equal, event for event but the host times, to real captures of
2- and 4-die pods (one and two micro-batches, MTP), the template taken from a pod of another
size and batch. It extrapolates structure, never timing.

Where the papers' pods place the shared expert as a routed one (000 §4.1: 32 shared-expert
copies among EP320's 320 experts; 001 §7.1: on 32 of EP288's dies), `shared_dies` > 0 drops
the template's `shared_expert` op and routes every row to one shared copy besides its top-k
(`bench.project.decode_scale` builds those routings).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point
from bench.project.synth import Routes, fused_combine, fused_dispatch
from bench.project.synth_common import write_die
from comm.capture import Capture
from comm.routing import Placement
from memory import layout as L
from runtime import PodConfig
from runtime.model import ModelConfig
from runtime.model.card import MODEL_OPS, ModelCard, card_of, op_size
from runtime.model.forward import attention_dims
from runtime.pod.capture import FORMAT, VERSION
from runtime.project import load_capture

CALLS = ("dispatch", "combine")
STEP = "step"
POD_MAX_DIES = 256  # PodConfig's die cap: a larger pod's config is built at 256, then uncapped


class SynthError(ValueError):
    """A template or a load the synthesizer cannot use (named)."""


@dataclass(frozen=True)
class Template:
    """One die's decode step (module docstring).

    events: the die's events from main's `step` begin to its end, collective bodies left out
    (each body's place: a `["body", name, op, events]` marker after its `begin`); seq0: each
    stream's seq at the step's first event; streams: the die's stream names; requests: the template
    die's requests per micro-batch; tokens: each request's rows in the step; first_op: the
    step's first collective's operation number; config / workload: the template pod's."""

    streams: list[str]
    events: list[list]
    seq0: list[int]
    requests: list[int]
    tokens: int
    first_op: int
    config: dict
    workload: dict
    step: int

    @property
    def microbatches(self) -> int:
        return len(self.requests)

    def collectives(self) -> int:
        return sum(1 for e in self.events if e[0] == "begin" and e[4] == "dispatch")

    def toy_card(self) -> ModelCard:
        """The template model's own card (the sizes its capture recorded)."""
        return toy_card(self.workload)


def cut_bodies(events: list[list], calls: tuple[str, ...], where: str) -> tuple[list, list]:
    """`events` (one die's step) with the body of every call of `calls` left out: a marker
    `["body", name, op, n events]` before its `end`; and each body's operation number (its
    first guard word's value; None: none). SynthError for another call, or a transfer or guard
    outside a call."""
    out, body, ops = [], None, []  # body: [stream, name, op, events] of the open call
    for e in events:
        if body is not None and e[1] == body[0]:
            if e[0] == "end" and e[4] == body[1]:
                out += [["body", body[1], body[2], body[3]], e]
                ops.append(body[2])
                body = None
            else:
                if body[2] is None and e[0] in ("pub", "acq"):
                    body[2] = int(e[6 if e[0] == "pub" else 5][0])
                body[3] += 1
            continue
        if e[0] == "begin" and e[4] in calls:
            body = [e[1], e[4], None, 0]
        elif e[0] == "begin" and e[4] != STEP:
            raise SynthError(f"{where}: call {e[4]!r}: only {' / '.join(calls)} in a step")
        elif e[0] in ("put", "get", "pub", "acq", "copy"):
            raise SynthError(f"{where}: a {e[0]} outside a call")
        out.append(e)
    return out, ops


def toy_card(workload: dict) -> ModelCard:
    """The card of a template pod's toy model (the sizes its capture recorded)."""
    w = workload
    cfg = ModelConfig.preset(w["model"], n_layers=w["layers"], n_dense_layers=w["dense_layers"],
                             num_experts=w["experts"], topk=w["topk"])  # fmt: skip
    return card_of(cfg)


def template_of(directory: str | Path, die: int = 0, step: int | None = None) -> Template:
    """Die `die`'s step `step` (default: the capture's last) of a decode capture (module
    docstring). SynthError if the capture has no such step or a collective the synthesizer
    does not write (fused dispatch / combine only)."""
    cap = load_capture(Path(directory), L.LAYOUT_VERSION)
    if die >= cap.num_dies:
        raise SynthError(f"template: die {die} of a {cap.num_dies}-die capture")
    streams, events = cap.streams[die], cap.events[die]
    wl = cap.meta.get("workload", {})
    if wl.get("bench") != "decode" or wl.get("protocol", "fused") != "fused":
        raise SynthError(f"template {directory}: a decode capture of protocol fused needed"
                         f" (got {wl.get('bench')!r}, {wl.get('protocol')!r})")  # fmt: skip
    main = streams.index("main")
    begins = [i for i, e in enumerate(events)
              if e[1] == main and e[0] == "begin" and e[4] == STEP]  # fmt: skip
    if step is not None:
        begins = [i for i in begins if events[i][5] == step]
    if not begins:
        raise SynthError(f"template {directory}: die {die} has no step call {step or ''}")
    start = begins[-1]
    end = next(
        i
        for i in range(start, len(events))
        if events[i][1] == main and events[i][0] == "end" and events[i][4] == STEP
    )
    seq0 = [0] * len(streams)
    for e in events[:start]:
        seq0[e[1]] += 1
    out, ops = cut_bodies(events[start : end + 1], CALLS, f"template {directory}")
    if any(o is None for o in ops):
        raise SynthError(f"template {directory}: a collective without a guard word (1 die?)")
    first_op = min(ops) if ops else 0
    per_mb: dict[int, list[int]] = {}
    for e in out:
        if e[0] == "op" and e[4] == "mla":
            per_mb.setdefault(int(e[8].get("mb", 0)), list(e[8]["req_span"]))
    if not per_mb or any(not v for v in per_mb.values()):
        raise SynthError(f"template {directory}: die {die} has an empty micro-batch (give the"
                         " template pod at least one request per die and micro-batch)")  # fmt: skip
    spans = {s for v in per_mb.values() for s in v}
    if len(spans) != 1:
        raise SynthError(f"template {directory}: requests of {sorted(spans)} rows: one size")
    requests = [len(per_mb[m]) for m in sorted(per_mb)]
    return Template(list(streams), out, seq0, requests, spans.pop(), first_op,
                    dict(cap.meta.get("config", {})), dict(wl), int(events[start][5]))  # fmt: skip


@dataclass(frozen=True)
class Load:
    """What every die of the synthesized pod does in the step.

    starts[d]: each request's cached positions before the step on die d (its rows attend to
    start + 1 .. start + tokens); route(d, i, rows): die d's i-th collective's routed experts,
    int64 [rows, topk] (expert ids of `placement`); placement: where each expert lives;
    shared_dies: > 0 when the shared expert is a routed one (module docstring); mtp_tokens[d]:
    each request's rows in the MTP sub-forward (1 + its accepted drafts; None: the step's);
    tokens: each request's rows in the main forward (None: the template's; 1 + k: a verify
    forward of k drafts through a template without MTP)."""

    starts: list[list[int]]
    route: Callable[[int, int, int], np.ndarray]
    placement: Placement
    topk: int
    shared_dies: int = 0
    mtp_tokens: list[list[int]] | None = None
    tokens: int | None = None

    @property
    def dies(self) -> int:
        return len(self.starts)


def _halves(starts: list[int], m: int) -> list[list[int]]:
    if m == 1:
        return [list(starts)]
    k = (len(starts) + 1) // 2  # runtime.model.pipeline.halves
    return [list(starts[:k]), list(starts[k:])]


class _Die:
    """One synthesized die: its recorder with the template's streams in the template's order,
    the seq map from the template's events to its own."""

    def __init__(self, d: int, lo: L.RegionLayout, tpl: Template):
        self.d = d
        self.cap = cap = Capture(d, lo)
        self.sid = [cap.stream(n) for n in tpl.streams]
        self.seq = list(tpl.seq0)  # the template's seq of its next event, per stream
        self.map: dict[tuple[int, int], int] = {}  # (template stream, seq) -> synthesized seq

    def emit(self, tpl_sid: int, ev: list) -> None:
        cap = self.cap
        sid = self.sid[tpl_sid]
        new = cap.seq[sid]
        cap.seq[sid] = new + 1
        cap.events.append([ev[0], sid, 0, 0, *ev[4:]])
        self.map[(tpl_sid, self.seq[tpl_sid])] = new
        self.seq[tpl_sid] += 1

    def drop(self, tpl_sid: int) -> None:
        """A template event left out: what waited for it waits for the stream's previous one."""
        self.map[(tpl_sid, self.seq[tpl_sid])] = self.cap.seq[self.sid[tpl_sid]] - 1
        self.seq[tpl_sid] += 1


def _phases(tpl: Template) -> list[tuple[str, int]]:
    """(phase, micro-batch) of every template event: "main" from `embed`, "mtp" from `mtp_in`."""
    out, phase = [], "main"
    for e in tpl.events:
        if e[0] == "op" and e[4] in ("embed", "mtp_in"):
            phase = "main" if e[4] == "embed" else "mtp"
        out.append((phase, int(e[8].get("mb", 0)) if e[0] == "op" else 0))
    return out


def _spans(tpl: Template) -> dict[tuple[str, int], list[int]]:
    """The template die's rows per request of each (phase, micro-batch), from its attention."""
    out: dict[tuple[str, int], list[int]] = {}
    for e, key in zip(tpl.events, _phases(tpl), strict=True):
        if e[0] == "op" and e[4] == "mla":
            out.setdefault(key, [int(x) for x in e[8]["req_span"]])
    return out


def _scaled_rows(name: str, r_t: int, spans_t: list[int], spans: list[int], phase: str) -> int:
    """An op's rows for a die whose requests have `spans` rows, the template's `spans_t`: all
    the rows (the template's op had sum(spans_t)) or one per request (len(spans_t)); where the
    template cannot tell (one row per request), all the rows in the main phase (a verify
    forward's every op, its head included, runs on all its rows)."""
    if r_t == sum(spans_t) and (
        sum(spans_t) != len(spans_t) or spans == [1] * len(spans) or phase == "main"
    ):
        return sum(spans)
    if r_t == len(spans_t):
        return len(spans)
    if r_t == sum(spans_t):  # the template's requests have one row each: ambiguous
        raise SynthError(
            f"template op {name}: one row per request in the template, not in the load: take"
            " a template step whose requests have their load's rows"
        )
    raise SynthError(f"template op {name}: {r_t} rows, neither the {sum(spans_t)} rows nor the"
                     f" {len(spans_t)} requests of its micro-batch")  # fmt: skip


def _plan(tpl: Template, load: Load, d: int) -> tuple[list[dict | None], list[int]]:
    """Die d's model op dims for every template event (None: not a model op; experts' rows
    and a gate's route are filled from the routing later) and its gate rows per collective."""
    m = tpl.microbatches
    halves = _halves(load.starts[d], m)
    mtp = _halves(load.mtp_tokens[d], m) if load.mtp_tokens is not None else None
    spans_t = _spans(tpl)
    out, gates = [], []
    for e, (phase, mb) in zip(tpl.events, _phases(tpl), strict=True):
        if e[0] != "op" or e[4] not in MODEL_OPS:
            out.append(None)
            continue
        main = load.tokens or tpl.tokens
        toks = mtp[mb] if phase == "mtp" and mtp is not None else [main] * len(halves[mb])
        dims = dict(e[8])
        if e[4] == "mla":
            dims.update(attention_dims([(None, range(t), s) for t, s in
                                        zip(toks, halves[mb], strict=True)]))  # fmt: skip
        elif e[4] != "experts":
            key = (phase, mb)
            if key not in spans_t:
                raise SynthError(f"template op {e[4]}: no attention in its phase {key}")
            dims["rows"] = _scaled_rows(e[4], int(dims.get("rows", 0)), spans_t[key], toks, phase)
            if e[4] == "gate":
                gates.append(dims["rows"])
        out.append(dims)
    return out, gates


def synthesize_decode(
    tpl: Template,
    load: Load,
    directory: str | Path,
    cfg: PodConfig | None = None,
    first_op: int | None = None,
    workload: dict | None = None,
) -> Path:
    """Write the capture of `load.dies` dies each running `tpl`'s step with its load (module
    docstring), labelled `synthesized`; `cfg`: the pod's config (default: the template's,
    sized for the load: `pod_config_for_load`); `first_op`: the step's first collective's
    operation number (default the template's)."""
    cfg = cfg or pod_config_for_load(tpl, load)
    lo = cfg.layout()
    card = tpl.toy_card()
    n = load.dies
    shift = (tpl.first_op if first_op is None else first_op) - tpl.first_op
    plans = [_plan(tpl, load, d) for d in range(n)]
    gates = [list(g) for g in zip(*(p[1] for p in plans), strict=True)]  # per collective, per die
    routes = [_routes(load, i, rows, card.hidden) for i, rows in enumerate(gates)]
    a2a = tpl.streams.index("a2a") if "a2a" in tpl.streams else -1
    quant = "int8" if tpl.workload.get("quant") == "int8" else "none"
    dies = []
    for d in range(n):
        die = _Die(d, lo, tpl)
        dies.append(die)
        coll, pending = 0, None  # the next collective; the dispatch whose experts come next
        for ev, dims in zip(tpl.events, plans[d][0], strict=True):
            kind, sid = ev[0], ev[1]
            if kind == "body":
                r = routes[coll if ev[1] == "dispatch" else coll - 1]
                it = ev[2] + shift - 1
                die.seq[a2a] += ev[3]  # the template's body events: not mapped (never waited on)
                with die.cap.on(die.sid[a2a]):
                    if ev[1] == "dispatch":
                        r.pt = dataclasses.replace(r.base, batch=gates[coll][d])
                        fused_dispatch(die, r, lo, it, quant)
                        pending, coll = r, coll + 1
                    else:
                        fused_combine(die, r, lo, it)
                continue
            if kind == "op" and ev[4] == "shared_expert" and load.shared_dies:
                die.drop(sid)
                continue
            if dims is not None:
                if ev[4] == "gate":
                    dims["route"] = routes[coll].idx[d].ravel().tolist()
                elif ev[4] == "experts":
                    dims.update(_expert_dims(pending, d))
                sized = {k: v for k, v in dims.items() if k not in ("unit", "dtype")}
                flops, rd, wr, _, _ = op_size(card, ev[4], sized)
                ev = [*ev[:5], int(flops), int(rd), int(wr), dict(sorted(dims.items()))]
            elif kind == "after":
                key = (ev[4], ev[5])
                if key not in die.map:
                    raise SynthError(f"template: an after on event {key} outside the step")
                ev = [*ev[:4], die.sid[ev[4]], die.map[key]]
            die.emit(sid, ev)
    return _write(dies, cfg, tpl, load, Path(directory), workload)


def _routes(load: Load, i: int, rows: list[int], hidden: int) -> Routes:
    """`bench.project.synth`'s routes of collective i: every die's routing of its rows."""
    idx = [np.asarray(load.route(d, i, rows[d]), np.int64).reshape(rows[d], load.topk)
           for d in range(load.dies)]  # fmt: skip
    pt = Point(load.dies, max(rows), hidden, load.topk, load.placement.num_experts, 0)
    r = Routes.of(pt, idx, load.placement)
    r.base = pt
    return r


def _expert_dims(r: Routes, d: int) -> dict:
    """The experts op's rows and rows per local expert of die d (every source's routing)."""
    p = r.placement
    mine = np.flatnonzero(p.die_of == d)
    counts = np.zeros(len(mine), np.int64)
    for idx in r.idx:
        e = idx[idx >= 0]
        e = e[p.die_of[e] == d]
        np.add.at(counts, p.local_of[e], 1)
    return {"rows": int(counts.sum()), "counts": counts.tolist()}


def pod_config_for_load(tpl: Template, load: Load) -> PodConfig:
    """The template pod's config for the load's pod: its dies, the largest gate rows, top-k,
    experts; built at 256 dies and uncapped beyond (a config for a layout, never a launch)."""
    rows = max((len(s) for s in load.starts), default=0) * (load.tokens or tpl.tokens)
    names = {f.name for f in dataclasses.fields(PodConfig)}
    base = {k: v for k, v in tpl.config.items() if k in names}
    base.update(num_dies=min(load.dies, POD_MAX_DIES), capture=True,
                a2a_max_batch=max(rows, int(base.get("a2a_max_batch", 0))), a2a_topk=load.topk,
                hosts=(), host_names=(), die_cpus=())  # fmt: skip
    cfg = PodConfig.from_dict(base)
    p = load.placement
    local = int(np.bincount(p.die_of, minlength=load.dies).max())
    changes = {"num_dies": load.dies, "num_experts": p.num_experts}
    if p.num_experts != int(base.get("num_experts", 0)) or load.dies > POD_MAX_DIES:
        changes["a2a_max_local_experts"] = local
    cfg = copy.copy(cfg)  # checked at <= 256 dies; beyond, a config for a layout only
    for k, v in changes.items():
        object.__setattr__(cfg, k, v)
    return cfg


def _write(dies: list[_Die], cfg: PodConfig, tpl: Template, load: Load, out: Path,
           workload: dict | None) -> Path:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").unlink(missing_ok=True)
    entries = [write_die(die, out) for die in dies]
    wl = {**tpl.workload, "dies": load.dies, "steps": 1, "warmup_steps": 0,
          "template_step": tpl.step, **(workload or {})}  # fmt: skip
    meta = {"format": FORMAT, "version": VERSION, "layout_version": L.LAYOUT_VERSION,
            "num_dies": load.dies, "dies": entries, "config": cfg.to_dict(), "workload": wl,
            "calls": [STEP], "warmup": 0, "synthesized": True, "commit": ""}  # fmt: skip
    tmp = out / ".meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True, default=list), encoding="utf-8")
    os.replace(tmp, out / "meta.json")
    return out


__all__ = ["Load", "SynthError", "Template", "captured_load", "cut_bodies", "pod_config_for_load",
           "synthesize_decode", "template_of", "toy_card"]  # fmt: skip


def captured_load(directory: str | Path, step: int | None = None) -> Load:
    """The load of a real decode capture's step (default: its last): each die's requests'
    starts (from its attention ops), each collective's routing (from its gate ops), the default
    placement. What the equality tests synthesize a captured pod from."""
    cap = load_capture(Path(directory), L.LAYOUT_VERSION)
    wl = cap.meta.get("workload", {})
    starts, routes, mtps = [], [], []
    for d in range(cap.num_dies):
        tpl = template_of(directory, d, step) if step is not None else template_of(directory, d)
        first: dict[tuple[str, int], list[int]] = {}
        gates, mtp = [], []
        for e, key in zip(tpl.events, _phases(tpl), strict=True):
            if e[0] == "op" and e[4] == "mla" and key not in first:
                dims = e[8]
                first[key] = [
                    int(c) - int(s) for c, s in zip(dims["req_ctx"], dims["req_span"], strict=True)
                ]
                if key[0] == "mtp":
                    mtp.extend(int(x) for x in dims["req_span"])
            elif e[0] == "op" and e[4] == "gate":
                gates.append(np.asarray(e[8]["route"], np.int64))
        starts.append([s for k in sorted(first) if k[0] == "main" for s in first[k]])
        routes.append(gates)
        mtps.append(mtp)
    topk = int(wl["topk"])
    placement = Placement.default(int(wl["experts"]), tuple(range(cap.num_dies)))
    return Load(
        starts,
        lambda d, i, rows: routes[d][i].reshape(rows, topk),
        placement,
        topk,
        mtp_tokens=mtps if any(mtps) else None,
    )
