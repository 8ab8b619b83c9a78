"""The `xpod` command.

```
xpod run   [--dies 4] [--size 1M]        launch a pod, move data between every pair, print a table
xpod decode [--dies 4] [--check] ...     toy-model decode over the pod (see runtime/decode.py)
xpod bench p2p|ring|alltoall ...         microbenchmarks (see `xpod bench p2p --help`)
xpod clean [--dry-run]                   remove segments of pods whose launcher is gone
xpod layout [--dies 8] ...               print the region layout of a configuration
```
`bench/` sits above `runtime/` in the import graph, so the bench subcommands are loaded by
module name (`bench.<name>`) when asked for, never imported at the top of this module.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import comm
from memory.errors import PodError
from runtime import control
from runtime.config import PodConfig
from runtime.pod import Pod

BENCHES = ("p2p", "ring", "alltoall")


def _pod_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=int, default=None, help="dies in the pod (PodConfig.num_dies)")
    p.add_argument("--config", default=None, help="PodConfig TOML file")
    p.add_argument("--lanes", type=int, default=None, help="AIV lanes per die")
    p.add_argument("--slot-bytes", type=int, default=None, help="ring slot bytes")
    p.add_argument("--ring-slots", type=int, default=None, help="slots per ring")
    p.add_argument("--timeout", type=float, default=None, help="wait deadline, seconds")
    p.add_argument("--trace", default=None, help="write a Chrome/Perfetto trace to FILE")


def _config(args: argparse.Namespace, **extra) -> PodConfig:
    return PodConfig.load(
        args.config,
        num_dies=args.dies,
        lanes=args.lanes,
        slot_bytes=args.slot_bytes,
        ring_slots=args.ring_slots,
        timeout_s=args.timeout,
        trace=True if args.trace else None,
        **extra,
    )


# -- xpod run ------------------------------------------------------------------------------------


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


def cmd_run(args: argparse.Namespace) -> int:
    size = _parse_size(args.size)
    cfg = _config(args, app_bytes=2 * (args.dies or 4) * size + (4 << 20))
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
        f"\nall-pairs exchange: {n} dies, each sends {args.size} to each of {n - 1} peers at once,"
    )
    print(f"{args.rounds} rounds, payloads checked on arrival (cpu cores: {cfg.cores})\n")
    print(f"{'variant':>10} {'cores':>5} {'bytes moved':>12} {'seconds':>8} {'GB/s':>7}  check")
    for variant, cores, moved, wall, gbps in rows:
        print(f"{variant:>10} {cores:>5} {moved:>12} {wall:>8.4f} {gbps:>7.2f}  ok")
    return 0


def _parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if mult > 1 else t) * mult


# -- other commands ------------------------------------------------------------------------------


def cmd_clean(args: argparse.Namespace) -> int:
    removed = control.clean(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    live = [p for p, names in control.list_pods().items() if any(n.endswith(".ctl") for n in names)]
    print(f"{verb} {len(removed)} segment(s); {len(live)} live pod(s) left alone")
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    cfg = _config(args)
    print(cfg.layout().describe())
    total = cfg.layout().region_bytes * cfg.num_dies
    print(f"pod total: {cfg.num_dies} regions, {total / 2**20:.1f} MiB")
    return 0


def cmd_decode(args: argparse.Namespace) -> int:
    from runtime import decode

    return decode.main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    mod = importlib.import_module(f"bench.{args.bench}")
    return mod.main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="xpod", description="An emulated AI SuperPod on one machine.")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="launch a pod and move data between every pair of dies")
    _pod_flags(r)
    r.add_argument("--size", default="1M", help="bytes per pair per round (default 1M)")
    r.add_argument("--rounds", type=int, default=5)
    r.set_defaults(fn=cmd_run, dies=4)

    from runtime import decode

    d = sub.add_parser("decode", help="distributed toy-model decode (DP attention + EP experts)")
    decode.add_args(d)
    d.set_defaults(fn=cmd_decode)
    b = sub.add_parser("bench", help="microbenchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name in BENCHES:
        mod = importlib.import_module(f"bench.{name}")
        bp = bsub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        mod.add_args(bp)
    b.set_defaults(fn=cmd_bench)

    c = sub.add_parser("clean", help="remove segments of pods whose launcher is gone")
    c.add_argument("--dry-run", action="store_true")
    c.set_defaults(fn=cmd_clean)

    lay = sub.add_parser("layout", help="print the region layout of a configuration")
    _pod_flags(lay)
    lay.set_defaults(fn=cmd_layout)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args) or 0
    except PodError as e:
        print(f"xpod: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xpod: interrupted; pod torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["exchange", "main"]
