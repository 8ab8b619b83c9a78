"""`xpod run`: launch a pod and move data between every pair of dies at once (isend / irecv over
every p2p variant), payloads checked on arrival; a table of bytes moved and GB/s.

`--hosts 2,2` (or `nodeA:8,nodeB:8`) spreads the dies over several hosts: emulated on this
machine for counts, real machines for names (mpirun over ssh), reached through MPI RMA
(`--fabric mpi`, the default) or through poisoned mirrors on one machine (`--fabric mirror`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import comm
from runtime.cli.argtypes import fmt_size, positive_int
from runtime.cli.argtypes import size as size_arg
from runtime.cli.flags import add_pod_flags, pod_config
from runtime.cli.hosts import add_host_args, host_fields
from runtime.pod import Pod, PodConfig


def add_args(p: argparse.ArgumentParser) -> None:
    add_pod_flags(p)
    p.add_argument(
        "--size", type=size_arg, default="1M", help="bytes per pair per round (default 1M)"
    )
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds (default 5)")
    add_host_args(p)
    p.set_defaults(dies=4)  # with --hosts: their sum


def parse_options(args: argparse.Namespace) -> tuple[argparse.Namespace, PodConfig]:
    flags = {"app_bytes": "--size/--dies"}
    args.dies, extra = host_fields(args, args.dies, 4)
    flags.update(hosts="--hosts", fabric="--fabric", host_names="--hosts", net_if="--net-if")
    app_bytes = 2 * (args.dies or 4) * args.size + (4 << 20)
    return args, pod_config(args, flags, app_bytes=app_bytes, **extra)


def run(opts: tuple[argparse.Namespace, PodConfig]) -> int:
    return run_exchange(*opts)


def exchange(die, size: int, variant: str, cores: int, rounds: int) -> dict:
    """Every die sends `size` bytes to every other die at once (isend/irecv), `rounds` times.

    Each payload names its sender and round, and every receiver checks what it got.
    """
    n, me = die.num_dies, die.die_id
    peers = [p for p in range(n) if p != me]
    send = {p: die.alloc(size) for p in peers}
    recv = {p: die.alloc(size) for p in peers}
    try:
        comm.barrier(die)
        t0 = time.perf_counter_ns()
        for r in range(rounds):
            for p in peers:
                send[p][:] = (me * 16 + p + r) % 251
            reqs = [comm.irecv(die, recv[p], p, r, cores, variant) for p in peers]
            reqs += [comm.isend(die, send[p], p, r, cores, variant) for p in peers]
            for q in reqs:
                q.wait()
            for p in peers:
                want = (p * 16 + me + r) % 251
                if not (recv[p] == want).all():
                    raise AssertionError(f"die {me}: round {r} data from die {p} is wrong")
        comm.barrier(die)
        dt = time.perf_counter_ns() - t0
    finally:
        for arr in list(send.values()) + list(recv.values()):
            die.free(arr)
    return {"ns": dt, "bytes_in": size * len(peers) * rounds}


def where(die) -> tuple[int, int, int]:
    """(die id, host, pid) of the calling die."""
    return die.die_id, die.fab.hosts[die.die_id], os.getpid()


def run_exchange(args: argparse.Namespace, cfg: PodConfig) -> int:
    """`xpod run`: every variant, all pairs at once, `args.rounds` rounds; print the table."""
    size = args.size
    print(
        f"xpod run: launching {cfg.num_dies} dies ({cfg.cores} cores,"
        f" wait={cfg.wait_policy().name}, pinned={cfg.pinned()})",
        file=sys.stderr,
    )
    rows = []
    with Pod.launch(cfg) as pod:
        print(
            f"pod {pod.pod_id}: {pod.layout.region_bytes / 2**20:.1f} MiB per region",
            file=sys.stderr,
        )
        if cfg.num_hosts > 1:
            for die, host, pid in pod.run(where):
                name = cfg.host_names[host] if cfg.host_names else f"emulated host {host}"
                print(f"die {die}: host {host} ({name}), pid {pid}", file=sys.stderr)
        for variant in ("mte", "dma", "zero-copy"):
            for cores in sorted({1, min(cfg.lanes, 2)}):
                res = pod.run(exchange, size, variant, cores, args.rounds)
                wall = max(r["ns"] for r in res) / 1e9
                moved = sum(r["bytes_in"] for r in res)
                rows.append((variant, cores, moved, wall, moved / wall / 1e9))
        if args.trace:
            pod.write_trace(args.trace)
    n = cfg.num_dies
    print(
        f"\nall-pairs exchange: {n} dies, each sends {fmt_size(size)} to each of {n - 1} peers"
        " at once,"
    )
    print(f"{args.rounds} rounds, payloads checked on arrival (cpu cores: {cfg.cores})\n")
    print(f"{'variant':>10} {'cores':>5} {'bytes moved':>12} {'seconds':>8} {'GB/s':>7}  check")
    for variant, cores, moved, wall, gbps in rows:
        print(f"{variant:>10} {cores:>5} {moved:>12} {wall:>8.4f} {gbps:>7.2f}  ok")
    return 0
