"""What `xpod decode` reports: the summary (tokens/s, TPOT, the 001 Fig. 20 breakdown), the
comparison with the single-process reference (`--check`), and the printed table."""

from __future__ import annotations

import os

import numpy as np

from memory.heap import keep_freed_memory
from runtime.decode.options import DecodeOptions, progress
from runtime.model import ModelConfig
from runtime.model.forward import PHASES
from runtime.pod.proc import limit_blas_threads


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
        "hosts": ",".join(str(list(opts.hosts).count(h)) for h in sorted(set(opts.hosts)))
        if opts.hosts
        else str(opts.dies),
        "fabric": opts.fabric if opts.hosts else "local",
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
        "step_ms": [float(v) for v in step_ms],  # decode step s = 1.. at index s - 1, max over dies
    }


def check(res: list[dict], per_die, opts: DecodeOptions, model: ModelConfig,
          baseline: bool = True) -> dict:  # fmt: skip
    """Run the single-process reference on the same prompts; compare tokens and logits; with
    `baseline`, also time the whole batch as one model in one process (`single_process`)."""
    from runtime.model.reference import ReferencePod

    limit_blas_threads(1)  # the reference is one process on one core (the pod's dies: the same)
    keep_freed_memory()  # as every die does
    progress("  --check: single-process reference (float32 dispatch) ...")
    maps = replayed_maps(res)
    ref = ReferencePod(
        model, opts.dies, quant=None, combine_dtype=opts.combine_dtype, expert_maps=maps,
        microbatches=opts.microbatches,
    ).generate(per_die, opts.steps, opts.temperature, opts.seed)  # fmt: skip
    out = {"ref_tokens_per_s": ref.decode_tokens_per_s, "ref_prefill_ms": ref.prefill_s * 1e3}
    out.update(compare(res, ref, exact=opts.quant is None))
    if baseline:
        out.update(single_process(per_die, opts, model))
    if opts.quant == "int8":
        progress("  --check: single-process reference with INT8 dispatch ...")
        ref8 = ReferencePod(
            model, opts.dies, quant="int8", combine_dtype=opts.combine_dtype, expert_maps=maps,
            microbatches=opts.microbatches,
        ).generate(per_die, opts.steps, opts.temperature, opts.seed)  # fmt: skip
        exact = compare(res, ref8, exact=True)
        out["int8_ref_mismatched_tokens"] = exact["mismatched_tokens"]
        out["int8_ref_logits_bit_equal"] = exact["logits_bit_equal"]
    return out


def single_process(per_die, opts: DecodeOptions, model: ModelConfig) -> dict:
    """What a user would run instead of the pod: the whole batch in one process as one batched
    model (`ReferencePod` as a single die: every expert local, no all-to-all), with one BLAS
    thread and with one per core of this machine; decode tokens/s of each (same prompts, same
    steps, same run). The ref_tokens_per_s above groups the batch per die instead."""
    from runtime.model.reference import ReferencePod

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


def repeats(runs: list, opts: DecodeOptions, model: ModelConfig) -> dict:
    """`--repeat R`: every pod run's tokens/s (the summary above is the median run's) and,
    with --check, the one-process baseline run after each, the per-pair ratios and medians
    (`tokens_per_s` and `single_process_tokens_per_s` become the medians)."""
    pod = [opts.batch * opts.steps / (max(r["decode_ns"] for r in res) / 1e9) for res, _ in runs]
    out: dict = {"repeat": len(runs), "tokens_per_s_runs": pod,
                 "tokens_per_s": float(np.median(pod))}  # fmt: skip
    base = [b for _, b in runs if b]
    if base:
        for key in ("single_process_tokens_per_s", "single_process_1thread_tokens_per_s"):
            vals = [b[key] for b in base]
            out[f"{key}_runs"] = vals
            out[key] = float(np.median(vals))
        out["single_process_blas_threads"] = base[0]["single_process_blas_threads"]
        pairs = [p / b["single_process_tokens_per_s"] for p, b in zip(pod, base, strict=True)]
        out["pod_over_single_process_runs"] = pairs
        out["pod_over_single_process"] = float(np.median(pairs))
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


# -- expert load balancing ------------------------------------------------------------------------


def replayed_maps(res: list[dict]) -> list[tuple[int, list]] | None:
    """The (switch step, phy2log) pairs an EPLB run served with (None without EPLB); every die
    must report the same ones."""
    reps = [r.get("eplb") for r in res]
    if (
        not reps
        or reps[0] is None
        or len(reps[0]["maps"]) == 0
        or "phy2log" not in reps[0]["maps"][0]
    ):
        return None
    maps = [(m["switch_step"], m["phy2log"]) for m in reps[0]["maps"]]
    for d, rep in enumerate(reps):
        if [(m["switch_step"], m["phy2log"]) for m in rep["maps"]] != maps:
            raise RuntimeError(f"eplb: die {d} switched maps unlike die 0")
    return maps


def _map_at(maps: list[tuple[int, np.ndarray]], step: int) -> np.ndarray:
    return [m for start, m in maps if start <= step][-1]


def eplb_stats(res: list[dict], model: ModelConfig, step_ms: list[float], first: int | None = None
               ) -> dict:  # fmt: skip
    """Load figures of a decode run from every die's per-step slot counts (steps 0 = prefill ..).

    Arguments:
        res: the dies' results (each with `eplb.counts [steps + 1][moe layers][slots]`).
        step_ms: the decode steps' times (index s - 1 = step s).
        first: the first step measured (default: the first switch of the run, else 0).

    Returns (over the measured steps):
        balancedness: mean over MoE layers of (mean / max) of the rows each die received,
            summed over the steps (vLLM's definition over a window); per layer too, and
            balancedness_per_step: the same per (step, layer), averaged.
        max_rows_per_die, mean_rows_per_die: per (step, layer) the largest / mean rows a die
            received, averaged over steps and layers.
        hottest_over_mean: per MoE layer the hottest logical expert's rows over the mean; the
            mean over layers (and per layer).
        rebalances: per plan its steps, bytes received over all dies, the slowest die's move
            time and the stall: the slowest step from the plan to the switch over the median of
            up to 4 steps on each side.
    """
    reps = [r["eplb"] for r in res]
    counts = np.array([rep["counts"] for rep in reps], np.int64)  # [D, T, J, S]
    dies, steps, n_moe, slots = counts.shape
    switches = reps[0]["maps"]
    maps = [(m["switch_step"], np.asarray(m["phy2log"], np.int64)) for m in switches]
    if not maps:  # EPLB off: the block placement, expert e in slot e
        maps = [(0, np.tile(np.arange(model.num_experts), (n_moe, 1)))]
    if first is None:
        first = switches[1]["switch_step"] if len(switches) > 1 else 0
    first = min(first, steps - 1)
    rows = counts.sum(-1)[:, first:]  # [D, t, J]
    tot = rows.sum(1)  # [D, J]
    top = tot.max(0)
    per_layer = np.where(top > 0, tot.mean(0) / np.maximum(top, 1), 1.0)
    step_top = rows.max(0)
    per_step = np.where(step_top > 0, rows.mean(0) / np.maximum(step_top, 1), 1.0)
    load = np.zeros((n_moe, model.num_experts), np.float64)
    for t in range(first, steps):
        phy2log = _map_at(maps, t)
        for j in range(n_moe):
            np.add.at(load[j], phy2log[j], counts[:, t, j].reshape(-1))
    mean = load.mean(1)
    hot = np.where(mean > 0, load.max(1) / np.maximum(mean, 1e-12), 0.0)
    out = {
        "measured_steps": [int(first), int(steps - 1)],
        "balancedness": float(per_layer.mean()),
        "balancedness_per_layer": [float(v) for v in per_layer],
        "balancedness_per_step": float(per_step.mean()),
        "max_rows_per_die": float(step_top.mean()),
        "mean_rows_per_die": float(rows.mean()),
        "hottest_over_mean": float(hot.mean()),
        "hottest_over_mean_per_layer": [float(v) for v in hot],
        "redundant_slots_per_die": (slots * dies - model.num_experts) // dies,
        "maps": [{k: m[k] for k in ("switch_step", "plan_step", "phy2log")} for m in switches],
        "rebalances": [],
    }
    for k, m in enumerate(switches[1:], start=1):
        b, sw = m["plan_step"], m["switch_step"]
        moved = [next(x for x in rep["moves"] if x["seq"] == m["seq"]) for rep in reps]
        hit = [step_ms[t - 1] for t in range(max(b, 1), sw + 1) if t - 1 < len(step_ms)]
        near = [step_ms[t - 1] for t in (*range(b - 4, b), *range(sw + 1, sw + 5))
                if 1 <= t <= len(step_ms)]  # fmt: skip
        stall = max(hit) / float(np.median(near)) if hit and near else None
        out["rebalances"].append({
            "plan": k, "plan_step": b, "switch_step": sw,
            "bytes_moved": int(sum(x["bytes"] for x in moved)),
            "move_ms_max_die": max(x["ns"] for x in moved) / 1e6,
            "slowest_step_ms": max(hit) if hit else None,
            "neighbour_step_ms_p50": float(np.median(near)) if near else None,
            "stall_over_neighbours": stall,
        })  # fmt: skip
    return out


def eplb_compare(off: list[dict], on: list[dict], per_die, opts: DecodeOptions,
                 model: ModelConfig) -> dict:  # fmt: skip
    """`xpod decode --eplb compare`: EPLB off and on over the same prompts, measured over the
    same steps (from the on run's first switch), and the on run against the reference replaying
    its maps (bit-exact) and against the off run (greedy tokens, logits)."""
    from runtime.model.reference import ReferencePod

    s_off, s_on = summarize(off, opts, model), summarize(on, opts, model)
    e_on = eplb_stats(on, model, s_on["step_ms"])
    e_off = eplb_stats(off, model, s_off["step_ms"], first=e_on["measured_steps"][0])
    limit_blas_threads(1)
    keep_freed_memory()
    progress("  reference replaying the EPLB run's maps ...")
    ref = ReferencePod(model, opts.dies, quant=opts.quant, combine_dtype=opts.combine_dtype,
                       expert_maps=replayed_maps(on)).generate(
        per_die, opts.steps, opts.temperature, opts.seed)  # fmt: skip
    replay = compare(on, ref, exact=True)
    vs_off = compare(on, _Generated(off), exact=False)
    out = {k: s_on[k] for k in ("bench", "model", "dies", "batch", "prompt_len", "steps", "quant",
                                "combine_dtype", "protocol")}  # fmt: skip
    out.update(
        bench="decode-eplb",
        score_bias=model.score_bias,
        eplb_every=opts.eplb_config.every,
        eplb_policy=opts.eplb_config.policy,
        redundant_per_die=opts.eplb_config.redundant_per_die,
        measured_steps=e_on["measured_steps"],
        balancedness_off=e_off["balancedness"],
        balancedness_on=e_on["balancedness"],
        balancedness_per_layer_off=e_off["balancedness_per_layer"],
        balancedness_per_layer_on=e_on["balancedness_per_layer"],
        balancedness_per_step_off=e_off["balancedness_per_step"],
        balancedness_per_step_on=e_on["balancedness_per_step"],
        max_rows_per_die_off=e_off["max_rows_per_die"],
        max_rows_per_die_on=e_on["max_rows_per_die"],
        max_rows_reduction=1.0 - e_on["max_rows_per_die"] / e_off["max_rows_per_die"]
        if e_off["max_rows_per_die"]
        else 0.0,
        mean_rows_per_die=e_off["mean_rows_per_die"],
        hottest_over_mean=e_off["hottest_over_mean"],
        hottest_over_mean_per_layer=e_off["hottest_over_mean_per_layer"],
        mismatched_tokens=replay["mismatched_tokens"],
        total_tokens=replay["total_tokens"],
        logits_bit_equal=replay["logits_bit_equal"],
        off_vs_on_mismatched_tokens=vs_off["mismatched_tokens"],
        off_vs_on_logits_max_abs_diff=vs_off["logits_max_abs_diff"],
        tokens_per_s_off=s_off["tokens_per_s"],
        tokens_per_s_on=s_on["tokens_per_s"],
        tpot_p50_ms_off=s_off["tpot_p50_ms"],
        tpot_p50_ms_on=s_on["tpot_p50_ms"],
        tpot_p99_ms_off=s_off["tpot_p99_ms"],
        tpot_p99_ms_on=s_on["tpot_p99_ms"],
        measured_step_ms_p50_off=_p50(s_off["step_ms"], e_on["measured_steps"][0]),
        measured_step_ms_p50_on=_p50(s_on["step_ms"], e_on["measured_steps"][0]),
        rebalances=e_on["rebalances"],
        maps=e_on["maps"],
    )
    return out


def _p50(step_ms: list[float], first: int) -> float:
    vals = step_ms[max(first, 1) - 1 :]
    return float(np.median(vals)) if vals else 0.0


class _Generated:
    """A decode run's tokens and logits in `GenerateResult`'s shape (for `compare`)."""

    def __init__(self, res: list[dict]):
        self.tokens = [r["tokens"] for r in res]
        self.logits = [r["logits"] for r in res]


def print_eplb(s: dict) -> None:
    """The EPLB part of the summary: one run (`s["eplb"]`) or a compare run."""
    if s.get("bench") == "decode-eplb":
        lo, hi = s["measured_steps"]
        print(
            f"\ndecode --eplb compare: {s['dies']} dies, model {s['model']}, score bias"
            f" {s['score_bias']}, {s['redundant_per_die']} redundant slot(s) per die,"
            f" {s['eplb_policy']} every {s['eplb_every']} steps; measured over steps {lo}..{hi}"
        )
        print(f"  {'':28}{'EPLB off':>12}{'EPLB on':>12}")
        rows = [
            ("balancedness (mean/max)", "balancedness_off", "balancedness_on", ".3f"),
            ("  per step", "balancedness_per_step_off", "balancedness_per_step_on", ".3f"),
            ("max rows per die", "max_rows_per_die_off", "max_rows_per_die_on", ".1f"),
            ("decode tokens/s", "tokens_per_s_off", "tokens_per_s_on", ".1f"),
            ("step p50 ms (measured)", "measured_step_ms_p50_off", "measured_step_ms_p50_on",
             ".2f"),
            ("TPOT p99 ms", "tpot_p99_ms_off", "tpot_p99_ms_on", ".2f"),
        ]  # fmt: skip
        for name, a, b, f in rows:
            print(f"  {name:28}{format(s[a], f):>12}{format(s[b], f):>12}")
        print(
            f"  max rows per die {s['max_rows_reduction']:.0%} lower with EPLB (mean rows per"
            f" die {s['mean_rows_per_die']:.1f}); hottest expert {s['hottest_over_mean']:.1f}x"
            " the mean (EPLB off, mean over layers)"
        )
        print(
            f"  tokens vs the reference replaying the maps: {s['mismatched_tokens']} of"
            f" {s['total_tokens']} mismatched, logits bit-equal {s['logits_bit_equal']};"
            f" vs EPLB off: {s['off_vs_on_mismatched_tokens']} mismatched, max |logit diff|"
            f" {s['off_vs_on_logits_max_abs_diff']:.2g}"
        )
        rebal = s["rebalances"]
    else:
        e = s["eplb"]
        print(
            f"\n  EPLB: balancedness {e['balancedness']:.3f} (per step"
            f" {e['balancedness_per_step']:.3f}), max rows per die {e['max_rows_per_die']:.1f}"
            f" (mean {e['mean_rows_per_die']:.1f}), hottest expert {e['hottest_over_mean']:.1f}x"
            f" the mean, over steps {e['measured_steps'][0]}..{e['measured_steps'][1]}"
        )
        rebal = e["rebalances"]
    for r in rebal:
        stall = r["stall_over_neighbours"]
        print(
            f"  rebalance {r['plan']}: planned after step {r['plan_step']}, switched at step"
            f" {r['switch_step']}; {r['bytes_moved'] / 1e6:.2f} MB moved, slowest die moving"
            f" {r['move_ms_max_die']:.1f} ms; slowest step"
            f" {r['slowest_step_ms'] or 0:.1f} ms vs neighbours"
            f" {r['neighbour_step_ms_p50'] or 0:.1f} ms"
            + (f" ({stall:.2f}x)" if stall is not None else "")
        )


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
        if "pod_over_single_process_runs" in s:
            pairs = ", ".join(
                f"{p:.0f} / {b:.0f} = {r:.2f}x"
                for p, b, r in zip(
                    s["tokens_per_s_runs"],
                    s["single_process_tokens_per_s_runs"],
                    s["pod_over_single_process_runs"],
                    strict=True,
                )  # fmt: skip
            )
            print(
                f"  {s['repeat']} alternating pairs, pod / one process (tokens/s): {pairs};"
                f" median pair {s['pod_over_single_process']:.2f}x (medians above)"
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
