"""The report of a PD run on stdout: after each layout's summary block, the PD extras
(interference, KV transfer against p2p, the TTFT split, the decode part against `xpod decode`,
the KV integrity counters, the replay verdict) and, with `--compare-colocated`, PD and
colocated side by side (the keys of `bench.serve.pd.COMPARE_ROWS`, the interference of both,
the rate sweeps at the same arrival rates)."""

from __future__ import annotations

import sys

from bench.common import print_table
from bench.serve.interference import INTERFERENCE_BAR
from bench.serve.options import Options
from bench.serve.pd import COMPARE_ROWS, DECODE_BAR, KV_OVER_P2P_BAR, PHASES, TTFT_SLACK_MS

WIDTH = 72


def _f(value, spec: str = ".2f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    return format(value, spec) if isinstance(value, int | float) else str(value)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "MISSED")


def print_title(text: str) -> None:
    print()
    print("{s:{c}^{n}}".format(s=f" {text} ", n=WIDTH, c="#"))


def _section(text: str) -> None:
    print("{s:{c}^{n}}".format(s=f" {text} ", n=WIDTH, c="-"))


def interference_lines(r: dict, bar: bool) -> list[str]:
    """The interference phase of one layout (`bar`: judge it against INTERFERENCE_BAR)."""
    if "idle_tpot_ms" not in r:
        return []
    ratio = r.get("burst_over_idle")
    judged = f" (bar <= {INTERFERENCE_BAR:g}: {_verdict(ratio <= INTERFERENCE_BAR)})" if (
        bar and ratio is not None) else ""  # fmt: skip
    return [
        f"idle TPOT {_f(r['idle_tpot_ms'])} ms (gap p99 {_f(r['idle_gap_p99_ms'])} ms,"
        f" {r['interference_streams']} streams, {r['idle_gaps']} gaps)",
        f"burst of {r['burst_prompts']} x {r['burst_len']}-token prompts: decode TPOT (a"
        f" stream's mean gap in the window) p50 {_f(r['burst_tpot_p50_ms'])} / p99"
        f" {_f(r['burst_tpot_p99_ms'])} ms over {r['interference_streams']} streams",
        f"burst TPOT p99 / idle TPOT {_f(ratio)}x{judged}",
        f"single gaps (ITL) in the {_f(r['burst_window_ms'], '.0f')} ms window: p50"
        f" {_f(r['burst_itl_p50_ms'])} / p99 {_f(r['burst_itl_p99_ms'])} ms ({r['burst_gaps']}"
        f" gaps), p99 / idle TPOT {_f(r['burst_itl_over_idle'])}x (idle gap p99 / idle TPOT"
        f" {_f(_div(r['idle_gap_p99_ms'], r['idle_tpot_ms']))}x: the noise floor); burst TTFT"
        f" p50 {_f(r['burst_ttft_p50_ms'], '.1f')} ms",
    ]


def pd_lines(r: dict) -> list[str]:
    """The PD extras of the PD layout's result keys."""
    out = []
    if r.get("kv_transfers"):
        p2p = r.get("p2p_zero_copy_gbps")
        out.append(
            f"KV transfer {_f(r['kv_transfer_gbps'], '.3f')} GB/s ({r['kv_transfers']}"
            f" transfers, mean {_f(r['kv_transfer_mean_bytes'], '.0f')} B); p2p zero-copy"
            f" {_f(p2p, '.3f')} GB/s at {r.get('p2p_size_bytes')} B: ratio"
            f" {_f(r.get('kv_over_p2p'))} (bar >= {KV_OVER_P2P_BAR:g}:"
            f" {_verdict(r.get('kv_over_p2p_met'))})"
        )
        if r.get("kv_link_alone_gbps") is not None:
            out.append(
                f"  the KV link alone (its ping-pong in the same pod, same size):"
                f" {_f(r['kv_link_alone_gbps'], '.3f')} GB/s, p50 {_f(r['kv_link_alone_p50_us'])}"
                f" us: {_f(r.get('kv_link_alone_over_p2p'))}x p2p zero-copy (while serving, the"
                " copy shares core 0 with the prefill dies' steps and masters)"
            )
    else:
        out.append("KV transfer: none in the main run")
    split = r.get("ttft_split_ms") or {}
    if r.get("ttft_split_sum_ms") is not None:
        parts = " + ".join(f"{p} {_f(split[p])}" for p in PHASES)
        out.append(f"TTFT split (means, ms): {parts} = {_f(r['ttft_split_sum_ms'])}")
        out.append(
            f"  client TTFT p50 {_f(r.get('median_ttft_ms'))} ms: slack"
            f" {_f(r.get('ttft_split_slack_ms'))} ms (split / TTFT"
            f" {_f(r.get('ttft_split_ratio'))});"
            f" mean TTFT - split {_f(r.get('ttft_split_slack_mean_ms'))} ms (bar <="
            f" {TTFT_SLACK_MS:g} ms: {_verdict(r.get('ttft_split_within_slack'))})"
        )
    elif split:
        out.append(
            "TTFT split: the server observed no xpod_pd_ttft_phase_seconds in the main run"
            f" ({r.get('ttft_split_requests', 0)} requests)"
        )
    isplit = r.get("idle_ttft_split_ms")
    if isplit:
        parts = " + ".join(f"{p} {_f(isplit[p])}" for p in PHASES)
        out.append(
            f"idle TTFT split ({r.get('ttft_probes')} probes one at a time, means, ms): {parts}"
            f" = {_f(r['idle_ttft_split_sum_ms'])}; client TTFT mean"
            f" {_f(r.get('idle_ttft_mean_ms'))} ms: slack {_f(r.get('idle_ttft_split_slack_ms'))}"
            f" ms (HTTP, tokenizing, rendering, the client; bar <= {TTFT_SLACK_MS:g} ms:"
            f" {_verdict(r.get('idle_ttft_split_within_slack'))})"
        )
    if r.get("ratio_to_decode") is not None:
        out.append(
            f"HTTP / xpod decode on the {r.get('decode_dies')} decode dies"
            f" ({r.get('decode_cores')} core(s))"
            f" {_f(r['ratio_to_decode'], '.3f')} (bar >= {DECODE_BAR:g}:"
            f" {_verdict(r.get('decode_part_bar_met'))})"
        )
    if r.get("decode_cpu_over_xpod_decode") is not None:
        ratio = r["decode_cpu_over_xpod_decode"]
        out.append(
            f"decode dies' CPU per output token {_f(r['decode_dies_cpu_ms_per_token'], '.3f')} ms"
            f" against xpod decode's {_f(r['decode_cpu_ms_per_token'], '.3f')} ms at the same"
            f" batch: {_f(ratio)}x (bar <= {r['decode_cpu_bar']:g}:"
            f" {_verdict(ratio <= r['decode_cpu_bar'])}); prefill dies'"
            f" {_f(r.get('prefill_dies_cpu_ms_per_token'), '.3f')} ms"
        )
    if "checksum_mismatches" in r:
        out.append(
            f"KV checksum mismatches {r['checksum_mismatches']}, quarantined blocks"
            f" {r['quarantined_blocks']}, leases expired {r['leases_expired']}, failed"
            f" transfers {r['pd_transfers_failed']}, recomputed {r['pd_recomputed']}, links"
            f" not ok {r['links_not_ok']}, server restarts {r['server_restarts']}"
        )
    out.append(replay_line(r))
    return out


def replay_line(r: dict) -> str:
    if "replay_bit_equal" not in r:
        return "replay: -"
    eq = r["replay_bit_equal"]
    verdict = "n/a" if eq is None else ("bit-equal" if eq else "NOT bit-equal")
    why = f" ({r['replay_error']})" if r.get("replay_error") else ""
    return (
        f"replay of every step: {verdict} over {r.get('replay_sampled')} sampled tokens,"
        f" {r.get('replay_steps')} steps{why}"
    )


def print_pd(r: dict, opts: Options) -> None:
    """The PD extras after a PD-only run's summary block."""
    _section("PD: interference")
    for line in interference_lines(r, True):
        print(line)
    _section("PD: KV transfer, TTFT split, integrity")
    for line in pd_lines(r):
        print(line)
    print("=" * WIDTH)
    sys.stdout.flush()


def print_comparison(res: dict, opts: Options) -> None:
    """PD vs colocated, side by side."""
    pd, colo, cmp = res["pd"], res["colocated"], res["comparison"]
    print_title("PD vs colocated (the same requests and arrival times)")
    rows = []
    for key, label, spec, _ in COMPARE_ROWS:
        c = cmp[key]
        rows.append({"metric": label, "pd": _f(c["pd"], spec),
                     "colocated": _f(c["colocated"], spec),
                     "ratio": _f(c["pd_over_colocated"], ".2f")})  # fmt: skip
    print_table(
        rows,
        [("metric", "metric", ""), ("pd", "PD", ""), ("colocated", "colocated", ""),
         ("ratio", "PD/colocated", "")],
    )  # fmt: skip
    _section("interference: PD")
    for line in interference_lines(pd, True):
        print(line)
    _section("interference: colocated")
    for line in interference_lines(colo, False):
        print(line)
    _section("PD only")
    for line in pd_lines(pd):
        print(line)
    print(f"colocated {replay_line(colo)}")
    if cmp.get("rate_sweep"):
        gp = "goodput req/s" if opts.goodput else "goodput (= req/s: no --goodput)"
        print(
            f"\nrate sweep, both layouts at fractions of the PD capacity"
            f" {_f(cmp['capacity_req_per_s'])} req/s ({gp}):"
        )
        print_table(
            cmp["rate_sweep"],
            [("fraction", "x cap", "g"), ("request_rate", "req/s", ".2f"),
             ("goodput_pd", "goodput PD", ".2f"), ("goodput_colocated", "colo", ".2f"),
             ("ttft_p50_ms_pd", "TTFT p50 PD", ".1f"), ("ttft_p50_ms_colocated", "colo", ".1f"),
             ("tpot_p99_ms_pd", "TPOT p99 PD", ".2f"),
             ("tpot_p99_ms_colocated", "colo", ".2f"),
             ("failed_pd", "failed PD", "d"), ("failed_colocated", "colo", "d")],
        )  # fmt: skip
    print("=" * WIDTH)
    sys.stdout.flush()
