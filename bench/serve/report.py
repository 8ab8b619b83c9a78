"""The report of a run on stdout (vLLM's summary block, then the server figures, the decode
baseline, the DP-balance comparison, the TTFT phase and the rate sweep) and its PNG plots."""

from __future__ import annotations

import sys

import numpy as np

from bench.common import print_table
from bench.serve.client import RequestResult
from bench.serve.options import Options
from bench.serve.stats import pct_key

METRIC_NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
SHOW_ERRORS = 5


def print_report(r: dict, opts: Options) -> None:
    def row(label: str, value, spec: str = "") -> None:
        v = "-" if value is None else (format(value, spec) if spec else value)
        print(f"{label:<40} {v:<10}")

    print()
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Maximum request concurrency:", r["max_concurrency"])
    row("Benchmark duration (s):", r["duration"], ".2f")
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"], ".2f")
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", r["output_throughput"], ".2f")
    row("Peak concurrent requests:", r["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", r["total_token_throughput"], ".2f")
    for name in opts.percentile_metrics:
        header, short = METRIC_NAMES[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", r[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", r[f"median_{name}_ms"], ".2f")
        for p in opts.metric_percentiles:
            row(f"P{p:g} {short} (ms):", r[f"{pct_key(p)}_{name}_ms"], ".2f")
    if "kv_balance" in r:
        print("{s:{c}^{n}}".format(s="Server (/metrics, over the run)", n=50, c="-"))
        row("KV balance (max/mean):", r["kv_balance"], ".3f")
        row("  while requests arrive:", r.get("kv_balance_arrivals"), ".3f")
        row("Dummy-step share:", r["dummy_step_share"], ".3f")
        row("Bubble per step (ms):", r["bubble_ms_per_step"], ".3f")
        row("Step time, mean (ms):", r["step_ms_mean"], ".2f")
        row("MoE wait share:", r["moe_wait_share"], ".3f")
        row("Attention imbalance (mean):", r["attention_imbalance_mean"], ".3f")
        row("Prefix hit rate:", r["prefix_hit_rate"], ".3f")
        if "hit_rate" in r:  # by source: the die's prefix cache, the KV pool, computed
            row("Prompt tokens local/pool/computed:", f"{r['local_prompt_tokens']}/"
                f"{r['pool_prompt_tokens']}/{r['computed_prompt_tokens']}")  # fmt: skip
            row("Hit rate (local + pool, pool):", f"{r['hit_rate']:.3f}, {r['pool_hit_rate']:.3f}")
        if "pool_loads" in r:
            row(
                "Pool loads (fell back, crc bad):",
                f"{r['pool_loads']} ({r['pool_fallbacks']}, {r['pool_crc_mismatches']})",
            )
            row("Pool load ms / GB/s:", f"{r['pool_load_ms_mean']:.2f} / {r['pool_load_gbps']:.2f}")
        print("{s:{c}^{n}}".format(s="CPU s (ms per output token)", n=50, c="-"))
        for key in ("client", "shell", "masters", "outputs", "dies", "server"):
            if f"cpu_s_{key}" in r:
                print(
                    "{:<40} {:<10}".format(
                        f"{key.capitalize()}:",
                        f"{r[f'cpu_s_{key}']:.2f} ({r[f'cpu_ms_per_token_{key}']:.3f})",
                    )
                )
    if "decode_tokens_per_s" in r:
        print("{s:{c}^{n}}".format(s="Against xpod decode (same run)", n=50, c="-"))
        row(f"Decode tok/s (batch {r['decode_batch']}):", r["decode_tokens_per_s"], ".2f")
        row("  with its prefill (tok/s):", r.get("decode_e2e_tokens_per_s"), ".2f")
        row("HTTP / decode:", r.get("ratio_to_decode"), ".3f")
        row("HTTP / decode with prefill:", r.get("ratio_to_decode_with_prefill"), ".3f")
        if r.get("pairs"):
            ratios = ", ".join(f"{p['ratio_to_decode']:.2f}" for p in r["pairs"])
            row("  pairs (median shown):", ratios)
    if r.get("lb_compare"):
        print("{s:{c}^{n}}".format(s="DP balance: least_kv vs round_robin", n=50, c="-"))
        for policy, f in r["lb_compare"].items():
            row(f"{policy}: KV max/mean, arriving / all:",
                f"{f['kv_balance_arrivals']:.3f} / {f['kv_balance']:.3f}")  # fmt: skip
            row(f"{policy}: attention imbalance:", f"{f['attention_imbalance_mean']:.3f}")
            row(f"{policy}: TTFT / TPOT p50 (ms):",
                f"{f['median_ttft_ms']:.1f} / {f['median_tpot_ms']:.2f}")  # fmt: skip
    if "ttft_idle_p50_ms" in r:
        print("{s:{c}^{n}}".format(s="TTFT phase", n=50, c="-"))
        row("Idle TTFT p50 (ms):", r["ttft_idle_p50_ms"], ".2f")
        row("Prefill per request (ms):", r["prefill_ms"], ".2f")
        row(
            "  bound prefill + 5 (ms):",
            f"{r['ttft_idle_bound_ms']:.2f} ({'met' if r['ttft_idle_within_bound'] else 'MISSED'})",
        )
        row(
            f"Loaded TTFT p50 / p99 (ms, {r['ttft_load_requests']} bg):",
            f"{r['ttft_load_p50_ms']:.2f} / {r['ttft_load_p99_ms']:.2f}",
        )
        row("Step time under load (ms):", r["step_load_ms"], ".2f")
        row(
            "  bound prefill + 2 steps + 5 (ms):",
            f"{r['ttft_load_bound_ms']:.2f} ({'met' if r['ttft_load_within_bound'] else 'MISSED'})",
        )
    print("=" * 50)
    if r.get("errors"):
        print(f"first errors of {r['failed']} failed request(s):")
        for e in r["errors"][:SHOW_ERRORS]:
            print(f"  {e}")
    if r.get("rate_sweep"):
        gp = "goodput" if opts.goodput else "goodput (= req/s, no --goodput)"
        print(
            f"\nrate sweep (capacity {r['capacity_req_per_s']:.2f} req/s at saturation;"
            f" open loop; {gp}; * = knee)"
        )
        rows = [{**x, "mark": "*" if x["knee"] else ""} for x in r["rate_sweep"]]
        print_table(
            rows,
            [
                ("fraction", "x cap", "g"),
                ("request_rate", "req/s", ".2f"),
                ("request_throughput", "done/s", ".2f"),
                ("goodput", "goodput", ".2f"),
                ("ttft_p50_ms", "TTFT p50", ".1f"),
                ("ttft_p99_ms", "p99", ".1f"),
                ("tpot_p50_ms", "TPOT p50", ".2f"),
                ("tpot_p99_ms", "p99", ".2f"),
                ("failed", "failed", "d"),
                ("mark", "knee", ""),
            ],
        )
    sys.stdout.flush()


def _figure(size: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_sweep(rows: list[dict], path: str, slo: bool) -> None:
    fig = _figure((12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    rate = [r["request_rate"] for r in rows]
    for key, style in (
        ("ttft_p50_ms", "o-"),
        ("ttft_p99_ms", "o--"),
        ("tpot_p50_ms", "s-"),
        ("tpot_p99_ms", "s--"),
    ):
        ax1.plot(rate, [r[key] for r in rows], style, label=key.replace("_ms", " (ms)"))
    ax1.set_yscale("log")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("ms")
    ax1.legend()
    ax1.grid(True, alpha=0.3)
    ax2.plot(rate, [r["goodput"] for r in rows], "o-", label="goodput" if slo else "req/s done")
    ax2.plot(rate, rate, ":", color="gray", label="offered")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("req/s")
    ax2.grid(True, alpha=0.3)
    for r in rows:
        if r["knee"]:
            for ax in (ax1, ax2):
                ax.axvline(r["request_rate"], color="red", alpha=0.5, label="knee")
    ax2.legend()
    fig.suptitle("xpod bench serve: latency and goodput against the request rate")
    fig.savefig(path, dpi=110)


def plot_cdfs(results: list[RequestResult], path: str) -> None:
    ok = [r for r in results if r.ok]
    values = {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [r.tpot * 1e3 for r in ok if r.output_tokens > 1],
        "ITL": [g * 1e3 for r in ok for g in r.itl],
        "E2E latency": [r.latency * 1e3 for r in ok],
    }
    fig = _figure((14, 3.8))
    for ax, (name, v) in zip(fig.subplots(1, 4), values.items(), strict=True):
        if v:
            a = np.sort(v)
            ax.plot(a, np.arange(1, a.size + 1) / a.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
    fig.suptitle("xpod bench serve: latency CDFs")
    fig.savefig(path, dpi=110)
