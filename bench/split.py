"""`xpod bench engine --attention-dies A --expert-dies E --domains 1,2,3 --microbatches 1,2`:
MoE-attention disaggregation, every (domains, micro-batches) shape in one run.

Per shape, same prompts, same machine state (compare within the run):
1. `xpod decode` on the split pod: tokens/s, TPOT p50 / p99, the expert dies' idle share (waiting
   for A2E input, their own counters), the phase times of every die;
2. the serving engine on the split pod at saturation: tokens/s against decode, the per-role time
   shares, the expert idle share, A2E / E2A ms per step (`Engine.split_stats`);
then the step model (`runtime.decode.step_model`): each shape's step predicted from the other
shapes' measured phase times (leave one out), against its measured mean step; and the idle CPU
of the split engine. Shapes the split cannot take (more domains than attention dies) are named
and skipped.
"""

from __future__ import annotations

import itertools
import time

import numpy as np
import psutil

from bench.common import progress
from memory.errors import ConfigError
from runtime.decode import DecodeOptions, make_prompts, run_decode
from runtime.decode.step_model import check, leave_one_out
from runtime.engine import Engine, EngineConfig
from sched import SamplingParams


def shapes(opts) -> tuple[list[tuple[int, int]], list[str]]:
    """The (domains, micro-batches) shapes to run, and why any others are skipped."""
    run, skipped = [], []
    for d, m in itertools.product(opts.domains, opts.microbatches):
        if d > opts.attention_dies:
            skipped.append(f"D={d} m={m}: a DP domain is a set of attention dies, and there are"
                           f" {opts.attention_dies}")  # fmt: skip
        else:
            run.append((d, m))
    return run, skipped


def split_engine(opts, d: int, m: int, **changes) -> EngineConfig:
    per_group = -(-opts.batch // opts.attention_dies)
    base = dict(dies=opts.attention_dies, expert_dies=opts.expert_dies, domains=d,
                microbatches=m, model=opts.model, model_overrides=opts.overrides,
                max_num_seqs=per_group, max_num_batched_tokens=max(64, 2 * opts.prompt_len),
                timeout_s=120.0, pin=opts.pin)  # fmt: skip
    return EngineConfig(**{**base, **changes})


def check_options(opts) -> None:
    run, _ = shapes(opts)
    if not run:
        raise ConfigError("argument --domains: no shape fits the attention dies")
    for d, m in run:
        split_engine(opts, d, m)


def engine_run(opts, d: int, m: int, idle_s: float = 0.0) -> dict:
    prompts = make_prompts(opts.waves * opts.batch, opts.prompt_len, opts.seed)
    params = SamplingParams(max_tokens=opts.steps, ignore_eos=True)
    out: dict = {}
    with Engine.launch(split_engine(opts, d, m)) as eng:
        eng.generate(prompts[: opts.batch], SamplingParams(max_tokens=4, ignore_eos=True))
        before = eng.split_stats()
        t0 = time.monotonic()
        outs = eng.generate(prompts, params)
        wall = time.monotonic() - t0
        out["split"] = eng.split_stats()
        out["split_before"] = before
        tokens = sum(len(o.token_ids) for o in outs)
        tpot = [o.tpot_s * 1e3 for o in outs]
        out.update(tokens_per_s=tokens / wall, wall_s=wall,
                   tpot_p50_ms=float(np.percentile(tpot, 50)),
                   tpot_p99_ms=float(np.percentile(tpot, 99)))  # fmt: skip
        if idle_s:
            time.sleep(0.5)
            procs = [psutil.Process()] + [psutil.Process(p) for _, _, p in eng.processes()]
            c0 = sum(sum(p.cpu_times()[:2]) for p in procs)
            time.sleep(idle_s)
            out["idle_cpu_pct"] = 100 * (sum(sum(p.cpu_times()[:2]) for p in procs) - c0) / idle_s
    return out


def run_split(opts) -> dict:
    todo, skipped = shapes(opts)
    progress(f"xpod bench engine (split): {opts.attention_dies} attention + {opts.expert_dies}"
             f" expert dies, shapes (D, m) {todo}, batch {opts.batch}, prompt {opts.prompt_len},"
             f" {opts.steps} tokens, model {opts.model}")  # fmt: skip
    for s in skipped:
        progress(f"  skipped {s}")
    rows, phases = [], []
    for i, (d, m) in enumerate(todo):
        progress(f"  [{i + 1}/{len(todo)}] D={d} m={m}: xpod decode, then the engine ...")
        dec = run_decode(DecodeOptions(
            dies=opts.attention_dies + opts.expert_dies, attention_dies=opts.attention_dies,
            expert_dies=opts.expert_dies, domains=d, microbatches=m, batch=opts.batch,
            prompt_len=opts.prompt_len, steps=opts.steps, model=opts.model,
            overrides=opts.overrides, pin=opts.pin))  # fmt: skip
        eng = engine_run(opts, d, m, opts.idle_s if i == len(todo) - 1 else 0.0)
        phases.append(dec["phases"])
        sp = eng["split"]
        rows.append({
            "domains": d, "microbatches": m,
            "decode_tokens_per_s": dec["tokens_per_s"], "decode_tpot_p50_ms": dec["tpot_p50_ms"],
            "decode_tpot_p99_ms": dec["tpot_p99_ms"],
            "decode_step_mean_ms": dec["phases"]["step_mean_ms"],
            "expert_idle_share": dec["expert_idle_share"],
            "engine_tokens_per_s": eng["tokens_per_s"],
            "engine_over_decode": eng["tokens_per_s"] / dec["tokens_per_s"],
            "engine_tpot_p50_ms": eng["tpot_p50_ms"], "engine_tpot_p99_ms": eng["tpot_p99_ms"],
            "engine_expert_idle_share": sp["expert_idle_share"],
            "attention_share": sp["attention_share"], "expert_share": sp["expert_share"],
            "a2e_ms_per_step": sp["a2e_ms_per_step"], "e2a_ms_per_step": sp["e2a_ms_per_step"],
            "model_self_error": check(dec["phases"])["model_error"],
            **({"idle_cpu_pct": eng["idle_cpu_pct"]} if "idle_cpu_pct" in eng else {}),
        })  # fmt: skip
    loo = leave_one_out(phases)
    for r, p in zip(rows, loo, strict=True):
        r.update(step_model_ms=p["step_model_ms"], step_measured_ms=p["step_measured_ms"],
                 model_error=p["model_error"])  # fmt: skip
    res = {"bench": "engine-split", "attention_dies": opts.attention_dies,
           "expert_dies": opts.expert_dies, "batch": opts.batch, "prompt_len": opts.prompt_len,
           "steps": opts.steps, "model": opts.model, "overrides": opts.overrides,
           "shapes": rows, "skipped": skipped, "phases": phases,
           "model_error_max": max(r["model_error"] for r in rows),
           "idle_cpu_pct": next((r["idle_cpu_pct"] for r in rows if "idle_cpu_pct" in r), None),
           }  # fmt: skip
    by = {(r["domains"], r["microbatches"]): r for r in rows}
    if (1, 1) in by and (2, 1) in by:
        res["idle_share_d1_d2"] = [by[1, 1]["expert_idle_share"], by[2, 1]["expert_idle_share"]]
    return res


def print_split(r: dict) -> None:
    print(f"\nMoE-attention disaggregation: {r['attention_dies']} attention + {r['expert_dies']}"
          f" expert dies, batch {r['batch']}, prompt {r['prompt_len']}, {r['steps']} tokens,"
          f" model {r['model']} (one run; compare within it)")  # fmt: skip
    head = ("D", "m", "decode tok/s", "TPOT p50/p99", "engine tok/s", "eng/dec", "idle",
            "A2E/E2A ms", "model ms", "meas ms", "error")  # fmt: skip
    print("  " + " ".join(f"{h:>13}" for h in head))
    for x in r["shapes"]:
        vals = (x["domains"], x["microbatches"], f"{x['decode_tokens_per_s']:.0f}",
                f"{x['decode_tpot_p50_ms']:.1f}/{x['decode_tpot_p99_ms']:.1f}",
                f"{x['engine_tokens_per_s']:.0f}", f"{x['engine_over_decode']:.2f}x",
                f"{x['expert_idle_share']:.0%}",
                f"{x['a2e_ms_per_step']:.1f}/{x['e2a_ms_per_step']:.1f}",
                f"{x['step_model_ms']:.1f}", f"{x['step_measured_ms']:.1f}",
                f"{x['model_error']:.0%}")  # fmt: skip
        print("  " + " ".join(f"{v:>13}" for v in vals))
    for s in r["skipped"]:
        print(f"  skipped {s}")
    print("  idle = the expert dies' time waiting for A2E input (decode); model = the step"
          " predicted from the other shapes' phase times (runtime.decode.step_model)")  # fmt: skip
    for x in r["shapes"]:
        a, e = x["attention_share"], x["expert_share"]
        print(f"  D={x['domains']} m={x['microbatches']} engine: attention dies "
              + ", ".join(f"{k} {v:.0%}" for k, v in a.items()) + "; expert dies "
              + ", ".join(f"{k} {v:.0%}" for k, v in e.items()))  # fmt: skip
    print(f"  step model: worst error {r['model_error_max']:.0%}")
    if r.get("idle_cpu_pct") is not None:
        print(f"  idle split engine, every process: {r['idle_cpu_pct']:.2f} % of one core")
