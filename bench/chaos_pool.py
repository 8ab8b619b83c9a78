"""`xpod bench chaos --kv-pool`: the chaos run's KV pool half (KVPOOL.md §5.2 E5).

```
xpod bench chaos --dies 4 --kv-pool --pool-ssd-mib 256 --dataset multi-turn \\
    --inject 'kill:pool=0,at=10s; stop:pool=0,at=25s,for=2s' --duration 60
```

Both servers serve with the pod-wide KV pool (`--kv-pool` and its `--pool-*` flags, passed to
`xpod serve`); the chaos run's plan may hit the pool server (`kill-pool`, `stop-pool` kinds, or
an explicit `--inject` plan with `pool=S` targets: `runtime.engine.faults`; one server per host
with `--hosts`, S the host's index).

`--dataset multi-turn`: `xpod bench serve`'s conversations (`bench.serve.multiturn`: one system
prompt, each turn the previous turn's prompt and reply ids plus a new user message), so most of
a turn's prompt is in the pool (whichever die stored its previous turn). `--mt-conversations`
play at a time (a closed loop, a seeded think time of mean conversations / --request-rate
between turns); a conversation of `--mt-turns` turns is followed by the next one; no turn
starts after `--duration`. The same conversations in both runs, compared turn for turn where
both ran it.

While the chaos run serves, `/metrics` is scraped every `SCRAPE_S`: the prefix-cache hit rate
(`xpod_prefix_cache_hits` / `_queries`: a prompt's loaded blocks join the die-local cache
before its admission, so a pool hit counts there) before each pool kill (the `HIT_WINDOW_S`
before it) and after its restart (the `HIT_WINDOW_S` after it), and how long after the restart
the hit rate over the last `RECOVERY_WINDOW_S` is back to `RECOVERY_SHARE` of its value before
(`hit_rate_recovery_s`; the issue's bar: within 5 s with the SSD tier). Also the pool's
fallbacks (loads recomputed: timed out or lost their server), its server's deaths and restarts,
kills and stops fired, from `/metrics` and the fault log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import dataclass, replace

import numpy as np

from bench.serve.scrape import parse_prometheus, total
from runtime.cli.argtypes import nonneg_float, positive_float, positive_int

DATASETS = ("random", "multi-turn")
SCRAPE_S = 0.25
HIT_WINDOW_S = 5.0  # the hit rate before a kill and after its restart, over this long
RECOVERY_WINDOW_S = 1.0  # the hit rate at a moment after a restart: over the last second
RECOVERY_SHARE = 0.8  # back to this share of the hit rate before the kill
RECOVERY_BAR_S = 5.0  # ... within this long of the restart (with the SSD tier)
MIN_QUERY_TOKENS = 16  # a window with fewer looked-up prompt tokens has no hit rate
MAX_CONVERSATIONS = 20_000  # drawn for a run at most


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--kv-pool", action="store_true",
        help="both servers with the pod-wide KV pool (its --pool-* flags passed on); the"
        " kill-pool / stop-pool kinds and pool=0 targets need it")  # fmt: skip
    add("--pool-dram-mib", type=positive_float, default=None, metavar="N",
        help="xpod serve --pool-dram-mib (default: serve's)")  # fmt: skip
    add("--pool-ssd-mib", type=nonneg_float, default=None, metavar="N",
        help="xpod serve --pool-ssd-mib (default: serve's, no SSD tier)")  # fmt: skip
    add("--pool-load-timeout", type=positive_float, default=None, metavar="S",
        help="xpod serve --pool-load-timeout (default: serve's)")  # fmt: skip
    add("--inject", default="", metavar="PLAN",
        help="the chaos run's fault plan (or @FILE) instead of one drawn from --kinds every"
        " --fault-every s, e.g. 'kill:pool=0,at=10s; stop:pool=0,at=25s,for=2s'")  # fmt: skip
    add("--dataset", default="random", choices=DATASETS,
        help="random prompts (default) or multi-turn conversations sharing prefixes")  # fmt: skip
    add("--mt-conversations", type=positive_int, default=None, metavar="N",
        help="multi-turn: conversations at a time (default --max-concurrency)")  # fmt: skip
    add("--mt-turns", type=positive_int, default=4, help="multi-turn: turns of a conversation"
        " (default 4)")  # fmt: skip
    add("--mt-system-len", type=positive_int, default=64,
        help="multi-turn: tokens of the system prompt every conversation starts with"
        " (default 64)")  # fmt: skip
    add("--mt-user-len", type=positive_int, default=16,
        help="multi-turn: tokens of each user message (default 16)")  # fmt: skip


@dataclass(frozen=True)
class PoolOptions:
    """The pool half of `bench.chaos.Options` (None fields: serve's defaults)."""

    kv_pool: bool
    dram_mib: float | None
    ssd_mib: float | None
    load_timeout: float | None
    inject: str
    dataset: str
    conversations: int
    turns: int
    system_len: int
    user_len: int
    max_seq_len: int | None = None  # given to the servers: the conversations need more


OFF = PoolOptions(False, None, None, None, "", "random", 0, 0, 0, 0)  # no pool, random prompts


def needs_context(po: PoolOptions, max_tokens: int) -> int:
    """Tokens of a conversation's last turn with its reply: BOS + S + T x (U + O)."""
    return 1 + po.system_len + po.turns * (po.user_len + max_tokens)


def parse_options(args: argparse.Namespace, concurrency: int, max_tokens: int,
                  max_seq_len: int) -> PoolOptions:  # fmt: skip
    """The pool options, checked (ValueError naming the flag)."""
    given = [f for f in ("pool_dram_mib", "pool_ssd_mib", "pool_load_timeout")
             if getattr(args, f) is not None]  # fmt: skip
    if given and not args.kv_pool:
        raise ValueError(f"argument --{given[0].replace('_', '-')}: needs --kv-pool")
    po = PoolOptions(args.kv_pool, args.pool_dram_mib, args.pool_ssd_mib,
                     args.pool_load_timeout, args.inject, args.dataset,
                     args.mt_conversations or concurrency, args.mt_turns, args.mt_system_len,
                     args.mt_user_len)  # fmt: skip
    need = needs_context(po, max_tokens)
    if po.dataset == "multi-turn" and need > max_seq_len:  # as xpod bench serve does
        po = replace(po, max_seq_len=-(-need // 256) * 256)
    return po


def server_argv(po: PoolOptions) -> list[str]:
    """`xpod serve` flags of the pool."""
    out = [] if po.max_seq_len is None else ["--max-seq-len", str(po.max_seq_len)]
    if not po.kv_pool:
        return out
    out.append("--kv-pool")
    for flag, v in (("--pool-dram-mib", po.dram_mib), ("--pool-ssd-mib", po.ssd_mib),
                    ("--pool-load-timeout", po.load_timeout)):  # fmt: skip
        if v is not None:
            out += [flag, f"{v:g}"]
    return out


# -- multi-turn conversations ------------------------------------------------------------------


def conversations(o, po: PoolOptions) -> list:
    """The conversations of a run (`bench.serve.multiturn.make_conversations`: the same shape
    as `xpod bench serve --dataset multi-turn`'s, one system prompt for all), enough for every
    slot to play them back to back for --duration: slot i plays i, i + C, i + 2C, ..."""
    from bench.serve.multiturn import make_conversations
    from bench.serve.options import MTSpec

    think = po.conversations / o.rate  # arrivals at about --request-rate in all
    rounds = int(o.duration / (po.turns * think)) + 2
    rounds = min(rounds, max(2, MAX_CONVERSATIONS // po.conversations))
    spec = MTSpec(conversations=po.conversations * rounds, turns=po.turns,
                  system_len=po.system_len, user_len=po.user_len, output_len=o.max_tokens,
                  think_s=think, stagger_s=think / po.conversations)  # fmt: skip
    return make_conversations(spec, o.seed)


async def stream_completion(http, url: str, body: dict, s, event, abort_after: int = 0) -> None:
    """POST a streamed completion to `url` and give each SSE frame to `event(s, frame, start)`;
    the client disconnects once `s.ids` holds `abort_after` tokens (0: never). Sets `s.start`,
    `s.status`, `s.error` (a client-side failure) and `s.end`."""
    import aiohttp

    start = s.start = time.monotonic()
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            s.status = resp.status
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    frame, buf = buf.split(b"\n\n", 1)
                    event(s, frame, start)
                if abort_after and len(s.ids) >= abort_after:
                    s.reason = "client_abort"  # disconnect mid-stream
                    break
    except (TimeoutError, aiohttp.ClientError) as e:
        s.error = f"{type(e).__name__}: {e}"
    s.end = time.monotonic()


async def drive_conversations(url: str, model: str, o, po: PoolOptions, event, seen_cls,
                              ) -> tuple[dict, float]:  # fmt: skip
    """Play the conversations against `url` (the module docstring): ({(conversation, turn):
    Seen}, t0). bench.chaos's SSE frame parser `event(seen, frame, start)` and record class
    `seen_cls` (Seen). Half of the conversations greedy, half sampled (temperature 0.8) with
    a seed per turn."""
    import aiohttp

    convs = conversations(o, po)
    seen: dict[tuple[int, int], object] = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.monotonic()

        async def one(key: tuple[int, int], prompt: list[int]) -> list[int]:
            s = seen[key] = seen_cls()
            c, t = key
            body = {"model": model, "prompt": prompt, "max_tokens": o.max_tokens,
                    "temperature": 0.8 if c % 2 else 0.0, "seed": 1000 + 97 * c + t,
                    "ignore_eos": True, "stream": True, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            await stream_completion(http, url, body, s, event)
            ok = s.status == 200 and s.reason == "length" and not s.error
            return s.ids if ok and len(s.ids) == o.max_tokens else []

        def over() -> bool:
            return time.monotonic() - t0 >= o.duration

        async def slot(i: int) -> None:
            await asyncio.sleep(convs[i].start_s)
            for conv in convs[i :: po.conversations]:
                history = list(conv.system)
                for t in range(po.turns):
                    if t:
                        await asyncio.sleep(conv.thinks[t - 1])
                    if over():
                        return
                    prompt = history + list(conv.users[t])
                    ids = await one((conv.index, t), prompt)
                    if not ids:
                        break  # the conversation cannot go on without its reply
                    history = prompt + ids
                await asyncio.sleep(conv.thinks[-1] if conv.thinks else 0.0)  # the next one

        await asyncio.gather(*[slot(i) for i in range(po.conversations)])
    return seen, t0


def align(chaos_seen: dict, base_seen: dict, seen_cls) -> tuple[list, list]:
    """The chaos run's requests in order, and the baseline's same turns (an empty `seen_cls`
    record for a turn the baseline did not run: not compared)."""
    keys = sorted(chaos_seen)
    return [chaos_seen[k] for k in keys], [base_seen.get(k) or seen_cls() for k in keys]


# -- /metrics while the chaos run serves --------------------------------------------------------


async def scrape(url: str, stop: asyncio.Event, out: list) -> None:
    """(time.monotonic(), prefix-cache hit tokens, query tokens) every SCRAPE_S until
    `stop`."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while not stop.is_set():
            try:
                async with http.get(url + "/metrics") as r:
                    snap = parse_prometheus(await r.text())
                out.append((time.monotonic(), total(snap, "xpod_prefix_cache_hits_total"),
                            total(snap, "xpod_prefix_cache_queries_total")))  # fmt: skip
            except (TimeoutError, aiohttp.ClientError, ValueError):
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SCRAPE_S)


def hit_rate(scrapes: list, lo: float, hi: float) -> float | None:
    """Hit tokens / query tokens admitted between the scrapes nearest `lo` and `hi` (None with
    fewer than MIN_QUERY_TOKENS looked up)."""
    if not scrapes:
        return None
    a = max((s for s in scrapes if s[0] <= lo), default=scrapes[0], key=lambda s: s[0])
    b = max((s for s in scrapes if s[0] <= hi), default=scrapes[0], key=lambda s: s[0])
    q = b[2] - a[2]
    return (b[1] - a[1]) / q if q >= MIN_QUERY_TOKENS else None


def recovery(scrapes: list, kill: float, restart: float, end: float) -> dict:
    """The hit rate before the kill and after the restart, and when it was back (module doc)."""
    before = hit_rate(scrapes, kill - HIT_WINDOW_S, kill)
    after = hit_rate(scrapes, restart, restart + HIT_WINDOW_S)
    back = None
    if before:
        for t, *_ in scrapes:
            if t < restart + RECOVERY_WINDOW_S or t > end:
                continue
            r = hit_rate(scrapes, t - RECOVERY_WINDOW_S, t)
            if r is not None and r >= RECOVERY_SHARE * before:
                back = t - restart
                break
    return {"hit_rate_before": before, "hit_rate_after": after, "hit_rate_recovery_s": back,
            "recovered_in_bar": back is not None and back <= RECOVERY_BAR_S}  # fmt: skip


def summary(runs: list, po: PoolOptions) -> dict:
    """The pool's figures over the chaos runs (`bench.chaos.Run`s with `scrapes`)."""
    out = {"kv_pool": po.kv_pool, "dataset": po.dataset, "pool_kills": 0, "pool_stops": 0,
           "pool_restarts": 0, "pool_deaths_logged": 0, "fallbacks": None,
           "pool_restarts_server": None, "hit_rate_before": None, "hit_rate_after": None,
           "hit_rate_recovery_s": None, "pool_recoveries": []}  # fmt: skip
    if not po.kv_pool:
        return out
    fallbacks, restarts = 0.0, 0.0
    for r in runs:
        ev = r.events
        inj = [e for e in ev if e["event"] == "injected" and e.get("target") == "pool"]
        out["pool_kills"] += sum(e["kind"] == "kill" for e in inj)
        out["pool_stops"] += sum(e["kind"] == "stop" for e in inj)
        out["pool_deaths_logged"] += sum(e["event"] == "detected" and e["kind"] == "pool_exit"
                                         for e in ev)  # fmt: skip
        recs = [e for e in ev if e["event"] == "recovered" and e.get("tier") == "pool_restart"]
        out["pool_restarts"] += len(recs)
        fallbacks += total(r.metrics, "xpod_pool_load_fallbacks_total")  # at the run's end
        restarts += total(r.metrics, "xpod_pool_server_restarts_total")
        end = r.scrapes[-1][0] if r.scrapes else 0.0
        for e in inj:
            if e["kind"] != "kill":
                continue
            rec = next((x for x in recs if x.get("fault") == e["fault"]), None)
            row = {"fault": e["fault"], "restart_s": None}
            if rec is not None:
                row["restart_s"] = rec["mono"] - e["mono"]
                row.update(recovery(r.scrapes, e["mono"], rec["mono"], end))
            out["pool_recoveries"].append(row)
    out["fallbacks"], out["pool_restarts_server"] = int(fallbacks), int(restarts)
    rows = [x for x in out["pool_recoveries"] if "hit_rate_before" in x]
    for k in ("hit_rate_before", "hit_rate_after"):
        vals = [x[k] for x in rows if x[k] is not None]
        out[k] = float(np.mean(vals)) if vals else None
    backs = [x["hit_rate_recovery_s"] for x in rows]
    out["hit_rate_recovery_s"] = max(backs) if backs and None not in backs else None
    return out


KEYS = ("pool_kills", "pool_stops", "pool_restarts", "pool_deaths_logged", "fallbacks",
        "hit_rate_before", "hit_rate_after", "hit_rate_recovery_s")  # fmt: skip
