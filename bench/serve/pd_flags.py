"""The PD flags of `xpod bench serve` (`--prefill-dies`, `--decode-dies`, `--compare-colocated`,
`--burst-prompts`, `--burst-len`), their checks (ConfigError naming the flag) and the `xpod
serve` flags of the two layouts: the PD one (`--prefill-dies P --decode-dies D`) and the
colocated one of the same dies (`--dies P+D`, the PD-only flags dropped), both with the same
model, batch limit and `--server-args`. Two things are added on their own, and said: a
`--max-seq-len` that holds the burst prompts when the model's context does not, and, for
`--compare-colocated`, an `--experts` count that splits over P, D and P + D dies (the same
model on both layouts)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from memory.errors import ConfigError
from runtime.cli.argtypes import int_range, positive_int

BURST_PROMPTS, BURST_LEN = 8, 1024
QUICK_BURST_PROMPTS, QUICK_BURST_LEN = 4, 128
# the dies of a PD run come from --prefill-dies / --decode-dies only
DIES_FLAGS = ("--dies", "--prefill-dies", "--decode-dies", "--attention-dies", "--expert-dies")
PD_ONLY_FLAGS = ("--decode-blocks", "--kv-policy", "--kv-lease", "--kv-timeout")  # with a value


def add_pd_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefill-decode disaggregation (--launch)")
    add = g.add_argument
    add("--prefill-dies", type=positive_int, default=None, metavar="P",
        help="launch a PD server: P prefill dies and --decode-dies D decode dies (instead of"
        " --dies); adds the interference phase, the KV transfer figures against xpod bench"
        " p2p, the TTFT split and the replay check")  # fmt: skip
    add("--decode-dies", type=positive_int, default=None, metavar="D",
        help="decode dies of the PD server (with --prefill-dies)")  # fmt: skip
    add(
        "--compare-colocated",
        action="store_true",
        help="then the same phases, same requests and arrivals, on a colocated server of the"
        " same P + D dies: PD vs colocated side by side (goodput, TTFT, TPOT, interference)",
    )
    add("--burst-prompts", type=positive_int, default=None, metavar="N",
        help=f"interference phase: prompts sent at once (default {BURST_PROMPTS},"
        f" {QUICK_BURST_PROMPTS} with --quick)")  # fmt: skip
    add("--burst-len", type=int_range(2), default=None, metavar="L",
        help=f"interference phase: tokens of each burst prompt (default {BURST_LEN},"
        f" {QUICK_BURST_LEN} with --quick)")  # fmt: skip


def launch_only(args: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """The PD flags that need --launch, with their values (None: not given)."""
    return (
        ("--prefill-dies", args.prefill_dies),
        ("--decode-dies", args.decode_dies),
        ("--compare-colocated", args.compare_colocated or None),
    )


def check_pd_flags(args: argparse.Namespace) -> bool:
    """The PD flags together; True for a PD run. ConfigError naming the flag."""
    p, d = args.prefill_dies, args.decode_dies
    if (p is None) != (d is None):
        flag = "--decode-dies" if p is not None else "--prefill-dies"
        raise ConfigError(
            f"argument {flag}: give --prefill-dies and --decode-dies together (a PD pod has"
            " both parts)"
        )
    pd = p is not None
    if pd and args.dies is not None:
        raise ConfigError(
            "argument --dies: not with --prefill-dies/--decode-dies (the PD pod has P + D"
            " dies, and so has the colocated layout of --compare-colocated)"
        )
    if args.compare_colocated and not pd:
        raise ConfigError(
            "argument --compare-colocated: needs --prefill-dies and --decode-dies (the PD"
            " layout to compare with)"
        )
    if args.compare_colocated and args.lb_compare:
        raise ConfigError("argument --lb-compare: not with --compare-colocated (one comparison)")
    for flag, value in (("--burst-prompts", args.burst_prompts), ("--burst-len", args.burst_len)):
        if value is not None and not pd:
            raise ConfigError(
                f"argument {flag}: only with --prefill-dies (the interference phase of a PD run)"
            )
    return pd


def burst_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(burst prompts, burst length) of the flags, --quick's caps applied."""
    n, length = args.burst_prompts or BURST_PROMPTS, args.burst_len or BURST_LEN
    if args.quick:
        n, length = min(n, QUICK_BURST_PROMPTS), min(length, QUICK_BURST_LEN)
    return n, length


def flag_given(argv: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def without(argv: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, ...]:
    """`argv` without `flags` (each with its value: `--f v` or `--f=v`)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return tuple(out)


def seq_len_for(burst_len: int) -> int:
    """The context given to the server for --burst-len prompts: 2 x L rounded up to 256, at
    least 512."""
    return max(512, -(-2 * burst_len // 256) * 256)


def pd_server_argvs(
    args: argparse.Namespace,
    base: tuple[str, ...],
    user: tuple[str, ...],
    burst_len: int,
    burst_need: int,
    check: Callable,
) -> tuple[tuple[str, ...], tuple[str, ...], object, tuple[str, ...]]:
    """(PD server flags, colocated server flags or (), the PD EngineConfig, notes). `base`:
    the flags of both servers (model, batch limit, balancing), `user`: --server-args split,
    `burst_len` / `burst_need`: a burst prompt's tokens / the context it needs (its tokens
    generated and the chat template's too), `check`: flags -> EngineConfig."""
    p, d = args.prefill_dies, args.decode_dies
    for f in DIES_FLAGS:
        if flag_given(user, f):
            raise ConfigError(
                f"argument --server-args: no {f} in a PD run (the dies come from"
                " --prefill-dies/--decode-dies)"
            )
    parts = ("--prefill-dies", str(p), "--decode-dies", str(d))
    try:
        engine = check((*parts, *base, *user))
    except ConfigError as e:
        if "num_experts" not in str(e):
            raise
        msg = str(e).rpartition("num_experts: ")[2]
        raise ConfigError(
            f"argument --prefill-dies/--decode-dies: the experts split over each part: {msg}"
            f' (or give --server-args "--experts N", N a multiple of {math.lcm(p, d)})'
        ) from None
    m = engine.model_config()
    extra: list[str] = []
    notes: list[str] = []
    if burst_need > m.max_seq_len:
        if "max_seq_len" in engine.model_overrides:
            raise ConfigError(
                f"argument --burst-len: a burst prompt needs {burst_need} tokens of context,"
                f" more than the {m.max_seq_len} of --max-seq-len in --server-args"
            )
        n = max(seq_len_for(burst_len), -(-burst_need // 256) * 256)
        extra += ["--max-seq-len", str(n)]
        notes.append(
            f"--max-seq-len {n} given to the server: a burst prompt needs {burst_need} tokens,"
            f" the {engine.model} model's context is {m.max_seq_len}"
        )
    dies = p + d
    if args.compare_colocated and m.num_experts % dies:
        step = math.lcm(p, d, dies)
        if "num_experts" in engine.model_overrides:
            raise ConfigError(
                f"argument --compare-colocated: {m.num_experts} experts (--experts in"
                f" --server-args) do not split over the colocated layout's {dies} dies; give"
                f" a multiple of {step}"
            )
        n = step * -(-m.num_experts // step)
        extra += ["--experts", str(n)]
        notes.append(
            f"--experts {n} given to both servers: the {engine.model} model's"
            f" {m.num_experts} experts do not split over the colocated layout's {dies} dies"
            f" ({n} split over {p}, {d} and {dies})"
        )
    pd_argv = (*parts, *extra, *base, *user)
    engine = check(pd_argv)
    colo: tuple[str, ...] = ()
    if args.compare_colocated:
        colo = ("--dies", str(dies), *extra, *base, *without(user, PD_ONLY_FLAGS))
        try:
            check(colo)
        except ConfigError as e:
            raise ConfigError(
                f"argument --compare-colocated: the colocated layout of {dies} dies: {e}"
            ) from None
    return pd_argv, colo, engine, tuple(notes)
