"""The `xpod` command: a table of commands, each in its own module, imported only when it runs.

```
xpod run    [--dies 4] [--size 1M]       launch a pod, move data between every pair, print a table
xpod decode [--dies 4] [--check] ...     toy-model decode over the pod
xpod generate --prompts FILE ...         batch generation with the serving engine
xpod serve  [--dies 4] [--port 8000]     an OpenAI-compatible HTTP server over the engine
xpod bench p2p|ring|alltoall|...         benchmarks (`xpod bench p2p --help`)
xpod clean  [--dry-run]                  remove segments of pods whose launcher is gone
xpod layout [--dies 8] ...               print the region layout of a configuration
xpod project DIR --profile cm384         re-project a saved capture on a hardware profile
```

Each command module has `add_args(parser)`, `parse_options(args)` (every flag checked, nothing
launched) and `run(options) -> exit status`; so does every `bench.<name>` module. The tables below
name the modules and their help lines, so `xpod --help`, `xpod clean` or `xpod bench p2p` load
only what they run (vLLM's `entrypoints/cli/main.py` does the same). `bench/` sits above
`runtime/` in the import graph: this table is the one place `runtime` names it (by module name;
`tests/unit/test_cli_main.py` checks the table against the modules).

Every flag is checked before any process starts: its argparse type (`runtime.cli.argtypes`)
first, then the command checks the flags together with its PodConfig (and model). A bad value is
one line `xpod <cmd>: error: argument --flag: ...` and exit status 2; a pod that fails while
running is `xpod: <Error>: ...` and status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from runtime.cli.argtypes import Parser, error_line

# name -> (module, help line)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("runtime.cli.run", "launch a pod and move data between every pair of dies"),
    "decode": ("runtime.cli.decode", "distributed toy-model decode (DP attention + EP experts)"),
    "generate": ("runtime.cli.generate", "generate completions of prompts with the serving engine"),
    "serve": ("runtime.cli.serve", "an OpenAI-compatible HTTP server over the serving engine"),
    "bench": ("", "benchmarks"),
    "clean": ("runtime.cli.clean", "remove segments of pods whose launcher is gone"),
    "layout": ("runtime.cli.layout", "print the region layout of a configuration"),
    "project": ("bench.project.cli", "project a capture on a hardware profile; validate a profile"),
}
# `xpod bench <name>` -> (module, help line: the first line of the module's docstring)
BENCHES: dict[str, tuple[str, str]] = {
    "p2p": ("bench.p2p", "`xpod bench p2p`: osu_latency / osu_bw-style ping-pong between die 0"
            " and die 1."),
    "ring": ("bench.ring", "`xpod bench ring`: pass a token around N dies and report"
             " microseconds per hop."),
    "alltoall": ("bench.alltoall", "`xpod bench alltoall`: expert-parallel dispatch + combine"
                 " latency over batch size and EP degree."),
    "passes": ("bench.passes", "`xpod bench passes`: each pass one die makes over the bytes of an"
               " EP dispatch + combine, timed"),
    "faults": ("bench.faults", "`xpod bench faults`: inject every fault kind and time how long"
               " the pod takes to report it."),
    "engine": ("bench.engine", "`xpod bench engine`: the serving engine's figures in one run,"
               " against `xpod decode`."),
    "serve": ("bench.serve", "`xpod bench serve`: a vLLM-style serving benchmark against xpod's"
              " OpenAI-compatible server."),
    "capture": ("bench.capture", "`xpod bench capture`: what capturing and replaying an all-to-all"
                " costs, per EP degree."),
    "chaos": ("bench.chaos", "`xpod bench chaos`: HTTP load while faults fire, against a"
              " fault-free baseline."),
    "pool": ("bench.pool", "`xpod bench pool`: TTFT and prefill throughput by reuse rate, KV pool"
             " hits against recompute."),
    "tiers": ("bench.tiers", "`xpod bench tiers`: the KV pool's eviction to the SSD tier and its"
              " admission against a scan."),
}  # fmt: skip


def selected(argv: list[str]) -> tuple[str | None, str | None]:
    """(command, bench) named by `argv`, as far as it names them (None: not given)."""
    words = [a for a in argv if not a.startswith("-")]
    cmd = words[0] if words and argv[0] == words[0] else None
    bench = words[1] if cmd == "bench" and len(words) > 1 and argv[1] == words[1] else None
    return cmd, bench


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `xpod` parser. With `argv`, only the command it names gets its flags (and only that
    module is imported); without, every command does (tests, docs)."""
    cmd, bench = selected(argv) if argv is not None else (None, None)
    p = Parser(prog="xpod", description="An emulated AI SuperPod on one machine.")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (module, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(module=module, cmd_prog=sp.prog)
        if name == "bench":
            _bench_parsers(sp, None if argv is None else bench, argv is None)
        elif argv is None or name == cmd:
            _load(module).add_args(sp)
    return p


def _bench_parsers(b: argparse.ArgumentParser, bench: str | None, every: bool) -> None:
    bsub = b.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(BENCHES) + "}")
    for name, (module, help_) in BENCHES.items():
        sp = bsub.add_parser(name, help=help_, description=help_)
        sp.set_defaults(module=module, cmd_prog=sp.prog)
        if every or name == bench:
            _load(module).add_args(sp)


def _load(module: str) -> ModuleType:
    return importlib.import_module(module)


def main(argv: list[str] | None = None) -> int:
    """Run `xpod` with `argv` (default sys.argv[1:]); returns the exit status.

    Bad options never start a process: argparse refuses a bad flag value, then the command
    checks the flags together (and its PodConfig / model); either way one line
    `xpod <cmd>: error: ...` on stderr and status 2. A pod that fails while running: status 1.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    mod = _load(args.module)
    try:
        opts = mod.parse_options(args)  # parse and check; nothing is launched here
    except ValueError as e:  # ConfigError included
        sys.stderr.write(error_line(args.cmd_prog, e))
        return 2
    except KeyboardInterrupt:
        print("xpod: interrupted", file=sys.stderr)
        return 130
    from memory.errors import ConfigError, PodError

    try:
        return mod.run(opts) or 0
    except PodError as e:
        if isinstance(e, ConfigError) and e.die_id is None:  # refused by the launcher, not a die
            sys.stderr.write(error_line(args.cmd_prog, e))
            return 2
        print(f"xpod: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("xpod: interrupted; pod torn down", file=sys.stderr)
        return 130


__all__ = ["BENCHES", "COMMANDS", "build_parser", "main"]
