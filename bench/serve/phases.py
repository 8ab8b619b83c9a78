"""The phases of a run against one server, in the order `bench_async` runs them: a test
request, the TTFT phase (idle, then under decode load), the interference phase (with
--prefill-dies: `bench.serve.interference`), the measured main run (requests, `/metrics`, CPU;
a PD server's figures: `bench.serve.pd`) and the rate sweep."""

from __future__ import annotations

import asyncio

import numpy as np
import psutil

from bench.common import Bar, progress
from bench.serve.client import Client, RequestResult, Scraper, run_requests, wait_idle
from bench.serve.dataset import (
    CHAT_OVERHEAD,
    Request,
    check_context,
    make_requests,
    probe_requests,
    random_text,
)
from bench.serve.interference import interference_phase
from bench.serve.multiturn import MultiTurnRun, load_figures
from bench.serve.options import PROG, BenchError, Options
from bench.serve.pd import idle_split, pd_figures
from bench.serve.scrape import by_label, kv_balance, server_figures, total
from bench.serve.stats import find_knee, summarize
from memory.errors import ConfigError

STATS_LAG_S = 0.3  # busy masters report every 0.1 s: wait this long before a phase's last scrape
# A run's first and last (full) scrapes: the masters' stats of the steps before are in (the
# dies' own counters are read fresh by the shell).
IDLE_LAG_S = 0.3


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
    out.update(idle_split(s0, s1, idle))  # a PD server: the idle probes' TTFT by part
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
    runner: MultiTurnRun | None = None,
) -> tuple[dict, list[RequestResult]]:
    """One run with /metrics scraped and CPU counted: (result dict, per-request results).
    `runner`: the multi-turn closed loop plays the run instead of `reqs` at their arrivals."""
    me = psutil.Process()
    await asyncio.sleep(IDLE_LAG_S)  # the steps before this run are all in
    s0 = await client.scrape()
    cpu0 = sum(me.cpu_times()[:2])
    client.peak = client.inflight
    bar = Bar(label, runner.num_requests if runner else len(reqs), opts.show_progress)
    with Scraper(client, bar) as sc:
        if runner is None:
            results, duration, last_sent = await run_requests(
                client, reqs, rate, opts, max_concurrency, bar, seed, ramp
            )
        else:
            results, duration, last_sent = await runner(client, bar, max_concurrency)
    cpu_client = sum(me.cpu_times()[:2]) - cpu0
    await asyncio.sleep(IDLE_LAG_S)
    s1 = await client.scrape()
    res = summarize(results, duration, opts.goodput, opts.metric_percentiles)
    res["max_concurrent_requests"] = client.peak
    n_out = res["total_output_tokens"]
    res["cpu_s_client"] = cpu_client
    res["cpu_ms_per_token_client"] = cpu_client * 1e3 / n_out if n_out else 0.0
    res.update(server_figures(s0, s1, sc.snaps, n_out))
    res.update(pd_figures(s0, s1, n_out))
    res.update(load_figures(s0, s1))  # prompt tokens per group: load imbalance
    if runner is not None:
        res.update(runner.figures(opts.block_size, results))
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
                "slo_attainment": (
                    res["request_goodput"] / res["request_throughput"]
                    if opts.goodput and res["request_throughput"]
                    else None
                ),
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
    opts: Options,
    base: str,
    res: dict,
    first: bool = True,
    last: bool = True,
    capacity: float | None = None,
) -> list[RequestResult]:
    """Everything against the server at `base`; fills `res`; returns the main run's results.
    The TTFT and interference phases run with the `first` main run, the rate sweep after the
    `last`, at fractions of `capacity` (req/s) if given, else of the main run's throughput."""
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
        runner = MultiTurnRun(opts.mt, opts.seed) if opts.mt else None
        reqs = make_requests(opts, 1 if runner else opts.num_prompts, 0)  # multi-turn: a test
        if max_len and runner is not None and opts.mt.max_context > max_len:
            raise BenchError(
                f"a conversation needs {opts.mt.max_context} tokens of context, the server's"
                f" model has {max_len} (fewer --mt-turns, shorter --mt-* lengths)"
            )
        if max_len and runner is None:
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
        if opts.interference and first:
            res.update(await interference_phase(client, opts, max_len or 256))
        conc = opts.max_concurrency or "no limit"
        if runner is not None:
            m = opts.mt
            progress(
                f"  main run: {m.conversations} conversations x {m.turns} turns (system"
                f" {m.system_len} x {m.families}{', skewed' if m.skew else ''}, user"
                f" {m.user_len}, output {m.output_len}), think {m.think_s:g} s, closed loop,"
                f" concurrency {conc} ..."
            )
        else:
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
            runner,
        )
        res.update(main)
        if opts.rate_sweep and last:
            if not main["completed"]:
                raise BenchError("the saturation run completed no request: no capacity to sweep")
            res["capacity_req_per_s"] = capacity or main["request_throughput"]
            if capacity:
                res["capacity_source"] = "given (the PD layout's saturation run)"
            res["rate_sweep"] = await rate_sweep(client, opts, res["capacity_req_per_s"])
            knee = [r for r in res["rate_sweep"] if r["knee"]]
            res["knee_request_rate"] = knee[0]["request_rate"] if knee else None
        return results
