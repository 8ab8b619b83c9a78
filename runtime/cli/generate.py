"""`xpod generate`: offline batch generation with the serving engine (`runtime.engine`).

```
xpod generate --dies 4 --prompts prompts.txt --max-tokens 64
xpod generate --dies 2 --model tiny --prompt hello --prompt "the pod" --max-tokens 16
cat prompts.txt | xpod generate --prompts - --quiet --json out.json
```

Every flag, the prompts and the EngineConfig they make are checked before anything starts
(`parse_options`): a bad value, no prompt at all, or a prompt that does not fit the model's
context with `--max-tokens` is one line `xpod generate: error: argument --flag: ...`, status 2.

`run` launches the engine (one line on stderr), submits every prompt (ids 0, 1, ... in the order
`--prompt` texts, then `--prompts` lines), collects the results in that order with a progress
bar on stderr (redrawn in place on a terminal, else a plain line every ~10 %), then prints every
completion (`[id] finish_reason: text`, the text's bytes that are not printable escaped) and a
summary: finish reasons, tokens, throughput, TTFT / TPOT / E2E percentiles, and per DP group the
scheduler's counters and the dies' step and bubble times (from the masters' final stats).
Exit status 0 when every request ended with stop or length, else 1; Ctrl-C tears the engine
down (130, `runtime.cli`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import TextIO

import numpy as np

from memory.errors import ConfigError
from runtime.cli.argtypes import (
    flag_error,
    input_file,
    int_list,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.cli.engine_flags import ENGINE_FLAGS, add_engine_flags, engine_config
from runtime.cli.generate_report import print_pd_stats, print_split_stats
from runtime.engine import CompletionOutput, Engine, EngineConfig, EngineError, SamplingParams
from runtime.engine.cache_stats import cache_lines, cache_summary
from runtime.engine.pd_shell import pd_summary
from runtime.engine.spec_stats import spec_line, spec_summary
from runtime.engine.tracker import MAX_NS_LEN
from runtime.model import encode

PROG = "xpod generate"
TICK_S = 0.2  # progress redraw period (at most ~5 per second) and result poll period
BAR_WIDTH = 20
FINISHED_OK = ("stop", "length")
REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class Options:
    """A checked `xpod generate` run: the engine, the prompts and what to do with the results.

    Attributes:
        engine: the EngineConfig (valid, its PodConfig too).
        prompts: the prompt texts, request i is prompts[i].
        params: the SamplingParams of every request (valid for the model).
        json: write the summary and every request to this file (None: do not).
        quiet: print the summary only, no completion.
        stall_s: give up when no request makes progress for this long (--timeout).
        cache_salt: every request's prefix-cache namespace (--cache-salt; None: the default).
    """

    engine: EngineConfig
    prompts: tuple[str, ...]
    params: SamplingParams
    json: str | None = None
    quiet: bool = False
    stall_s: float = 60.0
    cache_salt: str | None = None


# -- flags ----------------------------------------------------------------------------------------


def prompts_source(text: str) -> str:
    """An argparse type: a readable file, or '-' for standard input."""
    return text if text == "-" else input_file(text)


def add_args(p: argparse.ArgumentParser) -> None:
    _io_flags(p)
    _sampling_flags(p)
    add_engine_flags(p)


def _io_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add(
        "--prompts",
        type=prompts_source,
        default=None,
        metavar="FILE",
        help="one prompt per line, blank lines skipped; - reads standard input",
    )
    add(
        "--prompt",
        action="append",
        default=None,
        metavar="TEXT",
        help="a prompt (repeat for more; they come before the --prompts lines)",
    )
    add(
        "--timeout",
        type=positive_float,
        default=60.0,
        help="deadline of every wait in the pod, and the longest this command waits while no"
        " request makes progress (seconds, default 60)",
    )
    add(
        "--json",
        type=output_file,
        default=None,
        metavar="FILE",
        help="write the summary and one entry per request to FILE (one JSON object)",
    )
    add("--quiet", action="store_true", help="print the summary only, no completion")


def _sampling_flags(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--max-tokens", type=positive_int, default=64, help="tokens per request (default 64)")
    add("--temperature", type=nonneg_float, default=0.0, help="0 = greedy (default)")
    add("--seed", type=nonneg_int, default=0, help="sampling seed of every request (default 0)")
    add(
        "--stop-token-ids",
        type=int_list(0),
        default=None,
        metavar="IDS",
        help="comma list of token ids that end a request (ids in [0, vocab))",
    )
    add("--ignore-eos", action="store_true", help="do not stop at EOS")
    add("--cache-salt", default=None, metavar="S",
        help="every request's cache salt (the API's cache_salt): its prompt shares cached KV,"
        " die-local or in the KV pool, only with requests of the same salt")  # fmt: skip


def parse_options(args: argparse.Namespace) -> Options:
    """The checked Options of the parsed flags; nothing is launched.

    Raises:
        ConfigError naming the flag(s): a bad EngineConfig / PodConfig, sampling parameters
        the model refuses (e.g. a stop token out of its vocabulary), no prompt, an unreadable
        prompts file, or a prompt that does not fit the context with --max-tokens.
    """
    engine = engine_config(args)
    params = _sampling_params(args, engine.model_config().vocab_size)
    prompts, origins = read_prompts(args.prompt, args.prompts)
    check_context(prompts, origins, params.max_tokens, engine)
    salt = args.cache_salt
    if salt is not None and not 1 <= len(salt) <= MAX_NS_LEN:
        raise ConfigError(f"argument --cache-salt: {len(salt)} characters, give 1 to"
                          f" {MAX_NS_LEN}")  # fmt: skip
    return Options(engine, tuple(prompts), params, args.json, args.quiet, args.timeout, salt)


def _sampling_params(args: argparse.Namespace, vocab_size: int) -> SamplingParams:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop_token_ids=tuple(args.stop_token_ids or ()),
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate(vocab_size)
    except (ValueError, TypeError) as e:
        raise flag_error(ConfigError(str(e)), ENGINE_FLAGS) from None
    return params


def read_prompts(texts: list[str] | None, source: str | None) -> tuple[list[str], list[str]]:
    """The prompts (the `--prompt` texts, then the non-blank lines of `source`, '-' = stdin)
    and where each came from (for errors). ConfigError naming the flag if there are none."""
    prompts = list(texts or [])
    origins = [f"--prompt {i + 1}" for i in range(len(prompts))]
    if source is not None:
        name = "standard input" if source == "-" else source
        lines = _read_text(source).split("\n")
        found = [(i, ln.removesuffix("\r")) for i, ln in enumerate(lines) if ln.strip()]
        if not found:
            raise ConfigError(f"argument --prompts: {name} has no prompt (every line is blank)")
        prompts += [ln for _, ln in found]
        origins += [f"line {i + 1} of {name}" for i, _ in found]
    if not prompts:
        raise ConfigError(
            "argument --prompts: no prompt: give --prompts FILE (- for standard"
            " input) or --prompt TEXT"
        )
    return prompts, origins


def _read_text(source: str) -> str:
    try:
        if source == "-":
            return sys.stdin.read()
        with open(source, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"argument --prompts: {source} is not UTF-8 text ({e.reason} at byte {e.start})"
        ) from None
    except OSError as e:
        raise ConfigError(f"argument --prompts: cannot read {source}: {e.strerror or e}") from None


def check_context(
    prompts: list[str], origins: list[str], max_tokens: int, cfg: EngineConfig
) -> None:
    """ConfigError naming the first prompt whose tokens + max_tokens exceed the context."""
    limit = cfg.model_config().max_seq_len
    for i, (text, origin) in enumerate(zip(prompts, origins, strict=True)):
        n = len(encode(text))
        if n + max_tokens > limit:
            flag = "--prompt" if origin.startswith("--prompt") else "--prompts"
            raise ConfigError(
                f"argument {flag}/--max-tokens: prompt {i} ({origin}) has {n} tokens; with"
                f" --max-tokens {max_tokens} it exceeds the context of {limit} tokens of model"
                f" {cfg.model} (shorten the prompt or lower --max-tokens)"
            )


# -- progress -------------------------------------------------------------------------------------


class Progress:
    """`[#####.....] 12/40 requests, 345 tok/s` on stderr: redrawn in place at most every
    TICK_S on a terminal, otherwise a plain line each time another ~10 % is done.

    `done` and `got` (requests and output tokens collected) are set by the caller; the token
    rate counts the larger of `got` and the tokens the masters reported so far."""

    def __init__(self, total: int, t0: float, stream: TextIO | None = None):
        self.total, self.t0 = total, t0
        self.out = stream or sys.stderr
        self.tty = self.out.isatty()
        self.done = self.got = 0
        self.drawn_at = 0.0
        self.decile = 0
        self.width = 0

    def line(self, tokens: int) -> str:
        rate = max(tokens, self.got) / max(time.monotonic() - self.t0, 1e-9)
        return f"{self.done}/{self.total} requests, {rate:.0f} tok/s"

    def update(self, tokens: int, force: bool = False) -> None:
        """Redraw (terminal) or print a line (every ~10 %) with `tokens` reported so far."""
        if self.tty:
            now = time.monotonic()
            if force or now - self.drawn_at >= TICK_S:
                self.drawn_at = now
                self._draw(tokens)
        elif self.done * 10 // max(self.total, 1) > self.decile:
            self.decile = self.done * 10 // max(self.total, 1)
            print(f"{PROG}: {self.line(tokens)}", file=self.out, flush=True)

    def _draw(self, tokens: int) -> None:
        fill = BAR_WIDTH * self.done // max(self.total, 1)
        text = f"[{'#' * fill}{'.' * (BAR_WIDTH - fill)}] {self.line(tokens)}"
        self.out.write(f"\r{text}{' ' * max(0, self.width - len(text))}")
        self.width = len(text)
        self.out.flush()

    def close(self) -> None:
        if self.tty and self.width:
            self.out.write("\n")
            self.out.flush()


class Watchdog:
    """EngineError when neither a result nor a step (tokens, step results) arrived in `limit_s`."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.last: tuple = ()
        self.since = time.monotonic()

    def check(self, state: tuple) -> None:
        now = time.monotonic()
        if state != self.last:
            self.last, self.since = state, now
        elif now - self.since > self.limit_s:
            raise EngineError(f"no request made progress for {self.limit_s:g} s (--timeout)")


# -- the run --------------------------------------------------------------------------------------


def run(opts: Options) -> int:
    """Launch the engine, run every prompt, print the completions and the summary; write
    --json. Returns 0 if every request ended with stop or length, else 1."""
    cfg = opts.engine
    pcfg = cfg.pod_config()
    what = (
        f"{cfg.dies} attention + {cfg.expert_dies} expert dies ({cfg.domains} domain(s),"
        f" {cfg.microbatches} micro-batch(es))"
        if cfg.expert_dies
        else f"{cfg.prefill_dies} prefill + {cfg.decode_dies} decode dies"
        if cfg.pd
        else f"{cfg.dies} dies"
    )
    print(
        f"{PROG}: launching {what}, model {cfg.model}, {pcfg.cores} cores"
        f" (pin {cfg.pin}), {len(opts.prompts)} prompts",
        file=sys.stderr,
        flush=True,
    )
    with Engine.launch(cfg) as eng:
        outs, wall_s = collect(eng, opts)
        split = eng.split_stats()  # read from the dies' words: before the pod closes
    summary = summarize(outs, wall_s, eng)
    if split is not None:
        summary["split"] = split
    pd = pd_summary(cfg, eng.stats, eng.tracker.pd)
    if pd is not None:
        summary["pd"] = pd
    if cfg.speculative is not None:
        summary["spec"] = spec_summary(eng.stats, cfg.speculative)
    faults = fault_summary(eng)
    if faults is not None:  # the engine warned on stderr of each fault that did not fire
        summary["faults"] = faults
    if not opts.quiet:
        for out in outs:
            print(completion_line(out))
    print_summary(summary)
    if opts.json:
        write_json(opts.json, summary, outs)
    return 0 if all(o.finish_reason in FINISHED_OK for o in outs) else 1


def collect(eng: Engine, opts: Options) -> tuple[list[CompletionOutput], float]:
    """Submit every prompt, then wait for the results in submission order (progress on
    stderr); returns them and the wall time from the first submit to the last result."""
    t0 = time.monotonic()
    pending = [_submit(eng, p, opts.params, opts.cache_salt) for p in opts.prompts]
    bar = Progress(len(pending), t0)
    watch = Watchdog(opts.stall_s)
    outs: list[CompletionOutput] = []
    got = 0  # output tokens of the results collected
    try:
        for item in pending:
            out = item if isinstance(item, CompletionOutput) else _wait(eng, item, bar, watch)
            outs.append(out)
            got += len(out.token_ids)
            bar.done, bar.got = len(outs), got
            bar.update(_counters(eng)[0])
        wall_s = time.monotonic() - t0
        bar.update(_counters(eng)[0], force=True)
    finally:
        bar.close()
    return outs, wall_s


def _submit(eng: Engine, prompt: str, params: SamplingParams,
            salt: str | None = None) -> int | CompletionOutput:  # fmt: skip
    """The request id, or an error output if the engine refuses the prompt (checked before,
    so only if the engine's checks differ from ours)."""
    try:
        return eng.submit(prompt, params, cache_salt=salt)
    except (ValueError, TypeError) as e:
        return CompletionOutput(-1, prompt, [], "", "error", f"refused: {e}")


def _wait(eng: Engine, rid: int, bar: Progress, watch: Watchdog) -> CompletionOutput:
    while True:
        try:
            return eng.result(rid, TICK_S)
        except TimeoutError:
            tokens, results = _counters(eng)
            bar.update(tokens)
            watch.check((bar.done, tokens, results))


def _counters(eng: Engine) -> tuple[int, int]:
    """(output tokens, step results) over the groups' latest stats (sent every ~0.1 s)."""
    stats = list(eng.stats.values())  # one C call: safe while the receiver adds a group
    return sum(s.get("tokens", 0) for s in stats), sum(s.get("results", 0) for s in stats)


# -- output ---------------------------------------------------------------------------------------


def escape(token_ids: list[int]) -> str:
    """The text of byte tokens with every character that is not printable escaped (`\\n`,
    `\\xNN` for a byte that is not valid UTF-8, `\\uNNNN`); a backslash is doubled. Special
    tokens (>= 256: BOS, EOS, PAD) are skipped."""
    text = bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", "surrogateescape")
    return "".join(_escape_char(c) for c in text)


def _escape_char(c: str) -> str:
    o = ord(c)
    if 0xDC80 <= o <= 0xDCFF:  # an undecodable byte (surrogateescape)
        return f"\\x{o - 0xDC00:02x}"
    if c == "\\":
        return "\\\\"
    if c.isprintable():
        return c
    if c in "\n\r\t":
        return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}[c]
    return f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}"


def completion_line(out: CompletionOutput) -> str:
    line = f"[{out.request_id}] {out.finish_reason}: {escape(out.token_ids)}"
    return f"{line}  ({out.error})" if out.error else line


def _pcts(values: list[float]) -> dict[str, float | None]:
    """p50 and p99 in milliseconds (None without samples)."""
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values, dtype=np.float64) * 1e3, [50, 99])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3)}


def _median(values: list[float]) -> float | None:
    return round(float(np.median(values)), 4) if values else None


def summarize(outs: list[CompletionOutput], wall_s: float, eng: Engine) -> dict:
    """The summary of a run on the closed engine `eng`: totals, latency percentiles, and per
    group the latest (final) stats of its master."""
    reasons = Counter(o.finish_reason for o in outs)
    n_out = sum(len(o.token_ids) for o in outs)
    ok = [o for o in outs if o.finish_reason in FINISHED_OK]
    return {
        "requests": len(outs),
        "finish_reasons": {r: reasons.get(r, 0) for r in (*REASONS, *sorted(reasons))},
        "prompt_tokens": sum(o.num_prompt_tokens for o in outs),
        # the scheduler counts a preempted request's re-admission, prompt + output: cap it
        "cached_prompt_tokens": sum(min(o.num_cached_tokens, o.num_prompt_tokens) for o in outs),
        "output_tokens": n_out,
        "wall_s": round(wall_s, 4),
        "output_tokens_per_s": round(n_out / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_ms": _pcts([o.ttft_s for o in outs if o.token_ids]),
        "tpot_ms": _pcts([o.tpot_s for o in outs if len(o.token_ids) > 1]),
        "e2e_ms": _pcts([o.e2e_s for o in ok]),
        "groups": [_group(g, outs, eng) for g in range(eng.config.dies)],
        # prompt tokens by source (die-local cache, KV pool, computed); the pool's figures
        "cache": cache_summary(eng.stats, eng.pool.stats() if eng.pool is not None else None),
        "config": asdict(eng.config),
    }


def fault_summary(eng: Engine) -> dict | None:
    """What became of --inject's plan on the closed engine (None without a plan): planned,
    fired, verified, detected, recovered, and not_fired (the texts of the faults that never
    fired; `not_fired_reasons` says why, in the same order)."""
    if eng.supervisor is None or eng.supervisor.plan is None:
        return None
    s = eng.supervisor.fault_summary()
    return {k: s.get(k, []) for k in ("planned", "fired", "verified", "detected", "recovered",
                                       "not_fired", "not_fired_reasons")}  # fmt: skip


def _group(g: int, outs: list[CompletionOutput], eng: Engine) -> dict:
    s = eng.stats.get(g, {})
    kv = s.get("kv", {})
    peak = max(
        (m["kv"]["usage"] for m in eng.stats_log if m.get("group") == g and "kv" in m),
        default=0.0,
    )
    return {
        "group": g,
        "requests": sum(1 for o in outs if o.group == g),
        "final_stats": bool(s.get("final")),
        "steps": len(s.get("step_ms", [])),
        "dummy_steps": _dummy_steps(g, eng, s),
        "preemptions": s.get("num_preemptions", 0),
        "prefix_hit_rate": round(s.get("prefix_hit_rate", 0.0), 4),
        "kv_used": kv.get("used", 0),
        "kv_cached": kv.get("cached", 0),
        "kv_total": kv.get("total", 0),
        "kv_usage": round(kv.get("usage", 0.0), 4),
        "kv_peak_usage": round(peak, 4),
        "bubble_p50_ms": _median(s.get("bubble_ms", [])),
        "step_p50_ms": _median(s.get("step_ms", [])),
    }


def _dummy_steps(g: int, eng: Engine, s: dict) -> int:
    """The die's own count when its serving loop returned: a master's stats carry the count of
    the die's last result only, and an idle group's die runs dummy steps without results."""
    for r in eng.pod_result or ():
        if isinstance(r, dict) and r.get("die") == g and "dummy_steps" in r:
            return r["dummy_steps"]
    return s.get("dummy_steps", 0)


def _ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_summary(s: dict) -> None:
    r = s["finish_reasons"]
    print("\nsummary")
    rows = [
        ("requests", f"{s['requests']} (" + ", ".join(f"{k} {v}" for k, v in r.items()) + ")"),
        (
            "prompt tokens",
            f"{s['prompt_tokens']} ({s['cached_prompt_tokens']} from the prefix cache)",
        ),
        ("output tokens", str(s["output_tokens"])),
        ("wall seconds", f"{s['wall_s']:.3f}"),
        ("output tokens/s", f"{s['output_tokens_per_s']:.1f}"),
    ]
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms")):
        p = s[key]
        rows.append((f"{name} p50/p99 ms", f"{_ms(p['p50'], 2)} / {_ms(p['p99'], 2)}"))
    c = s["config"]
    rows.append((
        "engine",
        f"{c['dies']} groups, async depth {c['async_depth']}, prefix cache"
        f" {'on' if c['prefix_cache'] else 'off'}, lb {c['lb_policy']}, gc"
        f" {'every ' + str(c['gc_every']) + ' steps' if c['gc_every'] else 'automatic'},"
        f" pin {c['pin']}",
    ))  # fmt: skip
    for name, value in rows:
        print(f"  {name:<17} {value}")
    print(
        f"\n  {'group':>5} {'requests':>8} {'steps':>6} {'dummy':>6} {'preempt':>7}"
        f" {'prefix_hit':>10} {'kv_used':>9} {'kv_peak':>7} {'bubble_p50_ms':>13}"
        f" {'step_p50_ms':>11}"
    )
    for g in s["groups"]:
        kv = f"{g['kv_used']}/{g['kv_total']}"
        print(
            f"  {g['group']:>5} {g['requests']:>8} {g['steps']:>6} {g['dummy_steps']:>6}"
            f" {g['preemptions']:>7} {g['prefix_hit_rate']:>10.1%} {kv:>9}"
            f" {g['kv_peak_usage']:>7.1%} {_ms(g['bubble_p50_ms'], 3):>13}"
            f" {_ms(g['step_p50_ms'], 2):>11}"
        )
    for line in cache_lines(s["cache"]) if s.get("cache") else ():
        print(f"  {line}")
    if not all(g["final_stats"] for g in s["groups"]):
        print("  (some group sent no final stats: its numbers are the latest it sent)")
    if s.get("faults"):
        f = s["faults"]
        print(f"  faults planned {f['planned']}: fired {f['fired']} (verified {f['verified']}),"
              f" detected {f['detected']}, recovered {f['recovered']}, not fired"
              f" {len(f['not_fired'])}")  # fmt: skip
    if s.get("spec"):
        print(f"  {spec_line(s['spec'])}")
    if s.get("split"):
        print_split_stats(s["split"])
    if s.get("pd"):
        print_pd_stats(s["pd"])


def request_entry(o: CompletionOutput) -> dict:
    return {
        "id": o.request_id,
        "prompt": o.prompt,
        "text": o.text,
        "token_ids": list(o.token_ids),
        "finish_reason": o.finish_reason,
        "error": o.error,
        "group": o.group,
        "prompt_tokens": o.num_prompt_tokens,
        "cached_tokens": o.num_cached_tokens,
        "output_tokens": len(o.token_ids),
        "ttft_ms": round(o.ttft_s * 1e3, 3),
        "tpot_ms": round(o.tpot_s * 1e3, 3),
        "e2e_ms": round(o.e2e_s * 1e3, 3),
    }


def write_json(path: str, summary: dict, outs: list[CompletionOutput]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"summary": summary, "requests": [request_entry(o) for o in outs]}, f)
        f.write("\n")
    print(f"{PROG}: wrote {path}", file=sys.stderr)


__all__ = ["Options", "add_args", "escape", "parse_options", "run"]
