"""The KV pool's cost when nothing is reused (`xpod bench pool --overhead N`; issue 33's "at
r = 0 the pool costs <= 3 % TTFT").

The sweep's r = 0 point orders its requests for the hit bars (the pool hit first, its die-local
control after it), so the pool engine's request always comes first of its engine's and the
nocache engine's place rotates: an order effect of several percent on this machine, as large as
the bar. Here the two engines alternate ABBA: per quad, two fresh prompts of L tokens (nothing
shared with anything), pool(P1), nocache(P1), nocache(P2), pool(P2), each after a one-token
request on its die (`bench.pool.prime`) and after the pool's stores of the previous request are
done (a store runs off a request's critical path, but here it must not fall on the next
request, which may be the other engine's). Every request on die B, `max_tokens` 1. The figure:
the median over the 2N pairs of TTFT(pool) / TTFT(nocache) - 1, with a bootstrap 95 % interval
of that median (seeded), beside the ratio of the p50s.

Two engines are two pods, whose dies differ in speed by several percent on this machine (the
sweep's die A against die B): the ratio can carry that, either sign. So the pool's own work at
r = 0 is also counted directly, per measured pool request: the pool servers' CPU time (the
stores of its blocks; psutil, in clock ticks, and the stores' copy time the servers report) and
the shell's time in the pool (lookups, events, replies:
timed here, the shell being this process), beside that request's TTFT. The masters' part (an
offer: a hold and an event per new block) is not counted.
"""

from __future__ import annotations

import random
import time

import numpy as np
import psutil

from bench.common import progress
from bench.pool_requests import ask, prime, ttft
from runtime.engine import Engine

OVERHEAD_BAR = 0.03
SETTLE_S = 30.0


def settle(eng: Engine) -> None:
    """Wait until no store of the pool is in flight (deadline SETTLE_S; a miss is reported)."""
    deadline = time.monotonic() + SETTLE_S
    while time.monotonic() < deadline:
        with eng.lock:
            if not eng.pool.stores:
                return
        time.sleep(0.002)
    progress(f"  warning: pool stores still in flight after {SETTLE_S:g} s")


def overhead(o, pool: Engine, nocache: Engine, quads: int, die: int) -> dict:
    """ABBA pairs at r = 0 on `die` of each engine (module docstring); `o`: bench.pool's
    Options."""
    pairs: list[tuple[float, float]] = []
    shell_ns = [0]
    ps = pool.pool
    for name in ("hint", "on_event", "on_server"):  # the shell's pool calls, timed
        setattr(ps, name, _timed(getattr(ps, name), shell_ns))
    cpu0, copy0 = _server_cpu(pool), ps.stats()["pool_store_copy_ns"]
    for q in range(quads):
        rng = random.Random(f"{o.seed}/overhead/{q}")
        prompts = [[rng.randrange(256) for _ in range(o.prompt_len)] for _ in range(2)]
        got: dict[tuple[str, int], float] = {}
        for i, (name, eng, p) in enumerate(
            [("pool", pool, 0), ("nocache", nocache, 0), ("nocache", nocache, 1), ("pool", pool, 1)]
        ):
            settle(pool)
            prime(o, eng, die, 10_000 + q, 0, i)
            got[name, p] = ttft(ask(eng, [prompts[p]], die, 1, o.timeout)[0])
        pairs += [(got["pool", p], got["nocache", p]) for p in (0, 1)]
        progress(f"  overhead {q + 1}/{quads}: pool {got['pool', 0] * 1e3:.0f} /"
                 f" {got['pool', 1] * 1e3:.0f} ms, nocache {got['nocache', 0] * 1e3:.0f} /"
                 f" {got['nocache', 1] * 1e3:.0f} ms")  # fmt: skip
    server_ms = (_server_cpu(pool) - cpu0) * 1e3  # in clock ticks (10 ms): summed, not per order
    copy_ms = (ps.stats()["pool_store_copy_ns"] - copy0) / 1e6
    for name in ("hint", "on_event", "on_server"):
        delattr(ps, name)  # the class's methods again
    ratios = np.array([p / n - 1.0 for p, n in pairs])
    boot = np.random.default_rng(o.seed).choice(ratios, (2000, len(ratios)))
    lo, hi = np.percentile(np.median(boot, axis=1), [2.5, 97.5])
    med = float(np.median(ratios))
    ms_p = [p * 1e3 for p, _ in pairs]
    ms_n = [n * 1e3 for _, n in pairs]
    return {"pairs": len(pairs), "order": "ABBA: pool, nocache, nocache, pool",
            "ttft_ms_pool_p50": float(np.median(ms_p)),
            "ttft_ms_pool_p99": float(np.percentile(ms_p, 99)),
            "ttft_ms_nocache_p50": float(np.median(ms_n)),
            "ttft_ms_nocache_p99": float(np.percentile(ms_n, 99)),
            "overhead_paired_median": med, "overhead_ci95": [float(lo), float(hi)],
            "overhead_p50_ratio": float(np.median(ms_p) / np.median(ms_n) - 1.0),
            "samples_ms": {"pool": ms_p, "nocache": ms_n},
            "server_cpu_ms_per_request": server_ms / len(pairs),
            "server_store_copy_ms_per_request": copy_ms / len(pairs),
            "shell_pool_ms_per_request": shell_ns[0] / 1e6 / len(pairs),
            "counted_share_of_ttft": (max(server_ms, copy_ms) + shell_ns[0] / 1e6) / sum(ms_p),
            "bar": OVERHEAD_BAR, "ok": med <= OVERHEAD_BAR}  # fmt: skip


def _timed(fn, acc: list[int]):
    def call(*args, **kwargs):
        t0 = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[0] += time.perf_counter_ns() - t0

    return call


def _server_cpu(eng: Engine) -> float:
    """CPU seconds (user + system) of the engine's live pool servers."""
    total = 0.0
    for pid in [h.pid for h in (eng.pool.handle_of(s) for s in eng.pool.servers) if h]:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total
