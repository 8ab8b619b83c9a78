"""One `xpod bench alltoall` from start to end: per point of the plan one pod, every protocol x
quant row and then the peers (`--repeat` times), then the table, the summary, JSON and plot."""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np

from bench import common
from bench.alltoall.inputs import Point, counts_matrix, hottest_over_mean, msg_bytes, split_protocol
from bench.alltoall.measure import a2a_row, measure_peers, memcpy_gbps, xpod_row
from bench.alltoall.options import Options, parse_options, plan, pod_config
from bench.alltoall.report import COLUMNS, merge_repeats, mib, print_summary, table_rows
from bench.project import attach
from runtime import Pod


def _want_rows(pt: Point, counts) -> np.ndarray:
    """Rows each die must receive (expert dies) or send (A2E attention dies)."""
    want = counts.sum(axis=0)
    if pt.attention_dies:
        want[: pt.attention_dies] = counts[: pt.attention_dies].sum(axis=1)
    return want


def run_point(pt: Point, protocols: list[str], opts: Options, trace_path: str | None) -> list:
    """One pod for `pt`: every protocol x quant row, then the peers; `opts.repeat` times.
    Returns one list of rows per repeat."""
    counts = counts_matrix(pt)
    want = _want_rows(pt, counts)
    cfg = pod_config(pt, opts)
    cores = cfg.cores
    bufs = cfg.layout().fused_buffer_bytes()
    common.progress(
        f"{pt.label}: {pt.num_experts} experts, {cfg.layout().region_bytes / 2**20:.0f} MiB per"
        f" region, fused receive buffers per die: dispatch {mib(bufs['dispatch'])}"
        f" (x2 halves), combine {mib(bufs['combine'])}; wait={cfg.wait_policy().name}"
    )
    extra = {
        "fused_dispatch_buffer_bytes": bufs["dispatch"],
        "fused_combine_buffer_bytes": bufs["combine"],
        "wait": cfg.wait_policy().name,
        "pinned": cfg.pinned(),
    }
    dedup_counts = counts_matrix(pt, dedup=True)
    extra["hottest_over_mean"] = hottest_over_mean(pt)
    runs = []
    with Pod.launch(cfg) as pod:
        for rep in range(opts.repeat):
            rows = []
            memcpy = {}
            for quant in opts.quants:
                dm, cm = msg_bytes(pt, quant)
                msgs = float(np.mean(counts[: pt.senders].sum(axis=1)))
                memcpy[quant] = memcpy_gbps([int(msgs * dm), int(msgs * cm)])
            for protocol in protocols:
                for quant in opts.quants:
                    t0 = time.monotonic()
                    res = xpod_row(pod, pt, protocol, quant, want, opts)
                    a2e_extra = {k: v for k, v in res.items() if k.startswith("metadata")}
                    dedup = split_protocol(protocol)[1]
                    rows.append(
                        a2a_row(
                            "xpod",
                            protocol,
                            quant,
                            pt,
                            res,
                            dedup_counts if dedup else counts,
                            cores,
                            memcpy[quant],
                            **extra,
                            **a2e_extra,
                        )
                    )
                    r = rows[-1]
                    common.progress(
                        f"  {pt.label} xpod {protocol} {quant}: dispatch p50"
                        f" {r['dispatch_p50_us']:.0f} us, combine p50 {r['combine_p50_us']:.0f}"
                        f" us ({r['iters']} iters, {time.monotonic() - t0:.1f} s)"
                        + (f" [repeat {rep + 1}]" if opts.repeat > 1 else "")
                    )
            if opts.peers and not pt.attention_dies and pt.dies >= 2:
                rows += measure_peers(pt, counts, opts, memcpy, cores)
            runs.append(rows)
        if trace_path:
            n = pod.write_trace(trace_path)
            common.progress(f"wrote {n} trace events to {trace_path}")
    return runs


def _trace_path(base: str | None, pt: Point, many: bool) -> str | None:
    if not base or not many:
        return base
    root, ext = os.path.splitext(base)
    tag = (
        f"a2e{pt.attention_dies}+{pt.dies - pt.attention_dies}"
        if pt.attention_dies
        else (f"ep{pt.dies}")
    )
    skew = ".skew" if pt.routing == "skew" else ""
    return f"{root}.{tag}.b{pt.batch}{skew}{ext or '.json'}"


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))


def run(opts: Options) -> int:
    points = plan(opts)
    common.progress(
        f"xpod bench alltoall: {len(points)} pod(s), batches {opts.batches}, hidden {opts.hidden},"
        f" top-{opts.topk}, protocols {','.join(opts.protocols)}, quant {','.join(opts.quants)}"
        f"{', peers mpi4py + zmq' if opts.peers else ''}, {os.cpu_count()} cores"
    )
    cfg_of = partial(pod_config, opts=opts)
    projected = attach.alltoall_figures(opts.project, points, opts.quants, cfg_of)
    runs: list[list[dict]] = [[] for _ in range(opts.repeat)]
    t_start = time.monotonic()
    for i, (pt, protocols) in enumerate(points):
        per_rep = run_point(pt, protocols, opts, _trace_path(opts.trace, pt, len(points) > 1))
        for rep, rows in enumerate(per_rep):
            runs[rep] += rows
        common.progress(
            f"[{i + 1}/{len(points)}] {pt.label} done, {time.monotonic() - t_start:.0f} s"
        )
    rows = runs[0] if opts.repeat == 1 else merge_repeats(runs)
    attach.attach(rows, projected, attach.alltoall_key)
    columns = COLUMNS + ([("total_p50_spread", "spread", ".0%")] if opts.repeat > 1 else [])
    common.print_table(table_rows(rows), columns)
    print_summary(rows)
    attach.print_projected(rows, opts.project, "alltoall")
    common.write_outputs(rows, opts.json, opts.plot)
    return 0
