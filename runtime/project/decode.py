"""The figures of a projected decode capture (docs/projection.md §6): step time, per-layer
time, and where a step's time goes.

A decode capture (`xpod decode --project`) records each decode step as a call `step` on every
die's `main` stream, and every compute op of the step on `main` with its name
(`runtime.model.card`): a forward is `embed`, then per layer `mla_prolog`, `mla`, `o_proj`,
`norms`, and either `dense_ffn` or `gate`, the `dispatch` call, `experts`, the `combine` call,
`shared_expert`; then the head (`norms` with `count` 1, `lm_head`, `sample`). An MTP
sub-forward starts with `mtp_in` instead of `embed`. The collectives run on their own stream
(`a2a`); `main` waits for each call's `end` with an `after` event.

A die's step is tiled by its `main` stream: each event of the step owns the time from the
previous event's finish to its own (a wait for a collective is the `after` that waits for its
end, so it belongs to that collective: its launch, its own work, and the time it waited for the
slowest peer). The tiles sum to the step's span, `begin` to `end` (a `step` begin costs
nothing). Categories (`CATEGORIES`): `attention` (mla_prolog, mla, o_proj), `gate`, `dispatch`,
`experts` (the routed experts), `combine`, `shared` (the shared expert), `dense_ffn`, `mtp`
(every tile of the MTP sub-forwards, their collectives included), `other` (embedding, norms,
LM head, sampling, the rest).

Imports nothing of xpod but this package (like all of `runtime.project`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runtime.project.errors import ProjectError
from runtime.project.result import Result, percentile

STEP_CALL = "step"
CATEGORIES = ("attention", "gate", "dispatch", "experts", "combine", "shared", "dense_ffn", "mtp",
              "other")  # fmt: skip
OP_CATEGORY = {"mla_prolog": "attention", "mla": "attention", "o_proj": "attention",
               "gate": "gate", "experts": "experts", "shared_expert": "shared",
               "dense_ffn": "dense_ffn"}  # fmt: skip
CALL_CATEGORY = {"dispatch": "dispatch", "combine": "combine", "a2e": "dispatch", "e2a": "combine"}


@dataclass(frozen=True, slots=True)
class StepTiles:
    """One die's decode step, tiled (module docstring): its span, µs per category, and each
    main-model layer's µs in order as (kind, µs), kind "dense" or "moe"."""

    die: int
    step: int
    span_us: float
    by_category: dict[str, float]
    layers: list[tuple[str, float]]


@dataclass(frozen=True, slots=True)
class DecodeFigures:
    """The figures of the counted steps (after the capture's warm-up), µs.

    step_us[i]: counted step i's latency, the max over dies of their spans (its die:
    critical[i]); step_p50_us: their p50. layer_us: the mean per main-model layer of each kind
    ("dense", "moe") and of all ("all") on each step's critical die, averaged over the counted
    steps (None: no layer of that kind). mtp_us: the `mtp` tiles per step on the critical die,
    averaged. share[d]: die d's µs per category over its counted steps' spans; mean_share: the
    mean over dies; mean_us: µs per step per category, mean over dies and steps."""

    steps: list[int]
    step_us: list[float]
    critical: list[int]
    step_p50_us: float
    layer_us: dict[str, float | None]
    mtp_us: float
    share: list[dict[str, float]]
    mean_share: dict[str, float]
    mean_us: dict[str, float]


def tile_steps(result: Result, die: int) -> list[StepTiles]:
    """Every `step` call of `die`, tiled by its main stream (module docstring)."""
    cap = result.capture
    streams = cap.streams[die]
    if "main" not in streams:
        return []
    main = streams.index("main")
    seq = [0] * len(streams)
    ends: dict[tuple[int, int], str] = {}  # (stream, seq) of each call end on other streams
    out: list[StepTiles] = []
    cur = None  # the open step: [call, start, by_category, layers, phase, layer]
    prev = 0.0
    for ev in cap.events[die]:
        sid = ev[1]
        q = seq[sid]
        seq[sid] = q + 1
        kind = ev[0]
        if sid != main:
            if kind == "end":
                ends[(sid, q)] = ev[4]
            continue
        finish = result.times(die, main, q)[1]
        if kind == "begin" and ev[4] == STEP_CALL:
            cur = [ev[5], finish, dict.fromkeys(CATEGORIES, 0.0), [], "main", None]
            prev = finish
            continue
        if cur is None:
            continue
        tile, prev = finish - prev, finish
        if kind == "end" and ev[4] == STEP_CALL:
            cur[2]["other"] += tile
            span = finish - cur[1]
            out.append(StepTiles(die, cur[0], span, cur[2], [(k, v) for k, v in cur[3]]))
            cur = None
            continue
        cat = _category(cur, kind, ev, ends)
        cur[2][cat] += tile
        if cur[4] == "main" and cur[5] is not None:
            cur[3][cur[5]][1] += tile
    return out


def _category(cur: list, kind: str, ev: list, ends: dict) -> str:
    """The category of one main-stream event of an open step; updates the step's phase (main
    model or MTP) and its current layer."""
    if kind == "op":
        name = ev[4]
        if name == "embed":
            cur[4], cur[5] = "main", None
        elif name == "mtp_in":
            cur[4], cur[5] = "mtp", None
        elif cur[4] == "main" and name == "mla_prolog":
            cur[3].append(["dense", 0.0])
            cur[5] = len(cur[3]) - 1
        elif cur[4] == "main" and name in ("gate", "experts") and cur[5] is not None:
            cur[3][cur[5]][0] = "moe"
        elif name == "lm_head" or (name == "norms" and int(ev[8].get("count", 0)) == 1):
            cur[5] = None  # the head: after the last layer
        cat = OP_CATEGORY.get(name, "other")
    elif kind == "after":
        cat = CALL_CATEGORY.get(ends.get((ev[4], ev[5]), ""), "other")
    else:
        cat = "other"
    return "mtp" if cur[4] == "mtp" else cat


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
    share, sums = [], []
    for per in tiles:
        mine = [per[s] for s in counted if s in per]
        total = math.fsum(t.span_us for t in mine)
        cat = {c: math.fsum(t.by_category[c] for t in mine) for c in CATEGORIES}
        sums.append({c: v / len(mine) for c, v in cat.items()} if mine else None)
        share.append({c: v / total if total else 0.0 for c, v in cat.items()})
    have = [s for s in sums if s is not None]
    return DecodeFigures(
        steps=counted,
        step_us=step_us,
        critical=critical,
        step_p50_us=percentile(sorted(step_us), 50),
        layer_us={k: math.fsum(v) / len(v) if v else None for k, v in layers.items()},
        mtp_us=math.fsum(mtp) / len(mtp),
        share=share,
        mean_share={c: math.fsum(s[c] for s in share) / len(share) for c in CATEGORIES},
        mean_us={c: math.fsum(s[c] for s in have) / len(have) for c in CATEGORIES},
    )


__all__ = ["CALL_CATEGORY", "CATEGORIES", "OP_CATEGORY", "STEP_CALL", "DecodeFigures",
           "StepTiles", "decode_figures", "tile_steps"]  # fmt: skip
