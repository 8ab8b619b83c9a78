"""Decode steps at the papers' scale (docs/projection.md §6.3): a template step captured on a
small pod, synthesized for every die of the paper's pod (`bench.project.synth_decode`), sized by
the model card, replayed on the profile and composed into the model's step.

The template pod (`capture_template`) runs the toy model with the card's fan-out (256 experts
top-8, 8 groups / 4) but `TEMPLATE_LAYERS` layers, the first dense: one dense layer, three MoE
layers and the head (with MTP: the verify forward, then the MTP module's layer and head). Every
die of the synthesized pod runs that step with the workload's load (`scale_load`): its
requests, one row each or 1 + k with MTP, at the workload's context; the MTP sub-forward's rows
from the acceptance (1 + 1 for an accepted draft's request); each MoE layer's routing drawn per
(die, layer) uniformly or skewed (`bench.alltoall.inputs.routing`'s Zipf-like popularity),
mapped onto the paper's expert instances (`placement`). The replay's step is then composed into
the card's: per die, the step less its layers (the embedding, the heads, the MTP sub-forward)
plus `n_dense` times the dense layer and `n_moe` times the steady MoE layer (the mean of the
MoE layers after the first): `composed_us`. Every such figure is labelled with the profile, the
card, the routing, the context and the composition (`ASSUMPTIONS`).

Layouts (the shared expert and the redundant copies as the papers place them):
- `shared = "local"`: every die runs the shared expert after its combine (the toy's layout;
  DeepSeek's H800 deployment, 000 §3.5.1), the routed experts in block placement.
- `shared = "dispatched"`, 000 §4.1 (EP320: 256 routed, 32 redundant, 32 shared-expert copies,
  one per die) and 001 §7.1 (EP288: 256 routed, 32 dies with a shared copy and a redundant
  one): routed expert e on die e, the redundant copies of the `redundant` hottest experts on
  the dies after 256 (given one by one to the expert of the largest expected load per
  instance, EPLB's replication: `replicas`; a row of a replicated expert goes to its copy
  (row + die) mod copies), the shared copies on the last `shared` dies; every row is routed to
  its top-8 and to the shared copy of its die (d mod shared): top-9, the `shared_expert` op
  left out (its rows are experts' rows on the shared dies).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.alltoall.inputs import Point, routing
from bench.project.synth_decode import Load, Template, synthesize_decode, template_of
from comm.routing import Placement
from memory.layout import LAYOUT_VERSION
from runtime.decode.options import DecodeOptions
from runtime.decode.project import with_comm_widths
from runtime.model.card import CARDS, ModelCard, apply_card
from runtime.model.mtp import SpecConfig
from runtime.project import Profile, load_capture, replay, write_capture
from runtime.project.decode import CATEGORIES, decode_figures, tile_steps

TEMPLATE_LAYERS = 4  # one dense layer, three MoE layers
TEMPLATE_MODEL = "tiny"
MOE_CATEGORIES = ("gate", "dispatch", "experts", "combine", "shared")
ASSUMPTIONS = (
    "every MoE layer as the synthesized steady MoE layer (routing drawn per die and layer),"
    " every dense layer as the synthesized one; uniform context; MTP acceptance as the share"
    " of requests whose draft is accepted"
)


@dataclass(frozen=True)
class Workload:
    """One decode configuration at scale (a `bench.project.decode_points` point's workload)."""

    dies: int
    requests: int  # per die
    context: int
    mtp: int = 0  # MTP tokens per step (0 or 1)
    acceptance: float = 0.0
    routing: str = "uniform"  # or "skew"
    microbatches: int = 1
    card: str = "deepseek-v3"
    shared: str = "dispatched"  # "local" | "dispatched"
    shared_copies: int = 32
    redundant: int = 32
    seed: int = 0

    @classmethod
    def of(cls, w: dict) -> Workload:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in w.items() if k in names})

    def label(self, profile: str) -> str:
        mtp = f", MTP {self.mtp} at {self.acceptance:g}" if self.mtp else ""
        return (
            f"projected ({profile}, {self.card}, routing {self.routing}, context"
            f" {self.context}; EP{self.dies}, {self.requests} requests per die,"
            f" {self.microbatches} micro-batch(es){mtp}; synthesized)"
        )


def capture_template(directory: str | Path, microbatches: int = 1, mtp: int = 0,
                     dies: int = 2, seed: int = 0) -> Path:  # fmt: skip
    """A small capture pod's decode (the template): `dies` dies, one request per die and
    micro-batch, the toy model with the card's fan-out and `TEMPLATE_LAYERS` layers (the first
    dense), every draft accepted with MTP (its sub-forward's rows: 2 per request). Returns the
    raw capture's directory."""
    from runtime.decode.run import run_decode

    ov = {"seed": seed, "n_layers": TEMPLATE_LAYERS, "n_dense_layers": 1, "num_experts": 256,
          "topk": 8, "n_group": 8, "topk_group": 4}  # fmt: skip
    spec = SpecConfig(mtp, "synthetic", (1.0,) * mtp) if mtp else None
    opts = DecodeOptions(dies=dies, batch=dies * microbatches, prompt_len=16, steps=3,
                         model=TEMPLATE_MODEL, overrides=ov, project="host",
                         project_dir=str(directory), project_steps=3, microbatches=microbatches,
                         spec=spec, seed=seed)  # fmt: skip
    run_decode(opts)
    return Path(directory) / "raw"


def replicas(w: Workload, experts: int = 256, topk: int = 8) -> list[list[int]]:
    """Each routed expert's instances, the original first: the `redundant` copies go one by
    one to the expert of the largest expected load per instance (EPLB's replication step;
    the load counted over 4,096 sampled rows of the workload's routing). Instance ids: the
    expert itself, then `experts + j` for copy j."""
    out = [[e] for e in range(experts)]
    if w.shared == "local" or not w.redundant:
        return out
    pt = Point(1, 4096, 1, topk, experts, w.seed, routing=w.routing)
    load = np.bincount(routing(pt, 1 << 30)[0].ravel(), minlength=experts).astype(float)
    for j in range(w.redundant):
        e = int(np.argmax(load / np.array([len(c) for c in out])))
        out[e].append(experts + j)
    return out


def placement(w: Workload, experts: int = 256) -> tuple[Placement, int]:
    """(The expert instances' placement, top-k) of the workload's layout (module docstring)."""
    n = w.dies
    if w.shared == "local":
        return Placement.default(experts, tuple(range(n))), 8
    extra = n - experts
    if extra < max(1, w.shared_copies) or w.shared_copies < 1:
        raise ValueError(f"EP{n}: a dispatched shared expert needs more than {experts} dies")
    table = list(range(experts))
    table += [experts + j % extra for j in range(w.redundant)]
    table += [n - w.shared_copies + j for j in range(w.shared_copies)]
    return Placement.from_table(np.asarray(table), tuple(range(n))), 9


def scale_load(w: Workload, experts: int = 256, topk: int = 8) -> Load:
    """Every die's load (module docstring)."""
    place, k = placement(w, experts)
    reps = replicas(w, experts, topk)
    # the instance of (expert, copy): a row of a replicated expert to copy (row + die) mod n
    width = max(len(r) for r in reps)
    inst = np.array([[r[c % len(r)] for c in range(width)] for r in reps], np.int64)
    ncopy = np.array([len(r) for r in reps], np.int64)

    def route(d: int, i: int, rows: int) -> np.ndarray:
        # one popularity for every layer (the Point's seed), draws per (layer, die)
        pt = Point(w.dies, rows, 1, topk, experts, w.seed, routing=w.routing)
        idx = routing(pt, i * w.dies + d)[0]
        if w.shared == "local":
            return idx
        copy = (np.arange(rows)[:, None] + d) % ncopy[idx]
        idx = inst[idx, copy]
        shared = experts + w.redundant + d % w.shared_copies
        return np.concatenate([idx, np.full((rows, 1), shared, np.int64)], axis=1)

    accepted = round(w.acceptance * w.requests)
    mtp = [[2 if j < accepted else 1 for j in range(w.requests)] for _ in range(w.dies)]
    return Load(
        starts=[[w.context] * w.requests for _ in range(w.dies)],
        route=route,
        placement=place,
        topk=k,
        shared_dies=w.shared_copies if w.shared == "dispatched" else 0,
        mtp_tokens=mtp if w.mtp else None,
        tokens=1 + w.mtp,
    )


@dataclass(frozen=True)
class ScaleFigures:
    """A synthesized step's figures (µs), composed into the card's model (module docstring)."""

    label: str
    step_us: float  # composed: the card's step on its slowest die
    moe_layer_us: float  # the steady MoE layer on the composed step's die
    dense_layer_us: float
    rest_us: float  # embedding, heads, the MTP sub-forward
    mtp_us: float
    tokens_per_step: float
    breakdown_us: dict[str, float]  # composed, mean over dies
    stream_us: dict[str, float] | None  # each stream per micro-batch per layer (two streams)
    template_step_us: float  # the synthesized template step itself (p50 = its only step)
    events: int
    replay_s: float

    def share(self, *cats: str) -> float:
        total = math.fsum(self.breakdown_us.values())
        return 100.0 * math.fsum(self.breakdown_us[c] for c in cats) / total if total else 0.0

    @property
    def tpot_ms(self) -> float:
        return self.step_us / 1e3 / self.tokens_per_step


def project_scale(w: Workload, profile: Profile, template: Template, work: str | Path,
                  mtp_rows: bool = True) -> ScaleFigures:  # fmt: skip
    """Synthesize the workload's pod from `template`, size it by the card, replay it on
    `profile` and compose the card's step (module docstring); `mtp_rows` False: the verify
    rows only (a template without the MTP sub-forward)."""
    import time

    card = CARDS[w.card]
    work = Path(work)
    load = scale_load(w)
    if not mtp_rows:
        load = dataclasses.replace(load, mtp_tokens=None)
    raw = synthesize_decode(template, load, work / "raw",
                            workload={"scale": dataclasses.asdict(w)})  # fmt: skip
    cap = _sized(load_capture(raw, LAYOUT_VERSION), card, work / "sized")
    t0 = time.monotonic()
    res = replay(cap, profile)
    replay_s = time.monotonic() - t0
    return compose(res, w, card, profile.name, replay_s)


def _sized(raw, card: ModelCard, out: Path):
    hidden = int(raw.meta["config"]["a2a_hidden"])
    dies = [{"die": d, "streams": raw.streams[d],
             "events": apply_card(with_comm_widths(raw.events[d], hidden, card), card)}
            for d in range(raw.num_dies)]  # fmt: skip
    meta = {k: v for k, v in raw.meta.items() if k not in ("format", "version", "num_dies", "dies")}
    meta["card"] = {"name": card.name, **dataclasses.asdict(card)}
    write_capture(out, meta, dies)
    return load_capture(out, LAYOUT_VERSION)


def sized_capture(raw, card: ModelCard, out: Path):
    """A loaded capture's events sized by `card` (§6: the all-to-all's own ops given their
    widths, every model op and message at the card's sizes), written to `out` and loaded."""
    return _sized(raw, card, Path(out))


def compose(res, w: Workload, card: ModelCard, profile: str, replay_s: float = 0.0) -> ScaleFigures:
    """The card's step from the synthesized template step's replay (module docstring)."""
    n_dense, n_moe = card.n_dense_layers, card.n_layers - card.n_dense_layers
    best = None
    sums = dict.fromkeys(CATEGORIES, 0.0)
    dies = 0
    for d in range(res.capture.num_dies):
        tiles = tile_steps(res, d)
        if not tiles:
            continue
        t = tiles[-1]
        dense = [v for k, v in t.layers if k == "dense"]
        moe = [v for k, v in t.layers if k == "moe"]
        steady = moe[1:] or moe
        dense_us = math.fsum(dense) / len(dense) if dense else 0.0
        moe_us = math.fsum(steady) / len(steady) if steady else 0.0
        rest = t.span_us - math.fsum(v for _, v in t.layers)
        step = rest + n_dense * dense_us + n_moe * moe_us
        if best is None or step > best[0]:
            best = (step, moe_us, dense_us, rest, t.by_category["mtp"])
        f_moe = n_moe / len(moe) if moe else 0.0
        f_dense = n_dense / len(dense) if dense else 0.0
        f_all = (n_moe + n_dense) / len(t.layers) if t.layers else 0.0
        comp = {}
        for c in CATEGORIES:
            v = t.by_category[c]
            comp[c] = v * (f_moe if c in MOE_CATEGORIES else f_dense if c == "dense_ffn"
                           else f_all if c == "attention" else 1.0)  # fmt: skip
        for c in CATEGORIES:
            sums[c] += comp[c]
        dies += 1
    if best is None:
        raise ValueError("no die ran a step")
    fig = decode_figures(res)
    stream = getattr(fig, "stream_us", None)
    tps = 1.0 + w.mtp * w.acceptance
    return ScaleFigures(
        label=w.label(profile), step_us=best[0], moe_layer_us=best[1], dense_layer_us=best[2],
        rest_us=best[3], mtp_us=best[4], tokens_per_step=tps,
        breakdown_us={c: v / dies for c, v in sums.items()},
        stream_us=dict(stream) if stream else None, template_step_us=fig.step_p50_us,
        events=sum(len(e) for e in res.capture.events), replay_s=replay_s,
    )  # fmt: skip


def template_dir(root: str | Path, microbatches: int, mtp: int) -> Path:
    """A template capture under `root` (made once: `capture_template`)."""
    raw = Path(root) / f"template-mb{microbatches}-mtp{mtp}" / "raw"
    if not (raw / "meta.json").exists():
        capture_template(raw.parent, microbatches=microbatches, mtp=mtp)
    return raw


def capture_split_template(directory: str | Path, microbatches: int = 2, mtp: int = 0,
                           attention: int = 2, expert: int = 2, seed: int = 0) -> Path:  # fmt: skip
    """A small split capture pod's decode (`bench.project.synth_decode_split`'s template):
    `attention` + `expert` dies, one request per attention die and micro-batch, the toy model
    as `capture_template`'s, every draft accepted with MTP. Returns the raw capture's directory."""
    from runtime.decode.run import run_decode

    ov = {"seed": seed, "n_layers": TEMPLATE_LAYERS, "n_dense_layers": 1, "num_experts": 256,
          "topk": 8, "n_group": 8, "topk_group": 4}  # fmt: skip
    run_decode(DecodeOptions(
        dies=attention + expert, attention_dies=attention, expert_dies=expert,
        batch=attention * microbatches, prompt_len=16, steps=3, model=TEMPLATE_MODEL, overrides=ov,
        project="host", project_dir=str(directory), project_steps=3, microbatches=microbatches,
        spec=SpecConfig(mtp, "synthetic", (1.0,) * mtp) if mtp else None, seed=seed))  # fmt: skip
    return Path(directory) / "raw"


def split_template_dir(root: str | Path, microbatches: int, mtp: int) -> Path:
    """A split template capture under `root` (made once: `capture_split_template`)."""
    raw = Path(root) / f"split-template-mb{microbatches}-mtp{mtp}" / "raw"
    if not (raw / "meta.json").exists():
        capture_split_template(raw.parent, microbatches=microbatches, mtp=mtp)
    return raw


def project_workload(w: Workload, profile: Profile, templates: str | Path) -> ScaleFigures:
    """`project_scale` of `w` with its template (from `templates`, captured when missing).
    MTP with two micro-batches (xpod runs MTP on one stream): the verify forward through the
    two-stream template without MTP, plus the MTP sub-forward of the one-stream MTP template's
    synthesis of the same load (`ASSUMPTIONS`)."""
    with tempfile.TemporaryDirectory(prefix="xpod-decode-scale-") as tmp:
        if not (w.mtp and w.microbatches == 2):
            tpl = template_of(template_dir(templates, w.microbatches, w.mtp))
            return project_scale(w, profile, tpl, tmp)
        verify = project_scale(w, profile, template_of(template_dir(templates, 2, 0)), tmp,
                               mtp_rows=False)  # fmt: skip
        one = project_scale(w, profile, template_of(template_dir(templates, 1, w.mtp)),
                            Path(tmp) / "mtp")  # fmt: skip
        br = dict(verify.breakdown_us)
        br["mtp"] += one.breakdown_us["mtp"]
        return dataclasses.replace(
            verify, step_us=verify.step_us + one.mtp_us, rest_us=verify.rest_us + one.mtp_us,
            mtp_us=one.mtp_us, breakdown_us=br,
            label=verify.label + " (the MTP sub-forward on one stream)",
            events=verify.events + one.events, replay_s=verify.replay_s + one.replay_s,
        )  # fmt: skip


__all__ = ["ASSUMPTIONS", "ScaleFigures", "Workload", "capture_split_template",
           "capture_template", "compose", "placement", "project_scale", "project_workload",
           "scale_load", "sized_capture", "split_template_dir", "template_dir"]  # fmt: skip
