"""The flags of `xpod bench serve` (vLLM's where they apply) and their check into `Options`:
a bad flag is a ConfigError that names it, raised before anything starts."""

from __future__ import annotations

import argparse
import math
import re
import shlex

from bench.serve.dataset import CHAT_OVERHEAD, check_context, make_requests, read_jsonl
from bench.serve.interference import BURST_MAX_TOKENS
from bench.serve.mt_compare import POOL_FLAGS, add_mt_args, fit_context, layout_argvs, mt_spec
from bench.serve.options import PROG, Options
from bench.serve.pd_flags import (
    add_pd_args,
    burst_sizes,
    check_pd_flags,
    launch_only,
    pd_server_argvs,
    without,
)
from bench.serve.stats import METRICS
from memory.errors import ConfigError
from runtime.cli.argtypes import (
    Parser,
    float_range,
    input_file,
    int_range,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.model import PRESETS

DATASETS = ("random", "prefix-repetition", "prefix_repetition", "file", "multi-turn", "multi_turn")
TTFT_PROBES = 20
QUICK_MAX_PROMPTS, QUICK_MAX_LEN, QUICK_PROBES = 32, 32, 5


def _url(text: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL like http://127.0.0.1:8000")
    return text.strip().rstrip("/")


def _rate(text: str) -> float:
    """A request rate: a number > 0 or inf."""
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    return positive_float(text)


def _goodput_item(text: str) -> tuple[str, float]:
    """`KEY:MS` of --goodput: KEY ttft, tpot or e2el; MS a number > 0."""
    key, sep, value = text.partition(":")
    if not sep or key not in ("ttft", "tpot", "e2el"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY:MS with KEY one of ttft, tpot, e2el (e.g. ttft:500)"
        )
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not math.isfinite(ms) or ms <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be a number of ms > 0")
    return key, ms


def _fractions(text: str) -> list[float]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give fractions, e.g. 0.5,1")
    try:
        out = [positive_float(v) for v in items]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (in {text})") from None
    if sorted(set(out)) != out:
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing fractions, e.g. 0.5,1")
    return out


def _names(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in METRICS]
    if not names or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma list of {', '.join(METRICS)}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        out = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        out = []
    if not out or any(not 0 < p < 100 for p in out):
        raise argparse.ArgumentTypeError(f"{text!r}: give percentiles in (0, 100), e.g. 90,99")
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--url", type=_url, default=None, help="a running xpod serve (e.g. http://127.0.0.1:8000)"
    )
    where.add_argument(
        "--launch", action="store_true", help="start `xpod serve --port 0` here, stop it at the end"
    )
    s = p.add_argument_group("launched server (--launch)")
    s.add_argument("--dies", type=positive_int, default=None, help="dies = DP groups (default 4)")
    s.add_argument(
        "--model",
        default=None,
        choices=tuple(PRESETS),
        help="model preset (default small); the model id is read from /v1/models",
    )
    s.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help="batch limit per group (default ceil(max-concurrency / dies), else 8)",
    )
    s.add_argument(
        "--lb",
        default=None,
        choices=("least_kv", "round_robin"),
        help="DP load balancing (default least_kv)",
    )
    s.add_argument(
        "--lb-compare",
        action="store_true",
        help="then the main run again on a server with the other DP balancing policy"
        " (least_kv / round_robin), same requests: KV balance and attention imbalance of both",
    )
    s.add_argument("--output-procs", action="store_true", help="one output process per group")
    s.add_argument(
        "--server-args",
        default="",
        metavar='"FLAGS"',
        help='more `xpod serve` flags, e.g. "--async-depth 1 --no-prefix-cache"',
    )
    add(
        "--endpoint",
        default="completions",
        choices=("completions", "chat"),
        help="/v1/completions (default) or /v1/chat/completions",
    )
    add("--num-prompts", type=positive_int, default=200, help="requests (default 200)")
    add(
        "--request-rate",
        type=_rate,
        default=math.inf,
        help="requests per second (default inf: all at once)",
    )
    add(
        "--burstiness",
        type=positive_float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier (default 1)",
    )
    add(
        "--ramp-up-strategy",
        default=None,
        choices=("linear", "exponential"),
        help="move the rate from --ramp-up-start-rps to --ramp-up-end-rps over the run",
    )
    add("--ramp-up-start-rps", type=nonneg_float, default=None, help="rate of the first request")
    add("--ramp-up-end-rps", type=positive_float, default=None, help="rate of the last request")
    add(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests in flight at most (default: no limit)",
    )
    add(
        "--dataset",
        default="random",
        choices=DATASETS,
        help="random (default), prefix-repetition, file (--dataset-path), or multi-turn"
        " (conversations resending their history: --mt-*)",
    )
    add(
        "--random-input-len",
        type=int_range(2),
        default=64,
        help="prompt tokens, BOS included (default 64)",
    )
    add(
        "--random-output-len",
        type=positive_int,
        default=None,
        help="max_tokens (default 64; multi-turn: a reply's tokens, default 32)",
    )
    add(
        "--random-range-ratio",
        type=float_range(0.0),
        default=0.0,
        help="lengths uniform in [len (1 - r), len (1 + r)], r < 1 (default 0)",
    )
    add(
        "--random-prefix-len",
        type=nonneg_int,
        default=0,
        help="tokens of text shared by every prompt, in front (default 0)",
    )
    add(
        "--prefix-repetition-prefix-len",
        type=positive_int,
        default=192,
        help="tokens of each shared prefix (default 192)",
    )
    add(
        "--prefix-repetition-suffix-len",
        type=positive_int,
        default=64,
        help="tokens of each request's own suffix (default 64)",
    )
    add(
        "--prefix-repetition-num-prefixes",
        type=positive_int,
        default=4,
        help="distinct prefixes (default 4)",
    )
    add(
        "--prefix-repetition-output-len",
        type=positive_int,
        default=64,
        help="max_tokens (default 64)",
    )
    add(
        "--dataset-path",
        type=input_file,
        default=None,
        help='JSONL file, a line {"prompt": ..., "max_tokens"?: ...} per request',
    )
    add("--ignore-eos", action="store_true", help="generate max_tokens tokens, EOS or not")
    add("--temperature", type=float_range(0.0), default=0.0, help="0 = greedy (default)")
    add(
        "--goodput",
        type=_goodput_item,
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="SLOs of a good request, e.g. ttft:500 tpot:50 e2el:5000 (ms)",
    )
    add(
        "--percentile-metrics",
        type=_names,
        default=list(METRICS),
        help="metrics printed with percentiles (default ttft,tpot,itl,e2el)",
    )
    add(
        "--metric-percentiles",
        type=_percentiles,
        default=[90.0, 99.0],
        help="percentiles of every metric (default 90,99)",
    )
    add("--seed", type=nonneg_int, default=0, help="prompts and arrivals (default 0)")
    add("--json", type=output_file, default=None, help="write the results to FILE (one object)")
    add(
        "--plot",
        type=output_file,
        default=None,
        help="PNG: the rate sweep, else the latency CDFs (needs matplotlib)",
    )
    add(
        "--rate-sweep",
        type=_fractions,
        default=None,
        metavar="F1,F2,...",
        help="after the saturation run, runs at these fractions of its capacity",
    )
    add(
        "--ttft",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="TTFT phase, idle and under decode load (default: on with --launch)",
    )
    add(
        "--ttft-probes",
        type=positive_int,
        default=None,
        help=f"probe requests per TTFT part (default {TTFT_PROBES}, {QUICK_PROBES} with --quick)",
    )
    add(
        "--request-timeout",
        type=positive_float,
        default=600.0,
        help="seconds a request may take (default 600)",
    )
    add(
        "--save-detailed",
        action="store_true",
        help="--json also gets per-request lists (input_lens, output_lens, ttfts, itls, errors)",
    )
    add("--disable-tqdm", action="store_true", help="no progress bar")
    add(
        "--client-policy",
        default="batch",
        choices=("batch", "normal"),
        help="scheduling policy of this process once the server runs (default batch, as the"
        " shell's: a client woken per chunk does not preempt a die)",
    )
    add(
        "--repeat",
        type=positive_int,
        default=1,
        help="with --launch: R alternating pairs of xpod decode and the main run, the median"
        " pair's ratio reported (the machine is shared and noisy; default 1)",
    )
    add("--quick", action="store_true", help="short run (CI smoke test)")
    add_pd_args(p)
    add_mt_args(p)


def parse_options(args: argparse.Namespace) -> Options:
    """Every flag checked (ConfigError naming it) before anything starts."""
    try:
        import aiohttp  # noqa: F401
        import uvloop  # noqa: F401
    except ImportError as e:
        raise ConfigError(
            f"{PROG} needs the serve extra ({e.name} is missing): pip install -e '.[serve]'"
        ) from None
    if not args.launch:
        for flag, value in (
            ("--dies", args.dies),
            ("--model", args.model),
            ("--max-num-seqs", args.max_num_seqs),
            ("--lb", args.lb),
            ("--lb-compare", args.lb_compare or None),
            ("--output-procs", args.output_procs or None),
            ("--server-args", args.server_args or None),
            ("--compare-pool", args.compare_pool),
            *launch_only(args),
        ):
            if value is not None:
                raise ConfigError(
                    f"argument {flag}: only with --launch (the server at --url has its own)"
                )
    pd = check_pd_flags(args)
    dataset = args.dataset.replace("_", "-")
    mt = mt_spec(args, dataset)
    if args.compare_pool and (args.lb or args.lb_compare):
        flag = "--lb" if args.lb else "--lb-compare"
        raise ConfigError(f"argument {flag}: not with --compare-pool (each layout has its own)")
    n, in_len, out_len = args.num_prompts, args.random_input_len, args.random_output_len or 64
    pr_pre, pr_suf, pr_out = (
        args.prefix_repetition_prefix_len,
        args.prefix_repetition_suffix_len,
        args.prefix_repetition_output_len,
    )
    if args.quick:
        n, in_len, out_len = (
            min(n, QUICK_MAX_PROMPTS),
            min(in_len, QUICK_MAX_LEN),
            min(out_len, QUICK_MAX_LEN),
        )
        pr_pre, pr_suf, pr_out = (
            min(pr_pre, 3 * QUICK_MAX_LEN),
            min(pr_suf, QUICK_MAX_LEN),
            min(pr_out, QUICK_MAX_LEN),
        )
    if args.random_range_ratio >= 1:
        raise ConfigError(f"argument --random-range-ratio: {args.random_range_ratio} must be < 1")
    if args.temperature > 2:
        raise ConfigError(f"argument --temperature: {args.temperature} must be in [0, 2]")
    if (dataset == "file") != (args.dataset_path is not None):
        raise ConfigError("argument --dataset-path: give it with --dataset file (and only then)")
    file_rows = read_jsonl(args.dataset_path) if args.dataset_path else ()
    ramp = None
    ramp_flags = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    if any(v is not None for v in ramp_flags):
        if any(v is None for v in ramp_flags):
            raise ConfigError(
                "argument --ramp-up-strategy: give it with --ramp-up-start-rps"
                " and --ramp-up-end-rps"
            )
        if args.ramp_up_strategy == "exponential" and args.ramp_up_start_rps <= 0:
            raise ConfigError("argument --ramp-up-start-rps: must be > 0 with exponential ramp")
        if args.rate_sweep:
            raise ConfigError("argument --rate-sweep: not with --ramp-up-strategy")
        ramp = (args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    if args.rate_sweep and not math.isinf(args.request_rate):
        raise ConfigError(
            "argument --rate-sweep: the capacity is measured at --request-rate"
            f" inf (the saturation run), not {args.request_rate:g}"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError(
                "argument --plot: needs matplotlib: pip install -e '.[plot]'"
            ) from None
    goodput: dict[str, float] = {}
    for key, ms in args.goodput or ():
        if key in goodput:
            raise ConfigError(f"argument --goodput: {key} given twice")
        goodput[key] = ms
    ttft = args.launch and not args.quick and not mt if args.ttft is None else args.ttft
    if ttft and not args.launch and args.max_concurrency is None:
        raise ConfigError(
            "argument --ttft: with --url give --max-concurrency (the loaded part"
            " runs max-concurrency - 1 requests)"
        )
    probes = args.ttft_probes or (QUICK_PROBES if args.quick else TTFT_PROBES)

    dies = max_seqs = max_len = 0
    model, protocol, quant, server_argv = args.model or "small", "fused", None, ()
    colo_argv: tuple[str, ...] = ()
    overrides: dict = {}
    notes: tuple[str, ...] = ()
    layouts: tuple = ()
    block_size = 16
    burst_n, burst_len = burst_sizes(args)
    if args.launch:
        dies = args.dies or 4
        groups = args.decode_dies if pd else dies  # the requests run on these
        if args.max_num_seqs:
            max_seqs = args.max_num_seqs
        else:
            max_seqs = -(-args.max_concurrency // groups) if args.max_concurrency else 8
        base: tuple[str, ...] = ("--model", model, "--max-num-seqs", str(max_seqs),
                                 "--lb", args.lb or "least_kv")  # fmt: skip
        base += ("--output-procs",) if args.output_procs else ()
        try:
            user = tuple(shlex.split(args.server_args))
        except ValueError as e:
            raise ConfigError(f"argument --server-args: {e}") from None
        if pd:
            over = CHAT_OVERHEAD if args.endpoint == "chat" else 0
            server_argv, colo_argv, engine, notes = pd_server_argvs(
                args, base, user, burst_len, burst_len + BURST_MAX_TOKENS + over,
                check_server_args,
            )  # fmt: skip
        else:
            server_argv = ("--dies", str(dies), *base, *user)
            check = check_server_args
            if args.compare_pool:  # the --pool-* flags go to the pool layout only

                def check(argv: tuple[str, ...]):
                    return check_server_args(without(argv, POOL_FLAGS))

            engine = check(server_argv)
            if mt is not None:
                server_argv, engine, notes = fit_context(mt, engine, server_argv, check)
            if args.compare_pool:
                layouts = layout_argvs(args.compare_pool, server_argv, user, check_server_args)
                server_argv = layouts[0][1]
        block_size = engine.block_size
        dies, max_seqs, model = engine.dies, engine.max_num_seqs, engine.model
        protocol, quant = engine.protocol, engine.quant
        overrides = dict(engine.model_overrides)
        max_len = engine.model_config().max_seq_len
    opts = Options(
        url=args.url,
        launch=args.launch,
        server_argv=server_argv,
        dies=dies,
        model=model,
        max_num_seqs=max_seqs,
        protocol=protocol,
        quant=quant,
        max_model_len=max_len,
        endpoint=args.endpoint,
        num_prompts=mt.requests if mt else n,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ramp=ramp,
        max_concurrency=args.max_concurrency,
        dataset=dataset,
        input_len=in_len,
        output_len=out_len,
        range_ratio=args.random_range_ratio,
        prefix_len=args.random_prefix_len,
        pr_prefix_len=pr_pre,
        pr_suffix_len=pr_suf,
        pr_num_prefixes=args.prefix_repetition_num_prefixes,
        pr_output_len=pr_out,
        dataset_path=args.dataset_path,
        file_rows=file_rows,
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        goodput=goodput,
        percentile_metrics=tuple(args.percentile_metrics),
        metric_percentiles=tuple(args.metric_percentiles),
        seed=args.seed,
        json=args.json,
        plot=args.plot,
        rate_sweep=tuple(args.rate_sweep or ()),
        quick=args.quick,
        ttft=ttft,
        ttft_probes=probes,
        save_detailed=args.save_detailed,
        show_progress=not args.disable_tqdm,
        client_batch=args.client_policy == "batch",
        request_timeout_s=args.request_timeout,
        repeat=1 if args.quick else args.repeat,
        lb_compare=args.lb_compare,
        model_overrides=overrides,
        prefill_dies=args.prefill_dies or 0,
        decode_dies=args.decode_dies or 0,
        layout="pd" if pd else "",
        compare_colocated=args.compare_colocated,
        colocated_argv=colo_argv,
        burst_prompts=burst_n,
        burst_len=burst_len,
        notes=notes,
        mt=mt,
        block_size=block_size,
        compare_pool=layouts,
    )
    if opts.repeat > 1 and not opts.launch:
        raise ConfigError("argument --repeat: needs --launch (pairs with xpod decode)")
    if max_len and mt is None:
        check_context(opts, make_requests(opts, opts.num_prompts, 0), max_len)
    return opts


class _ServerArgsParser(Parser):
    def error(self, message: str):
        raise ConfigError(f"argument --server-args: {message}")


def check_server_args(argv: tuple[str, ...]):
    """The EngineConfig `xpod serve --port 0 <argv>` would run; ConfigError naming --server-args."""
    from runtime.cli import serve as serve_args

    p = _ServerArgsParser(prog="xpod serve")
    serve_args.add_args(p)
    ns = p.parse_args(["--port", "0", *argv])
    try:
        return serve_args.parse_options(ns).engine
    except ValueError as e:
        raise ConfigError(f"argument --server-args: {' '.join(str(e).split())}") from None
