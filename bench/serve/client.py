"""The benchmark's HTTP client: one aiohttp session against the server, a streamed request
timed chunk by chunk (`Client.send` never raises: the error goes in its `RequestResult`),
`/metrics` scraped on a background task, and requests sent at their arrival times."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

from bench.common import Bar
from bench.serve.dataset import Request, arrival_times
from bench.serve.options import BenchError, Options
from bench.serve.scrape import parse_prometheus, total

SCRAPE_S = 0.2  # the KV gauges while a run goes (`/metrics?name[]=...`: ~0.3 ms of the shell)
KV_GAUGE = "xpod_kv_cache_usage_perc"


@dataclass
class RequestResult:
    """What the client saw of one request (times in seconds)."""

    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float:
        n = self.output_tokens
        return (self.latency - self.ttft) / (n - 1) if n > 1 else 0.0


class Client:
    """One aiohttp session against the server: requests, /metrics, the in-flight count."""

    def __init__(self, session, base: str, model_id: str, opts: Options):
        self.session, self.base, self.model_id, self.opts = session, base, model_id, opts
        self.path = "/v1/chat/completions" if opts.endpoint == "chat" else "/v1/completions"
        self.inflight = self.peak = 0
        self.sent = 0

    def body(self, req: Request, ignore_eos: bool) -> dict:
        b: dict = {
            "model": self.model_id,
            "temperature": self.opts.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
            "seed": self.opts.seed + self.sent,
        }
        if self.opts.endpoint == "chat":
            b["messages"] = [{"role": "user", "content": req.prompt}]
            b["max_completion_tokens"] = req.max_tokens
        else:
            b["prompt"] = list(req.token_ids) if req.token_ids else req.prompt
            b["max_tokens"] = req.max_tokens
        self.sent += 1
        return b

    async def send(
        self,
        req: Request,
        bar: Bar | None = None,
        ignore_eos: bool | None = None,
        first=None,
        stamps: list[float] | None = None,
        ids: list[int] | None = None,
    ) -> RequestResult:
        """One streamed request; never raises (but for cancellation): errors go in the result.
        `first`: an asyncio.Event set at the first token; `stamps`: a list that gets the
        perf_counter of every chunk with tokens as it comes (kept if the request is cancelled);
        `ids`: a list that gets the output token ids as they come."""
        import aiohttp

        body = self.body(req, self.opts.ignore_eos if ignore_eos is None else ignore_eos)
        res = RequestResult(prompt_len=req.prompt_len)
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        st = last = time.perf_counter()
        ttft = None
        usage = None
        done = False
        try:
            async with self.session.post(self.base + self.path, json=body) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    with contextlib.suppress(ValueError, AttributeError, TypeError):
                        text = json.loads(text)["error"]["message"]
                    res.error = f"HTTP {resp.status}: {' '.join(str(text).split())[:200]}"
                    return res
                async for raw in resp.content:
                    line = raw.strip()
                    if not line or line.startswith(b":"):
                        continue
                    if not line.startswith(b"data:"):
                        res.error = f"bad SSE line: {line[:80]!r}"
                        return res
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        res.error = f"bad SSE data: {data[:80]!r}"
                        return res
                    if not isinstance(obj, dict):
                        res.error = f"bad SSE data: {data[:80]!r}"
                        return res
                    if "error" in obj:
                        err = obj["error"]
                        msg = err.get("message") if isinstance(err, dict) else err
                        res.error = f"error event: {msg}"
                        return res
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for c in obj.get("choices") or ():
                        text = (
                            c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        )
                        got = c.get("token_ids") or ()
                        if not text and not got:
                            continue
                        if ids is not None:
                            ids.extend(got)
                        now = time.perf_counter()
                        if stamps is not None:
                            stamps.append(now)
                        if ttft is None:
                            ttft = now - st
                            if first is not None:
                                first.set()
                        else:
                            res.itl.append(now - last)
                        last = now
                        if bar is not None:
                            bar.add_tokens(len(got))
            res.latency = time.perf_counter() - st
            if not done:
                res.error = "the stream ended without [DONE]"
            elif not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
                res.error = "no usage in the stream"
            elif ttft is None:
                res.error = "no token in the stream"
            else:
                res.ok = True
                res.ttft = ttft
                res.output_tokens = usage["completion_tokens"]
                res.prompt_len = usage.get("prompt_tokens") or req.prompt_len
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as e:
            res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        finally:
            self.inflight -= 1
            if bar is not None:
                bar.finished()
        return res

    async def get_json(self, path: str) -> dict:
        async with self.session.get(self.base + path) as resp:
            if resp.status != 200:
                raise BenchError(f"GET {path}: HTTP {resp.status}")
            return await resp.json()

    async def scrape(self, names: tuple[str, ...] = ()) -> dict | None:
        """/metrics parsed (only the samples `names`, if given: a cheap scrape)."""
        import aiohttp

        query = "?" + "&".join(f"name[]={n}" for n in names) if names else ""
        try:
            async with self.session.get(self.base + "/metrics" + query) as resp:
                if resp.status != 200:
                    return None
                return parse_prometheus(await resp.text())
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None


class Scraper:
    """/metrics every SCRAPE_S on a background task while a run goes."""

    def __init__(self, client: Client, bar: Bar | None = None):
        self.client, self.bar = client, bar
        self.snaps: list[dict] = []
        self.times: list[float] = []  # perf_counter of each snap
        self.task: asyncio.Task | None = None

    async def _loop(self) -> None:
        while True:
            t0 = time.perf_counter()
            s = await self.client.scrape((KV_GAUGE,))
            if s:
                self.snaps.append(s)
                self.times.append(time.perf_counter())
            if self.bar is not None:
                self.bar.draw()
            await asyncio.sleep(max(0.0, SCRAPE_S - (time.perf_counter() - t0)))

    def __enter__(self) -> Scraper:
        self.task = asyncio.create_task(self._loop())
        return self

    def __exit__(self, *exc) -> None:
        if self.task is not None:
            self.task.cancel()


async def run_requests(
    client: Client,
    reqs: list[Request],
    rate: float,
    opts: Options,
    max_concurrency: int | None,
    bar: Bar,
    seed: int,
    ramp=None,
) -> tuple[list[RequestResult], float, float]:
    """Send `reqs` at their arrival times (through the semaphore); (results, duration, the
    perf_counter when the last request was sent)."""
    times = arrival_times(len(reqs), rate, opts.burstiness, seed, ramp)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    last_sent = 0.0

    async def one(req: Request) -> RequestResult:
        nonlocal last_sent
        if sem is None:
            last_sent = time.perf_counter()
            return await client.send(req, bar)
        async with sem:
            last_sent = time.perf_counter()  # the request goes out now (the cap let it)
            return await client.send(req, bar)

    tasks = []
    t0 = time.perf_counter()
    bar.t0 = t0
    for t, req in zip(times, reqs, strict=True):
        wait = t0 + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(req)))
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    duration = time.perf_counter() - t0
    bar.close()
    return list(results), duration, last_sent


async def wait_idle(client: Client, timeout_s: float = 30.0) -> None:
    """Until the server runs and holds no request (after cancelled load requests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = await client.scrape()
        if s is None:
            return
        busy = (
            total(s, "xpod_num_requests_running")
            + total(s, "xpod_num_requests_waiting")
            + total(s, "xpod_num_requests_pending")
            + total(s, "xpod_num_requests_inflight_http")
        )
        if busy == 0:
            return
        await asyncio.sleep(0.05)
    raise BenchError(f"the server still runs requests {timeout_s:g} s after the load stopped")
