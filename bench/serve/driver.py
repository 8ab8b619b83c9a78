"""One `xpod bench serve` from start to end: the launched server, the `xpod decode` baseline
pairs, the phases against the server, the DP-balance comparison, then the report, the JSON and
the plot. A PD run (`--prefill-dies`) adds its server's replay verdict and the p2p baseline
(`pd_extras`); `--compare-colocated` runs a layout (`run_layout`) twice, PD then colocated,
the second one's rate sweep at the first one's capacity, and reports them side by side."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import tempfile
from dataclasses import replace

from bench.common import progress, run_info
from bench.serve.client import RequestResult
from bench.serve.flags import parse_options
from bench.serve.mt_compare import compare_pool_result, print_compare_pool, run_compare_pool
from bench.serve.options import PROG, BenchError, Options
from bench.serve.pd import (
    DECODE_BAR,
    DECODE_CPU_BAR,
    KV_OVER_P2P_BAR,
    best_goodput,
    comparison,
    p2p_size,
    p2p_zero_copy,
    read_replay,
    remove_quietly,
    ttft_check,
)
from bench.serve.pd_report import print_comparison, print_pd, print_title
from bench.serve.phases import bench_async
from bench.serve.report import SHOW_ERRORS, plot_cdfs, plot_sweep, print_report
from bench.serve.server import STOP_TIMEOUT_S, LaunchedServer

REPLAY_STOP_TIMEOUT_S = 900.0  # the replay of a long run's steps (one process) takes minutes


def set_policy(policy: int | dict[int, int]) -> dict[int, int]:
    """Every thread of this process to `policy` (one for all, or by thread id: SCHED_OTHER for
    the others); returns the policies they had. SCHED_BATCH: the client shares the 2 cores with
    the lockstep dies, like the shell (`runtime.api.server`); threads made later inherit it."""
    old = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError, AttributeError, ValueError):
            old[tid] = os.sched_getscheduler(tid)
            p = policy if isinstance(policy, int) else policy.get(tid, os.SCHED_OTHER)
            os.sched_setscheduler(tid, p, os.sched_param(0))
    return old


def decode_baseline(opts: Options, i: int = 0, n: int = 1) -> dict:
    """`xpod decode` at the launched server's dies (a PD server's decode dies) and global batch,
    the run's lengths, the server's model."""
    from runtime.decode import DecodeOptions, run_decode

    dies = opts.baseline_dies
    batch = opts.max_concurrency or dies * opts.max_num_seqs
    pair = f" (pair {i + 1}/{n})" if n > 1 else ""
    # a PD server's decode part runs on one core (prefill on the other): the baseline too
    cores = 1 if opts.layout == "pd" and len(os.sched_getaffinity(0)) >= 2 else 0
    part = " (the decode part, on one core as it serves)" if cores else (
        " (the decode part)" if opts.layout == "pd" else "")  # fmt: skip
    progress(
        f"  baseline{pair}: xpod decode, {dies} dies{part}, batch {batch}, prompt"
        f" {opts.input_len}, {opts.output_len} steps ..."
    )
    d = run_decode(
        DecodeOptions(
            dies=dies,
            batch=batch,
            prompt_len=opts.input_len,
            steps=opts.output_len,
            model=opts.model,
            protocol=opts.protocol,
            quant=opts.quant,
            seed=opts.seed,
            overrides=dict(opts.model_overrides),
            cores=cores,
        )
    )
    tokens = batch * opts.output_len
    e2e = tokens / (d["prefill_ms"] / 1e3 + tokens / d["tokens_per_s"])  # prefill + decode time
    return {
        "decode_tokens_per_s": d["tokens_per_s"],
        "decode_e2e_tokens_per_s": e2e,
        "decode_batch": batch,
        "decode_cores": cores or len(os.sched_getaffinity(0)),
        "decode_tpot_p50_ms": d.get("tpot_p50_ms"),
        "decode_prefill_ms": d["prefill_ms"],
        # the dies' CPU in decode steps per token (every die's, the same batch)
        "decode_cpu_ms_per_token": d["cpu_s_per_die"] * dies * 1e3 / tokens if tokens else None,
    }


LB_KEYS = ("kv_balance", "kv_balance_arrivals", "attention_imbalance_mean", "output_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "dummy_step_share",
           "failed")  # fmt: skip


def lb_policy(argv: tuple[str, ...]) -> str:
    """The --lb the server argv ends up with (the last one wins, as in argparse)."""
    policy = "least_kv"
    for i, a in enumerate(argv[:-1]):
        if a == "--lb":
            policy = argv[i + 1]
    return policy


def lb_compare(opts: Options, pairs: list) -> dict:
    """The main run once more on a server with the other policy; {policy: figures}."""
    import uvloop

    mine = lb_policy(opts.server_argv)
    other = "round_robin" if mine == "least_kv" else "least_kv"
    argv = (*opts.server_argv, "--lb", other)
    progress(f"  DP balance: the main run again, --lb {other} ...")
    out = {mine: {k: pairs[-1][0].get(k) for k in LB_KEYS}}
    server = LaunchedServer(argv)
    part: dict = {}
    policies: dict[int, int] = {}
    try:
        base = server.start()
        if opts.client_batch and hasattr(os, "SCHED_BATCH"):
            policies = set_policy(os.SCHED_BATCH)
        try:
            uvloop.run(bench_async(opts, base, part, first=False, last=False))
        finally:
            if policies:
                set_policy(policies)
        code = server.stop()
        if code != 0:
            raise BenchError(f"xpod serve --lb {other} exited with status {code}")
    except BaseException:
        server.kill()
        raise
    finally:
        server.close()
    out[other] = {k: part.get(k) for k in LB_KEYS}
    return out


def _base(opts: Options) -> dict:
    """The run's options as result keys."""
    res: dict = {
        "bench": "serve",
        "backend": "xpod",
        "endpoint_type": opts.endpoint,
        "dataset": opts.dataset,
        "num_prompts": opts.num_prompts,
        "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
        "burstiness": opts.burstiness,
        "max_concurrency": opts.max_concurrency,
        "ignore_eos": opts.ignore_eos,
        "random_input_len": opts.input_len,
        "random_output_len": opts.output_len,
        "random_range_ratio": opts.range_ratio,
        "goodput_slos_ms": opts.goodput,
        "launch": opts.launch,
    }
    if opts.launch:
        res.update(
            dies=opts.dies,
            model=opts.model,
            max_num_seqs=opts.max_num_seqs,
            server_args=shlex.join(opts.server_argv),
        )
    if opts.layout:
        res.update(layout=opts.layout, prefill_dies=opts.prefill_dies,
                   decode_dies=opts.decode_dies)  # fmt: skip
    return res


def _replay_file(opts: Options) -> tuple[tuple[str, ...], str, bool]:
    """(server flags, the --replay-check file, whether it is ours to remove): a launched server
    of a PD run (either layout) replays every step it ran at its exit."""
    argv = opts.server_argv
    if not (opts.launch and opts.layout):
        return argv, "", False
    for i, a in enumerate(argv):
        if a == "--replay-check" and i + 1 < len(argv):
            return argv, argv[i + 1], False
        if a.startswith("--replay-check="):
            return argv, a.partition("=")[2], False
    fd, path = tempfile.mkstemp(prefix="xpod-bench-replay-", suffix=".json")
    os.close(fd)
    os.unlink(path)  # the server writes it; none = no verdict
    return (*argv, "--replay-check", path), path, True


def run_layout(opts: Options, capacity: float | None = None) -> tuple[dict, list, int]:
    """One server (launched or at --url): the decode / main-run pairs and their phases, its
    stop (and replay), the DP-balance comparison; the median pair's figures. Returns (result
    keys, the main run's per-request results, exit status); BenchError stops it."""
    import uvloop

    res = _base(opts)
    argv, replay, ours = _replay_file(opts)
    server = LaunchedServer(argv) if opts.launch else None
    status = 0
    pairs: list[tuple[dict, dict, list[RequestResult]]] = []
    try:
        base = server.start() if server else opts.url
        res["url"] = base
        res["client_policy"] = "batch" if opts.client_batch else "normal"
        for i in range(opts.repeat):
            # xpod decode with the server up and idle (its dies parked: ~1 % of a core), and
            # with this process's default policy (its dies are forked from here)
            # (not for multi-turn: its prompts and replies are no decode batch)
            dec = decode_baseline(opts, i, opts.repeat) if opts.launch and not opts.mt else {}
            part = dict(res)
            policies: dict[int, int] = {}
            if opts.client_batch and hasattr(os, "SCHED_BATCH"):  # after every fork of ours
                policies = set_policy(os.SCHED_BATCH)
            try:
                first, last = i == 0, i == opts.repeat - 1
                results = uvloop.run(bench_async(opts, base, part, first, last, capacity))
            finally:
                if policies:
                    set_policy(policies)  # the caller's threads as they were
            part.update(dec)
            if dec.get("decode_tokens_per_s"):
                part["ratio_to_decode"] = part["output_throughput"] / dec["decode_tokens_per_s"]
                part["ratio_to_decode_with_prefill"] = (
                    part["output_throughput"] / dec["decode_e2e_tokens_per_s"]
                )
            pairs.append((part, dec, results))
        if server is not None:
            progress(
                "  stopping the server (SIGTERM"
                + ("; it replays every step it ran" if replay else "")
                + ") ..."
            )
            res["server_exit_status"] = server.stop(
                REPLAY_STOP_TIMEOUT_S if replay else STOP_TIMEOUT_S
            )
            if res["server_exit_status"] != 0:
                status = 1
                progress(
                    f"{PROG}: xpod serve exited with status {res['server_exit_status']}:"
                    f"\n{server.tail()}"
                )
    except BaseException:
        if server is not None:
            server.kill()
        raise
    finally:
        if server is not None:
            server.close()
        if replay and ours and "server_exit_status" not in res:
            remove_quietly(replay)
    if replay:
        res.update(read_replay(replay))
        if ours:
            remove_quietly(replay)
    if opts.lb_compare:
        res["lb_compare"] = lb_compare(opts, pairs)
    # the median pair's figures are the run's (by ratio to decode, else by throughput)
    key = "ratio_to_decode" if opts.launch else "output_throughput"
    order = sorted(range(len(pairs)), key=lambda k: pairs[k][0].get(key) or 0.0)
    part, _, results = pairs[order[len(order) // 2]]
    exit_status = res.get("server_exit_status")
    res.update(part)
    # the TTFT and interference phases ran with the first pair, the rate sweep after the last
    for p, _, _ in (pairs[0], pairs[-1]):
        res.update({k: v for k, v in p.items() if k.startswith(FIRST_LAST_KEYS)})
    if exit_status is not None:
        res["server_exit_status"] = exit_status
    if opts.repeat > 1:
        res["pairs"] = [
            {k: p.get(k) for k in ("decode_tokens_per_s", "output_throughput", "ratio_to_decode",
                                   "ratio_to_decode_with_prefill", "step_ms_mean",
                                   "median_tpot_ms", "failed")}
            for p, _, _ in pairs
        ]  # fmt: skip
        res["failed"] = sum(p["failed"] for p, _, _ in pairs)
    errors = [r.error for r in results if not r.ok]
    res["errors"] = errors[:SHOW_ERRORS]
    if opts.save_detailed:
        res.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            errors=[r.error for r in results],
        )
    if opts.layout:
        res["goodput"], res["goodput_request_rate"] = best_goodput(res)
    if opts.layout == "pd":
        res.update(pd_extras(opts, res))
    if res.get("replay_bit_equal") is False:
        status = 1
        progress(
            f"{PROG}: the replay of the {opts.layout} server's steps is not bit-equal:"
            f" {res.get('replay_token_mismatches')} token and"
            f" {res.get('replay_logit_mismatches')} logit mismatches"
            f" {res.get('replay_error', '')}"
        )
    if res["failed"]:
        status = 1
    return res, results, status


# result keys of the first pair (TTFT, interference) and of the last (the rate sweep)
FIRST_LAST_KEYS = ("ttft_", "prefill_", "step_load_ms", "capacity_", "rate_sweep", "knee_",
                   "idle_", "burst_", "interference_")  # fmt: skip


def pd_extras(opts: Options, res: dict) -> dict:
    """A PD layout's figures beyond the run's: the TTFT split's check, the decode part's bar,
    and `xpod bench p2p` zero-copy at the mean KV transfer size (a 2-die pod launched now: the
    server is gone, the machine quiet)."""
    out = ttft_check(res)
    r = res.get("ratio_to_decode")
    out["ratio_to_decode_bar"] = DECODE_BAR
    out["decode_part_bar_met"] = None if r is None else r >= DECODE_BAR
    mine, base = res.get("decode_dies_cpu_ms_per_token"), res.get("decode_cpu_ms_per_token")
    out["decode_cpu_over_xpod_decode"] = mine / base if mine and base else None
    out["decode_cpu_bar"] = DECODE_CPU_BAR
    mean = res.get("kv_transfer_mean_bytes")
    out.update(p2p_zero_copy_gbps=None, p2p_size_bytes=None, kv_over_p2p=None,
               kv_over_p2p_bar=KV_OVER_P2P_BAR, kv_over_p2p_met=None)  # fmt: skip
    if not (opts.launch and mean):
        return out
    size = p2p_size(mean)
    progress(f"  p2p: xpod bench p2p zero-copy, 1 lane, {size} B (the mean KV transfer) ...")
    row = p2p_zero_copy(size)
    out.update(p2p_zero_copy_gbps=row["gbps"], p2p_size_bytes=size, p2p_p50_us=row["p50_us"],
               p2p_p99_us=row["p99_us"])  # fmt: skip
    kv = res.get("kv_transfer_gbps")
    if kv is not None and row["gbps"]:
        out["kv_over_p2p"] = kv / row["gbps"]
        out["kv_over_p2p_met"] = out["kv_over_p2p"] >= KV_OVER_P2P_BAR
    link = row["kv_link"]  # the KV link's own ping-pong, same pod, same size: the protocol
    alone = link["gbps"] / row["gbps"] if row["gbps"] else None
    out.update(kv_link_alone_gbps=link["gbps"], kv_link_alone_p50_us=link["p50_us"],
               kv_link_alone_p99_us=link["p99_us"], kv_link_alone_over_p2p=alone)  # fmt: skip
    return out


def compare_result(opts: Options, pd: dict, colo: dict) -> dict:
    """The --json object of --compare-colocated: the options, each layout's result keys under
    "pd" and "colocated", the side-by-side "comparison", the run info."""
    res = {**_base(opts), "compare_colocated": True, "pd": pd, "colocated": colo,
           "comparison": comparison(pd, colo), **run_info()}  # fmt: skip
    res["failed"] = pd["failed"] + colo["failed"]
    return res


def run(opts: Options) -> int:
    for note in opts.notes:
        progress(f"  {PROG}: {note}")
    try:
        if opts.compare_pool:
            rounds, results, status = run_compare_pool(opts, run_layout)
        elif opts.compare_colocated:
            n = opts.prefill_dies + opts.decode_dies
            progress(f"  PD layout: {opts.prefill_dies} prefill + {opts.decode_dies} decode dies")
            pd, results, status = run_layout(opts)
            progress(f"  colocated layout: {n} dies, the same requests and arrivals")
            colo_opts = replace(opts, server_argv=opts.colocated_argv, layout="colocated")
            colo, _, colo_status = run_layout(colo_opts, pd.get("capacity_req_per_s"))
            status = max(status, colo_status)
        else:
            res, results, status = run_layout(opts)
    except BenchError as e:
        progress(f"{PROG}: error: {e}")
        return 1
    if opts.compare_pool:
        for i, rnd in enumerate(rounds):
            for name, r in rnd.items():
                print_title(f"round {i + 1}, layout {name}: {r['server_args']}")
                print_report(r, opts)
        res = compare_pool_result(opts, _base(opts), rounds)
        print_compare_pool(res)
        sweeps = []
    elif not opts.compare_colocated:
        res.update(run_info())
        print_report(res, opts)
        if opts.layout == "pd":
            print_pd(res, opts)
        sweeps = [(res.get("rate_sweep"), opts.plot)]
    else:
        print_title(f"PD layout: {opts.prefill_dies} prefill + {opts.decode_dies} decode dies")
        print_report(pd, opts)
        print_title(f"colocated layout: {opts.prefill_dies + opts.decode_dies} dies")
        print_report(colo, opts)
        res = compare_result(opts, pd, colo)
        print_comparison(res, opts)
        colo_plot = opts.plot and os.path.splitext(opts.plot)[0] + "-colocated.png"
        sweeps = [(pd.get("rate_sweep"), opts.plot), (colo.get("rate_sweep"), colo_plot)]
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        progress(f"  wrote {opts.json}")
    if opts.plot and opts.rate_sweep:
        for rows, path in sweeps:
            plot_sweep(rows, path, bool(opts.goodput))
            progress(f"  wrote {path}")
    elif opts.plot:
        plot_cdfs(results, opts.plot)  # the PD layout's with --compare-colocated
        progress(f"  wrote {opts.plot}")
    return status


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
