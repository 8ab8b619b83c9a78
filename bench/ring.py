"""`xpod bench ring`: pass a token around N dies and report microseconds per hop.

Die 0 sends to die 1, die i forwards to i+1, die N-1 returns the token to die 0: one round is N
hops of a blocking send/recv each. With more dies than cores this measures how well waiting dies
give way to the one holding the token (a pure-spin loop takes milliseconds per hop on 2 cores).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

import comm
from bench import common
from bench.project import attach
from runtime import Pod, PodConfig
from runtime.cli.argtypes import input_file, int_list, output_file, positive_int
from runtime.cli.argtypes import size as size_arg
from runtime.cli.flags import load_config

COLUMNS = [
    ("dies", "dies", "d"),
    ("size_bytes", "size", "size"),
    ("wait", "wait", ""),
    ("rounds", "rounds", "d"),
    ("p50_us_per_hop", "p50_us/hop", ".2f"),
    ("p99_us_per_hop", "p99_us/hop", ".2f"),
    ("min_us_per_hop", "min_us/hop", ".2f"),
    ("cpu_s_per_die", "cpu_s/die", ".3f"),
]


def token_ring(die, size: int, rounds: int, warmup: int) -> tuple:
    """Run `warmup + rounds` rounds; die 0 returns per-round times in ns."""
    n, me = die.num_dies, die.die_id
    nxt, prv = (me + 1) % n, (me - 1) % n
    tok = np.zeros(max(1, size // 8), np.int64)
    comm.barrier(die)
    cpu0 = time.process_time()
    samples = []
    for r in range(warmup + rounds):
        if me == 0:
            t0 = time.perf_counter_ns()
            tok[0] = r
            comm.send(die, tok, nxt, r)
            comm.recv(die, tok, prv, r)
            if tok[0] != r + n - 1:
                raise AssertionError(f"ring round {r}: token {tok[0]} != {r + n - 1}")
            if r >= warmup:
                samples.append(time.perf_counter_ns() - t0)
        else:
            comm.recv(die, tok, prv, r)
            tok[0] += 1
            comm.send(die, tok, nxt, r)
    return samples, time.process_time() - cpu0


RING_FLAGS = {"num_dies": "--dies", "app_bytes": "--size", "trace": "--trace"}


def ring_config(
    dies: int, size: int = 8, config: str | None = None, trace: bool = False
) -> PodConfig:
    """The PodConfig of a ring of `dies` dies passing a `size`-byte token; a ConfigError names
    the flag (`--dies`, `--size`, `--config`)."""
    app_bytes = 1 << 20 if size <= 256 << 10 else 2 * size + (1 << 20)  # room for the token
    return load_config(
        config, RING_FLAGS, num_dies=dies, app_bytes=app_bytes, trace=True if trace else None
    )


def run_ring(
    dies: int, rounds: int, size: int = 8, config: str | None = None, trace: str | None = None
) -> dict:
    cfg = ring_config(dies, size, config, bool(trace))
    with Pod.launch(cfg) as pod:
        res = pod.run(token_ring, size, rounds, max(5, rounds // 10))
        if trace:
            n = pod.write_trace(trace)
            common.progress(f"wrote {n} trace events to {trace}")
    samples = np.asarray(res[0][0], dtype=np.float64) / dies
    stats = common.latency_stats(samples)
    row = {
        "bench": "ring",
        "transport": "xpod",
        "dies": dies,
        "size_bytes": size,
        "wait": cfg.wait_policy().name,
        "rounds": rounds,
        "p50_us_per_hop": stats["p50_us"],
        "p99_us_per_hop": stats["p99_us"],
        "min_us_per_hop": stats["min_us"],
        "cpu_s_per_die": float(np.mean([r[1] for r in res])),
    }
    row.update(common.run_info())
    return row


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dies", type=int_list(2), default="8", help="comma list of pod sizes (>= 2), e.g. 8,16,32"
    )
    p.add_argument(
        "--rounds", type=positive_int, default=None, help="timed rounds (default by pod size)"
    )
    p.add_argument("--size", type=size_arg, default="8", help="token bytes, e.g. 8, 4K (default 8)")
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument(
        "--json", type=output_file, default=None, help="write one JSON line per row to FILE"
    )
    p.add_argument(
        "--trace",
        type=output_file,
        default=None,
        help="write a Chrome/Perfetto trace (last pod size)",
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    attach.add_project_args(p, "ring")


@dataclass(frozen=True, slots=True)
class Options:
    pods: list[tuple[int, int]]  # (dies, rounds), in run order
    size: int
    config: str | None
    trace: str | None
    json: str | None
    project: attach.Projection | None = None  # --project: loaded and checked here


def parse_options(args: argparse.Namespace) -> Options:
    """Options of the parsed flags, every pod's PodConfig checked (ConfigError names the flag)."""
    pods = []
    for dies in args.dies:
        ring_config(dies, args.size, args.config, bool(args.trace))
        pods.append((dies, args.rounds or max(20, (400 if args.quick else 2000) // dies)))
    project = attach.projection_of(args)
    return Options(pods, args.size, args.config, args.trace, args.json, project)


def run(opts: Options) -> int:
    rows = []
    cfg_of = partial(ring_config, size=opts.size, config=opts.config)
    projected = attach.ring_figures(opts.project, opts.pods, opts.size, cfg_of)
    for dies, rounds in opts.pods:
        common.progress(f"xpod bench ring: {dies} dies, {rounds} rounds ...")
        rows.append(run_ring(dies, rounds, opts.size, opts.config, opts.trace))
    attach.attach(rows, projected, lambda r: (r["dies"],))
    common.print_table(rows, COLUMNS)
    attach.print_projected(rows, opts.project, "ring")
    if opts.json:
        common.write_jsonl(opts.json, rows)
    return 0


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
