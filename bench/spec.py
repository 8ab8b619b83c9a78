"""`xpod bench engine --num-speculative-tokens K[,K2]`: the serving engine with MTP against the
same engine without it, same requests, same batch, same async depth (1: MTP plans
synchronously), in one run.

Per k: `repeat` alternating pairs (without MTP, then with), each the same `waves x batch`
requests at saturation (`ignore_eos`, fixed lengths, the balancer holding the surplus); the
run without MTP gives the transcript the oracle / synthetic drafts read and the tokens the MTP
run is compared with. Figures (issue 31's keys): the drafts and their acceptance (from the
masters' counters, what `/metrics` exports), the step time with and without MTP (the masters'
per-step die times, p50), their ratio and the MTP part, output tokens/s and the speedup against
the predicted one (`mean_acceptance_length / step_ratio`), whether every request's tokens equal
the run without MTP, and the schedule replay of a short MTP run (default mode: bit-equal?).
"""

from __future__ import annotations

import time

import numpy as np

from bench.common import progress
from runtime.decode import make_prompts
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay_engine
from runtime.engine.spec_stats import spec_summary
from runtime.model.mtp import SpecConfig
from sched import SamplingParams


def _median(values) -> float:
    return float(np.median(values)) if len(values) else 0.0


def _run(cfg: EngineConfig, prompts, params, transcripts=None, warm=None) -> dict:
    """One engine: warm-up, then the requests; tokens, tokens/s, the step times, spec stats.
    `warm`: the warm-up requests' transcripts (oracle / synthetic drafts read them too)."""
    with Engine.launch(cfg) as eng:
        warmed = eng.generate(prompts[: max(1, cfg.dies)],
                              SamplingParams(max_tokens=4, ignore_eos=True),
                              transcripts=warm)  # fmt: skip
        t0 = time.monotonic()
        outs = eng.generate(prompts, params, transcripts=transcripts, timeout_s=600)
        wall = time.monotonic() - t0
    spec = spec_summary(eng.stats, cfg.speculative)  # the masters' final stats (after close)
    steps = [v for s in eng.stats.values() for v in s.get("step_ms", [])]
    busy = sum(s.get("busy_steps", 0) for s in eng.stats.values())
    tokens = [o.token_ids for o in outs]
    return {"tokens": tokens, "tokens_per_s": sum(map(len, tokens)) / wall, "wall_s": wall,
            "step_ms": _median(steps), "busy_steps": busy, "spec": spec,
            "warm": [o.token_ids for o in warmed]}  # fmt: skip


def run_spec(opts, engine_config, spec_tokens: list[int], draft: str) -> dict:
    """Every k of `spec_tokens` (bench.engine's options and its engine_config)."""
    from runtime.model.mtp import parse_draft

    name, rates = parse_draft(draft)
    prompts = make_prompts(opts.waves * opts.batch, opts.prompt_len, opts.seed)
    params = SamplingParams(max_tokens=opts.steps, ignore_eos=True)
    rows = []
    for k in spec_tokens:
        spec = SpecConfig(k, name, rates)
        base_cfg = engine_config(opts, async_depth=1)
        mtp_cfg = engine_config(opts, async_depth=1, speculative=spec)
        pairs = []
        for i in range(opts.repeat):
            progress(f"xpod bench engine: MTP k={k} {spec.label}: pair {i + 1} of {opts.repeat},"
                     " without MTP ...")  # fmt: skip
            b = _run(base_cfg, prompts, params)
            progress("  with MTP ...")
            tr = spec.transcript
            m = _run(mtp_cfg, prompts, params, b["tokens"] if tr else None,
                     b["warm"] if tr else None)  # fmt: skip
            pairs.append((b, m))
        rows.append(_figures(spec, pairs, opts))
        progress(f"  MTP k={k}: speedup {rows[-1]['speedup']:.2f}x (predicted"
                 f" {rows[-1]['predicted_speedup'] or 0:.2f}x)")  # fmt: skip
    progress("xpod bench engine: the schedule replay of a short MTP run ...")
    replayed = _replay(opts, engine_config, SpecConfig(max(spec_tokens), name, rates))
    for r in rows:
        r["replay_bit_equal"] = replayed
    return {"bench": "engine-mtp", "dies": opts.dies, "batch": opts.batch,
            "prompt_len": opts.prompt_len, "steps": opts.steps, "waves": opts.waves,
            "repeat": opts.repeat, "model": opts.model, "rows": rows}  # fmt: skip


def _figures(spec: SpecConfig, pairs: list, opts) -> dict:
    """One k's figures: the median pair (by the speedup) and every pair's speedup."""
    speedups = [m["tokens_per_s"] / b["tokens_per_s"] for b, m in pairs]
    b, m = pairs[int(np.argsort(speedups)[len(speedups) // 2])]
    st = m["spec"]
    ratio = m["step_ms"] / b["step_ms"] if b["step_ms"] else None
    mtp_ms = st["mtp_s"] * 1e3 / max(m["busy_steps"], 1)
    mal = st["mean_acceptance_length"]
    identical = all(x == y for x, y in zip(m["tokens"], b["tokens"], strict=True))
    return {
        **{k: st[k] for k in ("spec_tokens", "draft_mode", "num_drafts", "num_draft_tokens",
                              "num_accepted_tokens", "acceptance_rate", "acceptance_per_pos",
                              "mean_acceptance_length")},  # fmt: skip
        "tokens_per_step": (sum(map(len, m["tokens"])) - len(m["tokens"]))
        / max(st["verify_rows"], 1),
        "step_ms": m["step_ms"], "step_ms_no_mtp": b["step_ms"], "step_ratio": ratio,
        "mtp_ms_per_step": mtp_ms,
        "verify_ratio": (m["step_ms"] - mtp_ms) / b["step_ms"] if b["step_ms"] else None,
        "tokens_per_s": m["tokens_per_s"], "tokens_per_s_no_mtp": b["tokens_per_s"],
        "speedup": m["tokens_per_s"] / b["tokens_per_s"],
        "predicted_speedup": mal / ratio if mal and ratio else None,
        "speedup_pairs": [round(x, 4) for x in speedups],
        "tokens_identical": identical,
        "batch_invariant": bool((opts.overrides or {}).get("batch_invariant")),
    }  # fmt: skip


def _replay(opts, engine_config, spec: SpecConfig) -> bool:
    """A short logged MTP run (fit drafts: no transcript needed) replayed bit for bit."""
    prompts = make_prompts(opts.batch, opts.prompt_len, opts.seed + 1)
    cfg = engine_config(opts, async_depth=1, log_steps=True, keep_logits=True,
                        speculative=SpecConfig(spec.k, "fit"))  # fmt: skip
    with Engine.launch(cfg) as eng:
        eng.generate(prompts, SamplingParams(max_tokens=min(opts.steps, 16), ignore_eos=True))
    return replay_engine(cfg, eng.step_log).bit_equal


def print_spec(res: dict) -> None:
    print(f"\nxpod bench engine with MTP: {res['dies']} dies, batch {res['batch']} (x"
          f" {res['waves']} waves), prompt {res['prompt_len']}, {res['steps']} tokens,"
          f" {res['repeat']} pair(s) per k; async depth 1 both")  # fmt: skip
    cols = ("k", "draft", "accept", "mean_len", "step_ms", "no_mtp", "ratio", "mtp_ms",
            "tok/s", "no_mtp", "speedup", "predicted", "identical")  # fmt: skip
    print("  " + " ".join(f"{c:>10}" for c in cols))
    for r in res["rows"]:
        vals = (r["spec_tokens"], r["draft_mode"], f"{r['acceptance_rate'] or 0:.3f}",
                f"{r['mean_acceptance_length'] or 0:.3f}", f"{r['step_ms']:.2f}",
                f"{r['step_ms_no_mtp']:.2f}", f"{r['step_ratio'] or 0:.2f}",
                f"{r['mtp_ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}",
                f"{r['tokens_per_s_no_mtp']:.0f}", f"{r['speedup']:.2f}x",
                f"{r['predicted_speedup'] or 0:.2f}x", str(r["tokens_identical"]))  # fmt: skip
        print("  " + " ".join(f"{v:>10}" for v in vals))
    if res["rows"]:
        print(
            f"  schedule replay of a short MTP run: bit-equal {res['rows'][0]['replay_bit_equal']}"
        )


__all__ = ["print_spec", "run_spec"]
