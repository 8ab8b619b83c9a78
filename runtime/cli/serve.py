"""`xpod serve`: the flags, checked into `runtime.api.options.ServerOptions`, then the server
(`runtime.api.server.run`). aiohttp (the `serve` extra) is imported only once the flags are
good: every other command works without it, and `xpod serve` says how to install it."""

from __future__ import annotations

import argparse

from memory.errors import ConfigError
from runtime.api.options import ServerOptions
from runtime.cli.argtypes import (
    int_range,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
    size,
)
from runtime.cli.engine_flags import add_engine_flags, engine_config

# -- command line ------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add(
        "--port", type=int_range(0, 65535), default=8000, help="port (default 8000; 0 = a free one)"
    )
    add("--served-model-name", default="", metavar="NAME",
        help="the model id clients use (default xpod-<model>)")  # fmt: skip
    add("--max-queue", type=nonneg_int, default=1024,
        help="requests held while every DP group is full; past it 503 (default 1024)")  # fmt: skip
    add("--queue-ahead", type=int, default=-1,
        help="requests a group's master may hold beyond its batch (-1: max-num-seqs)")  # fmt: skip
    add("--stream-interval", type=positive_int, default=1,
        help="streamed tokens go out every N tokens, the first at once (default 1)")  # fmt: skip
    add("--output-procs", action="store_true",
        help="output shortcutting: one output process per group renders and streams")  # fmt: skip
    add("--drain-timeout", type=positive_float, default=30.0,
        help="seconds in-flight requests may run after SIGTERM / Ctrl-C (default 30)")  # fmt: skip
    add("--health-timeout", type=positive_float, default=5.0,
        help="a group with no heartbeat for this long makes /health 503 (default 5 s)")  # fmt: skip
    add("--max-body", type=size, default=1 << 20, metavar="SIZE",
        help="largest request body (default 1M; larger: 413)")  # fmt: skip
    add("--timeout", type=positive_float, default=60.0,
        help="deadline of every wait in the pod, seconds (default 60)")  # fmt: skip
    add("--access-log", action="store_true", help="log every HTTP request on stderr")
    add("--shell-policy", default="batch", choices=("batch", "normal"),
        help="scheduling policy of the shell's threads (default batch: a shell woken per step"
        " does not preempt a die)")  # fmt: skip
    add("--receiver", default="loop", choices=("loop", "thread"),
        help="who reads the masters' messages: the event loop (default) or a thread")  # fmt: skip
    add("--replay-check", type=output_file, default=None, metavar="FILE",
        help="log every step (and its logits); at the end replay them through the"
        " single-process reference and write the verdict to FILE as JSON")  # fmt: skip
    add_engine_flags(p)


def parse_options(args: argparse.Namespace) -> ServerOptions:
    """Checked options; ConfigError naming the flag (or the missing serve extra). Nothing is
    launched."""
    if args.queue_ahead < -1:
        raise ConfigError(f"argument --queue-ahead: {args.queue_ahead} must be >= -1")
    check = {"log_steps": True, "keep_logits": True} if args.replay_check else {}
    engine = engine_config(args, output_procs=args.output_procs, queue_ahead=args.queue_ahead,
                           stream_interval=args.stream_interval, **check)  # fmt: skip
    if args.served_model_name and not args.served_model_name.strip():
        raise ConfigError("argument --served-model-name: must not be blank")
    try:
        import aiohttp  # noqa: F401 - the serve extra: checked before anything starts
        import prometheus_client  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"xpod serve needs the serve extra ({e.name} is missing):"
                          " pip install -e '.[serve]'") from None  # fmt: skip
    return ServerOptions(engine, args.host, args.port, args.served_model_name.strip(),
                         args.max_queue, args.drain_timeout, args.health_timeout, args.max_body,
                         args.access_log, args.shell_policy == "batch",
                         args.receiver == "loop", args.replay_check or "")  # fmt: skip


def run(opts: ServerOptions) -> int:
    from runtime.api.server import run as serve

    return serve(opts)
