"""vLLM's result keys of one run, from what the client saw of each request: throughput,
goodput, and mean / median / std / percentiles of TTFT, TPOT, ITL and E2E latency; the knee of
a rate sweep."""

from __future__ import annotations

import numpy as np

from bench.serve.client import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_RISE = 0.02  # the sweep's goodput "stops rising" when it gains less than this


def pct_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def metric_stats(values_ms: list[float], name: str, percentiles: tuple[float, ...]) -> dict:
    """vLLM's keys of one metric: mean_/median_/std_/p<q>_<name>_ms (0 when there are none)."""
    a = np.asarray(values_ms, dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(a.mean()) if a.size else 0.0,
        f"median_{name}_ms": float(np.median(a)) if a.size else 0.0,
        f"std_{name}_ms": float(a.std()) if a.size else 0.0,
    }
    for p in percentiles:
        out[f"{pct_key(p)}_{name}_ms"] = float(np.percentile(a, p)) if a.size else 0.0
    return out


def is_good(r: RequestResult, slos_ms: dict) -> bool:
    """Does a completed request meet every SLO of --goodput (ms)?"""
    got = {"ttft": r.ttft * 1e3, "tpot": r.tpot * 1e3, "e2el": r.latency * 1e3}
    return r.ok and all(got[k] <= v for k, v in slos_ms.items())


def summarize(
    results: list[RequestResult],
    duration: float,
    slos_ms: dict,
    percentiles: tuple[float, ...] = (90.0, 99.0),
) -> dict:
    """The vLLM result keys of one run."""
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": sum(is_good(r, slos_ms) for r in ok) / dur if slos_ms else None,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }
    values = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.output_tokens > 1],
        "itl": [g * 1e3 for r in ok for g in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    for name in METRICS:
        out.update(metric_stats(values[name], name, percentiles))
    return out


def find_knee(rows: list[dict]) -> int | None:
    """Index of the first sweep row whose TTFT p50 exceeds twice the lowest rate's, or whose
    goodput does not rise (by more than GOODPUT_RISE) over the previous row's; None if none."""
    if not rows:
        return None
    base = rows[0]["ttft_p50_ms"]
    for i, r in enumerate(rows):
        if i and r["ttft_p50_ms"] > 2 * base:
            return i
        if i and r["goodput"] <= rows[i - 1]["goodput"] * (1 + GOODPUT_RISE):
            return i
    return None
