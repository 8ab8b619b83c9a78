"""Requests of `xpod bench pool` and its overhead pairs: pinned to a die, waited for, timed."""

from __future__ import annotations

import random
import time

from runtime.engine import Engine, EngineError, SamplingParams


def ask(eng: Engine, prompts: list[list[int]], group: int, max_tokens: int, timeout: float,
        ) -> list:  # fmt: skip
    """Send `prompts` at once pinned to `group`; wait for all; their TrackedRequests."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ts = [eng.tracker.track(p, params, group=group) for p in prompts]
    eng.tracker.enqueue(ts)
    deadline = time.monotonic() + timeout
    for t in ts:
        if not t.done.wait(max(0.0, deadline - time.monotonic())):
            raise EngineError(f"request {t.id} on die {group}: no answer within {timeout:g} s")
        if t.reason == "error" or not t.t_first:
            raise EngineError(f"request {t.id} on die {group} failed: {t.error or t.reason}")
    return ts


def ttft(t) -> float:
    return t.t_first - t.t0


def prime(o, eng: Engine, die: int, point: int, rep: int, i: int) -> None:
    """A one-token request of less than a block (nothing to cache, store or hit) on the die
    about to be measured: every measured request meets its die just woken, not the first after
    a quiet spell (an idle master and die wait longer to wake: that would fall on whichever
    request comes first, the pool hit's)."""
    rng = random.Random(f"{o.seed}/prime/{point}/{rep}/{i}")
    ask(eng, [[rng.randrange(256) for _ in range(o.block_size - 1)]], die, 1, o.timeout)
