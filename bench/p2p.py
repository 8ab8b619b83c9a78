"""`xpod bench p2p`: osu_latency / osu_bw-style ping-pong between die 0 and die 1.

One-way latency is half of each send/recv round trip (osu_latency's definition); bandwidth is
ping-pong bandwidth, size / p50 one-way time. Every (variant, cores, size) row is measured in one
pod; with `--peers` the same sizes are measured, in the same run, by a bare shared-memory flag
ping-pong (the floor of any Python protocol), pyzmq PAIR over ipc://, multiprocessing.Pipe and
mpi4py (when installed).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

import comm
from bench import common
from bench.common import parse_sizes
from bench.p2p_report import merge_repeats, print_host_ratios, print_ratios
from bench.project import attach
from memory.errors import ConfigError
from runtime import Pod, PodConfig
from runtime.cli.argtypes import (
    choice_list,
    input_file,
    int_list,
    int_range,
    output_file,
    positive_float,
    positive_int,
    size_list,
)
from runtime.cli.flags import load_config

DEFAULT_SIZES = "8,64,512,4K,32K,256K,1M,8M,64M"
QUICK_SIZES = "8,4K,64K,1M,8M"
ALL_VARIANTS = ("mte", "dma", "zero-copy", "async", "kv-link")
DEFAULT_VARIANTS = ("mte", "dma", "zero-copy", "async")
COLUMNS = [
    ("transport", "transport", ""),
    ("variant", "variant", ""),
    ("cores", "cores", "d"),
    ("size_bytes", "size", "size"),
    ("iters", "iters", "d"),
    ("p50_us", "p50_us", ".2f"),
    ("p99_us", "p99_us", ".2f"),
    ("min_us", "min_us", ".2f"),
    ("gbps", "GB/s", ".2f"),
    ("cpu_s_per_die", "cpu_s/die", ".3f"),
]


def iters_for(size: int, scale: float) -> int:
    """~5000 iterations for small messages down to ~20 for 64 MiB."""
    n = int((512 << 20) / max(size, 4096) / 8)
    return max(10, int(min(5000, max(20, n)) * scale))


def pingpong(die, size: int, variant: str, cores: int, iters: int, warmup: int,
             pair: tuple[int, int] = (0, 1)) -> tuple:  # fmt: skip
    """Dies `pair` (default 0 and 1) ping-pong `iters` times; other dies idle. Returns
    (samples_ns, cpu_s); the pair's first die pings."""
    me = die.die_id
    if me not in pair:
        return [], 0.0
    peer = pair[1] if me == pair[0] else pair[0]
    first = me == pair[0]
    src = die.alloc(size)
    dst = die.alloc(size)
    src[:] = np.arange(size, dtype=np.uint64).astype(np.uint8) ^ ((me + 1) & 0xFF)
    cv = "mte" if variant == "async" else variant
    samples = []
    try:
        _pair_barrier(die, peer, first)
        if variant == "kv-link":
            samples, cpu_s = _kv_pingpong(die, peer, src, dst, size, iters, warmup)
            return _checked(die, dst, peer, size, variant, cores, samples, cpu_s)
        cpu0 = time.process_time()
        for i in range(warmup + iters):
            t0 = time.perf_counter_ns()
            if variant == "async":
                if first:
                    comm.isend(die, src, peer, i, cores).wait()
                    comm.irecv(die, dst, peer, i, cores).wait()
                else:
                    comm.irecv(die, dst, peer, i, cores).wait()
                    comm.isend(die, src, peer, i, cores).wait()
            elif first:
                comm.send(die, src, peer, i, cores, cv)
                comm.recv(die, dst, peer, i, cores, cv)
            else:
                comm.recv(die, dst, peer, i, cores, cv)
                comm.send(die, src, peer, i, cores, cv)
            if i >= warmup:
                samples.append((time.perf_counter_ns() - t0) / 2)
        cpu_s = time.process_time() - cpu0
        return _checked(die, dst, peer, size, variant, cores, samples, cpu_s)
    finally:
        die.free(src)
        die.free(dst)


def _checked(die, dst, peer: int, size: int, variant: str, cores: int, samples, cpu_s) -> tuple:
    expect = np.arange(size, dtype=np.uint64).astype(np.uint8) ^ ((peer + 1) & 0xFF)
    if not np.array_equal(dst, expect):
        raise AssertionError(f"die {die.die_id}: {variant} c{cores} {size} B payload corrupted")
    return samples, cpu_s


def _kv_pingpong(die, peer: int, src, dst, size: int, iters: int, warmup: int) -> tuple:
    """The KV link of a PD pod (comm.kvlink) as a ping-pong: die 0 writes `src` straight into
    die 1's `dst` (one segment, no checksum: the transfer only), die 1 sees the record in its
    own region, acks, and writes back. One-way = half a round trip, as for the other
    variants. The scatter list (dst's offset) is exchanged once, before the loop."""
    from comm.kvlink import KVLinkRx, KVLinkTx, peer_word
    from memory import layout as L

    me = die.die_id
    off = np.array([die.region.offset_of(dst)], np.int64)
    theirs = np.zeros(1, np.int64)
    ev = (1 << 41) + die.user.get("pair_barrier", 0)
    if me == 0:
        comm.send(die, off, peer, ev)
        comm.recv(die, theirs, peer, ev)
    else:
        comm.recv(die, theirs, peer, ev)
        comm.send(die, off, peer, ev)
    spans = np.array([[die.region.offset_of(src), int(theirs[0]), size]], np.int64)
    tx = KVLinkTx(die, die.policy.timeout_s, verify=False)
    rx = KVLinkRx(me, die.layout, die.words[me], {peer: die.words[peer]})
    done = peer_word(die.layout, peer, L.PD_DONE)
    own = die.words[me]
    samples = []

    def take() -> None:
        die.wait_ge(own, done, rx.taken[peer] + 1, peer, "pd.done")
        for rec in rx.poll(peer):
            rx.ack(peer, rec.k)

    cpu0 = time.process_time()
    for i in range(warmup + iters):
        t0 = time.perf_counter_ns()
        if me == 0:
            tx.push(peer, spans, i, 0)
            take()
        else:
            take()
            tx.push(peer, spans, i, 0)
        if i >= warmup:
            samples.append((time.perf_counter_ns() - t0) / 2)
    return samples, time.process_time() - cpu0


def _pair_barrier(die, peer: int, first: bool = True) -> None:
    token = np.zeros(1, np.int64)
    n = die.user.get(("pair_barrier", peer), 0) + 1  # per pair: a die may be in several
    die.user["pair_barrier"] = die.user[("pair_barrier", peer)] = n
    ev = (1 << 40) + n
    if first:
        comm.send(die, token, peer, ev)
        comm.recv(die, token, peer, ev)
    else:
        comm.recv(die, token, peer, ev)
        comm.send(die, token, peer, ev)


def pairs_of(cfg: PodConfig) -> list[tuple[int, int]]:
    """The die pairs a pod's ping-pong measures: (0, 1) on one host; over hosts, the first
    die of host 0 with the first die of host 1 (cross-host) and, when host 0 holds two dies,
    (0, 1) too (a same-host pair inside a multi-host pod)."""
    if cfg.num_hosts == 1:
        return [(0, 1)]
    pairs = [(0, cfg.hosts.index(1))]
    if cfg.hosts[1] == 0:
        pairs.append((0, 1))
    return pairs


def hosts_label(cfg: PodConfig) -> str:
    """ "2,2": dies per host (the `--hosts` spec without names)."""
    hosts = cfg.hosts or (0,) * cfg.num_dies
    return ",".join(str(hosts.count(h)) for h in range(cfg.num_hosts))


def measure_xpod(pod: Pod, sizes, variants, cores_list, scale: float,
                 pairs: list[tuple[int, int]] | None = None) -> list[dict]:  # fmt: skip
    rows = []
    cfg = pod.config
    pairs = pairs or [(0, 1)]
    hosts = cfg.hosts or (0,) * cfg.num_dies
    total = len(sizes) * len(variants) * len(cores_list) * len(pairs)
    done = 0
    t_start = time.monotonic()
    for variant in variants:
        for cores in cores_list:
            for size in sizes:
                for a, b in pairs:
                    iters = iters_for(size, scale)
                    res = pod.run(pingpong, size, variant, cores, iters, max(3, iters // 10),
                                  (a, b))  # fmt: skip
                    samples, cpu0 = res[a]
                    cpu1 = res[b][1]
                    rows.append(
                        common.p2p_row(
                            "xpod",
                            variant,
                            cores,
                            size,
                            samples,
                            (cpu0 + cpu1) / 2,
                            wait=cfg.wait_policy().name,
                            pinned=cfg.pinned(),
                            hosts=hosts_label(cfg),
                            cross_host=hosts[a] != hosts[b],
                            pair=f"{a}-{b}",
                            fabric=cfg.fabric_kind,
                        )  # fmt: skip
                    )
                    done += 1
                    if time.monotonic() - t_start > 3:
                        where = " cross-host" if hosts[a] != hosts[b] else ""
                        common.progress(
                            f"  [{done}/{total}] xpod {variant} c{cores} {common.fmt_size(size)}"
                            f" dies {a}-{b}{where}: p50 {rows[-1]['p50_us']:.2f} us"
                        )
    return rows


def measure_cross_host_peers(sizes, scale: float, net_if: str, hosts: str) -> list[dict]:
    """The peers of a cross-host pair, same run: mpi4py Send/Recv and the raw RMA send + ack
    cycle over MPI's TCP transport, pyzmq PAIR over TCP (`bench.peers.tcp`)."""
    from bench.peers.tcp import run_cross_host_peers

    common.progress("  cross-host peers (mpi4py-tcp, rma-raw, zmq-tcp) ...")
    try:
        rows = run_cross_host_peers(sizes, scale, timeout_s=600.0, net_if=net_if or "lo")
    except RuntimeError as e:
        common.progress(f"  cross-host peers failed: {e}")
        return []
    for r in rows:
        r["hosts"] = hosts
    return rows


def measure_peers(sizes, scale: float, which=None) -> list[dict]:
    from bench import peers

    rows = []
    for transport in which or peers.PEER_TRANSPORTS:
        if transport == "mpi4py":
            ok, why = peers.mpi_available()
            if not ok:
                common.progress(f"  skipping mpi4py peer: {why}")
                continue
        common.progress(f"  peer {transport} ...")
        try:
            rows.extend(peers.run_peer(transport, sizes, iters_scale=scale))
        except RuntimeError as e:
            common.progress(f"  peer {transport} failed: {e}")
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dies",
        type=int_range(2),
        default=2,
        help="dies in the pod, >= 2 (die 0 and 1 ping-pong)",
    )
    p.add_argument(
        "--sizes", type=size_list, default=None, help=f"comma list, default {DEFAULT_SIZES}"
    )
    p.add_argument(
        "--variants",
        type=choice_list(ALL_VARIANTS),
        default=",".join(DEFAULT_VARIANTS),
        help=",".join(ALL_VARIANTS) + " (kv-link: a PD pod's KV link, comm.kvlink; default: the"
        " others)",
    )
    p.add_argument(
        "--cores",
        type=int_list(1),
        default=None,
        help="lane counts to measure, e.g. 1,4 (default 1,2,4; 1,2 with --quick)",
    )
    p.add_argument("--peers", action="store_true", help="also measure shm-floor/zmq/pipe/mpi4py")
    p.add_argument("--quick", action="store_true", help="fewer sizes and iterations (~20 s)")
    p.add_argument("--iters-scale", type=positive_float, default=1.0, help="scale iteration counts")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="measure everything R times, alternating xpod and peers; report medians and spread",
    )
    p.add_argument(
        "--json", type=output_file, default=None, help="write one JSON line per row to FILE"
    )
    p.add_argument(
        "--plot", type=output_file, default=None, help="draw latency and bandwidth vs size to FILE"
    )
    p.add_argument(
        "--trace", type=output_file, default=None, help="write a Chrome/Perfetto trace of the run"
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="also trace a few transfers per row and print where the time goes, step by step",
    )
    p.add_argument(
        "--hosts",
        default=None,
        metavar="SPEC",
        help="dies per host, e.g. 1,1 (emulated hosts on this machine) or nodeA:1,nodeB:1:"
        " measures the first dies of host 0 and 1 (cross-host) and dies 0-1 when host 0 has two;"
        " --peers then runs mpi4py Send/Recv, the raw RMA cycle and zmq over TCP",
    )
    p.add_argument(
        "--fabric",
        choices=("mpi", "mpi-rma", "mirror"),
        default="mpi",
        help="with --hosts: MPI (store messages + RMA, default), MPI one-sided only (mpi-rma),"
        " or mirrors over shared memory (no MPI)",
    )
    p.add_argument(
        "--net-if", default="", help="with --hosts: the interface (or CIDR) between hosts (lo)"
    )
    p.add_argument(
        "--compare-single-host",
        action="store_true",
        help="with --hosts: also measure dies 0-1 of a one-host pod of as many dies, same run",
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    p.add_argument(
        "--slot-bytes", type=positive_int, default=None, help="ring slot size (PodConfig)"
    )
    p.add_argument(
        "--ring-slots", type=positive_int, default=None, help="slots per ring (PodConfig)"
    )
    attach.add_project_args(p, "p2p")


P2P_FLAGS = {
    "num_dies": "--dies",
    "lanes": "--cores",
    "app_bytes": "--sizes",
    "trace": "--trace",
    "slot_bytes": "--slot-bytes",
    "ring_slots": "--ring-slots",
    "hosts": "--hosts",
    "fabric": "--fabric",
    "host_names": "--hosts",
    "net_if": "--net-if",
}


@dataclass(frozen=True, slots=True)
class Options:
    config: PodConfig
    sizes: list[int]
    variants: list[str]
    cores: list[int]
    scale: float
    repeat: int
    peers: bool
    breakdown: bool
    trace: str | None
    json: str | None
    plot: str | None
    compare_single_host: bool = False
    project: attach.Projection | None = None  # --project: loaded and checked here


def parse_options(args: argparse.Namespace) -> Options:
    """Options of the parsed flags, the pod's PodConfig checked (ConfigError names the flag)."""
    sizes = args.sizes or parse_sizes(QUICK_SIZES if args.quick else DEFAULT_SIZES)
    cores = args.cores or ([1, 2] if args.quick else [1, 2, 4])
    hosts = fabric = names = None
    dies = args.dies
    if getattr(args, "hosts", None):
        from comm.fabric import host_names_of, hosts_of

        try:
            hosts = tuple(hosts_of(args.hosts))
            names = tuple(host_names_of(args.hosts))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if len(set(hosts)) < 2:
            raise ConfigError(f"--hosts {args.hosts}: a cross-host pair needs two hosts")
        if "kv-link" in args.variants:
            raise ConfigError("--variants kv-link: one host only (a PD pod's link)")
        dies, fabric = len(hosts), args.fabric
    cfg = load_config(
        args.config,
        P2P_FLAGS,
        num_dies=dies,
        hosts=hosts,
        fabric=fabric,
        host_names=names or None,
        net_if=getattr(args, "net_if", None) or None,
        lanes=max(4, max(cores)),
        app_bytes=2 * max(sizes) + (4 << 20),
        trace=bool(args.trace),
        slot_bytes=args.slot_bytes,
        ring_slots=args.ring_slots,
        serve_slot_bytes=4096 if "kv-link" in args.variants else 0,  # the KV link's words
    )
    return Options(
        config=cfg,
        sizes=sizes,
        variants=args.variants,
        cores=cores,
        scale=args.iters_scale * (0.2 if args.quick else 1.0),
        repeat=args.repeat,
        peers=args.peers,
        breakdown=args.breakdown,
        trace=args.trace,
        json=args.json,
        plot=args.plot,
        compare_single_host=bool(getattr(args, "compare_single_host", False) and hosts),
        project=attach.projection_of(args, pair=True),
    )


def run(opts: Options) -> int:
    cfg, sizes, variants, cores_list = opts.config, opts.sizes, opts.variants, opts.cores
    common.progress(
        f"xpod bench p2p: {cfg.num_dies} dies, wait={cfg.wait_policy().name},"
        f" pinned={cfg.pinned()}, sizes {','.join(map(common.fmt_size, sizes))},"
        f" variants {','.join(variants)}, cores {cores_list}"
    )
    runs: list[list[dict]] = []
    multi = cfg.num_hosts > 1
    if multi:
        common.progress(f"  hosts {hosts_label(cfg)} (fabric {cfg.fabric_kind}), pairs"
                        f" {', '.join(f'{a}-{b}' for a, b in pairs_of(cfg))}")  # fmt: skip
    single = (
        cfg.replace(hosts=(), fabric="auto", host_names=()) if opts.compare_single_host else None
    )
    projected = attach.p2p_figures(opts.project, cfg, sizes, variants, cores_list)
    with Pod.launch(cfg) as pod:
        for rep in range(opts.repeat):
            if opts.repeat > 1:
                common.progress(f"repeat {rep + 1}/{opts.repeat}")
            # xpod and the peers alternate, so slow phases of a noisy machine hit both
            runs.append(measure_xpod(pod, sizes, variants, cores_list, opts.scale, pairs_of(cfg)))
            if single is not None:
                with Pod.launch(single) as one:
                    base = measure_xpod(one, sizes, variants, cores_list, opts.scale)
                for r in base:
                    r["transport"] = "xpod-1host"
                runs[-1] += base
            if opts.peers and multi:
                runs[-1] += measure_cross_host_peers(sizes, opts.scale, cfg.net_if,
                                                     hosts_label(cfg))  # fmt: skip
            elif opts.peers:
                runs[-1] += measure_peers(sizes, opts.scale)
        if opts.trace:
            n = pod.write_trace(opts.trace)
            common.progress(f"wrote {n} trace events to {opts.trace}")
        if opts.breakdown:
            steps = breakdown(pod, sizes, variants, cores_list[0])
    rows = runs[0] if len(runs) == 1 else merge_repeats(runs)
    attach.attach(rows, projected, lambda r: (r["variant"], r["cores"], r["size_bytes"]))
    cols = COLUMNS + ([("pair", "pair", ""), ("cross_host", "cross", "")] if multi else [])
    common.print_table(rows, cols + ([("p50_spread", "spread", ".0%")] if len(runs) > 1 else []))
    if multi:
        print_host_ratios(rows)
    else:
        print_ratios(rows)
    if opts.breakdown:
        print("\nwhere the time goes: a traced ping-pong per row; mean us per message of die 0's")
        print("send steps and die 1's receive steps, as a share of the traced one-way p50 (steps")
        print("of the two sides overlap when they stream; polls are waits for the other side):")
        common.print_table(steps, BREAKDOWN_COLUMNS)
    attach.print_projected(rows, opts.project, "p2p")
    common.write_outputs(rows, opts.json, opts.plot)
    return 0


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))


BREAKDOWN_COLUMNS = [
    ("variant", "variant", ""),
    ("size_bytes", "size", "size"),
    ("side", "side", ""),
    ("step", "step", ""),
    ("us_per_msg", "us/msg", ".2f"),
    ("share", "share of p50", ".0%"),
]


def _traced(die, size: int, variant: str, cores: int, iters: int) -> tuple:
    die.trace.clear()
    die.trace.enabled = True
    try:
        samples, _ = pingpong(die, size, variant, cores, iters, 2)
    finally:
        die.trace.enabled = False
    # the pair barrier's own messages carry event ids >= 2**40; keep the ping-pong's only
    return samples, [r for r in die.trace.snapshot() if r[6] < (1 << 40)]


def breakdown(pod: Pod, sizes, variants, cores: int) -> list[dict]:
    """Where one one-way transfer spends its time: mean step durations of a traced ping-pong
    (die 0's send and die 1's receive steps), as a share of that traced run's p50 one-way time.
    Polls are waits for the other side; 'other' is what no step covers (Python call overhead,
    argument checks, cross-core visibility)."""
    from comm.trace import STEP_NAMES

    out = []
    for variant in variants:
        for size in sizes:
            iters = max(10, min(300, iters_for(size, 0.1)))
            res = pod.run(_traced, size, variant, cores, iters)
            p50 = common.latency_stats(res[0][0])["p50_us"]
            n_msgs = iters + 2
            covered = 0.0
            for die_id, side in ((0, "send"), (1, "recv")):
                sums: dict = {}
                for _, dur, op, step, *_ in res[die_id][1]:
                    if op.endswith(side) and dur > 0:
                        sums[(op, step)] = sums.get((op, step), 0) + dur
                for (op, step), total in sorted(sums.items(), key=lambda kv: kv[0][1]):
                    name = STEP_NAMES.get((op, step), f"{op} {step}")
                    us = total / n_msgs / 1e3
                    if "poll" not in name:
                        covered += us
                    out.append({"variant": variant, "size_bytes": size, "side": side,
                                "step": name, "us_per_msg": us, "share": us / p50})  # fmt: skip
            out.append({"variant": variant, "size_bytes": size, "side": "-",
                        "step": f"other (traced p50 {p50:.2f} us)", "us_per_msg": p50 - covered,
                        "share": (p50 - covered) / p50})  # fmt: skip
    return out
