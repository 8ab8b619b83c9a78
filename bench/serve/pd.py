"""The figures of a PD layout (`--prefill-dies`) and of its comparison with the colocated one:

- from `/metrics` over the main run (deltas between its first and last scrape): the KV
  transfer rate (`kv_transfer_gbps` = bytes / seconds summed over the prefill -> decode links;
  the seconds are the copies on the prefill dies' KV threads), the mean transfer size, the TTFT
  split (the mean of each `xpod_pd_ttft_phase_seconds` part: queue, prefill, transfer,
  first_step; their sum against the client's TTFT: `ttft_split_slack_ms` = median TTFT - the
  sum, as asked, and `ttft_split_slack_mean_ms` = mean TTFT - the sum, which is the HTTP and
  SSE path alone since a sum of means is the mean of the sums: the bar TTFT_SLACK_MS applies to
  it), and the KV checksum mismatches, quarantined blocks, expired leases, failed transfers,
  recomputed requests and restarts since the server started (a counter that went down was
  reset by a restart: `scrape.increase` counts it from 0);
- `xpod bench p2p`'s zero-copy ping-pong at the mean transfer size (one lane, a 2-die pod
  launched once the server is gone): `p2p_zero_copy_gbps`, `kv_over_p2p` (the bar: >= 0.8);
- the replay of every step the server ran (`xpod serve --replay-check`): `replay_bit_equal`;
- the PD / colocated comparison of a `--compare-colocated` run (`comparison`).
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np

from bench.serve.scrape import by_label, increase, total

PHASES = ("queue", "prefill", "kv_wait", "transfer", "first_step")
KV_OVER_P2P_BAR = 0.8  # KV transfer GB/s >= 0.8 x p2p zero-copy GB/s at the same size
DECODE_BAR = 0.85  # HTTP output tok/s >= 0.85 x xpod decode's on the decode part
DECODE_CPU_BAR = 1.1  # decode dies' CPU per output token <= 1.1 x xpod decode's, same batch
TTFT_SLACK_MS = 5.0  # mean TTFT - (queue + prefill + transfer + first_step) <= 5 ms
P2P_ALIGN = 64  # the p2p message: the mean transfer size rounded to a multiple of this

# --json of --compare-colocated: these keys under both "pd" and "colocated", PD_KEYS under "pd"
LAYOUT_KEYS = ("completed", "failed", "output_throughput", "goodput", "p99_tpot_ms",
               "idle_tpot_ms", "burst_tpot_p99_ms", "median_ttft_ms")  # fmt: skip
PD_KEYS = ("kv_transfer_gbps", "p2p_zero_copy_gbps", "replay_bit_equal", "checksum_mismatches")
# the side-by-side table: (key, label, format, higher is better)
COMPARE_ROWS = (
    ("completed", "completed", "d", True),
    ("failed", "failed", "d", False),
    ("output_throughput", "output tok/s", ".1f", True),
    ("request_throughput", "req/s (saturation)", ".2f", True),
    ("goodput", "goodput req/s (best of sweep)", ".2f", True),
    ("median_ttft_ms", "TTFT p50 ms", ".1f", False),
    ("p99_ttft_ms", "TTFT p99 ms", ".1f", False),
    ("median_tpot_ms", "TPOT p50 ms", ".2f", False),
    ("p99_tpot_ms", "TPOT p99 ms", ".2f", False),
    ("idle_tpot_ms", "idle TPOT ms", ".2f", False),
    ("burst_tpot_p50_ms", "burst TPOT p50 ms", ".2f", False),
    ("burst_tpot_p99_ms", "burst TPOT p99 ms", ".2f", False),
    ("burst_over_idle", "burst TPOT p99 / idle", ".2f", False),
    ("burst_itl_p99_ms", "burst ITL p99 ms", ".2f", False),
    ("burst_ttft_p50_ms", "burst TTFT p50 ms", ".1f", False),
    ("ratio_to_decode", "HTTP / xpod decode", ".3f", True),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def is_pd(snap: dict | None) -> bool:
    """Does a /metrics scrape come from a PD server?"""
    return bool(snap) and "xpod_kv_transfer_bytes_total" in snap


def pd_figures(s0: dict | None, s1: dict | None, n_out: int = 0) -> dict:
    """The PD figures of a run from its first and last scrape (see the module docstring); {}
    when the server is not a PD one (a sample missing in `s0` counts 0). The CPU of each part's
    dies per output token (the parts are read from the links' labels, `prefill->decode`)."""
    if not is_pd(s1):
        return {}

    def d(name: str, **labels: str) -> float:
        return increase(s0, s1, name, **labels)

    nbytes, secs = d("xpod_kv_transfer_bytes_total"), d("xpod_kv_transfer_seconds_total")
    n = d("xpod_kv_transfers_total")
    out: dict = {
        "kv_transfers": int(n),
        "kv_transfer_bytes": int(nbytes),
        "kv_transfer_seconds": secs,
        "kv_transfer_gbps": nbytes / secs / 1e9 if secs > 0 else None,
        "kv_transfer_mean_bytes": nbytes / n if n else None,
    }
    split: dict[str, float | None] = {}
    for p in PHASES:
        c = d("xpod_pd_ttft_phase_seconds_count", phase=p)
        split[p] = d("xpod_pd_ttft_phase_seconds_sum", phase=p) * 1e3 / c if c else None
    out["ttft_split_ms"] = split
    out["ttft_split_requests"] = int(d("xpod_pd_ttft_phase_seconds_count", phase="queue"))
    parts = list(split.values())
    out["ttft_split_sum_ms"] = sum(parts) if all(v is not None for v in parts) else None
    # since the server started (a mismatch any time is one too many)
    out["checksum_mismatches"] = int(total(s1, "xpod_kv_checksum_mismatches_total"))
    out["quarantined_blocks"] = int(total(s1, "xpod_kv_quarantined_blocks_total"))
    out["leases_expired"] = int(total(s1, "xpod_kv_leases_expired_total"))
    out["pd_transfers_failed"] = int(total(s1, "xpod_pd_transfers_total", result="failed"))
    out["pd_recomputed"] = int(total(s1, "xpod_pd_recomputed_total"))
    out["pd_failed"] = int(total(s1, "xpod_pd_failed_total"))
    out["server_restarts"] = int(total(s1, "xpod_engine_incarnation"))  # since it started
    links = [k.split("->") for k in by_label(s1, "xpod_kv_transfers_total", "link") if k]
    for part, side in (("prefill", 0), ("decode", 1)):
        dies = sorted({int(x[side]) for x in links})
        cpu = sum(d("xpod_process_cpu_seconds_total", role="die", group=str(g)) for g in dies)
        out[f"{part}_dies_cpu_s"] = cpu
        out[f"{part}_dies_cpu_ms_per_token"] = cpu * 1e3 / n_out if n_out else None
    states = by_label(s1, "xpod_kv_link_state", "state")
    out["links_not_ok"] = int(states.get("slow", 0) + states.get("dead", 0))
    return out


def ttft_split(s0: dict | None, s1: dict | None) -> dict[str, float | None]:
    """The mean of each TTFT part (ms) over the PD requests that finished between two scrapes
    ({} when the server is not a PD one)."""
    if not is_pd(s1):
        return {}
    out: dict[str, float | None] = {}
    for p in PHASES:
        c = increase(s0, s1, "xpod_pd_ttft_phase_seconds_count", phase=p)
        v = increase(s0, s1, "xpod_pd_ttft_phase_seconds_sum", phase=p)
        out[p] = v * 1e3 / c if c else None
    return out


def idle_split(s0: dict | None, s1: dict | None, ttfts_ms: list[float]) -> dict:
    """The TTFT split of probes sent one at a time (no queue, no backpressure) against their
    mean client TTFT (ms): `idle_ttft_split_ms`, its sum, the mean, the slack (HTTP,
    tokenizing, rendering, the client) and whether it is within TTFT_SLACK_MS; {} when the
    server is not a PD one or saw no whole split."""
    split = ttft_split(s0, s1)
    if not split or any(v is None for v in split.values()) or not ttfts_ms:
        return {}
    mean, parts = float(np.mean(ttfts_ms)), sum(split.values())
    return {"idle_ttft_split_ms": split, "idle_ttft_split_sum_ms": parts,
            "idle_ttft_mean_ms": mean, "idle_ttft_split_slack_ms": mean - parts,
            "idle_ttft_split_within_slack": mean - parts <= TTFT_SLACK_MS}  # fmt: skip


def ttft_check(res: dict) -> dict:
    """TTFT against its parts (`pd_figures`' split and the run's client TTFT)."""
    s = res.get("ttft_split_sum_ms")
    if s is None:
        return {"ttft_split_slack_ms": None, "ttft_split_slack_mean_ms": None,
                "ttft_split_ratio": None, "ttft_split_within_slack": None}  # fmt: skip
    med, mean = res.get("median_ttft_ms") or 0.0, res.get("mean_ttft_ms") or 0.0
    return {
        "ttft_split_slack_ms": med - s,
        "ttft_split_slack_mean_ms": mean - s,
        "ttft_split_ratio": s / med if med else None,
        "ttft_split_within_slack": mean - s <= TTFT_SLACK_MS,
    }


def p2p_size(mean_bytes: float) -> int:
    """The p2p message size of a mean KV transfer: rounded to a multiple of P2P_ALIGN."""
    return max(P2P_ALIGN, int(round(mean_bytes / P2P_ALIGN)) * P2P_ALIGN)


def p2p_zero_copy(size: int, scale: float = 1.0) -> dict:
    """`xpod bench p2p`'s zero-copy ping-pong between die 0 and die 1 of a 2-die pod at `size`
    bytes, one lane (a KV transfer is one thread's copy): its row (`gbps`, `p50_us`, ...), with
    the KV link's own ping-pong in the same pod at the same size under "kv_link" (the protocol
    alone, its dies each on a core: what the KV thread achieves when nothing else runs)."""
    from bench.p2p import measure_xpod
    from runtime import Pod, PodConfig

    cfg = PodConfig(num_dies=2, lanes=4, app_bytes=2 * size + (4 << 20), serve_slot_bytes=4096)
    with Pod.launch(cfg) as pod:
        zc, kv = measure_xpod(pod, [size], ["zero-copy", "kv-link"], [1], scale)
    return {**zc, "kv_link": kv}


def read_replay(path: str) -> dict:
    """The verdict `xpod serve --replay-check` wrote: replay_* keys (replay_bit_equal None and
    replay_error when there is none)."""
    try:
        with open(path, encoding="utf-8") as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        return {"replay_bit_equal": None, "replay_error": f"{type(e).__name__}: {e}"}
    out = {
        "replay_bit_equal": bool(rep.get("bit_equal")),
        "replay_steps": rep.get("steps"),
        "replay_sampled": rep.get("sampled"),
        "replay_token_mismatches": rep.get("n_token_mismatches"),
        "replay_logit_mismatches": rep.get("n_logit_mismatches"),
    }
    if not rep.get("steps"):
        out["replay_error"] = "the server logged no step"
    return out


def remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def best_goodput(res: dict) -> tuple[float | None, float | None]:
    """(goodput, offered rate) of a layout: the best sweep row's goodput (`request_goodput`,
    else the request throughput), or the main run's without a sweep."""
    rows = res.get("rate_sweep") or ()
    if rows:
        best = max(rows, key=lambda r: r["goodput"] or 0.0)
        return best["goodput"], best["request_rate"]
    g = res.get("request_goodput")
    return (g if g is not None else res.get("request_throughput")), None


def comparison(pd: dict, colo: dict) -> dict:
    """Side by side: {key: {"pd", "colocated", "pd_over_colocated"}} and the sweep's rows."""
    out: dict = {}
    for key, *_ in COMPARE_ROWS:
        a, b = pd.get(key), colo.get(key)
        out[key] = {"pd": a, "colocated": b, "pd_over_colocated": _ratio(a, b)}
    sweep = []
    colo_rows = {r["fraction"]: r for r in colo.get("rate_sweep") or ()}
    for r in pd.get("rate_sweep") or ():
        c = colo_rows.get(r["fraction"], {})
        sweep.append({"fraction": r["fraction"], "request_rate": r["request_rate"],
                      **{f"{k}_{side}": src.get(k) for k in ("goodput", "ttft_p50_ms",
                         "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "failed")
                         for side, src in (("pd", r), ("colocated", c))}})  # fmt: skip
    out["rate_sweep"] = sweep
    out["capacity_req_per_s"] = pd.get("capacity_req_per_s")
    out["capacity_note"] = "the PD layout's saturation throughput, used for both sweeps"
    return out
