"""One `xpod bench serve` from start to end: the launched server, the `xpod decode` baseline
pairs, the phases against the server, the DP-balance comparison, then the report, the JSON and
the plot."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex

from bench.common import progress, run_info
from bench.serve.client import RequestResult
from bench.serve.flags import parse_options
from bench.serve.options import PROG, BenchError, Options
from bench.serve.phases import bench_async
from bench.serve.report import SHOW_ERRORS, plot_cdfs, plot_sweep, print_report
from bench.serve.server import LaunchedServer


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
    """`xpod decode` at the launched server's dies and global batch, the run's lengths."""
    from runtime.decode import DecodeOptions, run_decode

    batch = opts.max_concurrency or opts.dies * opts.max_num_seqs
    pair = f" (pair {i + 1}/{n})" if n > 1 else ""
    progress(
        f"  baseline{pair}: xpod decode, {opts.dies} dies, batch {batch}, prompt"
        f" {opts.input_len}, {opts.output_len} steps ..."
    )
    d = run_decode(
        DecodeOptions(
            dies=opts.dies,
            batch=batch,
            prompt_len=opts.input_len,
            steps=opts.output_len,
            model=opts.model,
            protocol=opts.protocol,
            quant=opts.quant,
            seed=opts.seed,
        )
    )
    tokens = batch * opts.output_len
    e2e = tokens / (d["prefill_ms"] / 1e3 + tokens / d["tokens_per_s"])  # prefill + decode time
    return {
        "decode_tokens_per_s": d["tokens_per_s"],
        "decode_e2e_tokens_per_s": e2e,
        "decode_batch": batch,
        "decode_tpot_p50_ms": d.get("tpot_p50_ms"),
        "decode_prefill_ms": d["prefill_ms"],
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


def run(opts: Options) -> int:
    import uvloop

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
    server = LaunchedServer(opts.server_argv) if opts.launch else None
    status = 0
    pairs: list[tuple[dict, dict, list[RequestResult]]] = []
    try:
        base = server.start() if server else opts.url
        res["url"] = base
        res["client_policy"] = "batch" if opts.client_batch else "normal"
        for i in range(opts.repeat):
            # xpod decode with the server up and idle (its dies parked: ~1 % of a core), and
            # with this process's default policy (its dies are forked from here)
            dec = decode_baseline(opts, i, opts.repeat) if opts.launch else {}
            part = dict(res)
            policies: dict[int, int] = {}
            if opts.client_batch and hasattr(os, "SCHED_BATCH"):  # after every fork of ours
                policies = set_policy(os.SCHED_BATCH)
            try:
                results = uvloop.run(bench_async(opts, base, part, i == 0, i == opts.repeat - 1))
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
            progress("  stopping the server (SIGTERM) ...")
            res["server_exit_status"] = server.stop()
            if res["server_exit_status"] != 0:
                status = 1
                progress(
                    f"{PROG}: xpod serve exited with status {res['server_exit_status']}:"
                    f"\n{server.tail()}"
                )
    except BenchError as e:
        if server is not None:
            server.kill()
        progress(f"{PROG}: error: {e}")
        return 1
    except BaseException:
        if server is not None:
            server.kill()
        raise
    finally:
        if server is not None:
            server.close()
    if opts.lb_compare:
        try:
            res["lb_compare"] = lb_compare(opts, pairs)
        except BenchError as e:
            progress(f"{PROG}: error: {e}")
            return 1
    # the median pair's figures are the run's (by ratio to decode, else by throughput)
    key = "ratio_to_decode" if opts.launch else "output_throughput"
    order = sorted(range(len(pairs)), key=lambda k: pairs[k][0].get(key) or 0.0)
    part, _, results = pairs[order[len(order) // 2]]
    exit_status = res.get("server_exit_status")
    res.update(part)
    # the TTFT phase ran with the first pair, the rate sweep after the last
    for p, _, _ in (pairs[0], pairs[-1]):
        res.update({k: v for k, v in p.items() if k.startswith(("ttft_", "prefill_",
                    "step_load_ms", "capacity_", "rate_sweep", "knee_"))})  # fmt: skip
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
    res.update(run_info())
    print_report(res, opts)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        progress(f"  wrote {opts.json}")
    if opts.plot:
        if opts.rate_sweep:
            plot_sweep(res["rate_sweep"], opts.plot, bool(opts.goodput))
        else:
            plot_cdfs(results, opts.plot)
        progress(f"  wrote {opts.plot}")
    if res["failed"]:
        status = 1
    return status


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
