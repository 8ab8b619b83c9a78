"""The figures of a projected decode capture (docs/projection.md §6): step time, per-layer
time, and where a step's time goes.

A decode capture (`xpod decode --project`) records each decode step as a call `step` on every
die's `main` stream, and every compute op of the step with its name (`runtime.model.card`): a
forward is `embed`, then per layer `mla_prolog`, `mla`, `o_proj`, `norms`, and either
`dense_ffn` or `gate`, the `dispatch` call, `experts`, the `combine` call, `shared_expert`; then
the head (`norms` with `count` 1, `lm_head`, `sample`). An MTP sub-forward starts with `mtp_in`
instead of `embed`. The collectives run on their own stream (`a2a`); the stream that launched
one waits for its `end` with an `after` event.

**One stream.** A step whose ops are on `main` is tiled by `main`: each event of the step owns
the time from the previous event's finish to its own (a wait for a collective is the `after`
that waits for its end, so it belongs to that collective: its launch, its own work, and the
time it waited for the slowest peer). The tiles sum to the step's span, `begin` to `end` (a
`step` begin costs nothing). A layer is the tiles from its `mla_prolog` to the next layer's (or
to the head's `norms`).

**Two streams** (`xpod decode --microbatches 2`, `runtime.model.pipeline`): the step's ops are
on the compute streams `s0` (the attention path) and `s1` (the MoE path, which launches the
collectives); `main` opens the step, joins both streams and closes it. The step's span is still
`main`'s `begin` to `end`. Each compute stream is tiled as `main` is above, within the step:
each of its events owns the time from the stream's previous event's finish (its first: from the
step's begin) to its own finish; a wait for a collective's end is that collective's (its work
and its wait for the slowest peer). One kind of tile is not the stream's work: an `after` that
waits for another of the die's compute streams or `main` owns the time the stream idled for its
micro-batch's data (the pipeline's fill and bubbles); it is the stream's `idle_us`, in no
category. The rest is the stream's busy time. `main` is tiled the same way (its joins are idle;
its own ops, if any, such as an MTP sub-forward after the join, are busy). The step's
categories are the sum over its streams of their busy tiles: with overlap they are stream time,
as a profiler's kernel breakdown is, and sum to more than the span (a stream's busy and idle
time sum to its last event's finish minus the step's begin). Its per-layer time is the step's
critical path per layer: layer i's time is the finish of the layer's last event on the MoE
stream `s1` for its last micro-batch (its FFN) minus that of layer i - 1 (layer 0: minus the
step's begin). A layer's events are known by the ops' micro-batch tag (`mb`: a micro-batch's
`mla_prolog` on `s0` starts its next layer, its model ops on `s1` are that layer's); in a
capture without tags, by order (a layer starts at the first `mla_prolog` on `s0` after an `s1`
event and has the `s1` events until the next). The step's micro-batches are its `embed` ops
(one per micro-batch, empty or not).

Categories (`CATEGORIES`): `attention` (mla_prolog, mla, o_proj), `gate`, `dispatch`, `experts`
(the routed experts), `combine`, `shared` (the shared expert), `dense_ffn`, `mtp` (every tile of
the MTP sub-forwards, their collectives included), `other` (embedding, norms, LM head,
sampling, the rest).

Imports nothing of xpod but this package (like all of `runtime.project`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from runtime.project.errors import ProjectError
from runtime.project.result import Result, percentile

STEP_CALL = "step"
CATEGORIES = ("attention", "gate", "dispatch", "experts", "combine", "shared", "dense_ffn", "mtp",
              "other")  # fmt: skip
OP_CATEGORY = {"mla_prolog": "attention", "mla": "attention", "o_proj": "attention",
               "gate": "gate", "experts": "experts", "shared_expert": "shared",
               "dense_ffn": "dense_ffn"}  # fmt: skip
CALL_CATEGORY = {"dispatch": "dispatch", "combine": "combine", "a2e": "dispatch", "e2a": "combine"}
COMPUTE_STREAMS = ("s0", "s1")  # runtime.model.pipeline's attention and MoE streams
MOE_STREAM = "s1"


@dataclass(frozen=True, slots=True)
class StepTiles:
    """One die's decode step, tiled (module docstring): its span, µs per category, and each
    main-model layer's µs in order as (kind, µs), kind "dense" or "moe". On a two-stream step
    (empty on one stream): stream_us, each compute stream's busy µs, idle_us its idle µs; and
    the step's micro-batches."""

    die: int
    step: int
    span_us: float
    by_category: dict[str, float]
    layers: list[tuple[str, float]]
    stream_us: dict[str, float] = field(default_factory=dict)
    idle_us: dict[str, float] = field(default_factory=dict)
    microbatches: int = 1

    @property
    def tiled_us(self) -> float:
        """The sum of its categories: its span on one stream, its streams' busy time on two."""
        return math.fsum(self.by_category.values()) if self.stream_us else self.span_us


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """The figures of the counted steps (after the capture's warm-up), µs.

    step_us[i]: counted step i's latency, the max over dies of their spans (its die:
    critical[i]); step_p50_us: their p50. layer_us: the mean per main-model layer of each kind
    ("dense", "moe") and of all ("all") on each step's critical die, averaged over the counted
    steps (None: no layer of that kind). mtp_us: the `mtp` tiles per step on the critical die,
    averaged. share[d]: die d's µs per category over the sum of its counted steps' categories
    (their spans; on two streams their streams' busy time; None: a die without a counted step,
    such as a split pod's expert die); mean_share: the mean over the other dies; mean_us: µs
    per step per category, mean over those dies and steps. stream_us: per compute stream
    ("s0", "s1") its busy µs per micro-batch per layer on the critical die (its busy tiles in
    the step over layers x micro-batches), averaged over the counted steps; None without a
    two-stream step."""

    steps: list[int]
    step_us: list[float]
    critical: list[int]
    step_p50_us: float
    layer_us: dict[str, float | None]
    mtp_us: float
    share: list[dict[str, float] | None]
    mean_share: dict[str, float]
    mean_us: dict[str, float]
    stream_us: dict[str, float] | None = None


class _Stream:
    """One stream's tiles of an open step: the finish its next tile starts from, µs per
    category, µs idle (cat None: a wait for another compute stream)."""

    __slots__ = ("cats", "idle", "prev")

    def __init__(self, start: float) -> None:
        self.prev = start
        self.cats = dict.fromkeys(CATEGORIES, 0.0)
        self.idle = 0.0

    def tile(self, finish: float, cat: str | None) -> float:
        tile, self.prev = finish - self.prev, finish
        if cat is None:
            self.idle += tile
        else:
            self.cats[cat] += tile
        return tile


class _Step:
    """An open `step` call of one die: its streams' tiles, its phase (main model or MTP), its
    layers (module docstring)."""

    def __init__(self, die: int, call: int, start: float, main: int) -> None:
        self.die, self.call, self.start, self.main = die, call, start, main
        self.streams = {main: _Stream(start)}
        self.phase = "main"
        self.layers: list[list] = []  # one stream: [kind, µs]
        self.layer: int | None = None  # one stream: the open layer
        self.moe_layers: list[list] = []  # two streams: [kind, {mb: its last s1 finish}]
        self.in_layer = False  # two streams, untagged: a layer is open
        self.moe_seen = False  # two streams, untagged: the open layer has had an s1 event
        self.mb_layer: dict[int, int] = {}  # two streams, tagged: each micro-batch's layer
        self.embeds = 0

    def on_main(self, kind: str, ev: list, finish: float, ends: dict, inner: set[int]) -> None:
        """An event of the main stream; `inner`: the die's main and compute streams (a wait
        for one of them is idle)."""
        cat = self._category(kind, ev, ends)
        if kind == "after" and ev[4] in inner:
            cat = None
        if kind == "op":
            name = ev[4]
            if self.phase == "main" and name == "mla_prolog":
                self.layers.append(["dense", 0.0])
                self.layer = len(self.layers) - 1
            elif self.phase == "main" and name in ("gate", "experts") and self.layer is not None:
                self.layers[self.layer][0] = "moe"
            elif name in ("embed", "mtp_in") or _is_head(ev):
                self.layer = None
        tile = self.streams[self.main].tile(finish, cat)
        if self.phase == "main" and self.layer is not None:
            self.layers[self.layer][1] += tile

    def on_compute(self, sid: int, moe: bool, kind: str, ev: list, finish: float, ends: dict,
                   inner: set[int]) -> None:  # fmt: skip
        """An event of compute stream `sid` (`moe`: the MoE stream); `inner`: the die's main
        and compute streams, whose waits for each other are idle."""
        cat = self._category(kind, ev, ends)
        if kind == "after" and ev[4] in inner:
            cat = None
        name = ev[4] if kind == "op" else None
        mb = ev[8].get("mb") if name is not None else None
        if name == "embed":
            self.embeds += 1
        if self.phase != "main":
            pass
        elif mb is not None or self.mb_layer:
            self._tagged(moe, name, mb, finish)
        elif name in ("embed", "mtp_in") or (name is not None and _is_head(ev)):
            self.in_layer = False
        elif not moe and name == "mla_prolog":
            if not self.in_layer or self.moe_seen:  # the next layer's first micro-batch
                self.moe_layers.append(["dense", {}])
                self.in_layer, self.moe_seen = True, False
        elif moe and self.in_layer:
            self.moe_layers[-1][1][0] = finish
            self.moe_seen = True
            if name in ("gate", "experts"):
                self.moe_layers[-1][0] = "moe"
        if sid not in self.streams:
            self.streams[sid] = _Stream(self.start)
        self.streams[sid].tile(finish, cat)

    def _tagged(self, moe: bool, name: str | None, mb: int | None, finish: float) -> None:
        """The layers of a capture whose model ops carry their micro-batch (`mb`): a
        micro-batch's `mla_prolog` starts its next layer; its ops on the MoE stream end it."""
        if mb is None:
            return
        if not moe and name == "mla_prolog":
            i = self.mb_layer[mb] = self.mb_layer.get(mb, -1) + 1
            while len(self.moe_layers) <= i:
                self.moe_layers.append(["dense", {}])
        elif moe and mb in self.mb_layer:
            layer = self.moe_layers[self.mb_layer[mb]]
            layer[1][mb] = finish
            if name in ("gate", "experts"):
                layer[0] = "moe"

    def _category(self, kind: str, ev: list, ends: dict) -> str:
        """One event's category; updates the step's phase (main model or MTP)."""
        if kind == "op":
            name = ev[4]
            if name == "embed":
                self.phase = "main"
            elif name == "mtp_in":
                self.phase = "mtp"
            cat = OP_CATEGORY.get(name, "other")
        elif kind == "after":
            cat = CALL_CATEGORY.get(ends.get((ev[4], ev[5]), ""), "other")
        else:
            cat = "other"
        return "mtp" if self.phase == "mtp" else cat

    def close(self, finish: float, names: list[str]) -> StepTiles:
        main = self.streams[self.main]
        main.tile(finish, "other")
        span = finish - self.start
        compute = {names[sid]: s for sid, s in self.streams.items() if sid != self.main}
        if not compute:
            layers = [(k, v) for k, v in self.layers]
            return StepTiles(self.die, self.call, span, main.cats, layers)
        every = list(self.streams.values())  # main's own work too (none on a colocated step)
        cats = {c: math.fsum(s.cats[c] for s in every) for c in CATEGORIES}
        layers, prev = [], self.start
        for kind, ends in self.moe_layers:  # the last micro-batch's last MoE-stream event
            done = ends[max(ends)] if ends else prev
            layers.append((kind, done - prev))
            prev = done
        mine = [n for n in COMPUTE_STREAMS if n in compute]
        busy = {n: math.fsum(compute[n].cats.values()) for n in mine}
        idle = {n: compute[n].idle for n in mine}
        return StepTiles(self.die, self.call, span, cats, layers, busy, idle, max(self.embeds, 1))


def _is_head(ev: list) -> bool:
    """The head's first op (after the last layer): `lm_head`, or `norms` with count 1."""
    return ev[4] == "lm_head" or (ev[4] == "norms" and int(ev[8].get("count", 0)) == 1)


def tile_steps(result: Result, die: int) -> list[StepTiles]:
    """Every `step` call of `die`, tiled by its main stream, or by its compute streams on a
    two-stream step (module docstring)."""
    cap = result.capture
    streams = cap.streams[die]
    if "main" not in streams:
        return []
    main = streams.index("main")
    compute = {streams.index(n): n == MOE_STREAM for n in COMPUTE_STREAMS if n in streams}
    inner = {main, *compute}
    seq = [0] * len(streams)
    ends: dict[tuple[int, int], str] = {}  # (stream, seq) of each call end off main
    out: list[StepTiles] = []
    cur: _Step | None = None
    for ev in cap.events[die]:
        sid = ev[1]
        q = seq[sid]
        seq[sid] = q + 1
        kind = ev[0]
        if sid != main:
            if kind == "end":
                ends[(sid, q)] = ev[4]
            if cur is not None and sid in compute:
                finish = result.times(die, sid, q)[1]
                cur.on_compute(sid, compute[sid], kind, ev, finish, ends, inner)
            continue
        finish = result.times(die, main, q)[1]
        if kind == "begin" and ev[4] == STEP_CALL:
            cur = _Step(die, ev[5], finish, main)
        elif cur is None:
            continue
        elif kind == "end" and ev[4] == STEP_CALL:
            out.append(cur.close(finish, streams))
            cur = None
        else:
            cur.on_main(kind, ev, finish, ends, inner)
    return out


def decode_figures(result: Result) -> DecodeFigures:
    """The figures of the capture's `step` calls after its warm-up (DecodeFigures). Raises
    ProjectError if no step is left to count."""
    cap = result.capture
    tiles = [{t.step: t for t in tile_steps(result, d)} for d in range(cap.num_dies)]
    ids = sorted({s for per in tiles for s in per})
    counted = ids[cap.warmup() :]
    if not counted:
        raise ProjectError(
            f"capture {cap.path}: {len(ids)} '{STEP_CALL}' calls, none after the"
            f" {cap.warmup()} warm-up step(s)"
        )
    step_us, critical, layers, mtp = [], [], {"dense": [], "moe": [], "all": []}, []
    streams: dict[str, list[float]] = {n: [] for n in COMPUTE_STREAMS}
    for s in counted:
        spans = [(per[s].span_us, d) for d, per in enumerate(tiles) if s in per]
        us, d = max(spans, key=lambda x: (x[0], -x[1]))
        step_us.append(us)
        critical.append(d)
        t = tiles[d][s]
        for kind in ("dense", "moe"):
            vals = [v for k, v in t.layers if k == kind]
            if vals:
                layers[kind].append(math.fsum(vals) / len(vals))
        if t.layers:
            layers["all"].append(math.fsum(v for _, v in t.layers) / len(t.layers))
        mtp.append(t.by_category["mtp"])
        for n, busy in t.stream_us.items():
            streams[n].append(busy / (max(len(t.layers), 1) * t.microbatches))
    share: list[dict[str, float] | None] = []
    sums = []
    for per in tiles:
        mine = [per[s] for s in counted if s in per]
        if not mine:  # no counted step on this die (a split pod's expert die): left out
            share.append(None)
            continue
        total = math.fsum(t.tiled_us for t in mine)
        cat = {c: math.fsum(t.by_category[c] for t in mine) for c in CATEGORIES}
        sums.append({c: v / len(mine) for c, v in cat.items()})
        share.append({c: v / total if total else 0.0 for c, v in cat.items()})
    have = [s for s in share if s is not None]
    stream_us = {n: math.fsum(v) / len(v) for n, v in streams.items() if v}
    return DecodeFigures(
        steps=counted,
        step_us=step_us,
        critical=critical,
        step_p50_us=percentile(sorted(step_us), 50),
        layer_us={k: math.fsum(v) / len(v) if v else None for k, v in layers.items()},
        mtp_us=math.fsum(mtp) / len(mtp),
        share=share,
        mean_share={c: math.fsum(s[c] for s in have) / len(have) for c in CATEGORIES},
        mean_us={c: math.fsum(s[c] for s in sums) / len(sums) for c in CATEGORIES},
        stream_us=stream_us or None,
    )


__all__ = ["CALL_CATEGORY", "CATEGORIES", "COMPUTE_STREAMS", "MOE_STREAM", "OP_CATEGORY",
           "STEP_CALL", "DecodeFigures", "StepTiles", "decode_figures", "tile_steps"]  # fmt: skip
