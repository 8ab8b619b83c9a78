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
               "median_ttft_ms_by_turn", "server_args")  # fmt: skip
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
        ("--repeat", args.repeat > 1),
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


def run_compare_pool(opts: Options, run_layout: Callable) -> tuple[dict[str, dict], list, int]:
    """Each layout's run (`run_layout(opts) -> (result, results, status)`), in turn: (results
    by layout, the first layout's per-request results, the worst status)."""
    per: dict[str, dict] = {}
    first: list = []
    status = 0
    for i, (name, argv) in enumerate(opts.compare_pool):
        progress(f"  layout {i + 1}/{len(opts.compare_pool)}: {name}")
        res, results, st = run_layout(dataclasses.replace(opts, server_argv=argv))
        res["layout"] = name
        res["server_args"] = shlex.join(argv)
        per[name] = res
        first = first or results
        status = max(status, st)
    return per, first, status


def layout_figures(name: str, r: dict) -> dict:
    out = {k: r.get(k) for k in LAYOUT_KEYS}
    if name == "pool":
        out.update({k: r.get(k) for k in POOL_KEYS})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def evaluate_bars(layouts: dict[str, dict]) -> dict[str, dict]:
    """{bar name: {what, value, bar, ok}} of the layouts present (ok None: not evaluated)."""
    out = {}
    for name, what, lay, over, key, op, bar in BARS:
        value = None
        if lay in layouts and (over is None or over in layouts):
            a = layouts[lay].get(key)
            b = layouts[lay].get("ideal_hit_rate") if over is None else layouts[over].get(key)
            value = _ratio(a, b)
        ok = None if value is None else (value >= bar if op == ">=" else value <= bar)
        out[name] = {"what": what, "value": value, "bar": f"{op} {bar:g}", "ok": ok}
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


def compare_pool_result(opts: Options, base: dict, per: dict[str, dict]) -> dict:
    """The --json object of --compare-pool: the options, `layouts` (the keys above), `bars`,
    `reported`, every layout's whole result under `runs`, the run info."""
    layouts = {name: layout_figures(name, r) for name, r in per.items()}
    res = {**base, "compare_pool": list(per), "mt": dataclasses.asdict(opts.mt),
           "layouts": layouts, "bars": evaluate_bars(layouts), "reported": reported(layouts),
           "runs": per, **run_info()}  # fmt: skip
    res["failed"] = sum(r.get("failed") or 0 for r in per.values())
    return res


def _f(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_compare_pool(res: dict) -> None:
    m = res["mt"]
    print()
    print("{s:{c}^{n}}".format(s=" KV pool: multi-turn, layouts side by side ", n=72, c="#"))
    print(
        f"{m['conversations']} conversations x {m['turns']} turns, system {m['system_len']}"
        f" x {m['families']}{' (skewed)' if m['skew'] else ''}, user {m['user_len']}, output"
        f" {m['output_len']}, think {m['think_s']:g} s, stagger {m['stagger_s']:g} s"
    )
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
    print("bars (KVPOOL.md E1):")
    for b in res["bars"].values():
        verdict = "n/a" if b["ok"] is None else ("met" if b["ok"] else "MISSED")
        print(f"  {b['what']:<36} {_f(b['value']):>7}  (bar {b['bar']}: {verdict})")
    rep = res["reported"]
    if rep.get("pool_hit_over_ideal_replies") is not None:
        print(
            f"  pool hit rate / ideal with replies    {_f(rep['pool_hit_over_ideal_replies']):>7}"
            "  (reported: a die's own cache keeps reply blocks, the pool prompt blocks only)"
        )
    if "affinity_hit_rate" in rep:
        print(
            f"  affinity (--lb prefix): hit rate {_f(rep['affinity_hit_rate'])}, load"
            f" imbalance {_f(rep['affinity_load_imbalance'])} (reported, no bar)"
        )
    print("=" * 72)
