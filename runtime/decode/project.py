"""`xpod decode --project PROFILE [--model-card CARD] [--context N] [--project-trace F]`: the
decode step projected on a hardware profile (docs/projection.md §6, docs/usage.md).

After the measured run, a fresh capture pod (`PodConfig(capture=True)`, one host) runs the same
decode configuration for a prefill and `--project-steps` decode steps (default 3; the first is a
warm-up, left out), each die recording every step as a call `step` on its main stream and
every op and collective of it (`runtime.model.card.record`, `comm.capture`). The capture is
written (`raw/`), every die's events are sized by the model card with the uniform context
(`runtime.model.card.apply_card`) and written as a capture of their own (`projected/`, meta
`card`), which is replayed on the profile (`runtime.project.replay`) and tiled into the decode
figures (`runtime.project.decode`). With MTP the capture runs the speculative step
(`spec_decode_main`), so the verify rows and the MTP sub-forwards are in it, with the measured
run's transcript for the oracle / synthetic drafts. With `--microbatches 2` (colocated) the
capture runs the micro-batched step (`runtime.model.pipeline`: its ops on streams s0 / s1),
which the figures tile stream by stream (`projected_stream_us`; a layer is the step's critical
path through s1). The caller (`run_decode`, `run_spec_decode`) says what to capture: the
function the dies run, its spec, the pod's shape.

With `--model-card CARD` the run's model (measured and captured alike) has the card's
structure (`runtime.model.card.with_structure`: its layers, dense layers, experts, top-k and
groups; the preset's widths), so that a layer of the run is a layer of the card.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memory.errors import ConfigError
from memory.layout import LAYOUT_VERSION
from runtime.decode.options import DecodeOptions, progress
from runtime.model import ModelConfig
from runtime.model.card import (
    CARDS,
    COMM_OPS,
    ModelCard,
    apply_card,
    card_of,
    structure,
    with_structure,
)
from runtime.model.forward import prepared_for_fork
from runtime.pod import Pod
from runtime.pod.capture import write_capture as write_pod_capture
from runtime.pod.config import PodConfig
from runtime.project import (
    CONTENTION_MODEL,
    Capture,
    Profile,
    ProjectError,
    load_capture,
    load_profile,
    replay,
    write_capture,
    write_trace,
)
from runtime.project.decode import CATEGORIES, STEP_CALL, DecodeFigures, decode_figures

PROJECT_STEPS = 3  # decode steps of the capture pod (default)
WARMUP_STEPS = 1  # the first decode step: left out of the figures
TOY = "toy"  # --model-card toy: the run's own widths (the default)
ROUTING = {"none": "toy gate", "random": "toy gate + random bias", "skew": "toy gate + skew bias"}
CAPTURE_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class DecodeProjection:
    """A checked `--project`: the profile, the card (None: the toy's own), the uniform
    context (None: each row's own), the capture's decode steps."""

    profile: Profile
    card: ModelCard | None
    context: int | None
    steps: int

    def card_name(self) -> str:
        return self.card.name if self.card is not None else TOY


def card_model(opts: DecodeOptions, model: ModelConfig) -> ModelConfig:
    """`model` with `--model-card`'s structure (unchanged for none or `toy`). ConfigError for an
    unknown card, or a structure flag (--experts, --groups) that disagrees with the card."""
    name = opts.model_card
    if name is None or name == TOY:
        return model
    if name not in CARDS:
        raise ConfigError(
            f"argument --model-card: unknown card {name!r}; cards: {', '.join([TOY, *CARDS])}"
        )
    card = CARDS[name]
    for key, want in structure(card).items():
        got = opts.overrides.get(key)
        if got is not None and got != want:
            raise ConfigError(
                f"argument --model-card: card {name} has {key} = {want}; the flags set {got}"
                " (drop --experts / --groups: the card gives the structure)"
            )
    return with_structure(model, card)


def check_projection(opts: DecodeOptions, model: ModelConfig) -> DecodeProjection | None:
    """The checked projection flags (None without --project), before any pod starts: the
    profile loads, has every constant the card's ops need, the pod can hold the card's
    structure (`model` is the run's, `card_model` applied). ConfigError names the flag."""
    if opts.project is None:
        for flag, v in (("--model-card", opts.model_card), ("--context", opts.context),
                        ("--project-trace", opts.project_trace),
                        ("--project-dir", opts.project_dir)):  # fmt: skip
            if v is not None:
                raise ConfigError(f"argument {flag}: only with --project PROFILE")
        return None
    try:
        profile = load_profile(opts.project)
    except ProjectError as e:
        raise ConfigError(f"argument --project: {e}") from None
    if opts.eplb != "off":
        raise ConfigError("argument --project: with --eplb the expert placement moves during"
                          " the run; project without EPLB")  # fmt: skip
    if opts.context is not None and opts.context < 1:
        raise ConfigError(f"argument --context: {opts.context} must be >= 1")
    if opts.project_steps < WARMUP_STEPS + 1:
        raise ConfigError(f"argument --project-steps: {opts.project_steps} must be >= "
                          f"{WARMUP_STEPS + 1} (the first decode step is a warm-up)")  # fmt: skip
    if opts.spec is not None and opts.project_steps > opts.steps:
        raise ConfigError(
            f"argument --project-steps: with MTP the capture runs at most the measured run's"
            f" steps (its pod, its KV and its transcript); --steps is {opts.steps}"
        )
    card = None if opts.model_card in (None, TOY) else CARDS[opts.model_card]
    if profile.is_host and (card is not None or opts.context is not None):
        raise ConfigError("argument --model-card/--context: the host profile charges each"
                          " event its time here: a card or a context changes nothing")  # fmt: skip
    try:
        model.validate(opts.dies, opts.expert_dies or None)  # a split pod: its expert dies
    except ConfigError as e:
        raise ConfigError(f"argument --model-card/--dies: {e}") from None
    if not profile.is_host:
        _needs(profile, card or card_of(model))
    return DecodeProjection(profile, card, opts.context, opts.project_steps)


def _needs(profile: Profile, card: ModelCard) -> None:
    """Refuse a profile that lacks a constant the card's ops need (named, with the ops)."""
    wd = card.weight_dtype
    keys = {
        "die.hbm_gbps": "every op",
        "efficiency.vector_memory": "embed, norms, sample",
        "die.bf16_tflops": "mla",
        "efficiency.mla_compute": "mla",
        "efficiency.mla_memory": "mla",
        f"die.{wd}_tflops": f"the {wd} weight ops (mla_prolog, o_proj, gate, experts, ...)",
        f"efficiency.gemm_{wd}": f"the {wd} weight ops (mla_prolog, o_proj, gate, experts, ...)",
    }
    for key, ops in keys.items():
        try:
            profile.get(key)
        except ProjectError as e:
            hint = " (--model-card deepseek-v3 has INT8 weights)" if card.name == TOY else ""
            raise ConfigError(f"argument --project: {e}: card {card.name}'s {ops}{hint}") from None


def routing_of(model: ModelConfig) -> str:
    """How the run routes, for the label: the toy's gate and its score bias."""
    return ROUTING.get(model.score_bias, f"toy gate + {model.score_bias} bias")


def label(profile: str, card: str, routing: str, context: int | None) -> str:
    """`projected (PROFILE, CARD, routing ROUTING, context N)`: every projected figure's."""
    ctx = "as run" if context is None else str(context)
    return f"projected ({profile}, {card}, routing {routing}, context {ctx})"


# -- the capture pod ------------------------------------------------------------------------------


def _run_capture(cfg: PodConfig, model: ModelConfig, fn: Callable[..., dict], spec: Any, out: Path,
                 workload: dict) -> float:  # fmt: skip
    """Run `fn(die, spec)` on a fresh capture pod of `cfg`'s shape (one host), write its
    capture to `out`; the mean tokens per request per decode step of the run."""
    cfg = cfg.replace(capture=True, trace=False, hosts=(), fabric="auto", host_names=(),
                      net_if="")  # fmt: skip
    with prepared_for_fork(model):
        pod_cm = Pod.launch(cfg)
    with pod_cm as pod:
        res = pod.run(fn, spec, timeout_s=CAPTURE_TIMEOUT_S)
        write_pod_capture(pod, out, workload, [STEP_CALL], warmup=WARMUP_STEPS)
    res = [r for r in res if r.get("role") != "expert"]
    emitted = sum(len(t) - 1 for r in res for t in r["tokens"])  # after the prefill's token
    rows = sum(len(r["request_ids"]) for r in res) * spec.steps
    return emitted / rows if rows else 1.0


def _sized(raw: Capture, out: Path, proj: DecodeProjection, model: ModelConfig,
           routing: str) -> Capture:  # fmt: skip
    """The capture with every die's events sized by the card and the context, written to
    `out` (its meta: `card`, and the workload's card / context / routing); loaded back."""
    card = proj.card or card_of(model)
    hidden = int(raw.meta.get("config", {}).get("a2a_hidden") or model.hidden)
    dies = []
    for d in range(raw.num_dies):
        events = raw.events[d]  # the toy's own card: the all-to-all's ops as recorded
        if proj.card is not None:
            events = with_comm_widths(events, hidden, card)
        dies.append({"die": d, "streams": raw.streams[d],
                     "events": apply_card(events, card, proj.context)})  # fmt: skip
    meta = {k: v for k, v in raw.meta.items() if k not in ("format", "version", "num_dies", "dies")}
    ctx = proj.context
    meta["workload"] = {
        **raw.meta.get("workload", {}),
        "card": proj.card_name(),
        "context": "as run" if ctx is None else ctx,
        "routing": routing,
    }
    meta["card"] = {"name": proj.card_name(), "context": ctx, "from": str(raw.path),
                    **dataclasses.asdict(card)}  # fmt: skip
    write_capture(out, meta, dies)
    return load_capture(out, LAYOUT_VERSION)


def with_comm_widths(events: list[list], hidden: int, card: ModelCard) -> list[list]:
    """The all-to-all's own ops (`COMM_OPS`) with a width in their dims where the protocol
    left it out (fused's `assemble` / `weighted_sum`), so that `apply_card` scales them to the
    card (by the card's hidden over `dims.hidden`): `weighted_sum` reads 2-byte rows of the
    run's hidden; `assemble` copies dispatch rows, so its width is the one that scales the
    run's row stride (its bytes over its rows) to the card's dispatch row."""
    out = []
    for ev in events:
        if ev[0] == "op" and ev[4] in COMM_OPS and "hidden" not in ev[8]:
            rows = int(ev[8].get("rows", 0))
            width = hidden
            if ev[4] == "assemble" and rows and card.dispatch_row_bytes:
                width = ev[6] / rows * card.hidden / card.dispatch_row_bytes
            ev = [*ev[:8], {**ev[8], "hidden": width}]
        out.append(ev)
    return out


def project_decode(opts: DecodeOptions, model: ModelConfig, fn: Callable[..., dict], spec: Any,
                   cfg: PodConfig) -> dict:  # fmt: skip
    """Capture, size, replay and tile the decode (module docstring); the summary's projected
    keys (docs/usage.md). The caller says what to capture: `fn(die, spec)` run on a capture
    pod of `cfg`'s shape, its `spec.steps` decode steps each a call `step` (`decode_main` or
    `spec_decode_main` with the run's requests, `--project-steps` steps); `model`: the run's
    (the card's structure; its MTP module with --num-speculative-tokens). A refusal of the
    replay (a constant the profile lacks for an event) is returned as `projection_refused`."""
    proj = check_projection(opts, model)
    steps = spec.steps
    routing = routing_of(model)
    lbl = label(proj.profile.name, proj.card_name(), routing, proj.context)
    mtp = opts.spec
    workload = {
        "bench": "decode", "model": opts.model, "layers": model.n_layers,
        "dense_layers": model.n_dense_layers, "experts": model.num_experts, "topk": model.topk,
        "dies": opts.dies, "batch": opts.batch, "prompt_len": opts.prompt_len,
        "steps": steps, "warmup_steps": WARMUP_STEPS, "protocol": opts.protocol,
        "quant": opts.quant or "none", "combine_dtype": opts.combine_dtype,
        "score_bias": model.score_bias, "routing": routing, "seed": opts.seed,
        "temperature": opts.temperature, "mtp_k": mtp.k if mtp is not None else 0,
        "mtp_draft": mtp.label if mtp is not None else None,
        "microbatches": opts.microbatches,
    }  # fmt: skip
    progress(f"  {lbl}: capture pod of {steps} decode steps (the first a warm-up) ...")
    with tempfile.TemporaryDirectory(prefix="xpod-decode-capture-") as tmp:
        root = Path(opts.project_dir) if opts.project_dir else Path(tmp)
        t0 = time.monotonic()
        tps = _run_capture(cfg, model, fn, spec, root / "raw", workload)
        t1 = time.monotonic()
        raw = load_capture(root / "raw", LAYOUT_VERSION)
        cap = raw
        if proj.card is not None or proj.context is not None:
            cap = _sized(raw, root / "projected", proj, model, routing)
        try:
            res = replay(cap, proj.profile)
            fig = decode_figures(res)
        except ProjectError as e:  # a constant an event needs (the ops' were checked before)
            progress(f"  {lbl}: refused: {e}")
            return {"profile": proj.profile.name, "profile_sha256": proj.profile.sha256,
                    "projection_label": lbl, "projection_refused": str(e)}  # fmt: skip
        if opts.project_trace:
            write_trace(res, opts.project_trace)
            progress(f"  wrote the projected trace to {opts.project_trace}")
        replay_s = time.monotonic() - t1
        where = str(cap.path) if opts.project_dir else None
    out = fields(fig, proj, lbl, routing, tps, model)
    out.update(projection_capture_s=round(t1 - t0, 3), projection_replay_s=round(replay_s, 3))
    if where is not None:
        out["projection_capture"] = where
    return out


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(float(x), nd) + 0.0


def fields(fig: DecodeFigures, proj: DecodeProjection, lbl: str, routing: str, tps: float,
           model: ModelConfig) -> dict:  # fmt: skip
    """The summary's projected keys (docs/usage.md, "Projected decode")."""
    prof = proj.profile
    try:
        gap = None if prof.is_host else prof.get("runtime.iteration_gap_ms")
    except ProjectError:
        gap = None
    step_ms = fig.step_p50_us / 1e3
    return {
        "profile": prof.name, "profile_sha256": prof.sha256, "projection_label": lbl,
        "projection_card": proj.card_name(), "projection_routing": routing,
        "projection_context": proj.context, "projection_model": CONTENTION_MODEL,
        "projection_steps": fig.steps, "projection_critical_dies": fig.critical,
        "projected_step_ms": _r(step_ms),
        "projected_step_ms_per_step": [_r(u / 1e3) for u in fig.step_us],
        "projected_layer_us": {k: _r(v) for k, v in fig.layer_us.items()},
        "projected_layers": {"dense": model.n_dense_layers,
                             "moe": model.n_layers - model.n_dense_layers},
        "projected_mtp_ms": _r(fig.mtp_us / 1e3) if model.mtp_layers else None,
        "projected_tokens_per_step": _r(tps),
        "projected_tpot_ms": _r(step_ms / tps),
        "projected_iteration_gap_ms": gap,
        "projected_tpot_with_gap_ms": None if gap is None else _r((step_ms + gap) / tps),
        "projected_breakdown": {
            "mean": {c: _r(fig.mean_share[c]) for c in CATEGORIES},
            "per_die": [None if s is None else {c: _r(s[c]) for c in CATEGORIES}
                        for s in fig.share],
        },
        "projected_breakdown_us": {c: _r(fig.mean_us[c]) for c in CATEGORIES},
        "projected_stream_us": None if fig.stream_us is None else
                               {k: _r(v) for k, v in fig.stream_us.items()},
    }  # fmt: skip


def print_projection(s: dict) -> None:
    """The projected figures, every line labelled."""
    lbl = s["projection_label"]
    if s.get("projection_refused"):
        print(f"\n{lbl}: refused: {s['projection_refused']}")
        return
    gap = s["projected_iteration_gap_ms"]
    with_gap = "" if gap is None else (f"; with the profile's {gap:g} ms iteration gap"
                                       f" {s['projected_tpot_with_gap_ms']:.2f} ms")  # fmt: skip
    print(f"\n{lbl}:")
    print(f"  step {s['projected_step_ms']:.3f} ms (p50 over steps {s['projection_steps']}),"
          f" {s['projected_tokens_per_step']:.3f} tokens per step: TPOT"
          f" {s['projected_tpot_ms']:.3f} ms{with_gap}")  # fmt: skip
    lay = s["projected_layer_us"]
    parts = [f"{k} {lay[k]:.1f} us" for k in ("dense", "moe", "all") if lay[k] is not None]
    mtp = f"; MTP {s['projected_mtp_ms']:.3f} ms per step" if s["projected_mtp_ms"] else ""
    print(f"  per layer (the step's slowest die): {', '.join(parts)}{mtp}")
    streams = s.get("projected_stream_us")
    if streams:
        parts = [f"{k} {v:.1f} us" for k, v in streams.items()]
        print(f"  per stream, busy per micro-batch per layer: {', '.join(parts)}")
    mean = s["projected_breakdown"]["mean"]
    us = s["projected_breakdown_us"]
    parts = [f"{c} {100 * mean[c]:.1f} % ({us[c] / 1e3:.3f} ms)" for c in CATEGORIES if us[c]]
    what = "share and ms per step" + (" of s0 + s1 stream time" if streams else "")
    print(f"  breakdown (mean over dies, {what}): {', '.join(parts)}")
    print(f"  contention model: {s['projection_model']}")
    print(f"  profile {s['profile']} sha256 {s['profile_sha256']}")


__all__ = ["PROJECT_STEPS", "DecodeProjection", "card_model", "check_projection", "fields",
           "label", "print_projection", "project_decode", "routing_of",
           "with_comm_widths"]  # fmt: skip
