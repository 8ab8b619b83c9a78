"""The interference phase of a PD run (`--prefill-dies`; run on the colocated layout of
`--compare-colocated` too, with the same requests): does a burst of long prompts stall the
running decodes?

(a) idle: K = 2 x decode dies streaming `ignore_eos` requests (prompts of DECODE_PROMPT_LEN
tokens, IDLE_TOKENS tokens each) run alone. A stream's gaps are the times between its chunks
with tokens; only the gaps that start once every stream has its first token count (the others
may hold the later streams' prefills). `idle_tpot_ms` = the median over streams of each
stream's median gap; `idle_gap_p99_ms` the p99 of every gap.

(b) burst: the same K prompts again, now with as many tokens as the context allows; once every
stream has WARM_TOKENS chunks, `--burst-prompts` prompts of `--burst-len` tokens (max_tokens
BURST_MAX_TOKENS) go at once. The burst window runs from the first burst request sent to the
last one's end; every decode gap that overlaps it counts (a gap that holds a stall starts
before the stall ends). TPOT is a request's, as vLLM counts it: per stream its mean gap in the
window; `burst_tpot_p50_ms` / `burst_tpot_p99_ms` over the streams and `burst_over_idle` =
burst TPOT p99 / idle TPOT (the PD bar: <= 1.2, `INTERFERENCE_BAR`). The single gaps (ITL) are
reported too: `burst_itl_p50_ms` / `burst_itl_p99_ms` and `burst_itl_over_idle`; a p99 of single
gaps against a median carries the noise of a shared machine (the idle gaps' own p99 / median is
next to it: `idle_gap_p99_ms`). Then the streams are cancelled.

In a colocated layout every die prefills and decodes in one lockstep step, so a long prompt's
prefill chunks run in the decodes' steps (the spike); in a PD layout they run on the prefill
dies (pinned to core 0, the decode dies to core 1).
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from bench.common import progress
from bench.serve.client import Client, wait_idle
from bench.serve.dataset import CHAT_OVERHEAD, Request, random_text
from bench.serve.options import BenchError, Options

DECODE_PROMPT_LEN = 32  # tokens of a decode stream's prompt (BOS included)
IDLE_TOKENS = 96  # tokens of an idle stream
WARM_TOKENS = 8  # chunks every stream has before the burst goes
BURST_MAX_TOKENS = 2  # max_tokens of a burst prompt
INTERFERENCE_BAR = 1.2  # PD: burst TPOT p99 <= 1.2 x idle TPOT
START_TIMEOUT_S = 120.0


def _ms(values: list[float], q: float) -> float:
    """The q-th percentile of `values` (seconds) in ms; 0 when there are none."""
    return float(np.percentile(values, q)) * 1e3 if values else 0.0


def steady_gaps(streams: list[list[float]]) -> list[list[float]]:
    """Per stream (its chunk times, seconds), its gaps that start once every stream has its
    first chunk."""
    firsts = [s[0] for s in streams if s]
    if not firsts:
        return [[] for _ in streams]
    t0 = max(firsts)
    return [[b - a for a, b in zip(s, s[1:], strict=False) if a >= t0] for s in streams]


def stream_window_gaps(streams: list[list[float]], w0: float, w1: float) -> list[list[float]]:
    """Per stream, its gaps (b - a between consecutive chunk times) that overlap [w0, w1]:
    b > w0 and a < w1."""
    return [[b - a for a, b in zip(s, s[1:], strict=False) if b > w0 and a < w1] for s in streams]


def window_gaps(streams: list[list[float]], w0: float, w1: float) -> list[float]:
    """Every stream's gaps that overlap [w0, w1], in one list."""
    return [g for gs in stream_window_gaps(streams, w0, w1) for g in gs]


def idle_figures(streams: list[list[float]]) -> dict:
    """idle_tpot_ms (median over streams of their median steady gap), the p50 / p99 of every
    steady gap and their count."""
    per = steady_gaps(streams)
    medians = [float(np.median(g)) for g in per if g]
    flat = [x for g in per for x in g]
    return {
        "idle_tpot_ms": float(np.median(medians)) * 1e3 if medians else 0.0,
        "idle_gap_p50_ms": _ms(flat, 50),
        "idle_gap_p99_ms": _ms(flat, 99),
        "idle_gaps": len(flat),
    }


def burst_figures(streams: list[list[float]], w0: float, w1: float, idle_tpot_ms: float) -> dict:
    """The decode streams in the burst window [w0, w1]. TPOT in vLLM's sense, a request's: per
    stream its mean gap in the window, `burst_tpot_p50_ms` / `burst_tpot_p99_ms` over streams
    and `burst_over_idle` = that p99 / the idle TPOT (the PD bar). The single gaps (ITL):
    `burst_itl_p50_ms` / `burst_itl_p99_ms`, their count, `burst_itl_over_idle`."""
    per = stream_window_gaps(streams, w0, w1)
    g = [x for gs in per for x in gs]
    itl99 = _ms(g, 99)
    means = [float(np.mean(gs)) for gs in per if gs]
    tpot99 = _ms(means, 99)
    return {
        "burst_tpot_p50_ms": _ms(means, 50),
        "burst_tpot_p99_ms": tpot99,
        "burst_over_idle": tpot99 / idle_tpot_ms if idle_tpot_ms > 0 else None,
        "burst_itl_p50_ms": _ms(g, 50),
        "burst_itl_p99_ms": itl99,
        "burst_itl_over_idle": itl99 / idle_tpot_ms if idle_tpot_ms > 0 else None,
        "burst_gaps": len(g),
        "burst_window_ms": (w1 - w0) * 1e3,
    }


def decode_requests(opts: Options, k: int, max_tokens: int) -> list[Request]:
    """The K decode streams' prompts (the same on every layout: seeded), max_tokens each."""
    rng = np.random.default_rng([opts.seed, 1 << 24])
    texts = [random_text(rng, DECODE_PROMPT_LEN - 1) for _ in range(k)]
    return [Request(t, DECODE_PROMPT_LEN, max_tokens) for t in texts]


def burst_requests(opts: Options) -> list[Request]:
    """`--burst-prompts` random prompts of `--burst-len` tokens, BURST_MAX_TOKENS each."""
    rng = np.random.default_rng([opts.seed, 1 << 25])
    texts = [random_text(rng, opts.burst_len - 1) for _ in range(opts.burst_prompts)]
    return [Request(t, opts.burst_len, BURST_MAX_TOKENS) for t in texts]


async def _warm(streams: list[list[float]], tasks: list[asyncio.Task]) -> None:
    """Until every stream has WARM_TOKENS chunks; BenchError if one ends first or it takes
    START_TIMEOUT_S."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while any(len(s) < WARM_TOKENS for s in streams):
        done = [t for t in tasks if t.done()]
        if done:
            r = done[0].result()
            raise BenchError(f"interference phase: a decode stream ended early: {r.error}")
        if time.monotonic() > deadline:
            raise BenchError(
                f"interference phase: the decode streams did not start in {START_TIMEOUT_S:g} s"
            )
        await asyncio.sleep(0.005)


async def interference_phase(client: Client, opts: Options, max_len: int) -> dict:
    """(a) idle decode TPOT, (b) decode TPOT during a burst of long prompts; see the module
    docstring."""
    k = opts.interference_streams
    over = CHAT_OVERHEAD if opts.endpoint == "chat" else 0
    idle_tokens = max(WARM_TOKENS + 2, min(IDLE_TOKENS, max_len - DECODE_PROMPT_LEN - over))
    progress(f"  interference (a): {k} decode streams of {idle_tokens} tokens, idle ...")
    streams: list[list[float]] = [[] for _ in range(k)]
    reqs = decode_requests(opts, k, idle_tokens)
    res = await asyncio.gather(
        *(client.send(r, ignore_eos=True, stamps=s) for r, s in zip(reqs, streams, strict=True))
    )
    bad = [r for r in res if not r.ok]
    if bad:
        raise BenchError(f"interference phase: an idle decode stream failed: {bad[0].error}")
    out = {"interference_streams": k, "burst_prompts": opts.burst_prompts,
           "burst_len": opts.burst_len, **idle_figures(streams)}  # fmt: skip
    await wait_idle(client)

    long_tokens = max(idle_tokens, max_len - DECODE_PROMPT_LEN - over)
    progress(
        f"  interference (b): {k} decode streams, then {opts.burst_prompts} prompts of"
        f" {opts.burst_len} tokens at once ..."
    )
    streams = [[] for _ in range(k)]
    reqs = decode_requests(opts, k, long_tokens)
    tasks = [
        asyncio.create_task(client.send(r, ignore_eos=True, stamps=s))
        for r, s in zip(reqs, streams, strict=True)
    ]
    try:
        await _warm(streams, tasks)
        w0 = time.perf_counter()
        bres = await asyncio.gather(
            *(client.send(b, ignore_eos=True) for b in burst_requests(opts))
        )
        w1 = time.perf_counter()
        bad = [r for r in bres if not r.ok]
        if bad:
            raise BenchError(f"interference phase: a burst prompt failed: {bad[0].error}")
        ended = [t.result() for t in tasks if t.done()]
        if any(not r.ok for r in ended):
            err = next(r.error for r in ended if not r.ok)
            raise BenchError(f"interference phase: a decode stream failed: {err}")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await wait_idle(client)
    out.update(burst_figures(streams, w0, w1, out["idle_tpot_ms"]))
    ttft = [r.ttft for r in bres]
    out["burst_ttft_p50_ms"] = _ms(ttft, 50)
    out["burst_ttft_p99_ms"] = _ms(ttft, 99)
    out["burst_streams_ended"] = len(ended)  # decode streams that ran out before the burst did
    return out
