"""`xpod bench serve`: a vLLM-style serving benchmark against xpod's OpenAI-compatible server.

```
xpod bench serve --launch --dies 4 --max-concurrency 8 --ignore-eos --num-prompts 64
xpod bench serve --url http://127.0.0.1:8000 --request-rate 20 --burstiness 0.5 --json out.json
xpod bench serve --launch --max-concurrency 8 --ignore-eos --rate-sweep 0.25,0.5,0.75,1,1.25
```

It mirrors `vllm bench serve`: the same flags where they apply, the same summary block and JSON
keys (`completed`, `failed`, `duration`, `request_throughput`, `output_throughput`,
`mean_ttft_ms`, `median_tpot_ms`, `p99_itl_ms`, ...). Every request streams (`stream: true`,
`stream_options.include_usage`, `return_token_ids`): TTFT is the time to the first chunk that
carries text or token ids, ITL the gaps between such chunks, TPOT = (e2e - TTFT) / (output
tokens - 1), and output tokens are `usage.completion_tokens` (never a chunk count). A request
that gets an HTTP error, a bad SSE frame, an error event, no usage or a disconnect counts as
failed and keeps its error (the first few are printed); any failure makes the exit status 1.

Server: `--url` (a running server) or `--launch` (starts `xpod serve --port 0` as a child
process with `--dies`, `--model`, `--max-num-seqs`, `--lb`, `--output-procs` and the
`--server-args` passthrough, waits for `/health`, and at the end stops it with SIGTERM and
checks its exit status 0; on any error it is killed; nothing is left behind).

Datasets (nothing is downloaded): `random` (printable ASCII text, so a prompt of
`--random-input-len` tokens is BOS + that many bytes - 1; `--random-range-ratio` spreads input
and output lengths uniformly over [len (1 - r), len (1 + r)]; `--random-prefix-len` bytes of
text shared by every prompt in front), `prefix-repetition` (`--prefix-repetition-num-prefixes`
prefixes of `-prefix-len` bytes, each request one of them and its own `-suffix-len` bytes),
`file` (`--dataset-path`: JSONL lines `{"prompt": ..., "max_tokens"?: ...}`, taken in order and
cycled). Arrivals: gaps drawn from a gamma distribution of shape `--burstiness` (1 = Poisson)
and mean 1 / `--request-rate`, scaled so the last request goes at num_prompts / rate (vLLM's
way); `--ramp-up-strategy` moves the rate from `--ramp-up-start-rps` to `--ramp-up-end-rps`;
`--max-concurrency` caps the requests in flight (a semaphore, as vLLM's).

Extras, from `/metrics` (scraped every 0.2 s while the run goes, as deltas over the run): KV
balance (time-averaged max/mean KV usage over groups, over the scrapes whose mean is > 0),
dummy-step share (dummy steps over all die steps: with rows or dummy), scheduling bubble per
step, MoE wait share, attention imbalance, prefix hit rate, step time (the first and last
scrapes wait 1.2 s: an idle group's master reports its die's dummy steps at its next
heartbeat); CPU seconds of the client (this process, its /metrics parsing included) and of
the server by role (shell, masters, outputs, dies), also per output token. With `--launch`:
`xpod decode` at the same dies and global batch (`--max-concurrency`, else dies x
max-num-seqs), prompt length `--random-input-len` and `--random-output-len` steps, run in the
same run (the server up and idle), `ratio_to_decode` = output_throughput /
decode_tokens_per_s (decode steps only) and `ratio_to_decode_with_prefill` (against decode's
prefill + decode time: the same work); `--repeat R` alternates R decode / main-run pairs and
reports the median pair (`pairs` has them all).

TTFT phase (`--ttft`; on by default with `--launch`, off with `--quick` unless given): (a) idle
server: probes of `--random-input-len` tokens and `max_tokens` 1 sent one at a time: TTFT p50,
and the prefill time per request from `/metrics` (`xpod_step_seconds` over the phase: only
those prefills ran); (b) under decode load: concurrency - 1 long `ignore_eos` requests keep
running while probes go one after another: TTFT p50 / p99 and the step time under load. The
bounds of SERVING.md 6.2 are reported next to them: idle p50 <= prefill + 5 ms, under load
p50 <= prefill + 2 steps + 5 ms.

`--rate-sweep F1,F2,...`: after the main run (at `--request-rate inf`: the saturation phase,
whose request throughput is the capacity), one run of `--num-prompts` at each rate F x capacity
with open-loop arrivals (no client concurrency cap: requests queue in the server, so TTFT shows
the queueing): a table (and with `--plot` a PNG) of TTFT and TPOT p50 / p99 and goodput
(`request_goodput` with `--goodput`, else the request throughput) against the rate; the knee is
the first rate whose TTFT p50 exceeds twice the lowest rate's, or whose goodput stops rising
(within 2 %). Without `--rate-sweep`, `--plot` draws the latency CDFs of the main run.

`--json FILE` writes one JSON object: the vLLM keys plus the extras above, the options and the
run info (date, git sha). `--quick`: a short run (at most 32 prompts, lengths at most 32).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import psutil

from bench.common import print_table, progress, run_info
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
from runtime.model import PRESETS, ModelConfig, encode

PROG = "xpod bench serve"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
SCRAPE_S = 0.2  # the KV gauges while a run goes (`/metrics?name[]=...`: ~0.3 ms of the shell)
KV_GAUGE = "xpod_kv_cache_usage_perc"
STATS_LAG_S = 0.3  # busy masters report every 0.1 s: wait this long before a phase's last scrape
# A run's first and last (full) scrapes: the masters' stats of the steps before are in (the
# dies' own counters are read fresh by the shell).
IDLE_LAG_S = 0.3
TTFT_PROBES = 20
QUICK_MAX_PROMPTS, QUICK_MAX_LEN, QUICK_PROBES = 32, 32, 5
GOODPUT_RISE = 0.02  # the sweep's goodput "stops rising" when it gains less than this
SHOW_ERRORS = 5
CHAT_OVERHEAD = len(encode("<|user|>\n\n<|assistant|>\n", bos=False))  # openai_api.chat_prompt
SERVE_URL_LINE = re.compile(r"serving (\S+) on (https?://\S+)")
LAUNCH_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


class BenchError(Exception):
    """The benchmark cannot go on (the server failed, did not answer, refused the prompts)."""


@dataclass(frozen=True)
class Request:
    """One request of a dataset: its prompt text, prompt tokens (BOS included) and max_tokens."""

    prompt: str
    prompt_len: int
    max_tokens: int


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds)."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0


@dataclass(frozen=True)
class Options:
    url: str | None
    launch: bool
    server_argv: tuple[str, ...]  # `xpod serve` flags after `serve` (launch)
    dies: int  # of the launched server (0 with --url: read from /metrics)
    model: str
    max_num_seqs: int
    protocol: str
    quant: str | None
    max_model_len: int  # 0 with --url: read from /v1/models
    endpoint: str
    num_prompts: int
    request_rate: float
    burstiness: float
    ramp: tuple[str, float, float] | None
    max_concurrency: int | None
    dataset: str
    input_len: int
    output_len: int
    range_ratio: float
    prefix_len: int
    pr_prefix_len: int
    pr_suffix_len: int
    pr_num_prefixes: int
    pr_output_len: int
    dataset_path: str | None
    file_rows: tuple[tuple[str, int | None], ...]
    ignore_eos: bool
    temperature: float
    goodput: dict
    percentile_metrics: tuple[str, ...]
    metric_percentiles: tuple[float, ...]
    seed: int
    json: str | None
    plot: str | None
    rate_sweep: tuple[float, ...]
    quick: bool
    ttft: bool
    ttft_probes: int
    save_detailed: bool
    show_progress: bool
    request_timeout_s: float
    client_batch: bool = True
    repeat: int = 1
    lb_compare: bool = False

    @property
    def load_concurrency(self) -> int:
        """Requests in flight in the TTFT phase's loaded part (probe included)."""
        return self.max_concurrency or self.dies * self.max_num_seqs


# -- flags -----------------------------------------------------------------------------------------


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
        choices=("random", "prefix-repetition", "prefix_repetition", "file"),
        help="random (default), prefix-repetition, or file (--dataset-path)",
    )
    add(
        "--random-input-len",
        type=int_range(2),
        default=64,
        help="prompt tokens, BOS included (default 64)",
    )
    add("--random-output-len", type=positive_int, default=64, help="max_tokens (default 64)")
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
        ):
            if value is not None:
                raise ConfigError(
                    f"argument {flag}: only with --launch (the server at --url has its own)"
                )
    n, in_len, out_len = args.num_prompts, args.random_input_len, args.random_output_len
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
    dataset = args.dataset.replace("_", "-")
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
    ttft = args.launch and not args.quick if args.ttft is None else args.ttft
    if ttft and not args.launch and args.max_concurrency is None:
        raise ConfigError(
            "argument --ttft: with --url give --max-concurrency (the loaded part"
            " runs max-concurrency - 1 requests)"
        )
    probes = args.ttft_probes or (QUICK_PROBES if args.quick else TTFT_PROBES)

    dies = max_seqs = max_len = 0
    model, protocol, quant, server_argv = args.model or "small", "fused", None, ()
    if args.launch:
        dies = args.dies or 4
        if args.max_num_seqs:
            max_seqs = args.max_num_seqs
        else:
            max_seqs = -(-args.max_concurrency // dies) if args.max_concurrency else 8
        server_argv = (
            "--dies",
            str(dies),
            "--model",
            model,
            "--max-num-seqs",
            str(max_seqs),
            "--lb",
            args.lb or "least_kv",
        )
        server_argv += ("--output-procs",) if args.output_procs else ()
        try:
            server_argv += tuple(shlex.split(args.server_args))
        except ValueError as e:
            raise ConfigError(f"argument --server-args: {e}") from None
        engine = check_server_args(server_argv)
        dies, max_seqs, model = engine.dies, engine.max_num_seqs, engine.model
        protocol, quant = engine.protocol, engine.quant
        max_len = ModelConfig.preset(model).max_seq_len
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
        num_prompts=n,
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
    )
    if opts.repeat > 1 and not opts.launch:
        raise ConfigError("argument --repeat: needs --launch (pairs with xpod decode)")
    if max_len:
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


def read_jsonl(path: str) -> tuple[tuple[str, int | None], ...]:
    """(prompt, max_tokens or None) of every line of a JSONL file; ConfigError naming the line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"argument --dataset-path: {path}:{i}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ConfigError(f"{where}: not JSON: {e}") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ConfigError(f'{where}: want {{"prompt": "non-empty text", ...}}')
            mt = obj.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
                raise ConfigError(f"{where}: max_tokens must be an integer >= 1")
            rows.append((prompt, mt))
    if not rows:
        raise ConfigError(f"argument --dataset-path: {path} has no prompts")
    return tuple(rows)


# -- datasets and arrivals ------------------------------------------------------------------------


def random_text(rng: np.random.Generator, n: int) -> str:
    """`n` printable ASCII characters (one byte token each)."""
    return rng.integers(32, 127, size=n, dtype=np.uint8).tobytes().decode("ascii")


def _lens(rng: np.random.Generator, n: int, length: int, ratio: float, lo: int) -> np.ndarray:
    if ratio == 0:
        return np.full(n, length, dtype=np.int64)
    a, b = max(lo, math.floor(length * (1 - ratio))), max(lo, math.ceil(length * (1 + ratio)))
    return rng.integers(a, b + 1, size=n)


def make_requests(opts: Options, n: int, phase: int) -> list[Request]:
    """`n` requests of the dataset; random prompts differ between phases (no prefix hits)."""
    rng = np.random.default_rng([opts.seed, phase])
    if opts.dataset == "file":
        rows = [opts.file_rows[i % len(opts.file_rows)] for i in range(n)]
        return [Request(p, len(encode(p)), mt or opts.output_len) for p, mt in rows]
    if opts.dataset == "prefix-repetition":
        prng = np.random.default_rng([opts.seed, 1 << 20])  # the same prefixes in every phase
        prefixes = [random_text(prng, opts.pr_prefix_len) for _ in range(opts.pr_num_prefixes)]
        which = rng.permutation(np.arange(n) % opts.pr_num_prefixes)
        out = []
        for k in which:
            text = prefixes[k] + random_text(rng, opts.pr_suffix_len)
            out.append(Request(text, len(text) + 1, opts.pr_output_len))
        return out
    shared = random_text(np.random.default_rng([opts.seed, 1 << 21]), opts.prefix_len)
    ins = _lens(rng, n, opts.input_len, opts.range_ratio, 2)
    outs = _lens(rng, n, opts.output_len, opts.range_ratio, 1)
    out = []
    for i_len, o_len in zip(ins, outs, strict=True):
        text = shared + random_text(rng, int(i_len) - 1)
        out.append(Request(text, len(text) + 1, int(o_len)))
    return out


def probe_requests(opts: Options, n: int, phase: int) -> list[Request]:
    """TTFT probes: random prompts of --random-input-len tokens, max_tokens 1."""
    rng = np.random.default_rng([opts.seed, 1 << 22, phase])
    return [
        Request(t, len(t) + 1, 1) for t in (random_text(rng, opts.input_len - 1) for _ in range(n))
    ]


def context_len(opts: Options, req: Request) -> int:
    """Prompt tokens as the server counts them (chat: the template's too) + max_tokens."""
    return req.prompt_len + (CHAT_OVERHEAD if opts.endpoint == "chat" else 0) + req.max_tokens


def check_context(opts: Options, reqs: list[Request], max_len: int) -> None:
    worst = max(reqs, key=lambda r: context_len(opts, r))
    if context_len(opts, worst) <= max_len:
        return
    flags = {
        "random": "--random-input-len/--random-output-len/--random-prefix-len",
        "prefix-repetition": "--prefix-repetition-prefix-len/-suffix-len/-output-len",
        "file": "--dataset-path",
    }[opts.dataset]
    raise ConfigError(
        f"argument {flags}: a request of {worst.prompt_len} prompt tokens and"
        f" max_tokens {worst.max_tokens} does not fit the model's context of"
        f" {max_len} tokens"
    )


def arrival_times(
    n: int,
    rate: float,
    burstiness: float = 1.0,
    seed: int = 0,
    ramp: tuple[str, float, float] | None = None,
) -> np.ndarray:
    """Send times (s from the start) of `n` requests, vLLM's way.

    Gaps come from a gamma distribution of shape `burstiness` and mean 1 / rate (burstiness 1:
    Poisson arrivals; < 1 burstier; > 1 steadier; their coefficient of variation is
    1 / sqrt(burstiness)); then every time is scaled so that the last one is n / rate. rate inf:
    every request at 0. `ramp` = (linear | exponential, start, end): request i's gap is drawn at
    the rate start -> end at i / (n - 1), without the rescaling.
    """
    rng = np.random.default_rng(seed)
    if ramp is not None:
        kind, lo, hi = ramp
        x = np.arange(n) / max(n - 1, 1)
        rates = lo + (hi - lo) * x if kind == "linear" else lo * (hi / lo) ** x
        rates = np.maximum(rates, 1e-9)
        return np.cumsum(rng.gamma(burstiness, 1.0 / (rates * burstiness)))
    if math.isinf(rate):
        return np.zeros(n)
    t = np.cumsum(rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n))
    return t * ((n / rate) / t[-1]) if t[-1] > 0 else t


# -- statistics ------------------------------------------------------------------------------------


def pct_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def metric_stats(values_ms: list[float], name: str, percentiles: tuple[float, ...]) -> dict:
    """vLLM's keys of one metric: mean_/median_/std_/p<q>_<name>_ms (0 when there are none)."""
    a = np.asarray(values_ms, dtype=np.float64)
    out = {
        f"mean_{name}_ms": float(a.mean()) if a.size else 0.0,
        f"median_{name}_ms": float(np.median(a)) if a.size else 0.0,
        f"std_{name}_ms": float(a.std()) if a.size else 0.0,
    }
    for p in percentiles:
        out[f"{pct_key(p)}_{name}_ms"] = float(np.percentile(a, p)) if a.size else 0.0
    return out


def is_good(r: RequestResult, slos_ms: dict) -> bool:
    """Does a completed request meet every SLO of --goodput (ms)?"""
    got = {"ttft": r.ttft * 1e3, "tpot": r.tpot * 1e3, "e2el": r.latency * 1e3}
    return r.ok and all(got[k] <= v for k, v in slos_ms.items())


def summarize(
    results: list[RequestResult],
    duration: float,
    slos_ms: dict,
    percentiles: tuple[float, ...] = (90.0, 99.0),
) -> dict:
    """The vLLM result keys of one run."""
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_len for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    dur = max(duration, 1e-9)
    out = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": len(ok) / dur,
        "request_goodput": sum(is_good(r, slos_ms) for r in ok) / dur if slos_ms else None,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }
    values = {
        "ttft": [r.ttft * 1e3 for r in ok],
        "tpot": [r.tpot * 1e3 for r in ok if r.output_tokens > 1],
        "itl": [g * 1e3 for r in ok for g in r.itl],
        "e2el": [r.latency * 1e3 for r in ok],
    }
    for name in METRICS:
        out.update(metric_stats(values[name], name, percentiles))
    return out


def find_knee(rows: list[dict]) -> int | None:
    """Index of the first sweep row whose TTFT p50 exceeds twice the lowest rate's, or whose
    goodput does not rise (by more than GOODPUT_RISE) over the previous row's; None if none."""
    if not rows:
        return None
    base = rows[0]["ttft_p50_ms"]
    for i, r in enumerate(rows):
        if i and r["ttft_p50_ms"] > 2 * base:
            return i
        if i and r["goodput"] <= rows[i - 1]["goodput"] * (1 + GOODPUT_RISE):
            return i
    return None


# -- /metrics --------------------------------------------------------------------------------------


def parse_prometheus(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value)]} (prometheus-client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((dict(smp.labels), float(smp.value)))
    return out


def total(snap: dict | None, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels match."""
    if not snap:
        return 0.0
    rows = snap.get(name, ())
    return sum(v for lab, v in rows if all(lab.get(k) == x for k, x in labels.items()))


def by_label(snap: dict | None, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in (snap or {}).get(name, ()):
        out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def kv_balance(snaps: list[dict]) -> float:
    """Mean over scrapes of max/mean KV usage over groups (scrapes whose mean is > 0)."""
    ratios = []
    for s in snaps:
        use = list(by_label(s, "xpod_kv_cache_usage_perc", "group").values())
        if use and sum(use) > 0:
            ratios.append(max(use) * len(use) / sum(use))
    return float(np.mean(ratios)) if ratios else 0.0


CPU_ROLES = (("shell", "shell"), ("master", "masters"), ("output", "outputs"), ("die", "dies"))


def server_figures(s0: dict | None, s1: dict | None, snaps: list[dict], n_out: int) -> dict:
    """The /metrics figures of a run: deltas from s0 to s1 (and KV balance over `snaps`)."""
    if not s0 or not s1:
        return {}

    def d(name: str, **labels: str) -> float:
        return total(s1, name, **labels) - total(s0, name, **labels)

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    steps, fwd = d("xpod_steps_total"), d("xpod_forward_seconds_total")
    dummy = d("xpod_dummy_steps_total")
    out = {
        "kv_balance": kv_balance(snaps),
        # a die's steps: with rows (xpod_steps_total) or without (xpod_dummy_steps_total)
        "dummy_step_share": ratio(dummy, dummy + steps),
        "bubble_ms_per_step": ratio(d("xpod_scheduling_bubble_seconds_total") * 1e3, steps),
        "moe_wait_share": ratio(d("xpod_moe_wait_seconds_total"), fwd),
        "attention_imbalance_mean": ratio(
            d("xpod_attention_imbalance_sum"), d("xpod_attention_imbalance_count")
        ),
        "prefix_hit_rate": ratio(
            d("xpod_prefix_cache_hits_total"), d("xpod_prefix_cache_queries_total")
        ),
        "step_ms_mean": ratio(d("xpod_step_seconds_sum") * 1e3, d("xpod_step_seconds_count")),
        "steps": int(steps),
        "preemptions": int(d("xpod_num_preemptions_total")),
    }
    cpu = 0.0
    for role, key in CPU_ROLES:
        v = d("xpod_process_cpu_seconds_total", role=role)
        cpu += v
        out[f"cpu_s_{key}"] = v
        out[f"cpu_ms_per_token_{key}"] = ratio(v * 1e3, n_out)
    out["cpu_s_server"] = cpu
    out["cpu_ms_per_token_server"] = ratio(cpu * 1e3, n_out)
    return out


# -- progress --------------------------------------------------------------------------------------


class Bar:
    """Requests done / total and output tok/s on stderr (a redrawn line on a terminal, a line
    per quarter otherwise)."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.done = self.tokens = 0
        self.t0 = time.perf_counter()
        self.shown = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def finished(self) -> None:
        self.done += 1
        if self.enabled and not self.tty and self.done * 4 // self.total > self.shown:
            self.shown = self.done * 4 // self.total
            progress(self.line())

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        w = 30
        k = w * self.done // max(self.total, 1)
        return (
            f"  {self.label} [{'#' * k}{'.' * (w - k)}] {self.done}/{self.total} req"
            f"  {self.tokens / el if el > 0 else 0:.0f} tok/s  {el:.1f} s"
        )

    def draw(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line())
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line() + "\n")
            sys.stderr.flush()


# -- the client ------------------------------------------------------------------------------------


class Client:
    """One aiohttp session against the server: requests, /metrics, the in-flight count."""

    def __init__(self, session, base: str, model_id: str, opts: Options):
        self.session, self.base, self.model_id, self.opts = session, base, model_id, opts
        self.path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
        self.inflight = self.peak = 0
        self.sent = 0

    def body(self, req: Request, ignore_eos: bool) -> dict:
        b: dict = {
            "model": self.model_id,
            "temperature": self.opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "seed": self.opts.seed + self.sent,
        }
        if self.opts.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": req.prompt}]
            b["max_completion_tokens"] = req.max_tokens
        else:
            b["prompt"] = req.prompt
            b["max_tokens"] = req.max_tokens
        self.sent += 1
        return b

    async def send(
        self, req: Request, bar: Bar | None = None, ignore_eos: bool | None = None, first=None
    ) -> RequestResult:
        """One streamed request; never raises (but for cancellation): errors go in the result.
        `first`: an asyncio.Event set at the first token."""
        import aiohttp

        body = self.body(req, self.opts.ignore_eos if ignore_eos is None else ignore_eos)
        res = RequestResult(prompt_len=req.prompt_len)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        st = last = time.perf_counter()
        ttft = None
        usage = None
        done = False
        try:
            async with self.session.post(self.base + self.path, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    with contextlib.suppress(ValueError, AttributeError, TypeError):
                        text = json.loads(text)["error"]["message"]
                    res.error = f"HTTP {resp.status}: {' '.join(str(text).split())[:200]}"
                    return res
                async for raw in resp.content:
                    line = raw.strip()
                    if not line or line.startswith(b":"):
                        continue
                    if not line.startswith(b"data:"):
                        res.error = f"bad SSE line: {line[:80]!r}"
                        return res
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        res.error = f"bad SSE data: {data[:80]!r}"
                        return res
                    if not isinstance(obj, dict):
                        res.error = f"bad SSE data: {data[:80]!r}"
                        return res
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        res.error = f"error event: {msg}"
                        return res
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for c in obj.get("choices") or ():
                        text = (
                            c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        )
                        ids = c.get("token_ids") or ()
                        if not text and not ids:
                            continue
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - st
                            if first is not None:
                                first.set()
                        else:
                            res.itl.append(now - last)
                        last = now
                        if bar is not None:
                            bar.add_tokens(len(ids))
            res.latency = time.perf_counter() - st
            if not done:
                res.error = "the stream ended without [DONE]"
            elif not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
                res.error = "no usage in the stream"
            elif ttft is None:
                res.error = "no token in the stream"
            else:
                res.ok = True
                res.ttft = ttft
                res.output_tokens = usage["completion_tokens"]
                res.prompt_len = usage.get("prompt_tokens") or req.prompt_len
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        finally:
            self.inflight -= 1
            if bar is not None:
                bar.finished()
        return res

    async def get_json(self, path: str) -> dict:
        async with self.session.get(self.base + path) as resp:
            if resp.status != 200:
                raise BenchError(f"GET {path}: HTTP {resp.status}")
            return await resp.json()

    async def scrape(self, names: tuple[str, ...] = ()) -> dict | None:
        """/metrics parsed (only the samples `names`, if given: a cheap scrape)."""
        import aiohttp

        query = "?" + "&".join(f"name[]={n}" for n in names) if names else ""
        try:
            async with self.session.get(self.base + "/metrics" + query) as resp:
                if resp.status != 200:
                    return None
                return parse_prometheus(await resp.text())
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None


class Scraper:
    """/metrics every SCRAPE_S on a background task while a run goes."""

    def __init__(self, client: Client, bar: Bar | None = None):
        self.client, self.bar = client, bar
        self.snaps: list[dict] = []
        self.times: list[float] = []  # perf_counter of each snap
        self.task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            s = await self.client.scrape((KV_GAUGE,))
            if s:
                self.snaps.append(s)
                self.times.append(time.perf_counter())
            if self.bar is not None:
                self.bar.draw()
            await asyncio.sleep(max(0.0, SCRAPE_S - (time.perf_counter() - t0)))

    def __enter__(self) -> Scraper:
        self.task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            self.task.cancel()


async def run_requests(
    client: Client,
    reqs: list[Request],
    rate: float,
    opts: Options,
    max_concurrency: int | None,
    bar: Bar,
    seed: int,
    ramp=None,
) -> tuple[list[RequestResult], float, float]:
    """Send `reqs` at their arrival times (through the semaphore); (results, duration, the
    perf_counter when the last request was sent)."""
    times = arrival_times(len(reqs), rate, opts.burstiness, seed, ramp)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    last_sent = 0.0

    async def one(req: Request) -> RequestResult:
        nonlocal last_sent
        if sem is None:
            last_sent = time.perf_counter()
            return await client.send(req, bar)
        async with sem:
            last_sent = time.perf_counter()  # the request goes out now (the cap let it)
            return await client.send(req, bar)

    tasks = []
    t0 = time.perf_counter()
    bar.t0 = t0
    for t, req in zip(times, reqs, strict=True):
        wait = t0 + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration, last_sent


async def wait_idle(client: Client, timeout_s: float = 30.0) -> None:
    """Until the server runs and holds no request (after cancelled load requests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = await client.scrape()
        if s is None:
            return
        busy = (
            total(s, "xpod_num_requests_running")
            + total(s, "xpod_num_requests_waiting")
            + total(s, "xpod_num_requests_pending")
            + total(s, "xpod_num_requests_inflight_http")
        )
        if busy == 0:
            return
        await asyncio.sleep(0.05)
    raise BenchError(f"the server still runs requests {timeout_s:g} s after the load stopped")


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


async def _probe_ttfts(client: Client, reqs: list[Request], what: str) -> list[float]:
    """TTFT (ms) of each request, sent one after another; BenchError if one fails."""
    out = []
    for req in reqs:
        r = await client.send(req, ignore_eos=True)
        if not r.ok:
            raise BenchError(f"{what} failed: {r.error}")
        out.append(r.ttft * 1e3)
    return out


async def ttft_phase(client: Client, opts: Options, max_len: int) -> dict:
    """TTFT on an idle server and under decode load (see the module docstring)."""
    n = opts.ttft_probes
    progress(f"  TTFT phase (a): {n} probes of {opts.input_len} tokens, one at a time, idle ...")
    await asyncio.sleep(STATS_LAG_S)  # the test request's steps are all in
    s0 = await client.scrape()
    idle = await _probe_ttfts(client, probe_requests(opts, n, 0), "TTFT probe")
    await asyncio.sleep(STATS_LAG_S)
    s1 = await client.scrape()
    prefill_ms = (total(s1, "xpod_step_seconds_sum") - total(s0, "xpod_step_seconds_sum")) * 1e3 / n
    idle_steps = total(s1, "xpod_step_seconds_count") - total(s0, "xpod_step_seconds_count")

    k = max(opts.load_concurrency - 1, 0)
    progress(f"  TTFT phase (b): {k} long requests decoding, {n} probes one after another ...")
    long_req = Request(
        random_text(np.random.default_rng([opts.seed, 1 << 23]), opts.input_len - 1),
        opts.input_len,
        max(1, max_len - opts.input_len - CHAT_OVERHEAD),
    )
    stop = asyncio.Event()
    started = [asyncio.Event() for _ in range(k)]
    errors: list[str] = []

    async def load(ev: asyncio.Event) -> None:
        while not stop.is_set():
            r = await client.send(long_req, ignore_eos=True, first=ev)
            if not r.ok and not stop.is_set():
                errors.append(r.error)
                stop.set()

    workers = [asyncio.create_task(load(ev)) for ev in started]
    try:
        waits = [asyncio.create_task(ev.wait()) for ev in started]
        if waits:
            done, pending = await asyncio.wait(waits, timeout=120.0)
            for w in pending:
                w.cancel()
            if pending:
                raise BenchError(
                    f"TTFT phase: {len(pending)} of {k} load requests did not"
                    f" start in 120 s {errors[:1]}"
                )
        await asyncio.sleep(STATS_LAG_S)
        s2 = await client.scrape()
        loaded = await _probe_ttfts(client, probe_requests(opts, n, 1), "TTFT probe under load")
        await asyncio.sleep(STATS_LAG_S)  # the load goes on: the stats of the probes' steps come
        s3 = await client.scrape()
        if errors:
            raise BenchError(f"TTFT phase: a load request failed: {errors[0]}")
    finally:
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    await wait_idle(client)
    step_n = total(s3, "xpod_step_seconds_count") - total(s2, "xpod_step_seconds_count")
    step_s = total(s3, "xpod_step_seconds_sum") - total(s2, "xpod_step_seconds_sum")
    step_load_ms = step_s * 1e3 / step_n if step_n else 0.0
    out = {
        "ttft_probes": n,
        "ttft_load_requests": k,
        "ttft_idle_p50_ms": _p(idle, 50),
        "ttft_idle_p99_ms": _p(idle, 99),
        "prefill_ms": prefill_ms,
        "prefill_steps_per_request": idle_steps / n,
        "ttft_load_p50_ms": _p(loaded, 50),
        "ttft_load_p99_ms": _p(loaded, 99),
        "step_load_ms": step_load_ms,
        "ttft_idle_bound_ms": prefill_ms + 5.0,
        "ttft_load_bound_ms": prefill_ms + 2 * step_load_ms + 5.0,
    }
    out["ttft_idle_within_bound"] = out["ttft_idle_p50_ms"] <= out["ttft_idle_bound_ms"]
    out["ttft_load_within_bound"] = out["ttft_load_p50_ms"] <= out["ttft_load_bound_ms"]
    return out


async def measure(
    client: Client,
    opts: Options,
    reqs: list[Request],
    rate: float,
    max_concurrency: int | None,
    label: str,
    seed: int,
    ramp=None,
) -> tuple[dict, list[RequestResult]]:
    """One run with /metrics scraped and CPU counted: (result dict, per-request results)."""
    me = psutil.Process()
    await asyncio.sleep(IDLE_LAG_S)  # the steps before this run are all in
    s0 = await client.scrape()
    cpu0 = sum(me.cpu_times()[:2])
    client.peak = client.inflight
    bar = Bar(label, len(reqs), opts.show_progress)
    with Scraper(client, bar) as sc:
        results, duration, last_sent = await run_requests(
            client, reqs, rate, opts, max_concurrency, bar, seed, ramp
        )
    cpu_client = sum(me.cpu_times()[:2]) - cpu0
    await asyncio.sleep(IDLE_LAG_S)
    s1 = await client.scrape()
    res = summarize(results, duration, opts.goodput, opts.metric_percentiles)
    res["max_concurrent_requests"] = client.peak
    n_out = res["total_output_tokens"]
    res["cpu_s_client"] = cpu_client
    res["cpu_ms_per_token_client"] = cpu_client * 1e3 / n_out if n_out else 0.0
    res.update(server_figures(s0, s1, sc.snaps, n_out))
    # while requests arrive (the tail, where the last requests end one group at a time, is left
    # out: with a concurrency cap the last request goes out near the end anyway)
    arriving = [snap for t, snap in zip(sc.times, sc.snaps, strict=True) if t <= last_sent]
    res["kv_balance_arrivals"] = kv_balance(arriving)
    res["metrics_scrapes"] = len(sc.snaps)
    return res, results


async def rate_sweep(client: Client, opts: Options, capacity: float) -> list[dict]:
    rows = []
    for i, f in enumerate(opts.rate_sweep):
        rate = f * capacity
        progress(
            f"  rate sweep {i + 1}/{len(opts.rate_sweep)}: {f:g} x capacity ="
            f" {rate:.2f} req/s, {opts.num_prompts} requests ..."
        )
        reqs = make_requests(opts, opts.num_prompts, 10 + i)
        res, results = await measure(client, opts, reqs, rate, None, f"{f:g}x", opts.seed + 10 + i)
        ok = [r for r in results if r.ok]
        ttft = [r.ttft * 1e3 for r in ok]
        tpot = [r.tpot * 1e3 for r in ok if r.output_tokens > 1]
        rows.append(
            {
                "fraction": f,
                "request_rate": rate,
                "completed": res["completed"],
                "failed": res["failed"],
                "request_throughput": res["request_throughput"],
                "request_goodput": res["request_goodput"],
                "goodput": res["request_goodput"] if opts.goodput else res["request_throughput"],
                "output_throughput": res["output_throughput"],
                "ttft_p50_ms": _p(ttft, 50),
                "ttft_p99_ms": _p(ttft, 99),
                "tpot_p50_ms": _p(tpot, 50),
                "tpot_p99_ms": _p(tpot, 99),
                "max_concurrent_requests": res["max_concurrent_requests"],
                "kv_balance": res.get("kv_balance"),
            }
        )
    knee = find_knee(rows)
    for i, r in enumerate(rows):
        r["knee"] = i == knee
    return rows


async def bench_async(
    opts: Options, base: str, res: dict, first: bool = True, last: bool = True
) -> list[RequestResult]:
    """Everything against the server at `base`; fills `res`; returns the main run's results.
    The TTFT phase runs with the `first` main run, the rate sweep after the `last`."""
    import aiohttp

    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        client = Client(session, base, "", opts)
        try:
            models = await client.get_json("/v1/models")
            card = models["data"][0]
            client.model_id = card["id"]
            max_len = int(card.get("max_model_len") or opts.max_model_len or 0)
        except (
            TimeoutError,
            aiohttp.ClientError,
            OSError,
            KeyError,
            IndexError,
            TypeError,
            ValueError,
        ) as e:
            raise BenchError(f"GET {base}/v1/models: {type(e).__name__}: {e}") from None
        res["model_id"] = client.model_id
        res["max_model_len"] = max_len
        reqs = make_requests(opts, opts.num_prompts, 0)
        if max_len:
            try:
                check_context(opts, reqs, max_len)
            except ConfigError as e:
                raise BenchError(str(e)) from None
        snap = await client.scrape()
        groups = len(by_label(snap, "xpod_kv_cache_usage_perc", "group")) if snap else 0
        res["groups"] = groups or opts.dies
        progress(
            f"  {PROG}: {client.model_id} at {base} ({res['groups']} groups); one test request ..."
        )
        test = await client.send(Request(reqs[0].prompt, reqs[0].prompt_len, 2))
        if not test.ok:
            raise BenchError(f"the test request failed: {test.error}")
        if opts.ttft and first:
            res.update(await ttft_phase(client, opts, max_len or 256))
        conc = opts.max_concurrency or "no limit"
        progress(
            f"  main run: {opts.num_prompts} requests, rate {opts.request_rate:g}"
            f" req/s, burstiness {opts.burstiness:g}, concurrency {conc} ..."
        )
        main, results = await measure(
            client,
            opts,
            reqs,
            opts.request_rate,
            opts.max_concurrency,
            "main",
            opts.seed,
            opts.ramp,
        )
        res.update(main)
        if opts.rate_sweep and last:
            if not main["completed"]:
                raise BenchError("the saturation run completed no request: no capacity to sweep")
            res["capacity_req_per_s"] = main["request_throughput"]
            res["rate_sweep"] = await rate_sweep(client, opts, main["request_throughput"])
            knee = [r for r in res["rate_sweep"] if r["knee"]]
            res["knee_request_rate"] = knee[0]["request_rate"] if knee else None
        return results


# -- the launched server ---------------------------------------------------------------------------


class LaunchedServer:
    """`xpod serve --port 0 ...` as a child process (its own session: nothing outlives it)."""

    def __init__(self, argv: tuple[str, ...]):
        self.cmd = [sys.executable, "-m", "runtime.cli", "serve", "--port", "0", *argv]
        self.log = tempfile.TemporaryFile(mode="w+b")  # noqa: SIM115 - closed by close()
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def tail(self, n: int = 15) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").splitlines()
        return "\n".join("    " + ln for ln in lines[-n:])

    def start(self) -> str:
        progress(f"  launching: {shlex.join(self.cmd[1:])}")
        env = dict(os.environ)
        env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not self.url:
            self.log.seek(0)
            m = SERVE_URL_LINE.search(self.log.read().decode(errors="replace"))
            if m:
                self.url = m.group(2)
                break
            if self.proc.poll() is not None:
                raise BenchError(
                    f"xpod serve exited with status {self.proc.returncode} before"
                    f" serving:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(
                    f"xpod serve did not serve within {LAUNCH_TIMEOUT_S:g} s:\n{self.tail()}"
                )
            time.sleep(0.05)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2.0) as r:
                    if r.status == 200:
                        return self.url
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                raise BenchError(
                    f"xpod serve exited with status {self.proc.returncode}:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"{self.url}/health not 200 within {LAUNCH_TIMEOUT_S:g} s")
            time.sleep(0.1)

    def stop(self) -> int:
        """SIGTERM (drain), wait for the exit status."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise BenchError(
                f"xpod serve did not stop {STOP_TIMEOUT_S:g} s after SIGTERM:\n{self.tail()}"
            ) from None

    def kill(self) -> None:
        """Stop it whatever state it is in: SIGTERM twice (no drain), then SIGKILL its session."""
        p = self.proc
        if p is None or p.poll() is not None:
            self._reap_group()
            return
        for _ in range(2):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            time.sleep(0.1)
        try:
            p.wait(15.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10.0)
        self._reap_group()

    def _reap_group(self) -> None:
        """Anything left in the server's session (its pid is the session id) gets SIGKILL."""
        if self.proc is None:
            return
        sid = self.proc.pid
        for q in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, OSError):
                if q.pid not in (os.getpid(), sid) and os.getsid(q.pid) == sid:
                    q.kill()

    def close(self) -> None:
        self.log.close()


# -- the run ---------------------------------------------------------------------------------------


def set_policy(policy: int | dict[int, int]) -> dict[int, int]:
    """Every thread of this process to `policy` (one for all, or by thread id: SCHED_OTHER for
    the others); returns the policies they had. SCHED_BATCH: the client shares the 2 cores with
    the lockstep dies, like the shell (`runtime.api.server`); threads made later inherit it."""
    old = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(OSError, AttributeError, ValueError):
            old[tid] = os.sched_getscheduler(tid)
            p = policy if isinstance(policy, int) else policy.get(tid, os.SCHED_OTHER)
            os.sched_setscheduler(tid, p, os.sched_param(0))
    return old


def decode_baseline(opts: Options, i: int = 0, n: int = 1) -> dict:
    """`xpod decode` at the launched server's dies and global batch, the run's lengths."""
    from runtime.decode import DecodeOptions, run_decode

    batch = opts.max_concurrency or opts.dies * opts.max_num_seqs
    pair = f" (pair {i + 1}/{n})" if n > 1 else ""
    progress(
        f"  baseline{pair}: xpod decode, {opts.dies} dies, batch {batch}, prompt"
        f" {opts.input_len}, {opts.output_len} steps ..."
    )
    d = run_decode(
        DecodeOptions(
            dies=opts.dies,
            batch=batch,
            prompt_len=opts.input_len,
            steps=opts.output_len,
            model=opts.model,
            protocol=opts.protocol,
            quant=opts.quant,
            seed=opts.seed,
        )
    )
    tokens = batch * opts.output_len
    e2e = tokens / (d["prefill_ms"] / 1e3 + tokens / d["tokens_per_s"])  # prefill + decode time
    return {
        "decode_tokens_per_s": d["tokens_per_s"],
        "decode_e2e_tokens_per_s": e2e,
        "decode_batch": batch,
        "decode_tpot_p50_ms": d.get("tpot_p50_ms"),
        "decode_prefill_ms": d["prefill_ms"],
    }


LB_KEYS = ("kv_balance", "kv_balance_arrivals", "attention_imbalance_mean", "output_throughput",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "dummy_step_share",
           "failed")  # fmt: skip


def lb_policy(argv: tuple[str, ...]) -> str:
    """The --lb the server argv ends up with (the last one wins, as in argparse)."""
    policy = "least_kv"
    for i, a in enumerate(argv[:-1]):
        if a == "--lb":
            policy = argv[i + 1]
    return policy


def lb_compare(opts: Options, pairs: list) -> dict:
    """The main run once more on a server with the other policy; {policy: figures}."""
    import uvloop

    mine = lb_policy(opts.server_argv)
    other = "round_robin" if mine == "least_kv" else "least_kv"
    argv = (*opts.server_argv, "--lb", other)
    progress(f"  DP balance: the main run again, --lb {other} ...")
    out = {mine: {k: pairs[-1][0].get(k) for k in LB_KEYS}}
    server = LaunchedServer(argv)
    part: dict = {}
    policies: dict[int, int] = {}
    try:
        base = server.start()
        if opts.client_batch and hasattr(os, "SCHED_BATCH"):
            policies = set_policy(os.SCHED_BATCH)
        try:
            uvloop.run(bench_async(opts, base, part, first=False, last=False))
        finally:
            if policies:
                set_policy(policies)
        code = server.stop()
        if code != 0:
            raise BenchError(f"xpod serve --lb {other} exited with status {code}")
    except BaseException:
        server.kill()
        raise
    finally:
        server.close()
    out[other] = {k: part.get(k) for k in LB_KEYS}
    return out


def run(opts: Options) -> int:
    import uvloop

    res: dict = {
        "bench": "serve",
        "backend": "xpod",
        "endpoint_type": opts.endpoint,
        "dataset": opts.dataset,
        "num_prompts": opts.num_prompts,
        "request_rate": opts.request_rate if math.isfinite(opts.request_rate) else "inf",
        "burstiness": opts.burstiness,
        "max_concurrency": opts.max_concurrency,
        "ignore_eos": opts.ignore_eos,
        "random_input_len": opts.input_len,
        "random_output_len": opts.output_len,
        "random_range_ratio": opts.range_ratio,
        "goodput_slos_ms": opts.goodput,
        "launch": opts.launch,
    }
    if opts.launch:
        res.update(
            dies=opts.dies,
            model=opts.model,
            max_num_seqs=opts.max_num_seqs,
            server_args=shlex.join(opts.server_argv),
        )
    server = LaunchedServer(opts.server_argv) if opts.launch else None
    status = 0
    pairs: list[tuple[dict, dict, list[RequestResult]]] = []
    try:
        base = server.start() if server else opts.url
        res["url"] = base
        res["client_policy"] = "batch" if opts.client_batch else "normal"
        for i in range(opts.repeat):
            # xpod decode with the server up and idle (its dies parked: ~1 % of a core), and
            # with this process's default policy (its dies are forked from here)
            dec = decode_baseline(opts, i, opts.repeat) if opts.launch else {}
            part = dict(res)
            policies: dict[int, int] = {}
            if opts.client_batch and hasattr(os, "SCHED_BATCH"):  # after every fork of ours
                policies = set_policy(os.SCHED_BATCH)
            try:
                results = uvloop.run(bench_async(opts, base, part, i == 0, i == opts.repeat - 1))
            finally:
                if policies:
                    set_policy(policies)  # the caller's threads as they were
            part.update(dec)
            if dec.get("decode_tokens_per_s"):
                part["ratio_to_decode"] = part["output_throughput"] / dec["decode_tokens_per_s"]
                part["ratio_to_decode_with_prefill"] = (
                    part["output_throughput"] / dec["decode_e2e_tokens_per_s"]
                )
            pairs.append((part, dec, results))
        if server is not None:
            progress("  stopping the server (SIGTERM) ...")
            res["server_exit_status"] = server.stop()
            if res["server_exit_status"] != 0:
                status = 1
                progress(
                    f"{PROG}: xpod serve exited with status {res['server_exit_status']}:"
                    f"\n{server.tail()}"
                )
    except BenchError as e:
        if server is not None:
            server.kill()
        progress(f"{PROG}: error: {e}")
        return 1
    except BaseException:
        if server is not None:
            server.kill()
        raise
    finally:
        if server is not None:
            server.close()
    if opts.lb_compare:
        try:
            res["lb_compare"] = lb_compare(opts, pairs)
        except BenchError as e:
            progress(f"{PROG}: error: {e}")
            return 1
    # the median pair's figures are the run's (by ratio to decode, else by throughput)
    key = "ratio_to_decode" if opts.launch else "output_throughput"
    order = sorted(range(len(pairs)), key=lambda k: pairs[k][0].get(key) or 0.0)
    part, _, results = pairs[order[len(order) // 2]]
    exit_status = res.get("server_exit_status")
    res.update(part)
    # the TTFT phase ran with the first pair, the rate sweep after the last
    for p, _, _ in (pairs[0], pairs[-1]):
        res.update({k: v for k, v in p.items() if k.startswith(("ttft_", "prefill_",
                    "step_load_ms", "capacity_", "rate_sweep", "knee_"))})  # fmt: skip
    if exit_status is not None:
        res["server_exit_status"] = exit_status
    if opts.repeat > 1:
        res["pairs"] = [
            {k: p.get(k) for k in ("decode_tokens_per_s", "output_throughput", "ratio_to_decode",
                                   "ratio_to_decode_with_prefill", "step_ms_mean",
                                   "median_tpot_ms", "failed")}
            for p, _, _ in pairs
        ]  # fmt: skip
        res["failed"] = sum(p["failed"] for p, _, _ in pairs)
    errors = [r.error for r in results if not r.ok]
    res["errors"] = errors[:SHOW_ERRORS]
    if opts.save_detailed:
        res.update(
            input_lens=[r.prompt_len for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft for r in results],
            itls=[r.itl for r in results],
            errors=[r.error for r in results],
        )
    res.update(run_info())
    print_report(res, opts)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        progress(f"  wrote {opts.json}")
    if opts.plot:
        if opts.rate_sweep:
            plot_sweep(res["rate_sweep"], opts.plot, bool(opts.goodput))
        else:
            plot_cdfs(results, opts.plot)
        progress(f"  wrote {opts.plot}")
    if res["failed"]:
        status = 1
    return status


# -- the report ------------------------------------------------------------------------------------


def print_report(r: dict, opts: Options) -> None:
    def row(label: str, value, spec: str = "") -> None:
        v = "-" if value is None else (format(value, spec) if spec else value)
        print(f"{label:<40} {v:<10}")

    print()
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    row("Successful requests:", r["completed"])
    row("Failed requests:", r["failed"])
    row("Maximum request concurrency:", r["max_concurrency"])
    row("Benchmark duration (s):", r["duration"], ".2f")
    row("Total input tokens:", r["total_input_tokens"])
    row("Total generated tokens:", r["total_output_tokens"])
    row("Request throughput (req/s):", r["request_throughput"], ".2f")
    if r["request_goodput"] is not None:
        row("Request goodput (req/s):", r["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", r["output_throughput"], ".2f")
    row("Peak concurrent requests:", r["max_concurrent_requests"])
    row("Total Token throughput (tok/s):", r["total_token_throughput"], ".2f")
    for name in opts.percentile_metrics:
        header, short = METRIC_NAMES[name]
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", r[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", r[f"median_{name}_ms"], ".2f")
        for p in opts.metric_percentiles:
            row(f"P{p:g} {short} (ms):", r[f"{pct_key(p)}_{name}_ms"], ".2f")
    if "kv_balance" in r:
        print("{s:{c}^{n}}".format(s="Server (/metrics, over the run)", n=50, c="-"))
        row("KV balance (max/mean):", r["kv_balance"], ".3f")
        row("  while requests arrive:", r.get("kv_balance_arrivals"), ".3f")
        row("Dummy-step share:", r["dummy_step_share"], ".3f")
        row("Bubble per step (ms):", r["bubble_ms_per_step"], ".3f")
        row("Step time, mean (ms):", r["step_ms_mean"], ".2f")
        row("MoE wait share:", r["moe_wait_share"], ".3f")
        row("Attention imbalance (mean):", r["attention_imbalance_mean"], ".3f")
        row("Prefix hit rate:", r["prefix_hit_rate"], ".3f")
        print("{s:{c}^{n}}".format(s="CPU s (ms per output token)", n=50, c="-"))
        for key in ("client", "shell", "masters", "outputs", "dies", "server"):
            if f"cpu_s_{key}" in r:
                print(
                    "{:<40} {:<10}".format(
                        f"{key.capitalize()}:",
                        f"{r[f'cpu_s_{key}']:.2f} ({r[f'cpu_ms_per_token_{key}']:.3f})",
                    )
                )
    if "decode_tokens_per_s" in r:
        print("{s:{c}^{n}}".format(s="Against xpod decode (same run)", n=50, c="-"))
        row(f"Decode tok/s (batch {r['decode_batch']}):", r["decode_tokens_per_s"], ".2f")
        row("  with its prefill (tok/s):", r.get("decode_e2e_tokens_per_s"), ".2f")
        row("HTTP / decode:", r.get("ratio_to_decode"), ".3f")
        row("HTTP / decode with prefill:", r.get("ratio_to_decode_with_prefill"), ".3f")
        if r.get("pairs"):
            ratios = ", ".join(f"{p['ratio_to_decode']:.2f}" for p in r["pairs"])
            row("  pairs (median shown):", ratios)
    if r.get("lb_compare"):
        print("{s:{c}^{n}}".format(s="DP balance: least_kv vs round_robin", n=50, c="-"))
        for policy, f in r["lb_compare"].items():
            row(f"{policy}: KV max/mean, arriving / all:",
                f"{f['kv_balance_arrivals']:.3f} / {f['kv_balance']:.3f}")  # fmt: skip
            row(f"{policy}: attention imbalance:", f"{f['attention_imbalance_mean']:.3f}")
            row(f"{policy}: TTFT / TPOT p50 (ms):",
                f"{f['median_ttft_ms']:.1f} / {f['median_tpot_ms']:.2f}")  # fmt: skip
    if "ttft_idle_p50_ms" in r:
        print("{s:{c}^{n}}".format(s="TTFT phase", n=50, c="-"))
        row("Idle TTFT p50 (ms):", r["ttft_idle_p50_ms"], ".2f")
        row("Prefill per request (ms):", r["prefill_ms"], ".2f")
        row(
            "  bound prefill + 5 (ms):",
            f"{r['ttft_idle_bound_ms']:.2f} ({'met' if r['ttft_idle_within_bound'] else 'MISSED'})",
        )
        row(
            f"Loaded TTFT p50 / p99 (ms, {r['ttft_load_requests']} bg):",
            f"{r['ttft_load_p50_ms']:.2f} / {r['ttft_load_p99_ms']:.2f}",
        )
        row("Step time under load (ms):", r["step_load_ms"], ".2f")
        row(
            "  bound prefill + 2 steps + 5 (ms):",
            f"{r['ttft_load_bound_ms']:.2f} ({'met' if r['ttft_load_within_bound'] else 'MISSED'})",
        )
    print("=" * 50)
    if r.get("errors"):
        print(f"first errors of {r['failed']} failed request(s):")
        for e in r["errors"][:SHOW_ERRORS]:
            print(f"  {e}")
    if r.get("rate_sweep"):
        gp = "goodput" if opts.goodput else "goodput (= req/s, no --goodput)"
        print(
            f"\nrate sweep (capacity {r['capacity_req_per_s']:.2f} req/s at saturation;"
            f" open loop; {gp}; * = knee)"
        )
        rows = [{**x, "mark": "*" if x["knee"] else ""} for x in r["rate_sweep"]]
        print_table(
            rows,
            [
                ("fraction", "x cap", "g"),
                ("request_rate", "req/s", ".2f"),
                ("request_throughput", "done/s", ".2f"),
                ("goodput", "goodput", ".2f"),
                ("ttft_p50_ms", "TTFT p50", ".1f"),
                ("ttft_p99_ms", "p99", ".1f"),
                ("tpot_p50_ms", "TPOT p50", ".2f"),
                ("tpot_p99_ms", "p99", ".2f"),
                ("failed", "failed", "d"),
                ("mark", "knee", ""),
            ],
        )
    sys.stdout.flush()


def _figure(size: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_sweep(rows: list[dict], path: str, slo: bool) -> None:
    fig = _figure((12, 4.5))
    ax1, ax2 = fig.subplots(1, 2)
    rate = [r["request_rate"] for r in rows]
    for key, style in (
        ("ttft_p50_ms", "o-"),
        ("ttft_p99_ms", "o--"),
        ("tpot_p50_ms", "s-"),
        ("tpot_p99_ms", "s--"),
    ):
        ax1.plot(rate, [r[key] for r in rows], style, label=key.replace("_ms", " (ms)"))
    ax1.set_yscale("log")
    ax1.set_xlabel("request rate (req/s)")
    ax1.set_ylabel("ms")
    ax1.legend()
    ax1.grid(True, alpha=0.3)
    ax2.plot(rate, [r["goodput"] for r in rows], "o-", label="goodput" if slo else "req/s done")
    ax2.plot(rate, rate, ":", color="gray", label="offered")
    ax2.set_xlabel("request rate (req/s)")
    ax2.set_ylabel("req/s")
    ax2.grid(True, alpha=0.3)
    for r in rows:
        if r["knee"]:
            for ax in (ax1, ax2):
                ax.axvline(r["request_rate"], color="red", alpha=0.5, label="knee")
    ax2.legend()
    fig.suptitle("xpod bench serve: latency and goodput against the request rate")
    fig.savefig(path, dpi=110)


def plot_cdfs(results: list[RequestResult], path: str) -> None:
    ok = [r for r in results if r.ok]
    values = {
        "TTFT": [r.ttft * 1e3 for r in ok],
        "TPOT": [r.tpot * 1e3 for r in ok if r.output_tokens > 1],
        "ITL": [g * 1e3 for r in ok for g in r.itl],
        "E2E latency": [r.latency * 1e3 for r in ok],
    }
    fig = _figure((14, 3.8))
    for ax, (name, v) in zip(fig.subplots(1, 4), values.items(), strict=True):
        if v:
            a = np.sort(v)
            ax.plot(a, np.arange(1, a.size + 1) / a.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.grid(True, alpha=0.3)
    fig.suptitle("xpod bench serve: latency CDFs")
    fig.savefig(path, dpi=110)


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))


__all__ = ["Options", "add_args", "arrival_times", "parse_options", "run", "summarize"]
