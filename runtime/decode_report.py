"""What `xpod decode` reports: the summary (tokens/s, TPOT, the 001 Fig. 20 breakdown), the
comparison with the single-process reference (`--check`), and the printed table."""

from __future__ import annotations

import os

import numpy as np

from memory.heap import keep_freed_memory
from runtime.blas import limit_blas_threads
from runtime.decode import DecodeOptions, progress
from runtime.executor import PHASES
from runtime.model import ModelConfig


def summarize(res: list[dict], opts: DecodeOptions, model: ModelConfig) -> dict:
    steps = opts.steps
    decode_s = max(r["decode_ns"] for r in res) / 1e9
    step_ms = (
        np.max(np.array([r["step_ns"] for r in res], np.float64), axis=0) / 1e6
        if steps
        else np.zeros(0)
    )
    layer_ns = sum(r["layer_ns"] for r in res) / len(res)  # mean over dies
    per_step_us = layer_ns / max(steps, 1) / 1e3  # [layer, phase]
    other_us = sum(r["other_ns"] for r in res) / len(res) / max(steps, 1) / 1e3
    totals = per_step_us.sum(axis=0)
    totals[PHASES.index("other")] += other_us
    wait_share = [r["wait_ns"] / max(r["decode_ns"], 1) for r in res]
    return {
        "bench": "decode",
        "model": opts.model,
        "dies": opts.dies,
        "batch": opts.batch,
        "prompt_len": opts.prompt_len,
        "steps": steps,
        "quant": opts.quant or "none",
        "combine_dtype": opts.combine_dtype,
        "protocol": opts.protocol,
        "tokens_per_s": opts.batch * steps / decode_s if decode_s else 0.0,
        "tpot_p50_ms": float(np.percentile(step_ms, 50)) if steps else 0.0,
        "tpot_p99_ms": float(np.percentile(step_ms, 99)) if steps else 0.0,
        "prefill_ms": max(r["prefill_ns"] for r in res) / 1e6,
        "breakdown_us_per_step": {p: float(totals[i]) for i, p in enumerate(PHASES)},
        "breakdown_us_per_layer": [
            {
                "layer": i,
                "moe": model.is_moe(i),
                **{p: float(per_step_us[i, j]) for j, p in enumerate(PHASES)},
            }
            for i in range(model.n_layers)
        ],
        "wait_share": float(np.mean(wait_share)),
        "wait_share_per_die": [float(w) for w in wait_share],
        "cpu_s_per_die": float(np.mean([r["cpu_decode_s"] for r in res])),
    }


def check(res: list[dict], per_die, opts: DecodeOptions, model: ModelConfig) -> dict:
    """Run the single-process reference on the same prompts; compare tokens and logits."""
    from runtime.reference_model import ReferencePod

    limit_blas_threads(1)  # the reference is one process on one core (the pod's dies: the same)
    keep_freed_memory()  # as every die does
    progress("  --check: single-process reference (float32 dispatch) ...")
    ref = ReferencePod(model, opts.dies, quant=None, combine_dtype=opts.combine_dtype).generate(
        per_die, opts.steps, opts.temperature, opts.seed
    )
    out = {"ref_tokens_per_s": ref.decode_tokens_per_s, "ref_prefill_ms": ref.prefill_s * 1e3}
    out.update(compare(res, ref, exact=opts.quant is None))
    out.update(single_process(per_die, opts, model))
    if opts.quant == "int8":
        progress("  --check: single-process reference with INT8 dispatch ...")
        ref8 = ReferencePod(
            model, opts.dies, quant="int8", combine_dtype=opts.combine_dtype
        ).generate(per_die, opts.steps, opts.temperature, opts.seed)
        exact = compare(res, ref8, exact=True)
        out["int8_ref_mismatched_tokens"] = exact["mismatched_tokens"]
        out["int8_ref_logits_bit_equal"] = exact["logits_bit_equal"]
    return out


def single_process(per_die, opts: DecodeOptions, model: ModelConfig) -> dict:
    """What a user would run instead of the pod: the whole batch in one process as one batched
    model (`ReferencePod` as a single die: every expert local, no all-to-all), with one BLAS
    thread and with one per core of this machine; decode tokens/s of each (same prompts, same
    steps, same run). The ref_tokens_per_s above groups the batch per die instead."""
    from runtime.reference_model import ReferencePod

    batch = [[p for ps in per_die for p in ps]]
    cores = len(os.sched_getaffinity(0))
    out = {}
    try:
        for threads, key in ((1, "single_process_1thread_tokens_per_s"),
                             (cores, "single_process_tokens_per_s")):  # fmt: skip
            limit_blas_threads(threads)
            progress(f"  --check: the whole batch in one process, {threads} BLAS thread(s) ...")
            pod = ReferencePod(model, 1, quant=opts.quant, combine_dtype=opts.combine_dtype)
            r = pod.generate(batch, opts.steps, opts.temperature, opts.seed)
            out[key] = r.decode_tokens_per_s
    finally:
        limit_blas_threads(1)
    out["single_process_blas_threads"] = cores
    return out


def compare(res: list[dict], ref, exact: bool) -> dict:
    """Tokens, first mismatch and logit differences of the pod against a GenerateResult.

    The logit difference is taken over the steps before a request's first token mismatch (after
    it the inputs differ and so do the logits, legitimately)."""
    total = mismatched = 0
    first = None
    max_diff, scale, bit_equal, prefill_diff = 0.0, 0.0, True, 0.0
    for d, r in enumerate(res):
        for i, req in enumerate(r["request_ids"]):
            got, want = r["tokens"][i], ref.tokens[d][i]
            total += len(want)
            bad = [s for s, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            mismatched += len(bad)
            stop = bad[0] + 1 if bad else len(want)
            if bad and (first is None or bad[0] < first["step"]):
                first = {
                    "die": d,
                    "request": req,
                    "step": bad[0],
                    "got": got[bad[0]],
                    "want": want[bad[0]],
                }
            for s in range(stop):
                a, b = r["logits"][s][i], ref.logits[d][s][i]
                bit_equal &= bool(np.array_equal(a, b))
                diff = float(np.max(np.abs(a - b)))
                max_diff = max(max_diff, diff)
                if s == 0:
                    prefill_diff = max(prefill_diff, diff)
                scale = max(scale, float(np.max(np.abs(b))))
    return {
        "mismatched_tokens": mismatched,
        "total_tokens": total,
        "token_agreement": 1.0 - mismatched / total if total else 1.0,
        "first_mismatch": first,
        "logits_bit_equal": bit_equal,
        "logits_max_abs_diff": max_diff,
        "logits_max_abs_diff_prefill": prefill_diff,
        "logits_max_abs": scale,
    }


# -- output ----------------------------------------------------------------------------------------


def print_summary(s: dict) -> None:
    print(
        f"\ndecode: {s['dies']} dies, model {s['model']}, batch {s['batch']}, prompt"
        f" {s['prompt_len']}, {s['steps']} steps, {s['protocol']} {s['quant']} dispatch,"
        f" {s['combine_dtype']} combine"
    )
    print(
        f"  tokens/s {s['tokens_per_s']:.1f}   TPOT p50 {s['tpot_p50_ms']:.2f} ms  p99"
        f" {s['tpot_p99_ms']:.2f} ms   prefill {s['prefill_ms']:.1f} ms   waiting"
        f" {s['wait_share']:.0%} of decode time   cpu {s['cpu_s_per_die']:.2f} s/die"
    )
    b = s["breakdown_us_per_step"]
    tot = sum(b.values()) or 1.0
    print("\n  one decode step, us per die (mean over dies), as 001 Fig. 20:")
    print("  " + "".join(f"{p:>11}" for p in ("layer", *PHASES, "total")))
    for row in s["breakdown_us_per_layer"]:
        vals = [row[p] for p in PHASES]
        kind = "moe" if row["moe"] else "dense"
        print(
            f"  {row['layer']:>5} {kind:>5}"
            + "".join(f"{v:>11.0f}" for v in vals)
            + f"{sum(vals):>11.0f}"
        )
    print("  " + f"{'all':>11}" + "".join(f"{b[p]:>11.0f}" for p in PHASES) + f"{tot:>11.0f}")
    print("  " + f"{'share':>11}" + "".join(f"{b[p] / tot:>11.0%}" for p in PHASES))
    if "ref_tokens_per_s" in s:
        ratio = s["tokens_per_s"] / s["ref_tokens_per_s"] if s["ref_tokens_per_s"] else 0.0
        print(
            f"\n  reference (one process, same prompts, same run): {s['ref_tokens_per_s']:.1f}"
            f" tokens/s -> pod / reference = {ratio:.2f}x"
        )
        if s.get("single_process_tokens_per_s"):
            one, one1 = s["single_process_tokens_per_s"], s["single_process_1thread_tokens_per_s"]
            print(
                f"  the whole batch as one model in one process (what a user would run instead):"
                f" {one:.1f} tokens/s with {s['single_process_blas_threads']} BLAS threads,"
                f" {one1:.1f} with 1 -> pod / it = {s['tokens_per_s'] / one:.2f}x"
            )
        fm = s["first_mismatch"]
        print(
            f"  tokens: {s['total_tokens'] - s['mismatched_tokens']}/{s['total_tokens']} equal"
            f" ({s['token_agreement']:.1%});  logits bit-equal: {s['logits_bit_equal']};  max"
            f" |diff| {s['logits_max_abs_diff']:.3g} over the steps before a request's first"
            f" mismatch, {s['logits_max_abs_diff_prefill']:.3g} at the prefill step (max |logit|"
            f" {s['logits_max_abs']:.3g})"
        )
        if fm:
            print(
                f"  first mismatch: die {fm['die']} request {fm['request']} step {fm['step']}:"
                f" got {fm['got']}, reference {fm['want']}"
            )
        if "int8_ref_mismatched_tokens" in s:
            print(
                f"  vs the INT8 reference: {s['int8_ref_mismatched_tokens']} mismatched tokens,"
                f" logits bit-equal: {s['int8_ref_logits_bit_equal']}"
            )


def jsonable(o):
    """`json.dumps(default=...)` for numpy scalars and arrays."""
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
