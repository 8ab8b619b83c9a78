"""The multi-turn flags of `xpod bench serve` and `--compare-pool`: the same multi-turn
workload (same seed, same conversations, same think times) against one launched server per
layout, in turn, and the KV pool's bars (KVPOOL.md §5.2 E1) evaluated over them.

```
xpod bench serve --launch --dies 4 --dataset multi-turn --compare-pool local,affinity,pool \
    --json mt.json
```

Layouts (each a fresh `xpod serve` with the run's flags and `--server-args`):
- `local`: the die-local prefix cache only, `--lb least_kv` (load-only routing): a turn hits
  only if the balancer sent it where the conversation's earlier turns ran;
- `affinity`: `--lb prefix` (the KV-centric baseline: the group that was lately sent the
  prompt's leading blocks, less its reserved KV), no pool;
- `pool`: `--kv-pool` with `--lb least_kv`: the hit is pod-wide, the routing load-only. The
  `--pool-*` flags of `--server-args` go to this layout only.

`--repeat R`: R rounds of the layouts, the order reversed every other round (the machine
drifts: a ratio is taken within a round, between runs minutes apart at most); the JSON has
each round (`rounds`, `runs`), each layout's medians over its rounds (`layouts`) and each bar's
median over the rounds' ratios (`bars`, with `values`). A run whose engine restarted
(`engine_restarts` > 0: a die declared dead, its counters and caches started over) is left out
of the medians, and said.

Per layout (`layouts` in the JSON): `completed`, `failed`, `output_throughput`,
`median_ttft_ms`, `p99_ttft_ms`, `hit_rate` (local + pool prompt tokens over all, from
`/metrics`), `local_hit_rate`, `pool_hit_rate`, `ideal_hit_rate` (the trace's, as sent:
`bench.serve.multiturn`), `load_imbalance` (max over groups / mean of the prompt tokens each
served), ... ; `bars`: {name: {value, bar, ok}}: pool hit rate >= 0.9 x its ideal, pool TTFT
p50 <= 0.8 x local's, output throughput >= 0.97 x local's, load imbalance <= 1.1 x local's;
`reported`: the affinity layout's hit rate and imbalance (no bar: on a skewed mix,
`--mt-system-prompts G --mt-skew`, its imbalance should show). A missed bar is reported, not an
exit status; a failed request is (status 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from collections.abc import Callable

import numpy as np

from bench.common import print_table, progress, run_info
from bench.serve.options import MTSpec, Options
from bench.serve.pd_flags import flag_given, without
from memory.errors import ConfigError
from runtime.cli.argtypes import nonneg_float, positive_int

LAYOUTS = ("local", "affinity", "pool")
LAYOUT_LB = {"local": "least_kv", "affinity": "prefix", "pool": "least_kv"}
POOL_FLAGS = ("--pool-dram-mib", "--pool-ssd-mib", "--pool-dir", "--pool-admit", "--pool-store",
              "--pool-min-hit-blocks", "--pool-load-timeout")  # fmt: skip
QUICK_MT = dict(conversations=4, turns=3, system_len=96, user_len=32, output_len=32)
LAYOUT_KEYS = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms",
               "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "hit_rate", "local_hit_rate",
               "pool_hit_rate", "ideal_hit_rate", "ideal_hit_rate_replies",
               "local_prompt_tokens", "pool_prompt_tokens", "computed_prompt_tokens",
               "load_imbalance", "computed_imbalance", "prompt_tokens_by_group",
               "median_ttft_ms_by_turn", "engine_restarts", "server_args")  # fmt: skip
POOL_KEYS = ("pool_loads", "pool_fallbacks", "pool_crc_mismatches", "pool_load_gbps",
             "pool_load_ms_mean", "pool_stored_blocks", "pool_evictions")  # fmt: skip
# (name, what, layout, over layout or None, key, op, bar)
BARS = (
    ("pool_hit_over_ideal", "pool hit rate / its ideal", "pool", None, "hit_rate", ">=", 0.9),
    ("pool_ttft_p50_over_local", "pool TTFT p50 / local's", "pool", "local", "median_ttft_ms",
     "<=", 0.8),
    ("pool_throughput_over_local", "pool output tok/s / local's", "pool", "local",
     "output_throughput", ">=", 0.97),
    ("pool_imbalance_over_local", "pool load imbalance / local's", "pool", "local",
     "load_imbalance", "<=", 1.1),
)  # fmt: skip


def _layouts(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in LAYOUTS]
    if not names or bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a comma list of distinct layouts of {', '.join(LAYOUTS)}"
        )
    return names


def add_mt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-turn (--dataset multi-turn) and the KV pool comparison")
    add = g.add_argument
    d = MTSpec()
    add("--mt-conversations", type=positive_int, default=None, metavar="C",
        help=f"conversations (default {d.conversations})")  # fmt: skip
    add("--mt-turns", type=positive_int, default=None, metavar="T",
        help=f"turns of each (default {d.turns})")  # fmt: skip
    add(
        "--mt-system-len",
        type=positive_int,
        default=None,
        metavar="S",
        help=f"tokens of the shared system prompt, BOS not counted (default {d.system_len})",
    )
    add("--mt-system-prompts", type=positive_int, default=None, metavar="G",
        help="system prompts (conversation families; default 1: shared by all)")  # fmt: skip
    add("--mt-user-len", type=positive_int, default=None, metavar="U",
        help=f"new user tokens of each turn (default {d.user_len}); a reply is"
        f" --random-output-len tokens (default {d.output_len} here), ignore_eos")  # fmt: skip
    add("--mt-think-time", type=nonneg_float, default=None, metavar="Z",
        help=f"mean seconds (exponential) between a reply and the next turn (default"
        f" {d.think_s:g})")  # fmt: skip
    add("--mt-stagger", type=nonneg_float, default=None, metavar="S",
        help=f"seconds between conversation starts (default {d.stagger_s:g})")  # fmt: skip
    add(
        "--mt-skew",
        action="store_true",
        help="family 0 takes half of the conversations (needs --mt-system-prompts >= 2)",
    )
    add("--compare-pool", type=_layouts, default=None, metavar="LAYOUTS",
        help="with --launch --dataset multi-turn: one server per layout in turn, the same"
        " workload: local (die-local prefix cache, least_kv), affinity (--lb prefix), pool"
        " (--kv-pool, least_kv); the KV pool's bars over them")  # fmt: skip


MT_FLAGS = (("--mt-conversations", "mt_conversations"), ("--mt-turns", "mt_turns"),
            ("--mt-system-len", "mt_system_len"), ("--mt-system-prompts", "mt_system_prompts"),
            ("--mt-user-len", "mt_user_len"), ("--mt-think-time", "mt_think_time"),
            ("--mt-stagger", "mt_stagger"))  # fmt: skip


def mt_spec(args: argparse.Namespace, dataset: str) -> MTSpec | None:
    """The multi-turn workload of the flags (None for another dataset); ConfigError naming a
    flag that does not go with it."""
    given = [f for f, k in MT_FLAGS if getattr(args, k) is not None]
    given += ["--mt-skew"] * args.mt_skew + ["--compare-pool"] * bool(args.compare_pool)
    if dataset != "multi-turn":
        if given:
            raise ConfigError(f"argument {given[0]}: only with --dataset multi-turn")
        return None
    for flag, bad in (
        ("--endpoint", args.endpoint != "completions"),
        ("--rate-sweep", bool(args.rate_sweep)),
        ("--ramp-up-strategy", args.ramp_up_strategy is not None),
        ("--request-rate", args.request_rate != float("inf")),
        ("--repeat", args.repeat > 1 and not args.compare_pool),
        ("--prefill-dies", args.prefill_dies is not None),
    ):
        if bad:
            raise ConfigError(
                f"argument {flag}: not with --dataset multi-turn (a closed loop of token-id"
                " prompts on /v1/completions: think time --mt-think-time)"
            )
    d = MTSpec()
    spec = MTSpec(
        conversations=args.mt_conversations or d.conversations,
        turns=args.mt_turns or d.turns,
        system_len=args.mt_system_len or d.system_len,
        families=args.mt_system_prompts or d.families,
        user_len=args.mt_user_len or d.user_len,
        output_len=args.random_output_len or d.output_len,
        think_s=d.think_s if args.mt_think_time is None else args.mt_think_time,
        stagger_s=d.stagger_s if args.mt_stagger is None else args.mt_stagger,
        skew=args.mt_skew,
    )
    if spec.skew and spec.families < 2:
        raise ConfigError("argument --mt-skew: needs --mt-system-prompts >= 2 (family 0 takes"
                          " half of the conversations, the others the rest)")  # fmt: skip
    if args.quick:
        spec = dataclasses.replace(
            spec, **{k: min(getattr(spec, k), v) for k, v in QUICK_MT.items()}
        )
    return spec


def fit_context(
    spec: MTSpec, engine, base: tuple[str, ...], check: Callable
) -> tuple[tuple[str, ...], object, tuple[str, ...]]:
    """(server flags, EngineConfig, notes) with a `--max-seq-len` added when the longest
    conversation does not fit the model's context (said in a note); ConfigError if the
    user's own --max-seq-len is too short."""
    have = engine.model_config().max_seq_len
    if spec.max_context <= have:
        return base, engine, ()
    if "max_seq_len" in engine.model_overrides:
        raise ConfigError(
            f"argument --mt-turns: a conversation needs {spec.max_context} tokens of context,"
            f" more than the {have} of --max-seq-len in --server-args"
        )
    n = -(-spec.max_context // 256) * 256
    argv = (*base, "--max-seq-len", str(n))
    note = (
        f"--max-seq-len {n} given to the server: a conversation needs {spec.max_context}"
        f" tokens (1 + S + T x (U + O)), the {engine.model} model's context is {have}"
    )
    return argv, check(argv), (note,)


def layout_argvs(
    names: list[str], argv: tuple[str, ...], user: tuple[str, ...], check: Callable
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each layout's `xpod serve` flags: `argv` (the run's, without --lb and the --pool-*
    flags) + its balancer (+ --kv-pool and the --pool-* flags of `user` for `pool`)."""
    for f in ("--kv-pool", "--lb", "--no-prefix-cache"):
        if flag_given(user, f):
            raise ConfigError(
                f"argument --server-args: no {f} with --compare-pool (each layout sets its"
                " own balancer and pool)"
            )
    pool_flags = _only(user, POOL_FLAGS)
    base = without(without(argv, POOL_FLAGS), ("--lb",))
    out = []
    for name in names:
        extra = ("--lb", LAYOUT_LB[name])
        if name == "pool":
            extra += ("--kv-pool", *pool_flags)
        layout = (*base, *extra)
        try:
            check(layout)
        except ConfigError as e:
            raise ConfigError(f"argument --compare-pool: the {name} layout: {e}") from None
        out.append((name, layout))
    return tuple(out)


def _only(argv: tuple[str, ...], flags: tuple[str, ...]) -> tuple[str, ...]:
    """The `flags` of `argv` with their values (`--f v` or `--f=v`), in order."""
    out: list[str] = []
    take = False
    for a in argv:
        if take:
            out.append(a)
            take = False
        elif a in flags:
            out.append(a)
            take = True
        elif any(a.startswith(f + "=") for f in flags):
            out.append(a)
    return tuple(out)


def run_compare_pool(opts: Options, run_layout: Callable) -> tuple[list[dict], list, int]:
    """`--repeat` R rounds of every layout's run (`run_layout(opts) -> (result, results,
    status)`), the order reversed every other round (local, affinity, pool, then pool,
    affinity, local, ...: a drift of the machine hits both ends of a ratio alike): (per round
    {layout: result}, the first run's per-request results, the worst status)."""
    rounds: list[dict] = []
    first: list = []
    status = 0
    names = list(opts.compare_pool)
    for r in range(opts.repeat):
        rnd: dict[str, dict] = {}
        for i, (name, argv) in enumerate(names if r % 2 == 0 else names[::-1]):
            progress(
                f"  round {r + 1}/{opts.repeat}, layout {i + 1}/{len(names)}: {name}"
                if opts.repeat > 1
                else f"  layout {i + 1}/{len(names)}: {name}"
            )
            res, results, st = run_layout(dataclasses.replace(opts, server_argv=argv, repeat=1))
            res["layout"], res["server_args"] = name, shlex.join(argv)
            rnd[name] = res
            first = first or results
            status = max(status, st)
        rounds.append({name: rnd[name] for name, _ in names})
    return rounds, first, status


def layout_figures(name: str, r: dict) -> dict:
    out = {k: r.get(k) for k in LAYOUT_KEYS}
    if name == "pool":
        out.update({k: r.get(k) for k in POOL_KEYS})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _median(values: list) -> float | None:
    v = [x for x in values if isinstance(x, int | float) and not isinstance(x, bool)]
    return float(np.median(v)) if v else None


def evaluate_bars(layouts: dict[str, dict]) -> dict[str, dict]:
    """{bar name: {what, value, bar, ok}} of the layouts present (ok None: not evaluated)."""
    out = {}
    for name, what, lay, over, key, op, bar in BARS:
        value = None
        if lay in layouts and (over is None or over in layouts):
            a = layouts[lay].get(key)
            b = layouts[lay].get("ideal_hit_rate") if over is None else layouts[over].get(key)
            value = _ratio(a, b)
        ok = _ok(value, op, bar)
        out[name] = {"what": what, "value": value, "bar": f"{op} {bar:g}", "ok": ok}
    return out


def _ok(value: float | None, op: str, bar: float) -> bool | None:
    return None if value is None else (value >= bar if op == ">=" else value <= bar)


def _clean(rnd: dict[str, dict], names: tuple[str, ...]) -> bool:
    """No engine restart in these layouts' runs of a round (their counters cover it all)."""
    return all(not rnd[n].get("engine_restarts") for n in names if n in rnd)


def round_bars(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """The bars over rounds: each round's ratio (its layouts ran next to each other), the
    median over the rounds without an engine restart in the layouts it compares (over all
    rounds if every one had one, and said: `clean` false)."""
    per = [evaluate_bars(rnd) for rnd in rounds]
    out = {}
    for name, what, lay, over, _, op, bar in BARS:
        involved = (lay,) if over is None else (lay, over)
        values = [b[name]["value"] for b in per]
        clean = [v for v, rnd in zip(values, rounds, strict=True) if _clean(rnd, involved)]
        value = _median(clean if clean else values)
        out[name] = {"what": what, "value": value, "values": values, "bar": f"{op} {bar:g}",
                     "ok": _ok(value, op, bar), "clean": bool(clean)}  # fmt: skip
    return out


def median_layouts(rounds: list[dict[str, dict]]) -> dict[str, dict]:
    """Each layout's figures: numbers the median over its rounds without a restart (all, if
    every one had one), lists those of its first such round."""
    out = {}
    for name in rounds[0]:
        rows = [rnd[name] for rnd in rounds if _clean(rnd, (name,))] or [r[name] for r in rounds]
        fig = {}
        for k in rows[0]:
            vals = [r.get(k) for r in rows]
            num = _median(vals)
            fig[k] = num if num is not None and not isinstance(rows[0][k], list) else rows[0][k]
        for k in ("completed", "failed"):
            fig[k] = sum(rnd[name].get(k) or 0 for rnd in rounds)
        fig["engine_restarts"] = sum(rnd[name].get("engine_restarts") or 0 for rnd in rounds)
        fig["rounds"] = len(rounds)
        out[name] = fig
    return out


def reported(layouts: dict[str, dict]) -> dict:
    """The figures without a bar: affinity's hit rate and imbalance, each layout's hit rate
    over local's."""
    out: dict = {}
    if "pool" in layouts:  # the die-local cache also keeps reply blocks: this ideal is higher
        p = layouts["pool"]
        out["pool_hit_over_ideal_replies"] = _ratio(p.get("hit_rate"),
                                                    p.get("ideal_hit_rate_replies"))  # fmt: skip
    if "affinity" in layouts:
        a = layouts["affinity"]
        out.update(affinity_hit_rate=a.get("hit_rate"),
                   affinity_load_imbalance=a.get("load_imbalance"),
                   affinity_ideal_hit_rate=a.get("ideal_hit_rate"))  # fmt: skip
    if "local" in layouts:
        for name in layouts:
            if name != "local":
                out[f"{name}_hit_rate_over_local"] = _ratio(
                    layouts[name].get("hit_rate"), layouts["local"].get("hit_rate")
                )
    return out


def compare_pool_result(opts: Options, base: dict, rounds: list[dict[str, dict]]) -> dict:
    """The --json object of --compare-pool: the options, `layouts` (the keys above; medians
    over the rounds), `bars` (median of the rounds' ratios), `reported`, each round's figures
    under `rounds` and its whole results under `runs`, the run info."""
    per_round = [{n: layout_figures(n, r) for n, r in rnd.items()} for rnd in rounds]
    layouts = median_layouts(per_round)
    res = {**base, "compare_pool": list(rounds[0]), "mt": dataclasses.asdict(opts.mt),
           "repeat": len(rounds), "layouts": layouts, "bars": round_bars(per_round),
           "reported": reported(layouts), "rounds": per_round, "runs": rounds,
           **run_info()}  # fmt: skip
    res["failed"] = sum(r.get("failed") or 0 for rnd in rounds for r in rnd.values())
    return res


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


ROUND_COLUMNS = [
    ("layout", "layout", ""),
    ("output_throughput", "out tok/s", ".1f"),
    ("median_ttft_ms", "TTFT p50", ".1f"),
    ("p99_ttft_ms", "p99", ".1f"),
    ("hit_rate", "hit", ".3f"),
    ("pool_hit_rate", "pool hit", ".3f"),
    ("ideal_hit_rate", "ideal", ".3f"),
    ("load_imbalance", "imbalance", ".3f"),
    ("engine_restarts", "restarts", "d"),
]


def print_rounds(res: dict) -> None:
    """Each round's layouts, in the order they ran."""
    rows = []
    for i, rnd in enumerate(res["rounds"]):
        order = list(rnd) if i % 2 == 0 else list(rnd)[::-1]
        rows += [{"layout": f"{i + 1}: {n}", **rnd[n]} for n in order]
    print_table(rows, ROUND_COLUMNS)


def print_compare_pool(res: dict) -> None:
    m = res["mt"]
    print()
    print("{s:{c}^{n}}".format(s=" KV pool: multi-turn, layouts side by side ", n=72, c="#"))
    print(
        f"{m['conversations']} conversations x {m['turns']} turns, system {m['system_len']}"
        f" x {m['families']}{' (skewed)' if m['skew'] else ''}, user {m['user_len']}, output"
        f" {m['output_len']}, think {m['think_s']:g} s, stagger {m['stagger_s']:g} s"
    )
    if res.get("repeat", 1) > 1:
        print_rounds(res)
        print(f"each layout: median of {res['repeat']} rounds (order reversed every other one)")
    rows = [{"layout": k, **v} for k, v in res["layouts"].items()]
    print_table(
        rows,
        [
            ("layout", "layout", ""),
            ("completed", "done", "d"),
            ("failed", "failed", "d"),
            ("output_throughput", "out tok/s", ".1f"),
            ("median_ttft_ms", "TTFT p50", ".1f"),
            ("p99_ttft_ms", "p99", ".1f"),
            ("hit_rate", "hit", ".3f"),
            ("pool_hit_rate", "pool hit", ".3f"),
            ("ideal_hit_rate", "ideal", ".3f"),
            ("ideal_hit_rate_replies", "+replies", ".3f"),
            ("load_imbalance", "imbalance", ".3f"),
            ("computed_imbalance", "computed imb.", ".3f"),
        ],
    )
    for name, lay in res["layouts"].items():
        if lay.get("engine_restarts"):
            print(
                f"WARNING: the {name} layout's engine restarted {lay['engine_restarts']} time(s)"
                " (a die declared dead): its /metrics figures of that round cover part of it"
                " and are left out of the medians"
            )
    rounds = res.get("repeat", 1)
    print(f"bars (KVPOOL.md E1){f'; median of {rounds} rounds (each)' if rounds > 1 else ''}:")
    for b in res["bars"].values():
        verdict = "n/a" if b["ok"] is None else ("met" if b["ok"] else "MISSED")
        each = ", ".join(_f(v) for v in b.get("values") or ()) if rounds > 1 else ""
        print(
            f"  {b['what']:<36} {_f(b['value']):>7}  (bar {b['bar']}: {verdict})"
            + (f"  rounds {each}" if each else "")
        )
    rep = res["reported"]
    if rep.get("pool_hit_over_ideal_replies") is not None:
        print(
            f"  pool hit rate / ideal with replies    {_f(rep['pool_hit_over_ideal_replies']):>7}"
            "  (reported: the pool stores reply blocks with --pool-store all only)"
        )
    if "affinity_hit_rate" in rep:
        print(
            f"  affinity (--lb prefix): hit rate {_f(rep['affinity_hit_rate'])}, load"
            f" imbalance {_f(rep['affinity_load_imbalance'])} (reported, no bar)"
        )
    print("=" * 72)
