"""The `xpod` command.

```
xpod run   [--dies 4] [--size 1M]        launch a pod, move data between every pair, print a table
xpod decode [--dies 4] [--check] ...     toy-model decode over the pod (see runtime/decode.py)
xpod generate --prompts FILE ...         batch generation with the serving engine (see generate.py)
xpod bench p2p|ring|alltoall ...         microbenchmarks (see `xpod bench p2p --help`)
xpod clean [--dry-run]                   remove segments of pods whose launcher is gone
xpod layout [--dies 8] ...               print the region layout of a configuration
```
`bench/` sits above `runtime/` in the import graph, so the bench subcommands are loaded by
module name (`bench.<name>`) when asked for, never imported at the top of this module.

Every flag is checked before any process starts: its argparse type (`runtime.argtypes`) first,
then the command checks the flags together with its PodConfig (and model) and returns the job to
run. A bad value is one line `xpod <cmd>: error: argument --flag: ...` and exit status 2; a pod
that fails while running is `xpod: <Error>: ...` and status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Callable

import comm
from memory.errors import ConfigError, PodError
from runtime.argtypes import (
    Parser,
    error_line,
    fmt_size,
    input_file,
    load_config,
    output_file,
    positive_float,
    positive_int,
)
from runtime.argtypes import size as size_arg
from runtime.pod import Pod, control
from runtime.pod.config import PodConfig

BENCHES = ("p2p", "ring", "alltoall", "passes", "faults", "engine", "serve")


# A job: what a command runs once every option has been parsed and checked (no process before).
Job = Callable[[], int]

POD_FLAGS = {
    "num_dies": "--dies",
    "lanes": "--lanes",
    "slot_bytes": "--slot-bytes",
    "ring_slots": "--ring-slots",
    "timeout_s": "--timeout",
    "trace": "--trace",
}


def _pod_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dies", type=positive_int, default=None, help="dies in the pod (PodConfig.num_dies)"
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    p.add_argument("--lanes", type=positive_int, default=None, help="AIV lanes per die")
    p.add_argument("--slot-bytes", type=positive_int, default=None, help="ring slot bytes")
    p.add_argument("--ring-slots", type=positive_int, default=None, help="slots per ring")
    p.add_argument("--timeout", type=positive_float, default=None, help="wait deadline, seconds")
    p.add_argument(
        "--trace", type=output_file, default=None, help="write a Chrome/Perfetto trace to FILE"
    )


def _config(args: argparse.Namespace, flags: dict[str, str] | None = None, **extra) -> PodConfig:
    """The PodConfig of the pod flags and `extra`; a ConfigError names the flag (`flags` maps
    the fields of `extra` to the flags they come from)."""
    return load_config(
        args.config,
        {**POD_FLAGS, **(flags or {})},
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


def cmd_run(args: argparse.Namespace) -> Job:
    app_bytes = 2 * (args.dies or 4) * args.size + (4 << 20)
    cfg = _config(args, {"app_bytes": "--size/--dies"}, app_bytes=app_bytes)
    return lambda: run_exchange(args, cfg)


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


# -- other commands ------------------------------------------------------------------------------


def cmd_clean(args: argparse.Namespace) -> Job:
    return lambda: clean(args.dry_run)


def clean(dry_run: bool) -> int:
    removed = control.clean(dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    live = [p for p, names in control.list_pods().items() if any(n.endswith(".ctl") for n in names)]
    print(f"{verb} {len(removed)} segment(s); {len(live)} live pod(s) left alone")
    return 0


def cmd_layout(args: argparse.Namespace) -> Job:
    cfg = _config(args)
    return lambda: print_layout(cfg)


def print_layout(cfg: PodConfig) -> int:
    print(cfg.layout().describe())
    total = cfg.layout().region_bytes * cfg.num_dies
    print(f"pod total: {cfg.num_dies} regions, {total / 2**20:.1f} MiB")
    return 0


def cmd_decode(args: argparse.Namespace) -> Job:
    from runtime import decode_args as decode

    decode.options(args)  # parses and checks every option, the model and the PodConfig
    return lambda: decode.main(args)


def cmd_generate(args: argparse.Namespace) -> Job:
    from runtime import generate

    opts = generate.parse_options(args)  # flags, prompts and the EngineConfig, all checked
    return lambda: generate.run(opts)


def cmd_serve(args: argparse.Namespace) -> Job:
    from runtime import serve_args

    opts = serve_args.parse_options(args)  # flags and the EngineConfig, all checked
    try:
        from runtime.api import server
    except ImportError as e:
        raise ConfigError(f"xpod serve needs the serve extra ({e.name} is missing):"
                          " pip install -e '.[serve]'") from None  # fmt: skip
    return lambda: server.run(opts)


def cmd_bench(args: argparse.Namespace) -> Job:
    mod = importlib.import_module(f"bench.{args.bench}")
    opts = mod.parse_options(args)
    return lambda: mod.run(opts)


def _sub(sub, name: str, fn: Callable[[argparse.Namespace], Job], **kw) -> argparse.ArgumentParser:
    sp = sub.add_parser(name, **kw)
    sp.set_defaults(fn=fn, cmd_prog=sp.prog)
    return sp


def build_parser() -> argparse.ArgumentParser:
    """The `xpod` parser; every subcommand's errors are one line with exit status 2."""
    p = Parser(prog="xpod", description="An emulated AI SuperPod on one machine.")
    names = ("run", "decode", "generate", "serve", "bench", "clean", "layout")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(names) + "}")

    r = _sub(sub, "run", cmd_run, help="launch a pod and move data between every pair of dies")
    _pod_flags(r)
    r.add_argument(
        "--size", type=size_arg, default="1M", help="bytes per pair per round (default 1M)"
    )
    r.add_argument("--rounds", type=positive_int, default=5, help="rounds (default 5)")
    r.set_defaults(dies=4)

    from runtime import decode_args as decode

    help_ = "distributed toy-model decode (DP attention + EP experts)"
    decode.add_args(_sub(sub, "decode", cmd_decode, help=help_))
    from runtime import generate

    help_ = "generate completions of prompts with the serving engine"
    generate.add_args(_sub(sub, "generate", cmd_generate, help=help_))
    from runtime import serve_args

    help_ = "an OpenAI-compatible HTTP server over the serving engine"
    serve_args.add_args(_sub(sub, "serve", cmd_serve, help=help_))
    b = _sub(sub, "bench", cmd_bench, help="microbenchmarks")
    bsub = b.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name in BENCHES:
        mod = importlib.import_module(f"bench.{name}")
        help_ = (mod.__doc__ or "").strip().splitlines()[0]
        mod.add_args(_sub(bsub, name, cmd_bench, help=help_))

    c = _sub(sub, "clean", cmd_clean, help="remove segments of pods whose launcher is gone")
    c.add_argument("--dry-run", action="store_true")

    lay = _sub(sub, "layout", cmd_layout, help="print the region layout of a configuration")
    _pod_flags(lay)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `xpod` with `argv` (default sys.argv[1:]); returns the exit status.

    Bad options never start a process: argparse refuses a bad flag value, then the command
    checks the flags together (and its PodConfig / model); either way one line
    `xpod <cmd>: error: ...` on stderr and status 2. A pod that fails while running: status 1.
    """
    args = build_parser().parse_args(argv)
    try:
        job = args.fn(args)  # parse and check; nothing is launched here
    except ValueError as e:  # ConfigError included
        sys.stderr.write(error_line(args.cmd_prog, e))
        return 2
    except KeyboardInterrupt:
        print("xpod: interrupted", file=sys.stderr)
        return 130
    try:
        return job() or 0
    except PodError as e:
        if isinstance(e, ConfigError) and e.die_id is None:  # refused by the launcher, not a die
            sys.stderr.write(error_line(args.cmd_prog, e))
            return 2
        print(f"xpod: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xpod: interrupted; pod torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["exchange", "main"]
