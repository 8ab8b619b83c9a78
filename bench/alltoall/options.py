"""The flags of `xpod bench alltoall`, checked into `Options`, and the plan they make: every pod
of the run with its protocols, each pod's `PodConfig` built (a ConfigError names the flag)
before any starts."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from bench.alltoall.inputs import Point, default_experts
from bench.project import attach
from comm.quant import COMBINE_DTYPES
from memory.errors import ConfigError
from runtime import PodConfig
from runtime.cli.argtypes import (
    choice_list,
    input_file,
    int_list,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.cli.flags import load_config
from runtime.cli.hosts import add_host_args, host_fields

DEFAULT_BATCHES = "1,8,16,32,64,128"
QUICK_BATCHES = "1,16,128"
PROTOCOLS = ("pull", "fused", "pull-dedup", "fused-dedup", "a2e")
ROUTINGS = ("uniform", "skew")
QUANTS = ("int8", "none")
BUDGET_S, QUICK_BUDGET_S = 1.5, 0.3  # timed seconds per row
ITERS_RANGE, QUICK_ITERS_RANGE = (10, 400), (5, 60)


@dataclass(slots=True)
class Options:
    dies: list[int]
    batches: list[int]
    hidden: int
    topk: int
    experts: int | None
    protocols: list[str]
    quants: list[str]
    combine_dtype: str
    a2e_pods: list[tuple[int, int]]
    routings: list[str]
    peers: bool
    budget_s: float
    iters_range: tuple[int, int]
    iters: int
    repeat: int
    seed: int
    trace: str | None
    config: str | None
    timeout: float | None
    json: str | None = None
    plot: str | None = None
    hosts: dict = field(default_factory=dict)  # PodConfig hosts / fabric / ... (--hosts)
    project: attach.Projection | None = None  # --project: loaded and checked with the flags


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=int_list(1), default="8", help="EP degrees, comma list, e.g. 4,8")
    p.add_argument(
        "--batch",
        type=int_list(1),
        default=None,
        help=f"tokens per die, comma list, default {DEFAULT_BATCHES}",
    )
    p.add_argument("--hidden", type=positive_int, default=7168, help="hidden size (default 7168)")
    p.add_argument(
        "--topk", type=positive_int, default=8, help="experts per token, <= experts (default 8)"
    )
    p.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="experts (default 256 if it divides over the expert dies, else 8 per die)",
    )
    p.add_argument(
        "--protocol",
        type=choice_list(PROTOCOLS),
        default="pull,fused",
        help=f"comma list of {','.join(PROTOCOLS)}",
    )
    p.add_argument(
        "--quant",
        type=choice_list(QUANTS),
        default="int8,none",
        help=f"comma list of {','.join(QUANTS)}",
    )
    p.add_argument(
        "--routing",
        type=choice_list(ROUTINGS),
        default="uniform",
        help="comma list of uniform (default) and skew (Zipf expert popularity)",
    )
    p.add_argument(
        "--combine-dtype",
        default="bfloat16",
        choices=COMBINE_DTYPES,
        help="combine rows in 16 bits (the paper's, default) or float32",
    )
    p.add_argument("--a2e", action="store_true", help="add A2E/E2A rows (protocol a2e)")
    p.add_argument(
        "--attention-dies", type=int_list(1), default="2", help="A2E attention dies, comma list"
    )
    p.add_argument(
        "--expert-dies",
        type=int_list(1),
        default="4",
        help="A2E expert dies (>= attention dies), paired with the above",
    )
    p.add_argument("--peers", action="store_true", help="also mpi4py Alltoallv and pyzmq")
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, few iters")
    p.add_argument(
        "--iters", type=nonneg_int, default=0, help="timed iterations (default 0: by time)"
    )
    p.add_argument("--iters-scale", type=positive_float, default=1.0, help="scale the time per row")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="measure everything R times, alternating xpod and peers; report medians",
    )
    p.add_argument("--seed", type=nonneg_int, default=0, help="routing and token seed")
    p.add_argument(
        "--json", type=output_file, default=None, help="write one JSON line per row to FILE"
    )
    p.add_argument(
        "--plot", type=output_file, default=None, help="draw latency and bandwidth vs batch to FILE"
    )
    p.add_argument(
        "--trace", type=output_file, default=None, help="write a Chrome/Perfetto trace per pod"
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    p.add_argument("--timeout", type=positive_float, default=None, help="wait deadline (PodConfig)")
    add_host_args(p)
    attach.add_project_args(p, "alltoall")


def _a2e_pods(att: list[int], exp: list[int]) -> list[tuple[int, int]]:
    """(attention dies, expert dies) pairs of --attention-dies and --expert-dies (a single
    value pairs with every value of the other list)."""
    if len(att) != len(exp) and 1 not in (len(att), len(exp)):
        raise ConfigError(
            f"argument --attention-dies/--expert-dies: lists of {len(att)} and {len(exp)} values"
            " do not pair up (give as many values in each, or one in either)"
        )
    n = max(len(att), len(exp))
    pods = list(
        zip(att * n if len(att) == 1 else att, exp * n if len(exp) == 1 else exp, strict=True)
    )
    bad = [(a, x) for a, x in pods if a > x]
    if bad:
        raise ConfigError(
            f"argument --attention-dies/--expert-dies: A2E needs attention dies <= expert dies,"
            f" got {bad[0][0]} > {bad[0][1]}"
        )
    return pods


def parse_options(args: argparse.Namespace) -> Options:
    """Options of the parsed flags, every pod of the run checked (experts, topk, PodConfig)
    before any starts; a ConfigError names the flag(s)."""
    protocols = list(args.protocol)
    if args.a2e and "a2e" not in protocols:
        protocols.append("a2e")
    quick = args.quick
    dies = args.dies
    _, host_cfg = host_fields(args, None)
    if host_cfg.get("hosts"):
        n = len(host_cfg["hosts"])
        if dies not in ([8], [n]) or any(a + x != n for a, x in _a2e_pods(args.attention_dies,
                                                                          args.expert_dies)
                                         if args.a2e or "a2e" in protocols):  # fmt: skip
            raise ConfigError(f"argument --hosts: {n} dies, so one pod of {n} (--dies {n})")
        dies = [n]
    opts = Options(
        dies=dies,
        batches=args.batch or int_list(1)(QUICK_BATCHES if quick else DEFAULT_BATCHES),
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        protocols=protocols,
        quants=args.quant,
        combine_dtype=args.combine_dtype,
        a2e_pods=_a2e_pods(args.attention_dies, args.expert_dies),
        routings=list(args.routing),
        peers=args.peers,
        budget_s=(QUICK_BUDGET_S if quick else BUDGET_S) * args.iters_scale,
        iters_range=QUICK_ITERS_RANGE if quick else ITERS_RANGE,
        iters=args.iters,
        repeat=args.repeat,
        seed=args.seed,
        trace=args.trace,
        config=args.config,
        timeout=args.timeout,
        json=args.json,
        plot=args.plot,
        hosts=host_cfg,
        project=attach.projection_of(args),
    )
    for pt, _ in plan(opts):
        _check_point(pt, opts)
    return opts


def _check_point(pt: Point, opts: Options) -> None:
    n_exp = pt.dies - pt.attention_dies
    if pt.num_experts % n_exp:
        raise ConfigError(
            f"argument --experts: {pt.num_experts} experts do not divide over the {n_exp}"
            f" expert dies of {pt.label}"
        )
    if pt.topk > pt.num_experts:
        raise ConfigError(
            f"argument --topk: {pt.topk} is more than the {pt.num_experts} experts of {pt.label}"
            " (--experts)"
        )
    pod_config(pt, opts)


def plan(opts: Options) -> list[tuple[Point, list[str]]]:
    """Every pod of the run with the protocols it measures, in run order."""
    out = []
    ep_protocols = [p for p in opts.protocols if p != "a2e"]
    for routing_ in opts.routings:
        for dies in opts.dies if ep_protocols else []:
            e = opts.experts or default_experts(dies)
            for b in opts.batches:
                pt = Point(dies, b, opts.hidden, opts.topk, e, opts.seed, 0, opts.combine_dtype,
                           routing_)  # fmt: skip
                out.append((pt, ep_protocols))
        for a, x in opts.a2e_pods if "a2e" in opts.protocols else []:
            e = opts.experts or default_experts(x)
            for b in opts.batches:
                pt = Point(a + x, b, opts.hidden, opts.topk, e, opts.seed, a, opts.combine_dtype,
                           routing_)  # fmt: skip
                out.append((pt, ["a2e"]))
    return out


def pod_config(pt: Point, opts: Options) -> PodConfig:
    """The pod of `pt`; a ConfigError names the flag(s) that set the bad field."""
    n_exp = pt.dies - pt.attention_dies
    dies_flag = "--attention-dies/--expert-dies" if pt.attention_dies else "--dies"
    shape = "--batch/--hidden/--topk/" + dies_flag
    flags = {
        "num_dies": dies_flag,
        "a2a_max_batch": "--batch",
        "a2a_hidden": "--hidden",
        "a2a_topk": "--topk",
        "num_experts": "--experts/" + dies_flag,
        "a2a_max_local_experts": "--experts/" + dies_flag,
        "app_bytes": shape,  # the region's size is that of its all-to-all areas
        "trace": "--trace",
        "timeout_s": "--timeout",
        "hosts": "--hosts",
        "fabric": "--fabric",
        "host_names": "--hosts",
        "net_if": "--net-if",
    }
    return load_config(
        opts.config,
        flags,
        num_dies=pt.dies,
        a2a_max_batch=pt.batch,
        a2a_hidden=pt.hidden,
        a2a_topk=pt.topk,
        num_experts=pt.num_experts,
        a2a_max_local_experts=pt.num_experts // n_exp if pt.attention_dies else None,
        app_bytes=1 << 20,  # the all-to-all areas are separate; the app area stays unused
        # INT8-only runs get the paper's INT8 row size (a quarter of the float32 rows)
        a2a_dispatch_dtype="int8" if opts.quants == ["int8"] else "float32",
        a2a_combine_dtype=pt.combine_dtype,
        trace=True if opts.trace else None,
        timeout_s=opts.timeout,
        **opts.hosts,
    )
