"""`xpod decode` on a split pod: attention dies and expert dies (MoE-attention disaggregation).

```
xpod decode --attention-dies 2 --expert-dies 6 --domains 2 --microbatches 2 --check --trace t.json
```

The launcher spreads the batch over the attention dies only (request r -> attention die r % n_att,
ids given die by die). Each attention die prefills, decodes `steps` steps through
`runtime.model.split.attention_step` (MLA, latent KV, dense layers, gate, shared expert, LM head;
A2E / E2A to the experts), then sends the end marker. Each expert die runs
`runtime.model.split.expert_loop` for the whole run: it learns every call from the A2E packets,
and receives no message after the run's start (counted: `expert_control_messages`).

In a capture pod (`--project`, runtime.decode.project) each attention die records each decode
step as a call `step` on its main stream, with every op of the step in it
(`runtime.model.split`); an expert die records its calls and `experts` ops, no step.

`--check` replays the same topology and schedule in one process (`SplitReference`: bit-equal
tokens and logits required, INT8 against the INT8 replay) and compares greedy tokens with the
colocated model of the same prompts (`ReferencePod`, every die attending and hosting experts:
other matmul groupings, so logits within a bound, tokens equal in practice).
"""

from __future__ import annotations

import time

import numpy as np

import comm
from comm.alltoall import Split
from runtime.decode.options import DecodeOptions, progress
from runtime.decode.step_model import check
from runtime.model import ModelConfig, sample
from runtime.model.forward import PHASES
from runtime.model.split import (
    attention_step,
    build_split_model,
    end_experts,
    expert_loop,
    split_clock,
)
from runtime.project.decode import STEP_CALL
from sched import KVManager

__all__ = ["print_split", "split_check", "split_decode_main", "split_summary"]


def split_decode_main(die, spec) -> dict:
    """Run on every die of a split pod: an attention die prefills and decodes its requests, an
    expert die loops until the attention dies' end marker."""
    sp: Split = spec.split
    cfg, me = spec.model, die.die_id
    clock = split_clock(die, cfg.n_layers)
    cpu0 = time.process_time()
    if me not in sp.att_dies:
        model, _ = build_split_model(die, cfg, sp, 0, spec.block_size)
        comm.barrier(die)
        t0, w0 = time.perf_counter_ns(), die.ctx.waited_ns
        stats = expert_loop(die, model, sp, spec.quant, clock)
        return {"role": "expert", "die": me, "stats": stats.to_dict(),
                "layer_ns": clock.layer_ns, "loop_ns": time.perf_counter_ns() - t0,
                "wait_ns": die.ctx.waited_ns - w0,
                "cpu_s": time.process_time() - cpu0}  # fmt: skip
    i = sp.att_dies.index(me)
    prompts, ids = spec.prompts[i], spec.request_ids[i]
    n_blocks = sum(-(-(len(p) + spec.steps) // spec.block_size) for p in prompts)
    model, pool = build_split_model(die, cfg, sp, n_blocks, spec.block_size)
    kv = KVManager(max(n_blocks, 1), spec.block_size, enable_prefix_cache=False)
    tables = [kv.alloc_blocks(r, len(p) + spec.steps) for r, p in zip(ids, prompts, strict=True)]
    tokens: list[list[int]] = [[] for _ in ids]
    history, counters = [], {}

    def step(segments) -> None:
        model.kv.begin_step(
            [(r, start, len(t), tables[j]) for j, (r, t, start) in enumerate(segments)]
        )
        logits = attention_step(die, model, segments, sp, spec.quant, clock, counters)
        t = time.perf_counter_ns()
        s = clock.step
        rngs = [np.random.default_rng([spec.seed, r, s]) for r in ids] if spec.temperature else None
        for j, tok in enumerate(sample(logits, spec.temperature, rngs).tolist()):
            tokens[j].append(tok)
        if spec.keep_logits:
            history.append(logits)
        clock.span(5, -1, t)

    try:
        comm.barrier(die)
        t0 = time.perf_counter_ns()
        step([(r, p, 0) for r, p in zip(ids, prompts, strict=True)])
        prefill_ns = time.perf_counter_ns() - t0
        step_ns, ctx_len = [], []
        clock.counting = True
        cpu1, wait0, t0 = time.process_time(), die.ctx.waited_ns, time.perf_counter_ns()
        cap = getattr(die, "cap", None)  # a capture pod: each step a call (decode.project)
        for s in range(1, spec.steps + 1):
            clock.step = s
            ts = time.perf_counter_ns()
            ctx_len.append(sum(len(p) + s for p in prompts))
            if cap is not None:
                cap.begin(STEP_CALL, s, cap.main)
            step([(r, [tokens[j][-1]], len(prompts[j]) + s - 1) for j, r in enumerate(ids)])
            if cap is not None:
                cap.end(STEP_CALL, s)
            step_ns.append(time.perf_counter_ns() - ts)
        decode_ns = time.perf_counter_ns() - t0
        cpu_decode = time.process_time() - cpu1
        wait_ns = die.ctx.waited_ns - wait0
        end_experts(die, sp, spec.quant)
    finally:
        die.free(pool)
    return {"role": "attention", "die": me, "request_ids": ids, "tokens": tokens,
            "logits": history, "prefill_ns": prefill_ns, "decode_ns": decode_ns,
            "step_ns": step_ns, "ctx_len": ctx_len, "layer_ns": clock.layer_ns,
            "other_ns": clock.other_ns, "wait_ns": wait_ns, "cpu_decode_s": cpu_decode,
            "cpu_prefill_s": cpu1 - cpu0, "counters": counters}  # fmt: skip


def split_summary(res: list[dict], opts: DecodeOptions, model: ModelConfig,
                  sp: Split) -> dict:  # fmt: skip
    """The split run's summary: throughput and TPOT, per-role phase times, the expert dies'
    idle share and calls, the control messages they received, the a2e metadata writes."""
    att = [r for r in res if r["role"] == "attention"]
    exp = [r for r in res if r["role"] == "expert"]
    steps = opts.steps
    decode_s = max(r["decode_ns"] for r in att) / 1e9
    step_ms = np.max(np.array([r["step_ns"] for r in att], np.float64), axis=0) / 1e6
    # an expert die's counters per step; the decode steps are 1..steps
    ex = {k: np.array([r["stats"][k][1 : steps + 1] for r in exp], np.float64)
          for k in ("a2e_ns", "a2e_wait_ns", "experts_ns", "e2a_ns", "rows", "calls")}  # fmt: skip
    busy = ex["a2e_ns"] + ex["experts_ns"] + ex["e2a_ns"]
    idle = float(ex["a2e_wait_ns"].sum() / max(busy.sum(), 1))
    att_ns = sum(r["layer_ns"] for r in att) / len(att) / max(steps, 1) / 1e3  # [layer, phase]
    exp_ns = sum(r["layer_ns"] for r in exp) / len(exp) / max(steps, 1) / 1e3
    calls = [r["counters"].get("a2e_calls", 0) for r in att]
    writes = [r["counters"].get("a2e_writes", 0) for r in att]
    n_moe = model.n_layers - model.n_dense_layers
    out = {
        "bench": "decode",
        "layout": "split",
        "model": opts.model,
        "dies": len(sp.att_dies) + len(sp.exp_dies),
        "attention_dies": len(sp.att_dies),
        "expert_dies": len(sp.exp_dies),
        "domains": sp.num_domains,
        "microbatches": sp.microbatches,
        "batch": opts.batch,
        "prompt_len": opts.prompt_len,
        "steps": steps,
        "quant": opts.quant or "none",
        "combine_dtype": opts.combine_dtype,
        "tokens_per_s": opts.batch * steps / decode_s if decode_s else 0.0,
        "step_mean_ms": max(r["decode_ns"] for r in att) / steps / 1e6,
        "tpot_p50_ms": float(np.percentile(step_ms, 50)) if steps else 0.0,
        "tpot_p99_ms": float(np.percentile(step_ms, 99)) if steps else 0.0,
        "prefill_ms": max(r["prefill_ns"] for r in att) / 1e6,
        "step_ms": [float(v) for v in step_ms],
        "attention_us_per_step": {p: float(att_ns[:, i].sum()) for i, p in enumerate(PHASES)},
        "expert_us_per_step": {p: float(exp_ns[:, i].sum()) for i, p in enumerate(PHASES)},
        "expert_idle_share": idle,
        "expert_idle_share_per_die": [
            float(w.sum() / max(b.sum(), 1)) for w, b in zip(ex["a2e_wait_ns"], busy, strict=True)
        ],
        "expert_a2e_calls_per_step": float(ex["calls"].mean()) if steps else 0.0,
        "expected_expert_calls_per_step": n_moe * sp.cycle,
        "attention_a2e_calls_per_step": float(np.mean(calls) / max(steps + 1, 1)),
        "a2e_metadata_writes_per_step": float(sum(writes) / max(sum(calls), 1)),
        "expert_control_messages": int(sum(r["stats"]["control_messages"] for r in exp)),
        "expert_rows_per_step": float(ex["rows"].sum(axis=0).mean()) if steps else 0.0,
        "a2e_us_per_step": float(ex["a2e_ns"].mean() * 1 / 1e3) if steps else 0.0,
        "e2a_us_per_step": float(ex["e2a_ns"].mean() / 1e3) if steps else 0.0,
        "wait_share_attention": float(
            np.mean([r["wait_ns"] / max(r["decode_ns"], 1) for r in att])
        ),  # fmt: skip
        "cpu_s_attention": float(np.mean([r["cpu_decode_s"] for r in att])),
        "cpu_s_expert": float(np.mean([r["cpu_s"] for r in exp])),
    }
    out["phases"] = phase_times(res, opts, model, sp)
    # the step model on this one shape: its costs from this run, composed (step_model); the
    # prediction of other shapes is `xpod bench engine --attention-dies ... --domains 1,2,3`
    sm = check(out["phases"])
    out.update(step_model_ms=sm["step_model_ms"], step_measured_ms=sm["step_measured_ms"],
               model_error_max=sm["model_error"])  # fmt: skip
    return out


def phase_times(res: list[dict], opts: DecodeOptions, model: ModelConfig, sp: Split) -> dict:
    """The measured phase times per decode step of every die, in us (the step model's input,
    `runtime.decode.step_model`): an attention die's compute (attention, gate, dense / shared
    FFN, embedding, LM head, sampling), A2E send and E2A (wait + reduce); an expert die's
    expert compute, its A2E and E2A time less their waits, the rows it served; every die's CPU."""
    import os

    steps = max(opts.steps, 1)
    att = [r for r in res if r["role"] == "attention"]
    exp = [r for r in res if r["role"] == "expert"]
    col = {p: i for i, p in enumerate(PHASES)}

    def per_step(r: dict, *names: str) -> float:
        ns = sum(float(r["layer_ns"][:, col[n]].sum()) for n in names)
        return ns / steps / 1e3

    def span(r: dict, key: str) -> float:
        return float(sum(r["stats"][key][1 : opts.steps + 1])) / steps / 1e3

    return {
        "cores": len(os.sched_getaffinity(0)),
        "attention_dies": len(sp.att_dies), "expert_dies": len(sp.exp_dies),
        "domains": sp.num_domains, "microbatches": sp.microbatches,
        "n_layers": model.n_layers, "moe_layers": model.n_layers - model.n_dense_layers,
        "att_rows": [len(r["request_ids"]) for r in att],
        "att_ctx": [float(np.mean(r["ctx_len"])) if r["ctx_len"] else 0.0 for r in att],
        "att_compute_us": [per_step(r, "attention", "gate", "experts")
                           + r["other_ns"] / steps / 1e3 for r in att],
        "att_a2e_us": [per_step(r, "dispatch") for r in att],
        "att_e2a_us": [per_step(r, "combine") for r in att],
        "att_cpu_us": [r["cpu_decode_s"] / steps * 1e6 for r in att],
        "exp_rows": [span(r, "rows") * 1e3 for r in exp],
        "exp_calls": [span(r, "calls") * 1e3 for r in exp],
        "exp_compute_us": [span(r, "experts_ns") for r in exp],
        "exp_a2e_busy_us": [span(r, "a2e_ns") - span(r, "a2e_wait_ns") for r in exp],
        "exp_e2a_busy_us": [span(r, "e2a_ns") - span(r, "e2a_wait_ns") for r in exp],
        "exp_cpu_us": [r["stats"]["cpu_decode_s"] / steps * 1e6 for r in exp],
        "step_mean_ms": max(r["decode_ns"] for r in att) / steps / 1e6,
        "tpot_p50_ms": float(np.percentile(
            np.max(np.array([r["step_ns"] for r in att], np.float64), axis=0), 50) / 1e6),
    }  # fmt: skip


def split_check(res: list[dict], per_die, opts: DecodeOptions, model: ModelConfig,
                sp: Split) -> dict:  # fmt: skip
    """Replay the same topology and schedule in one process (bit-equal required) and compare
    greedy tokens with the colocated model of the same prompts."""
    from runtime.decode.report import compare
    from runtime.model.reference import ReferencePod
    from runtime.model.split_reference import SplitReference
    from runtime.pod.proc import limit_blas_threads

    limit_blas_threads(1)
    att = [r for r in res if r["role"] == "attention"]
    progress("  --check: replay of the split topology and schedule in one process ...")
    ref = SplitReference(model, sp, quant=opts.quant, combine_dtype=opts.combine_dtype)
    got = ref.generate(per_die, opts.steps, opts.temperature, opts.seed)
    exact = compare(att, got, exact=True)
    out = {f"replay_{k}": v for k, v in exact.items()}
    out["mismatched_tokens"] = exact["mismatched_tokens"]
    out["logits_bit_equal"] = exact["logits_bit_equal"]
    # the colocated model: every prompt on a pod of the same dies, each attending and hosting
    progress("  --check: the colocated model on the same prompts ...")
    # the colocated pod of as many dies as the split's, or the most that split the experts
    n = max(k for k in range(1, len(sp.att_dies) + len(sp.exp_dies) + 1)
            if model.num_experts % k == 0)  # fmt: skip
    flat = [p for ps in per_die for p in ps]
    colo = [[p for r, p in enumerate(flat) if r % n == d] for d in range(n)]
    col = ReferencePod(model, n, quant=opts.quant, combine_dtype=opts.combine_dtype).generate(
        colo, opts.steps, opts.temperature, opts.seed)  # fmt: skip
    # request k of the flat list is (die k % n, index k // n) colocated; the split pod's
    # request ids are given attention die by attention die, in per_die order
    got_tokens, want_tokens, diff = [], [], 0.0
    k = 0
    for r in att:
        for j in range(len(r["request_ids"])):
            d, idx = k % n, k // n
            want = col.tokens[d][idx]
            got_tokens.append(r["tokens"][j])
            want_tokens.append(want)
            same = next((s for s, (a, b) in enumerate(zip(r["tokens"][j], want, strict=True))
                         if a != b), len(want))  # fmt: skip
            for s in range(min(same + 1, len(want))):
                diff = max(diff, float(np.max(np.abs(r["logits"][s][j] - col.logits[d][s][idx]))))
            k += 1
    # sampled tokens draw on the request id, which differs between the layouts: greedy only
    out["greedy_equal_colocated"] = got_tokens == want_tokens if not opts.temperature else None
    out["colocated_mismatched_tokens"] = sum(
        a != b
        for g, w in zip(got_tokens, want_tokens, strict=True)
        for a, b in zip(g, w, strict=True)
    )
    out["colocated_logits_max_abs_diff"] = diff
    out["colocated_dies"] = n
    return out


def print_split(s: dict) -> None:
    """The split run's report (stdout)."""
    print(
        f"\ndecode on a split pod: {s['attention_dies']} attention dies in {s['domains']}"
        f" domain(s) x {s['microbatches']} micro-batch(es), {s['expert_dies']} expert dies;"
        f" model {s['model']}, batch {s['batch']}, prompt {s['prompt_len']}, {s['steps']}"
        f" steps, {s['quant']} A2E, {s['combine_dtype']} E2A"
    )
    print(
        f"  tokens/s {s['tokens_per_s']:.1f}   TPOT p50 {s['tpot_p50_ms']:.2f} ms  p99"
        f" {s['tpot_p99_ms']:.2f} ms   prefill {s['prefill_ms']:.1f} ms"
    )
    for role in ("attention", "expert"):
        b = s[f"{role}_us_per_step"]
        tot = sum(b.values()) or 1.0
        names = ("a2e" if p == "dispatch" else "e2a" if p == "combine" else p for p in PHASES)
        print(f"  {role} dies, us per step (mean over dies): "
              + ", ".join(f"{n} {b[p]:.0f} ({b[p] / tot:.0%})"
                          for n, p in zip(names, PHASES, strict=True) if b[p]))  # fmt: skip
    per = ", ".join(f"{v:.0%}" for v in s["expert_idle_share_per_die"])
    print(
        f"  expert dies: idle {s['expert_idle_share']:.0%} of their time (waiting for A2E input,"
        f" their own counters; per die {per}),"
        f" {s['expert_a2e_calls_per_step']:.0f} A2E calls per step (MoE layers x D x m ="
        f" {s['expected_expert_calls_per_step']}), {s['expert_control_messages']} control"
        f" messages received while looping"
    )
    print(
        f"  attention dies: {s['a2e_metadata_writes_per_step']:.2f} metadata writes per A2E"
        f" call, waiting {s['wait_share_attention']:.0%} of decode time"
    )
    print(
        f"  step model (runtime.decode.step_model, this run's costs): {s['step_model_ms']:.2f}"
        f" ms against {s['step_measured_ms']:.2f} ms measured (mean step), error"
        f" {s['model_error_max']:.0%}"
    )
    if "replay_logits_bit_equal" in s:
        print(
            f"  --check: replay of the same topology and schedule: {s['mismatched_tokens']}"
            f" mismatched tokens of {s['replay_total_tokens']}, logits bit-equal"
            f" {s['logits_bit_equal']}; colocated model: greedy tokens equal"
            f" {s['greedy_equal_colocated']}, max |logit diff|"
            f" {s['colocated_logits_max_abs_diff']:.3g}"
        )
