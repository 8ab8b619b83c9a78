"""`xpod bench pool`: TTFT and prefill throughput by reuse rate, KV pool hits against recompute.

The pod-wide KV pool's curve (000 §5.4.3; KVPOOL.md §5.1-5.3, E2), a die-local hit beside it.

```
xpod bench pool [--dies 4] [--model medium] [--max-seq-len 2048] [--prompt-len 1024] \\
    [--reuse 0,0.125,0.25,0.5,0.75,0.9] [--prompts 5] [--concurrency 4] [--overhead 4] [--json F]
```

Two engines run side by side in one run, with the same settings: the *pool* engine (prefix cache
and a pod-wide KV pool, `kv_pool=PoolConfig(dram_mib=...)`) and the *nocache* engine (no prefix
cache, no pool: every prompt recomputed; the engine cannot turn its cache off at runtime, so the
control is a second engine, idle while the other one works). Per reuse rate r and repetition
(fresh seeded prompts each), with k = floor(r x L / block_size) blocks of the prompt's L tokens
shared:

1. warm: a request W = P + tail_w (P: the k shared blocks) pinned to die A (0) of the pool
   engine, 4 output tokens (a request that ends within two tokens can end in the results that
   carry its prefill's, before its master offers its blocks to the pool: nothing stored); a wait
   until the pool's `pool_stored_blocks` (a counter that only grows) covers W's blocks; W then
   runs on die A of the nocache engine too (nothing kept: both engines did the same work last);
2. measured, one request at a time on an idle engine (the nocache one's place rotated):
   - pool: M = P + tail_m pinned to die B (1) != A: the die-local cache cannot help, every hit is
     a pool hit (`ttft_ms_pool`; the hit's tokens, bytes and load time from the landing);
   - local: M' = P + tail_l (the same prefix, another tail of the same length) pinned to die B,
     whose cache now holds P (landed by the pool hit): a die-local hit on the same die
     (`ttft_ms_local`), the control of the bar below;
   - local on die A: M'' = P + tail_a pinned to die A, whose cache holds P from W
     (`ttft_ms_local_die_a`). Not the bar's control: die 0 prefilled 8-16 % faster than dies
     1-3 of this pod, with or without the pool (2026-11-28): A against B measures the dies too;
   - nocache: M pinned to die B of the nocache engine (`ttft_ms_nocache`).
3. throughput (`--concurrency N` > 0): N warm prompts on die A, then N measured prompts sent at
   once to die B, on each engine in turn (the order alternates by r): prompt tokens over the
   time to the last first token (`prefill_tok_s_*`); with N = 0, L / the idle TTFT p50.

Every measured request follows a one-token request of less than a block on its die (`prime`):
each meets its die just woken. TTFT is the tracker's: from `track()` to the first token. Then
`xpod bench p2p`'s zero-copy ping-pong (one lane, a 2-die pod launched once the engines are
gone) at every load's size gives the bar of a hit: bytes / (0.8 x p2p GB/s) + 1 ms. What a pool
hit adds to a die-local hit's path is its load (the hint's lookup both pay): the load's time
in the master, from its arrival to the request queued with the blocks landed and crc-checked
(`load_ms`, `pool_hit_cost_ms_r*`), is judged against the bar; TTFT(pool) - TTFT(local)
(`pool_minus_local_ms`, its IQR beside it) is reported too, but a prefill's run-to-run noise
is tens of times the bar. The machine's noise: the nocache TTFTs (the same work at every r)
pooled, p99 / p50, and the load averages. At r = 0 the pool's overhead is judged on the ratio
of the p50s and on the median of each repetition's pool / nocache ratio (`_paired`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from dataclasses import dataclass

import numpy as np

from bench.common import pct, print_table, progress, run_info, write_json
from bench.pool_overhead import overhead
from bench.pool_requests import ask, prime, ttft
from memory.errors import ConfigError
from runtime.cli.argtypes import int_range, output_file, positive_float, positive_int
from runtime.cli.hosts import hosts_spec
from runtime.engine import Engine, EngineConfig
from runtime.engine.pool_shell import PoolConfig
from runtime.model import PRESETS

DEFAULT_REUSE = "0,0.125,0.25,0.5,0.75,0.9"
P2P_BAR = 0.8  # a hit's extra over a die-local hit: bytes / (0.8 x p2p zero-copy GB/s) + 1 ms
P2P_SLACK_MS = 1.0
MONOTONE_SLACK = 0.03
REDUCTION_BARS = {0.5: 0.30, 0.9: 0.55}  # TTFT reduction against recompute (000: 34 %, 59 %)
GAIN_BARS = {0.5: 1.3, 0.9: 2.0}  # prefill throughput, pool / recompute (000: 1.42x, 2.28x)
OVERHEAD_BAR = 0.03  # r = 0: TTFT(pool) / TTFT(nocache) - 1
STORE_WAIT_S = 30.0  # the warm request's blocks stored in the pool by then
# A master offers a request's prompt blocks to the pool after a result while the request still
# runs; with two steps in flight (async_depth 2) a request of 1 or 2 tokens can end in the
# results that carry its prefill's, and then nothing of it is stored. 4 always leaves it running.
WARM_TOKENS = 4
DIE_A, DIE_B = 0, 1
LOAD_TIMEOUT_S = 30.0


def pd_pair(text: str) -> tuple[int, int]:
    """An argparse type: `P,D` (prefill and decode dies, each >= 1)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not P,D (prefill and decode dies >= 1)")
    return int(parts[0]), int(parts[1])


def reuse_list(text: str) -> list[float]:
    """An argparse type: a non-empty comma list of reuse rates in [0, 1), sorted, no repeats."""
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a comma list of rates in [0, 1)")
    out = []
    for v in items:
        try:
            r = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v} is not a number (in {text})") from None
        if not 0.0 <= r < 1.0:
            raise argparse.ArgumentTypeError(f"{v} is outside [0, 1) (in {text})")
        out.append(r)
    return sorted(set(out))


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--dies", type=int_range(2), default=4, help="dies = DP groups, >= 2 (default 4)")
    add("--model", default="medium", choices=tuple(PRESETS), help="model preset (default medium)")
    add("--max-seq-len", type=positive_int, default=2048,
        help="the model's context, tokens (default 2048)")  # fmt: skip
    add("--prompt-len", type=positive_int, default=1024, help="L, tokens per prompt (default 1024)")
    add("--reuse", type=reuse_list, default=reuse_list(DEFAULT_REUSE),
        help=f"reuse rates r in [0, 1) (default {DEFAULT_REUSE})")  # fmt: skip
    add("--prompts", type=positive_int, default=5,
        help="idle repetitions per rate, fresh prompts each (default 5)")  # fmt: skip
    add("--concurrency", type=int_range(0), default=4,
        help="prompts sent at once for the throughput figure (default 4; 0: L / TTFT)")  # fmt: skip
    add("--block-size", type=positive_int, default=16, help="KV block tokens (default 16)")
    add("--max-num-batched-tokens", type=positive_int, default=None,
        help="a step's token budget (default: the prompt length, one prefill step)")  # fmt: skip
    add("--pool-dram-mib", type=positive_float, default=256.0,
        help="the pool's DRAM tier, MiB (default 256)")  # fmt: skip
    add("--timeout", type=positive_float, default=600.0,
        help="seconds one request (or batch) may take (default 600)")  # fmt: skip
    add("--overhead", type=int_range(0), default=4,
        help="ABBA quads of fresh prompts at r = 0 for the pool's cost when nothing is reused"
        " (bench.pool_overhead; default 4: 8 pairs; 0: none)")  # fmt: skip
    add("--seed", type=int, default=0, help="prompts (default 0)")
    add("--json", type=output_file, default=None, help="write the figures to FILE (one object)")
    add("--hosts", type=hosts_spec, default=None, metavar="SPEC",
        help="emulated hosts (e.g. 2,2): a hit on the die's host's pool server against one on"
        " another host's, fetched over TCP (bench.pool_hosts; --dies is the sum)")  # fmt: skip
    add("--fabric", choices=("mpi", "mpi-rma", "mirror"), default=None,
        help="with --hosts: how dies reach other hosts (default mpi)")  # fmt: skip
    add(
        "--pd",
        type=pd_pair,
        default=None,
        metavar="P,D",
        help="a PD pod of P prefill and D decode dies: the decode die loading the pooled prefix"
        " (the KV link carries the rest) against the link carrying it all (bench.pool_pd)",
    )


@dataclass(frozen=True)
class Options:
    dies: int
    model: str
    max_seq_len: int
    prompt_len: int
    reuse: tuple[float, ...]
    prompts: int
    concurrency: int
    block_size: int
    budget: int
    dram_mib: float
    timeout: float
    seed: int
    json: str | None
    overhead: int = 0
    fabric: str | None = None
    hosts: tuple | None = None  # (spec, host of each die): bench.pool_hosts
    pd: tuple[int, int] | None = None  # (prefill, decode dies): bench.pool_pd


def parse_options(args: argparse.Namespace) -> Options:
    if getattr(args, "hosts", None):
        from bench.pool_hosts import dies_of

        dies_of(args.hosts[1])  # refused before anything starts
        n = len(args.hosts[1])
        if args.dies not in (4, n):
            raise ConfigError(f"argument --dies: {args.dies}: --hosts {args.hosts[0]} makes {n}")
        args.dies = n
    elif getattr(args, "fabric", None):
        raise ConfigError("argument --fabric: only with --hosts")
    o = Options(args.dies, args.model, args.max_seq_len, args.prompt_len, tuple(args.reuse),
                args.prompts, args.concurrency, args.block_size,
                args.max_num_batched_tokens or args.prompt_len, args.pool_dram_mib,
                args.timeout, args.seed, args.json, args.overhead,
                getattr(args, "fabric", None), getattr(args, "hosts", None),
                getattr(args, "pd", None))  # fmt: skip
    if o.pd and o.hosts:
        raise ConfigError("argument --pd: not with --hosts (a PD pod runs on one host)")
    if o.prompt_len + WARM_TOKENS > o.max_seq_len:
        raise ConfigError(f"argument --prompt-len: {o.prompt_len} tokens + {WARM_TOKENS}"
                          f" generated exceed the model's context of {o.max_seq_len}"
                          " (--max-seq-len)")  # fmt: skip
    if o.prompt_len < 2 * o.block_size:
        raise ConfigError(f"argument --prompt-len: {o.prompt_len} tokens is less than two blocks"
                          f" of {o.block_size} (--block-size)")  # fmt: skip
    try:
        engine_config(o, True)
    except ConfigError as e:
        raise ConfigError(f"argument --dies/--model/--max-seq-len/--block-size: {e}") from None
    return o


def engine_config(o: Options, pool: bool) -> EngineConfig:
    """The pool engine's config, or the nocache control's (no prefix cache, no pool; the rest
    identical). A prefill of the medium model takes seconds on 2 cores: no stall detector, no
    rollback deadline, no restart (a fault ends the run rather than hiding in its figures); a
    pool load may take LOAD_TIMEOUT_S (default 2 s): a slow load shows in the TTFT instead of
    turning into a recompute."""
    return EngineConfig(
        dies=o.dies, model=o.model, model_overrides={"max_seq_len": o.max_seq_len},
        max_num_seqs=max(2, o.concurrency), max_num_batched_tokens=o.budget,
        block_size=o.block_size, prefix_cache=pool,
        kv_pool=PoolConfig(dram_mib=o.dram_mib, load_timeout_s=LOAD_TIMEOUT_S) if pool else None,
        timeout_s=120.0, recover=False, rollback=False,
    )  # fmt: skip


# -- prompts and requests -----------------------------------------------------------------------


def prompt_set(o: Options, point: int, rep: int, k: int) -> dict[str, list[int]]:
    """Seeded prompts of L tokens: W, M and M' share their first k blocks (P) and nothing
    after (each tail starts with a different token); nothing is shared across (point, rep)."""
    rng = random.Random(f"{o.seed}/{point}/{rep}")
    n, L = k * o.block_size, o.prompt_len
    shared = [rng.randrange(256) for _ in range(n)]
    tails = [[rng.randrange(256) for _ in range(L - n)] for _ in range(4)]
    first = rng.sample(range(256), 4)
    for t, f in zip(tails, first, strict=True):
        t[0] = f
    return {
        "warm": shared + tails[0],
        "pool": shared + tails[1],
        "local": shared + tails[2],
        "local_die_a": shared + tails[3],
    }


def wait_stored(eng: Engine, target: int) -> float:
    """Wait until the pool has stored `target` blocks in all (deadline STORE_WAIT_S); seconds
    waited. A miss is not an error: the measured hit is then shorter, and reported so."""
    t0 = time.monotonic()
    while eng.pool.stats()["pool_stored_blocks"] < target:
        if time.monotonic() - t0 > STORE_WAIT_S:
            progress(f"  warning: the pool stored {eng.pool.stats()['pool_stored_blocks']} of"
                     f" {target} blocks after {STORE_WAIT_S:g} s")  # fmt: skip
            break
        time.sleep(0.002)
    return time.monotonic() - t0


def master_counters(eng: Engine, groups: tuple[int, ...], after: float) -> dict[int, dict]:
    """Each group's latest master stats sent after `after` (time.time()); a master sends them
    as it goes idle and every wake-up (<= 1 s) while idle."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if all(eng.stats.get(g, {}).get("t", 0.0) >= after for g in groups):
            break
        time.sleep(0.01)
    return {g: dict(eng.stats.get(g, {})) for g in groups}


def landed(eng: Engine) -> tuple[int, float, int, int]:
    """The shell's pool counters: blocks landed, load ms, load bytes, loads failed."""
    s = eng.pool.stats()
    return (s["pool_landed_blocks"], s["pool_load_ms_sum"], s["pool_load_bytes"],
            s["pool_load_failed"])  # fmt: skip


# -- one reuse rate ---------------------------------------------------------------------------


def idle_rep(o: Options, pool: Engine, nocache: Engine, point: int, rep: int, k: int) -> dict:
    """Warm, then the measured requests one at a time (pool before local: die B's cache holds P
    once the pool hit landed; the nocache request's place rotates)."""
    ps = prompt_set(o, point, rep, k)
    before = pool.pool.stats()["pool_stored_blocks"]
    ask(pool, [ps["warm"]], DIE_A, WARM_TOKENS, o.timeout)
    waited = wait_stored(pool, before + o.prompt_len // o.block_size)
    ask(nocache, [ps["warm"]], DIE_A, WARM_TOKENS, o.timeout)  # the same recent work on both
    out = {"store_wait_ms": waited * 1e3}
    order = ["pool", "local", "local_die_a"]
    order.insert(rep % 4, "nocache")
    out["local_pool_blocks"] = 0  # blocks landed for a local request: must stay 0
    for i, which in enumerate(order):
        if which == "nocache":
            prime(o, nocache, DIE_B, point, rep, i)
            out["nocache"] = ttft(ask(nocache, [ps["pool"]], DIE_B, 1, o.timeout)[0])
            continue
        prime(o, pool, DIE_A if which == "local_die_a" else DIE_B, point, rep, i)
        c0 = landed(pool)
        t = ask(pool, [ps[which]], DIE_A if which == "local_die_a" else DIE_B, 1, o.timeout)[0]
        c1 = landed(pool)
        out[which] = ttft(t)
        out[f"{which}_cached"] = t.n_cached
        if which == "pool":
            out.update(hit_tokens=(c1[0] - c0[0]) * o.block_size, load_ms=c1[1] - c0[1],
                       load_bytes=c1[2] - c0[2], load_failed=c1[3] - c0[3])  # fmt: skip
        else:
            out["local_pool_blocks"] += c1[0] - c0[0]
    return out


def batch(o: Options, pool: Engine, nocache: Engine, point: int, k: int) -> dict:
    """N warm prompts on die A, then N measured ones at once on die B of each engine (the order
    of the two engines alternates by point): prompt tokens per second to the last first token."""
    sets = [prompt_set(o, point, 1000 + j, k) for j in range(o.concurrency)]
    out: dict = {}
    engines = [("pool", pool), ("nocache", nocache)][:: 1 if point % 2 == 0 else -1]
    for name, eng in engines:
        c0 = (0, 0.0, 0, 0)
        before = pool.pool.stats()["pool_stored_blocks"]
        ask(eng, [s["warm"] for s in sets], DIE_A, WARM_TOKENS, o.timeout)
        if name == "pool":
            wait_stored(pool, before + o.concurrency * (o.prompt_len // o.block_size))
            c0 = landed(pool)
        ts = ask(eng, [s["pool"] for s in sets], DIE_B, 1, o.timeout)
        span = max(t.t_first for t in ts) - min(t.t0 for t in ts)
        out[f"prefill_tok_s_{name}"] = o.concurrency * o.prompt_len / span
        if name == "pool":
            out["batch_hit_tokens"] = (landed(pool)[0] - c0[0]) * o.block_size // o.concurrency
    return out


def summarize(o: Options, r: float, k: int, reps: list[dict], thr: dict, ctr: dict) -> dict:
    ms = {w: [x[w] * 1e3 for x in reps] for w in ("nocache", "pool", "local", "local_die_a")}
    p50 = {w: pct(v, 50) for w, v in ms.items()}
    loads = [x["load_ms"] for x in reps if x["hit_tokens"]]
    nbytes = [x["load_bytes"] for x in reps if x["hit_tokens"]]
    load_ms = pct(loads, 50) if loads else 0.0
    load_bytes = int(np.median(nbytes)) if nbytes else 0
    tok_n = thr.get("prefill_tok_s_nocache") or o.prompt_len / (p50["nocache"] / 1e3)
    tok_p = thr.get("prefill_tok_s_pool") or o.prompt_len / (p50["pool"] / 1e3)
    b_hit, a_hit = ctr["after"][DIE_B], ctr["before"][DIE_B]
    row = {
        "reuse": r, "reuse_blocks": k, "hit_expected": k * o.block_size,
        "hit_tokens": int(np.median([x["hit_tokens"] for x in reps])),
        "pool_hit_tokens": (b_hit.get("pool_hit_tokens", 0) - a_hit.get("pool_hit_tokens", 0))
        / len(reps),
        "pool_load_fallbacks": b_hit.get("pool_load_fallbacks", 0)
        - a_hit.get("pool_load_fallbacks", 0),
        "local_cached_tokens": int(np.median([x["local_cached"] for x in reps])),
        "local_die_a_cached_tokens": int(np.median([x["local_die_a_cached"] for x in reps])),
        "local_pool_blocks": sum(x["local_pool_blocks"] for x in reps),
        "ttft_ms_nocache": p50["nocache"], "ttft_ms_nocache_p99": pct(ms["nocache"], 99),
        "ttft_ms_pool": p50["pool"], "ttft_ms_pool_p99": pct(ms["pool"], 99),
        "ttft_ms_local": p50["local"], "ttft_ms_local_p99": pct(ms["local"], 99),
        "ttft_ms_local_die_a": p50["local_die_a"],
        "ttft_ms_local_die_a_p99": pct(ms["local_die_a"], 99),
        "ttft_reduction": 1.0 - p50["pool"] / p50["nocache"],
        "ttft_reduction_paired": float(np.median([1 - x["pool"] / x["nocache"] for x in reps])),
        "load_ms": load_ms, "load_ms_p99": pct(loads, 99) if loads else 0.0,
        "load_bytes": load_bytes,
        "load_gbps": load_bytes / (load_ms * 1e6) if load_ms else None,
        "prefill_tok_s_nocache": tok_n, "prefill_tok_s_pool": tok_p,
        "throughput_gain": tok_p / tok_n,
        "throughput_mode": "concurrent" if thr else "ttft",
        "batch_hit_tokens": thr.get("batch_hit_tokens"),
        "pool_minus_local_ms": float(np.median([(x["pool"] - x["local"]) * 1e3 for x in reps])),
        "pool_minus_local_iqr_ms": float(np.subtract(*np.percentile(
            [(x["pool"] - x["local"]) * 1e3 for x in reps], [75, 25]))),
        "pool_minus_local_die_a_ms": float(np.median([(x["pool"] - x["local_die_a"]) * 1e3
                                                      for x in reps])),  # fmt: skip
        "store_wait_ms": pct([x["store_wait_ms"] for x in reps], 50),
        "p2p_gbps": None, "bar_ms": None, "ok": None, "load_within_bar": None,
        "samples_ms": ms, "load_samples_ms": [x["load_ms"] for x in reps],
    }  # fmt: skip
    return row


def apply_p2p(row: dict, p2p: dict[int, float]) -> None:
    """The bar of a hit: bytes loaded / (0.8 x p2p zero-copy GB/s at that size) + 1 ms."""
    gbps = p2p.get(row["load_bytes"])
    if not row["load_bytes"] or not gbps:
        return
    bar = row["load_bytes"] / (P2P_BAR * gbps * 1e9) * 1e3 + P2P_SLACK_MS
    row.update(p2p_gbps=gbps, bar_ms=bar, ok=row["load_ms"] <= bar,
               load_within_bar=row["load_ms"] <= bar,
               ttft_diff_within_bar=row["pool_minus_local_ms"] <= bar)  # fmt: skip


def p2p_zero_copy(sizes: list[int]) -> dict[int, float]:
    """`xpod bench p2p`'s zero-copy ping-pong (die 0 - die 1 of a 2-die pod, one lane: a load
    is one process's copy) at each size: GB/s = size / p50 one-way time."""
    if not sizes:
        return {}
    from bench.p2p import measure_xpod
    from runtime import Pod, PodConfig

    cfg = PodConfig(num_dies=2, lanes=4, app_bytes=2 * max(sizes) + (4 << 20))
    with Pod.launch(cfg) as pod:
        rows = measure_xpod(pod, sorted(sizes), ["zero-copy"], [1], 1.0)
    return {r["size_bytes"]: r["gbps"] for r in rows}


# -- the bars -----------------------------------------------------------------------------------


def bar(value, limit, ok) -> dict:
    return {"value": value, "bar": limit, "ok": None if value is None else bool(ok)}


def bars(rows: list[dict]) -> dict:
    by = {round(r["reuse"], 6): r for r in rows}
    red = [r["ttft_reduction"] for r in rows]  # rows are sorted by r
    drop = max([a - b for a, b in zip(red, red[1:], strict=False)] + [0.0])  # 0: never drops
    out = {"ttft_reduction_monotone_worst_drop": bar(drop, MONOTONE_SLACK, drop <= MONOTONE_SLACK)}
    for r, lim in REDUCTION_BARS.items():
        if r in by:
            v = by[r]["ttft_reduction"]
            out[f"ttft_reduction_r{r:g}"] = bar(v, lim, v >= lim)
    for r, lim in GAIN_BARS.items():
        if r in by:
            v = by[r]["throughput_gain"]
            out[f"throughput_gain_r{r:g}"] = bar(v, lim, v >= lim)
    if 0.0 in by:
        v = by[0.0]["ttft_ms_pool"] / by[0.0]["ttft_ms_nocache"] - 1.0
        out["pool_overhead_r0"] = bar(v, OVERHEAD_BAR, v <= OVERHEAD_BAR)
        sm = by[0.0]["samples_ms"]  # the same repetition's two requests, close in time
        v = float(np.median([p / n - 1.0 for p, n in zip(sm["pool"], sm["nocache"], strict=True)]))
        out["pool_overhead_r0_paired"] = bar(v, OVERHEAD_BAR, v <= OVERHEAD_BAR)
        if by[0.0]["throughput_mode"] == "concurrent":  # the same bar on the batch's tok/s
            v = 1.0 - by[0.0]["throughput_gain"]
            out["pool_overhead_r0_throughput"] = bar(v, OVERHEAD_BAR, v <= OVERHEAD_BAR)
    for r in rows:
        if r["bar_ms"] is not None:
            out[f"pool_hit_cost_ms_r{r['reuse']:g}"] = bar(r["load_ms"], r["bar_ms"], r["ok"])
            out[f"pool_minus_local_ttft_ms_r{r['reuse']:g}"] = bar(
                r["pool_minus_local_ms"], r["bar_ms"], r["ttft_diff_within_bar"]
            )
    return out


def load_fit(rows: list[dict]) -> dict:
    """load_ms = fixed_ms + bytes / marginal GB/s, fitted over the rates' load p50s: what a load
    costs whatever its size, and per byte."""
    pts = [(r["load_bytes"], r["load_ms"]) for r in rows if r["load_bytes"]]
    if len(pts) < 2:
        return {"fixed_ms": None, "marginal_gbps": None, "points": len(pts)}
    slope, fixed = np.polyfit([b for b, _ in pts], [m for _, m in pts], 1)
    return {"fixed_ms": float(fixed), "points": len(pts),
            "marginal_gbps": float(1.0 / (slope * 1e6)) if slope > 0 else None}  # fmt: skip


def noise(rows: list[dict], load0: tuple, load1: tuple) -> dict:
    """The nocache control does the same work at every r: its spread is the machine's."""
    xs = [x for r in rows for x in r["samples_ms"]["nocache"]]
    p50, p99 = pct(xs, 50), pct(xs, 99)
    return {"nocache_ttft_ms_p50": p50, "nocache_ttft_ms_p99": p99,
            "nocache_p99_over_p50": p99 / p50, "nocache_min_ms": min(xs), "nocache_max_ms": max(xs),
            "nocache_samples": len(xs), "loadavg_start": list(load0),
            "loadavg_end": list(load1), "host_cores": os.cpu_count()}  # fmt: skip


# -- the command --------------------------------------------------------------------------------


def run(opts: Options) -> int:
    o = opts
    if o.hosts:
        from bench.pool_hosts import run as run_hosts

        return run_hosts(o, o.hosts[1], o.hosts[0])
    if o.pd:
        from bench.pool_pd import run as run_pd

        return run_pd(o, o.pd)
    bs, L = o.block_size, o.prompt_len
    progress(f"xpod bench pool: {o.dies} dies, model {o.model} (context {o.max_seq_len}), prompt"
             f" {L} tokens, block {bs}, r = {', '.join(f'{r:g}' for r in o.reuse)}, {o.prompts}"
             f" idle prompts per r, concurrency {o.concurrency}; die A = {DIE_A}, die B ="
             f" {DIE_B}")  # fmt: skip
    load0 = os.getloadavg()
    t_start = time.monotonic()
    rows: list[dict] = []
    with contextlib.ExitStack() as stack:
        progress("  launching the pool engine and the nocache engine ...")
        pool = stack.enter_context(Engine.launch(engine_config(o, True)))
        nocache = stack.enter_context(Engine.launch(engine_config(o, False)))
        groups = (DIE_A, DIE_B)
        ctr_at = master_counters(pool, groups, 0.0)
        for i, r in enumerate(o.reuse):
            k = int(r * L // bs)
            reps = []
            for rep in range(o.prompts):
                x = idle_rep(o, pool, nocache, i, rep, k)
                reps.append(x)
                progress(f"  r={r:g} ({k} blocks) {rep + 1}/{o.prompts}: nocache"
                         f" {x['nocache'] * 1e3:.0f} ms, pool {x['pool'] * 1e3:.0f} ms (hit"
                         f" {x['hit_tokens']} tok, load {x['load_ms']:.2f} ms), local"
                         f" {x['local'] * 1e3:.0f} ms, local on die A"
                         f" {x['local_die_a'] * 1e3:.0f} ms")  # fmt: skip
            ctr = {"before": ctr_at, "after": master_counters(pool, groups, time.time())}
            ctr_at = ctr["after"]
            thr = batch(o, pool, nocache, i, k) if o.concurrency else {}
            if thr:
                progress(f"  r={r:g} throughput, {o.concurrency} at once: nocache"
                         f" {thr['prefill_tok_s_nocache']:.0f}, pool"
                         f" {thr['prefill_tok_s_pool']:.0f} prompt tok/s")  # fmt: skip
                ctr_at = master_counters(pool, groups, time.time())
            rows.append(summarize(o, r, k, reps, thr, ctr))
        over = overhead(o, pool, nocache, o.overhead, DIE_B) if o.overhead else None
        pool_stats = pool.pool.stats()
    progress("  p2p: xpod bench p2p zero-copy, 1 lane, a 2-die pod, at every load's size ...")
    p2p = p2p_zero_copy(sorted({r["load_bytes"] for r in rows if r["load_bytes"]}))
    for row in rows:
        apply_p2p(row, p2p)
    res = {
        "bench": "pool", "model": o.model, "dies": o.dies, "max_seq_len": o.max_seq_len,
        "block_size": bs, "prompt_len": L, "plane": "shm", "prompts": o.prompts,
        "concurrency": o.concurrency, "max_num_batched_tokens": o.budget, "seed": o.seed,
        "die_a": DIE_A, "die_b": DIE_B, "pool_dram_mib": o.dram_mib,
        "pool_load_timeout_s": LOAD_TIMEOUT_S,
        "nocache_control": "a second engine in the same run: prefix_cache=False, no pool, the"
                           " same settings otherwise; M on its die B",
        "local_control": "ttft_ms_local: M' = the same k-block prefix, another tail, on die B"
                         " after its pool hit landed P there (the same die as the pool hit);"
                         " ttft_ms_local_die_a: M'' on die A, which ran the warm request",
        "reuse_sweep": rows,
        "p2p_zero_copy_gbps": {str(s): g for s, g in p2p.items()},
        "noise": noise(rows, load0, os.getloadavg()),
        "load_fit": load_fit(rows),
        "pool_stats": {k: v for k, v in pool_stats.items() if isinstance(v, int | float)},
        "wall_s": time.monotonic() - t_start, **run_info(),
    }  # fmt: skip
    res["overhead_r0"] = over
    res["bars"] = bars(rows)
    if over is not None:
        res["bars"]["pool_overhead_r0_abba"] = bar(over["overhead_paired_median"],
                                                   over["bar"], over["ok"])  # fmt: skip
    print_report(res)
    if o.json:
        write_json(o.json, res)
    bad = [r["reuse"] for r in rows if (r["reuse_blocks"] == 0) != (r["pool_hit_tokens"] == 0)]
    if bad:
        progress(f"  pool hits where none were expected, or none where k > 0: r = {bad}")
    return 1 if bad else 0


COLUMNS = [
    ("reuse", "r", "g"), ("hit_tokens", "hit tok", "d"),
    ("ttft_ms_nocache", "nocache ms", ".0f"), ("ttft_ms_nocache_p99", "p99", ".0f"),
    ("ttft_ms_pool", "pool ms", ".0f"), ("ttft_ms_pool_p99", "p99", ".0f"),
    ("ttft_ms_local", "local ms", ".0f"), ("ttft_ms_local_p99", "p99", ".0f"),
    ("ttft_ms_local_die_a", "local A ms", ".0f"),
    ("ttft_reduction", "reduction", ".1%"), ("load_ms", "load ms", ".2f"),
    ("load_gbps", "load GB/s", ".2f"), ("p2p_gbps", "p2p GB/s", ".2f"),
    ("pool_minus_local_ms", "pool-local ms", ".1f"), ("bar_ms", "bar ms", ".2f"),
    ("ok", "ok", ""), ("prefill_tok_s_nocache", "tok/s nocache", ".0f"),
    ("prefill_tok_s_pool", "tok/s pool", ".0f"), ("throughput_gain", "gain", ".2f"),
]  # fmt: skip


def print_report(res: dict) -> None:
    n = res["noise"]
    print(f"\nKV pool against recompute and a die-local hit: model {res['model']}, {res['dies']}"
          f" dies, prompt {res['prompt_len']} tokens, block {res['block_size']}, TTFT p50 / p99"
          f" over {res['prompts']} idle prompts per r; throughput:"
          f" {res['concurrency'] or 'L / TTFT'} at once (one run; compare within it)")  # fmt: skip
    print_table(res["reuse_sweep"], COLUMNS)
    print(f"machine noise: nocache TTFT (the same work at every r) p50"
          f" {n['nocache_ttft_ms_p50']:.0f} ms, p99 {n['nocache_ttft_ms_p99']:.0f} ms"
          f" ({n['nocache_p99_over_p50']:.2f}x);"
          f" load average {n['loadavg_start'][0]:.2f} -> {n['loadavg_end'][0]:.2f} on"
          f" {n['host_cores']} cores")  # fmt: skip
    f = res["load_fit"]
    if f["fixed_ms"] is not None:
        gbps = f["marginal_gbps"]
        print(f"a load's cost, fitted over the rates: {f['fixed_ms']:.2f} ms + bytes /"
              f" {'-' if gbps is None else format(gbps, '.2f')} GB/s")  # fmt: skip
    ov = res.get("overhead_r0")
    if ov:
        lo, hi = ov["overhead_ci95"]
        print(f"the pool's cost at r = 0, {ov['pairs']} ABBA pairs: TTFT p50 pool"
              f" {ov['ttft_ms_pool_p50']:.0f} ms, nocache {ov['ttft_ms_nocache_p50']:.0f} ms;"
              f" paired median {ov['overhead_paired_median']:+.1%} (95 % CI {lo:+.1%} to"
              f" {hi:+.1%}); counted per pool request: servers' CPU"
              f" {ov['server_cpu_ms_per_request']:.2f} ms (store copies"
              f" {ov['server_store_copy_ms_per_request']:.2f} ms), shell"
              f" {ov['shell_pool_ms_per_request']:.3f} ms ="
              f" {ov['counted_share_of_ttft']:.2%} of its TTFT")  # fmt: skip
    print("bars:")
    for name, b in res["bars"].items():
        v, lim = b["value"], b["bar"]
        verdict = {True: "met", False: "NOT met", None: "-"}[b["ok"]]
        print(f"  {name:<40} {v:10.4g}  bar {lim:.4g}  {verdict}")


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
