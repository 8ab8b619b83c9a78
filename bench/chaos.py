"""`xpod bench chaos`: HTTP load while faults fire, against a fault-free baseline.

Same arrivals for both, alternated; the accounting of every client stream.

```
xpod bench chaos [--dies 4] [--model small] [--duration 60] [--fault-every 20] \\
    [--kinds kill-die,err-die,stop-die,drop-die,kill-master,kvfault-die,stop-master] \\
    [--request-rate 6] \\
    [--max-concurrency 8] [--max-tokens 64] [--seed 7] [--repeat 1] [--json F]
```

Each repeat launches two servers in turn (baseline first on even repeats, chaos first on odd
ones) and sends both the same seeded Poisson arrivals: each request streamed, seeded
(temperature 0.8, its own seed) or greedy, `ignore_eos`, `return_token_ids`. The chaos server
gets a fault plan (`--inject`): one fault every `--fault-every` seconds, kinds in turn, targets
drawn from `--seed`; its fault log (JSON lines of the supervisor) gives, per fault: verified,
how and how fast it was detected, the recovery parts (teardown, launch, recompute: launch to the
first resumed token) and the requests resumed.

Accounting, per request of the chaos run against the same request of the baseline:
- lost: an accepted request (HTTP 200) that did not end with its `max_tokens` tokens;
- duplicated / skipped: tokens beyond `max_tokens`, or missing from a stream that says
  "length"; a usage count different from the ids received;
- differing: a full stream whose ids differ from the baseline's (recomputation is bit-equal to
  its schedule replay, not necessarily to another batch order: see the note in the README).
Also the server's own ledger (`xpod_token_gaps_total` must be 0) and leaks (processes and
/dev/shm entries of the server left after it stopped).

Throughput: output tokens over the span from the first send to the last end; the ratio chaos
over baseline per pair, the median over pairs. Not built (reported as null): rollback stalls.

With `--kv-pool` both servers serve with the pod-wide KV pool and the plan may kill or stop its
server (`kill-pool`, `stop-pool`, or `--inject` with `pool=0` targets); `--dataset multi-turn`
sends conversations that share prefixes; the pool's fallbacks, restarts and hit rate around
each restart are reported (`bench.chaos_pool`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np
import psutil

from bench import chaos_pool
from bench.common import print_table, progress, run_info, write_jsonl
from bench.serve.scrape import parse_prometheus
from bench.serve.server import LaunchedServer
from runtime.cli.argtypes import choice_list, output_file, positive_float, positive_int
from runtime.cli.hosts import hosts_spec

KINDS = ("kill-die", "stop-die", "kill-master", "stop-master", "kvfault-die", "err-die",
         "drop-die", "delay-die", "kill-output", "kill-pool", "stop-pool")  # fmt: skip
POOL_STOP_S = 2.0  # a drawn stop-pool's length (KVPOOL.md §5.2 E5: longer than a load timeout)
DEFAULT_KINDS = "kill-die,err-die,stop-die,drop-die,kill-master,kvfault-die,stop-master"


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--dies", type=positive_int, default=4, help="dies = DP groups (default 4)")
    add("--model", default="small", help="model preset (default small)")
    add("--duration", type=positive_float, default=60.0,
        help="seconds of arrivals per run (default 60)")  # fmt: skip
    add("--fault-every", type=positive_float, default=20.0,
        help="a fault every S seconds of the chaos run (default 20)")  # fmt: skip
    add("--kinds", type=choice_list(KINDS), default=DEFAULT_KINDS,
        help=f"fault kinds, in turn (default {DEFAULT_KINDS}; kill-output adds"
        " --output-procs)")  # fmt: skip
    add("--request-rate", type=positive_float, default=6.0, help="arrivals per second (default 6)")
    add("--max-concurrency", type=positive_int, default=8, help="requests in flight (default 8)")
    add("--max-tokens", type=positive_int, default=64, help="tokens per request (default 64)")
    add("--input-len", type=positive_int, default=32, help="prompt bytes (default 32)")
    add("--seed", type=int, default=7, help="arrivals, prompts, fault targets (default 7)")
    add("--repeat", type=positive_int, default=1, help="baseline / chaos pairs (default 1)")
    add("--stall-timeout", type=positive_float, default=1.0,
        help="the servers' --stall-timeout (default 1)")  # fmt: skip
    add("--op-timeout", type=positive_float, default=0.5,
        help="the servers' --op-timeout (default 0.5)")  # fmt: skip
    add("--abort-fraction", type=float, default=0.0,
        help="share of requests whose client disconnects mid-stream (default 0)")  # fmt: skip
    add("--hog", type=int, default=0,
        help="CPU hog processes (busy loops) running through both runs: detectors must not"
        " fire on slowness (default 0)")  # fmt: skip
    add("--batch-invariant", action="store_true",
        help="both servers in batch-invariant mode: every complete stream must then equal the"
        " baseline's bit for bit (streams_differing 0)")  # fmt: skip
    add("--json", type=output_file, default=None, help="write the summary (and faults) as JSON")
    add("--hosts", type=hosts_spec, default=None, metavar="SPEC",
        help="serve over emulated hosts (e.g. 2,2; --dies is the sum): with --kv-pool one pool"
        " server per host, each a fault target pool=S")  # fmt: skip
    chaos_pool.add_args(p)


@dataclass(frozen=True)
class Options:
    dies: int
    model: str
    duration: float
    fault_every: float
    kinds: tuple[str, ...]
    rate: float
    concurrency: int
    max_tokens: int
    input_len: int
    seed: int
    repeat: int
    stall_timeout: float
    op_timeout: float
    abort_fraction: float
    hog: int
    batch_invariant: bool
    json: str | None
    pool: chaos_pool.PoolOptions = chaos_pool.OFF
    hosts: tuple | None = None  # (spec, host of each die)

    @property
    def pool_servers(self) -> int:
        """The servers' pool servers: one per host with --kv-pool (one host: one)."""
        if not self.pool.kv_pool:
            return 0
        return len(set(self.hosts[1])) if self.hosts else 1


def parse_options(args: argparse.Namespace) -> Options:
    from runtime.engine.faults import parse_faults
    from runtime.model import ModelConfig

    pool = chaos_pool.parse_options(args, args.max_concurrency, args.max_tokens,
                                    ModelConfig.preset(args.model).max_seq_len)  # fmt: skip
    hosts = getattr(args, "hosts", None)
    if hosts is not None:
        if args.dies not in (4, len(hosts[1])):
            raise ValueError(f"argument --dies: {args.dies}: --hosts {hosts[0]} makes"
                             f" {len(hosts[1])}")  # fmt: skip
        args.dies = len(hosts[1])
    o = Options(args.dies, args.model, args.duration, args.fault_every, tuple(args.kinds),
                args.request_rate, args.max_concurrency, args.max_tokens, args.input_len,
                args.seed, args.repeat, args.stall_timeout, args.op_timeout,
                args.abort_fraction, args.hog,
                args.batch_invariant, args.json, pool, hosts)  # fmt: skip
    for k in range(o.repeat):  # refused now, not by the server (FaultSpecError: a ValueError)
        plan = fault_plan(o, np.random.default_rng([o.seed, 2, k]))
        parse_faults(plan, o.dies, _output_procs(o), o.dies, o.pool_servers)
    return o


def _output_procs(o: Options) -> bool:
    return any(k.endswith("output") for k in o.kinds)


# -- the load ---------------------------------------------------------------------------------


@dataclass
class Req:
    i: int
    at: float
    prompt: str
    temperature: float
    seed: int
    abort_after: int = 0  # the client disconnects after this many tokens (0: never)


@dataclass
class Seen:
    """What the client saw of one request."""

    status: int = 0
    reason: str = ""
    ids: list[int] = field(default_factory=list)
    usage: int = -1
    ttft: float = 0.0
    start: float = 0.0
    end: float = 0.0
    error: str = ""


def arrivals(o: Options) -> list[Req]:
    rng = np.random.default_rng([o.seed, 1])
    t, out = 0.0, []
    words = "the pod serves a toy model across its dies while faults fire and streams go on"
    words = words.split()
    while True:
        t += float(rng.exponential(1.0 / o.rate))
        if t >= o.duration:
            return out
        text = " ".join(rng.choice(words, size=o.input_len // 4 + 1))[: o.input_len]
        i = len(out)
        cut = int(rng.integers(1, o.max_tokens)) if rng.random() < o.abort_fraction else 0
        out.append(Req(i, t, text, 0.8 if i % 2 else 0.0, 1000 + i, cut))


async def drive(url: str, model: str, reqs: list[Req], o: Options) -> tuple[list[Seen], float]:
    import aiohttp

    sem = asyncio.Semaphore(o.concurrency)
    seen = [Seen() for _ in reqs]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        t0 = time.monotonic()

        async def one(r: Req) -> None:
            await asyncio.sleep(max(0.0, t0 + r.at - time.monotonic()))
            async with sem:
                s = seen[r.i]
                body = {"model": model, "prompt": r.prompt, "max_tokens": o.max_tokens,
                        "temperature": r.temperature, "seed": r.seed, "ignore_eos": True,
                        "stream": True, "return_token_ids": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                await chaos_pool.stream_completion(http, url, body, s, _event, r.abort_after)

        await asyncio.gather(*[one(r) for r in reqs])
    return seen, t0


def _event(s: Seen, frame: bytes, start: float) -> None:
    if not frame.startswith(b"data: "):
        return
    payload = frame[6:]
    if payload == b"[DONE]":
        return
    ev = json.loads(payload)
    if "error" in ev:
        s.error = ev["error"].get("message", "error")
        return
    if ev.get("usage") and not ev.get("choices"):
        s.usage = ev["usage"]["completion_tokens"]
        return
    ch = ev["choices"][0]
    ids = ch.get("token_ids") or []
    if ids and not s.ids:
        s.ttft = time.monotonic() - start
    s.ids += ids
    if ch.get("finish_reason"):
        s.reason = ch["finish_reason"]


# -- one run ----------------------------------------------------------------------------------


def fault_plan(o: Options, rng: np.random.Generator) -> str:
    if o.pool.inject:
        from runtime.engine.faults import read_plan

        return read_plan(o.pool.inject).strip()
    out, k, t = [], 0, o.fault_every
    while t < o.duration:
        kind, target = o.kinds[k % len(o.kinds)].split("-")
        extra = ",for=0.2s" if kind == "delay" else ""  # below the op deadline: no recovery
        index = int(rng.integers(0, o.dies))
        if target == "pool":  # one of its servers; a stop longer than a load's timeout
            index = int(rng.integers(0, o.pool_servers)) if o.pool_servers > 1 else 0
            extra = f",for={POOL_STOP_S:g}s" if kind == "stop" else ""
        out.append(f"{kind}:{target}={index},at={t:g}s{extra}")
        k, t = k + 1, t + o.fault_every
    return "; ".join(out)


@dataclass
class Run:
    chaos: bool
    seen: list[Seen]
    t0: float
    metrics: dict
    events: list[dict]
    leaks: list[str]
    exit: int
    turns: dict | None = None  # multi-turn: {(conversation, turn): Seen}
    scrapes: list | None = None  # the chaos run with the pool: /metrics over time


def one_run(o: Options, reqs: list[Req], plan: str) -> Run:
    log = tempfile.NamedTemporaryFile(prefix="xpod-chaos-", suffix=".jsonl", delete=False)  # noqa: SIM115
    log.close()
    argv = ["--dies", str(o.dies), "--model", o.model, "--max-num-seqs", str(o.concurrency),
            "--stall-timeout", str(o.stall_timeout), "--op-timeout", str(o.op_timeout),
            "--fault-log", log.name]  # fmt: skip
    if _output_procs(o):
        argv.append("--output-procs")
    if o.batch_invariant:
        argv.append("--batch-invariant")
    argv += chaos_pool.server_argv(o.pool)
    if o.hosts:
        argv += ["--hosts", o.hosts[0]]
    if plan:  # the restart-storm guard must let the planned faults through
        path = log.name + ".plan"
        with open(path, "w") as fh:
            fh.write(plan)
        argv += ["--inject", "@" + path, "--max-restarts", str(plan.count(";") + 2)]
    srv = LaunchedServer(tuple(argv))
    pods: set[str] = set()
    procs: list[psutil.Process] = []
    try:
        url = srv.start()
        model = f"xpod-{o.model}"
        pods = pods_of(srv.proc.pid)
        seen, t0, turns, scrapes = asyncio.run(_load(url, model, reqs, o, bool(plan)))
        import urllib.error
        import urllib.request

        try:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
                metrics = parse_prometheus(r.read().decode())
            procs = psutil.Process(srv.proc.pid).children(recursive=True)
            code = srv.stop()
        except (urllib.error.URLError, OSError, psutil.Error):  # the server is gone
            metrics, code = {}, srv.proc.wait(30)
            progress(f"  the server exited ({code}):\n{srv.tail()}")
    finally:
        srv.kill()
        srv.close()
    time.sleep(0.2)
    leaks = [f"pid {p.pid}" for p in procs if p.is_running() and p.status() != "zombie"]
    leaks += [n for n in os.listdir("/dev/shm") if n.split(".")[1:2] and n.split(".")[1] in pods]
    with open(log.name) as fh:
        events = [json.loads(line) for line in fh if line.strip()]
    os.unlink(log.name)
    with contextlib.suppress(OSError):
        os.unlink(log.name + ".plan")
    return Run(bool(plan), seen, t0, metrics, events, leaks, code, turns, scrapes)


async def _load(url: str, model: str, reqs: list[Req], o: Options, chaos: bool):
    """(seen, t0, the multi-turn requests by key or None, /metrics scrapes or None): the
    arrivals of `reqs` or `--dataset multi-turn`'s conversations, with the chaos run of a pool
    scraped meanwhile."""
    po = o.pool
    scrapes: list | None = [] if chaos and po.kv_pool else None
    stop = asyncio.Event()
    task = None
    if scrapes is not None:
        task = asyncio.ensure_future(chaos_pool.scrape(url, stop, scrapes))
    try:
        if po.dataset == "multi-turn":
            turns, t0 = await chaos_pool.drive_conversations(url, model, o, po, _event, Seen)
            seen = [turns[k] for k in sorted(turns)]
        else:
            (seen, t0), turns = await drive(url, model, reqs, o), None
    finally:
        stop.set()
        if task is not None:
            await task
    return seen, t0, turns, scrapes


def pods_of(pid: int) -> set[str]:
    """Ids of the pods whose control segment names `pid` as their launcher."""
    out = set()
    for n in os.listdir("/dev/shm"):
        if n.startswith("xpod.") and n.endswith(".ctl"):
            try:
                with open(f"/dev/shm/{n}", "rb") as fh:
                    head = fh.read(24)
            except OSError:
                continue
            if len(head) == 24 and struct.unpack("<3q", head)[2] == pid:
                out.add(n.split(".")[1])
    return out


# -- the report -------------------------------------------------------------------------------


def throughput(r: Run) -> float:
    ends = [s.end for s in r.seen if s.end]
    toks = sum(len(s.ids) for s in r.seen)
    return toks / max(1e-9, max(ends) - r.t0) if ends else 0.0


def account(chaos: Run, base: Run, max_tokens: int) -> dict:
    acc = {"requests_accepted": 0, "requests_lost": 0, "tokens_duplicated": 0,
           "tokens_skipped": 0, "streams_differing": 0, "requests_refused": 0,
           "client_aborts": 0}  # fmt: skip
    for c, b in zip(chaos.seen, base.seen, strict=True):
        if c.status != 200:
            acc["requests_refused"] += 1
            continue
        acc["requests_accepted"] += 1
        if c.reason == "client_abort":  # the client left: what it had must still agree
            acc["client_aborts"] += 1
            acc["streams_differing"] += c.ids != b.ids[: len(c.ids)]
            continue
        if c.error or c.reason != "length":
            acc["requests_lost"] += 1
            continue
        n = len(c.ids)
        acc["tokens_duplicated"] += max(0, n - max_tokens) + max(0, n - c.usage)
        acc["tokens_skipped"] += max(0, max_tokens - n) + max(0, c.usage - n)
        if n == max_tokens and b.reason == "length" and c.ids != b.ids:
            acc["streams_differing"] += 1
    return acc


def faults_of(r: Run) -> list[dict]:
    """One row per injected fault, joined with its detection and recovery records."""
    rows = []
    inj = [e for e in r.events if e["event"] == "injected"]
    for e in inj:
        det = next((d for d in r.events if d["event"] == "detected" and d["fault"] == e["fault"]),
                   None)  # fmt: skip
        rec = next((d for d in r.events if d["event"] == "recovered"
                    and d.get("fault") == e["fault"]), None)  # fmt: skip
        res = next((d for d in r.events if d["event"] == "resumed"
                    and d.get("fault") == e["fault"]), None)  # fmt: skip
        parts = dict(rec["parts"]) if rec else {}
        if res:
            parts["recompute"] = res["recompute_s"]
        row = {"fault": e["fault"], "kind": f"{e['kind']}-{e['target']}",
               "verified": e["verified"], "detected": det["kind"] if det else "",
               "detect_s": det["detect_s"] if det else None,
               "tier": rec["tier"] if rec else "", "resumed": rec["requests_resumed"] if rec
               else 0, **{f"{k}_s": v for k, v in parts.items() if k != "detect"}}  # fmt: skip
        if det and rec and res and rec["tier"] == "restart":
            row["restart_s"] = (det["detect_s"] or 0) + sum(
                v for k, v in parts.items() if k != "detect" and v is not None
            )
        rows.append(row)
    return rows


def _pct(vals: list[float], q: float) -> float | None:
    vals = [v for v in vals if v is not None]
    return float(np.percentile(vals, q)) if vals else None


def false_recoveries(r: Run) -> int:
    """Detections with no injected fault behind them, or behind a delay (slowness only)."""
    return sum(1 for e in r.events if e["event"] == "detected"
               and (not e.get("fault") or e["fault"].startswith("delay")))  # fmt: skip


def run(o: Options) -> int:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             start_new_session=True) for _ in range(o.hog)]  # fmt: skip
    try:
        return _run(o)
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def _run(o: Options) -> int:
    reqs = arrivals(o) if o.pool.dataset == "random" else []
    po = o.pool
    load = f"{len(reqs)} requests"
    if po.dataset == "multi-turn":
        load = f"multi-turn conversations ({po.conversations} at a time, {po.turns} turns)"
    what = f"a fault every {o.fault_every:g} s ({', '.join(o.kinds)})"
    if po.inject:
        what = f"the plan {po.inject!r}"
    progress(f"chaos: {load} over {o.duration:g} s, {what}, {o.repeat} pair(s)"
             f"{', KV pool on' if po.kv_pool else ''}")  # fmt: skip
    if po.max_seq_len is not None:
        progress(f"  --max-seq-len {po.max_seq_len} given to the servers: a conversation needs"
                 f" {chaos_pool.needs_context(po, o.max_tokens)} tokens (1 + S + T x (U + O)),"
                 f" the {o.model} model's context is shorter")  # fmt: skip
    pairs = []
    for k in range(o.repeat):
        plan = fault_plan(o, np.random.default_rng([o.seed, 2, k]))
        order = [False, True] if k % 2 == 0 else [True, False]
        runs = {}
        for chaos in order:
            n = plan.count(";") + 1 if plan else 0
            head = "; ".join(plan.split("; ")[:3]) + ("; ..." if n > 3 else "")
            progress(f"  pair {k + 1}/{o.repeat}: "
                     f"{f'chaos ({n} faults): {head}' if chaos else 'baseline'}")  # fmt: skip
            runs[chaos] = one_run(o, reqs, plan if chaos else "")
        pairs.append((runs[True], runs[False]))
    faults, ratios, accs, leaks, gaps, ttft, base_ttft = [], [], [], [], 0.0, [], []
    base_tpot: list[float] = []
    for c, b in pairs:
        faults += faults_of(c)
        ratios.append(throughput(c) / max(1e-9, throughput(b)))
        if c.turns is not None:  # the same conversation turns, where both runs had them
            c.seen, b_seen = chaos_pool.align(c.turns, b.turns or {}, Seen)
            b = Run(b.chaos, b_seen, b.t0, b.metrics, b.events, b.leaks, b.exit)
        accs.append(account(c, b, o.max_tokens))
        leaks += c.leaks + b.leaks
        gaps += sum(v for _, v in c.metrics.get("xpod_token_gaps_total", []))
        ttft += [s.ttft for s in c.seen if s.ids]
        base_ttft += [s.ttft for s in b.seen if s.ids]
        base_tpot += [(s.end - s.start - s.ttft) / (len(s.ids) - 1) for s in b.seen
                      if len(s.ids) > 1 and s.start]  # fmt: skip
    print_table(faults, [("fault", "fault", ""), ("verified", "ok", ""),
                         ("detected", "by", ""), ("detect_s", "detect s", ".3f"),
                         ("teardown_s", "teardown s", ".3f"), ("launch_s", "launch s", ".3f"),
                         ("recompute_s", "recompute s", ".3f"), ("restart_s", "restart s", ".3f"),
                         ("stall_s", "stall s", ".3f"),
                         ("resumed", "resumed", "d")])  # fmt: skip
    acc = {k: sum(a[k] for a in accs) for k in accs[0]}
    # planned faults the engine reported as never fired (each with why: the fault log)
    not_fired = [{"fault": e["fault"], "reason": e.get("reason", "")}
                 for c, _ in pairs for e in c.events if e["event"] == "not_fired"]  # fmt: skip
    kills = [f["detect_s"] for f in faults if f["kind"].startswith("kill")]
    restarts = [f.get("restart_s") for f in faults]
    step_s = _pct(base_tpot, 50) or 0.0
    # a link error's rollback stall (the bar: 2 steps + 20 ms); a lost write's adds the op
    # deadline that detects it
    stalls = [f["stall_s"] for f in faults if f.get("tier") == "rollback" and f.get("stall_s")
              and f["detected"] == "link"]  # fmt: skip
    lost = [f["stall_s"] for f in faults if f.get("tier") == "rollback" and f.get("stall_s")
            and f["detected"] == "deadline"]  # fmt: skip
    by_kind: dict = {}
    for f in faults:
        k = by_kind.setdefault(f["kind"], {"n": 0, "verified": 0, "detect": [], "restart": [],
                                            "stall": []})  # fmt: skip
        k["n"] += 1
        k["verified"] += bool(f["verified"])
        k["detect"].append(f["detect_s"])
        k["restart"].append(f.get("restart_s"))
        k["stall"].append(f.get("stall_s"))
    kinds = {kind: {"n": k["n"], "verified": k["verified"],
                    **{f"{m}_{q}_s": _pct(k[m], 50 if q == "p50" else 100)
                       for m in ("detect", "restart", "stall") for q in ("p50", "max")}}
             for kind, k in by_kind.items()}  # fmt: skip
    summary = {
        "bench": "chaos", **run_info(), "dies": o.dies, "model": o.model,
        "hosts": o.hosts[0] if o.hosts else None,
        "duration_s": o.duration, "fault_every_s": o.fault_every, "kinds": list(o.kinds),
        "pairs": o.repeat, "requests": len(reqs) or sum(len(c.seen) for c, _ in pairs),
        "requests_sent": sum(len(c.seen) for c, _ in pairs),
        "requests_completed": sum(s.status == 200 and s.reason == "length" and not s.error
                                  for c, _ in pairs for s in c.seen),
        "faults_injected": len(faults),
        "faults_not_fired": len(not_fired), "not_fired": not_fired,
        "faults_verified": sum(f["verified"] for f in faults),
        "faults_detected": sum(bool(f["detected"]) for f in faults),
        "faults_recovered": sum(bool(f["tier"]) for f in faults),
        **acc,
        "token_gaps_server": gaps,
        "false_recoveries": sum(false_recoveries(c) + false_recoveries(b) for c, b in pairs),
        "batch_invariant": o.batch_invariant,
        "hogs": o.hog,
        "throughput_ratio": float(np.median(ratios)), "throughput_ratios": ratios,
        "detect_kill_p50_s": _pct(kills, 50), "detect_kill_max_s": _pct(kills, 100),
        "restart_p50_s": _pct(restarts, 50), "restart_max_s": _pct(restarts, 100),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "baseline_ttft_p50_s": _pct(base_ttft, 50), "baseline_ttft_p99_s": _pct(base_ttft, 99),
        "rollback_stall_max_s": max(stalls) if stalls else None,
        "lost_write_stall_max_s": max(lost) if lost else None,
        "by_kind": kinds,
        "rollback_stall_max_steps": max(stalls) / step_s if stalls and step_s else None,
        "baseline_tpot_p50_s": step_s,
        "leaks": leaks, "faults": faults,
        **chaos_pool.summary([c for c, _ in pairs], o.pool),
    }  # fmt: skip
    for nf in not_fired:
        progress(f"  planned fault {nf['fault']!r} did not fire: {nf['reason']}")
    for key in ("faults_injected", "faults_not_fired", "faults_verified", "faults_detected",
                "faults_recovered", "requests_sent", "requests_completed",
                "requests_accepted", "requests_lost", "client_aborts", "tokens_duplicated",
                "tokens_skipped", "false_recoveries",
                "streams_differing", "throughput_ratio", "detect_kill_p50_s", "restart_p50_s",
                "restart_max_s", "rollback_stall_max_s", "rollback_stall_max_steps",
                "lost_write_stall_max_s",
                "ttft_p50_s", "baseline_ttft_p50_s",
                *(chaos_pool.KEYS if o.pool.kv_pool else ())):  # fmt: skip
        v = summary[key]
        print(f"  {key:22s} {v:.3f}" if isinstance(v, float) else f"  {key:22s} {v}")
    print(f"  leaks                  {len(leaks)}{': ' + ', '.join(leaks) if leaks else ''}")
    print()
    print_table(
        [{"kind": k, **v} for k, v in kinds.items()],
        [
            ("kind", "kind", ""),
            ("n", "n", "d"),
            ("verified", "verified", "d"),
            ("detect_p50_s", "detect p50", ".3f"),
            ("detect_max_s", "max", ".3f"),
            ("restart_p50_s", "restart p50", ".3f"),
            ("restart_max_s", "max", ".3f"),
            ("stall_p50_s", "stall p50", ".3f"),
            ("stall_max_s", "max", ".3f"),
        ],
    )
    if o.json:
        write_jsonl(o.json, [summary])
    bad = (summary["faults_verified"] < len(faults) or acc["requests_lost"] or leaks
           or acc["tokens_duplicated"] or acc["tokens_skipped"] or gaps
           or summary["false_recoveries"]
           or (o.batch_invariant and acc["streams_differing"]))  # fmt: skip
    return 1 if bad else 0
