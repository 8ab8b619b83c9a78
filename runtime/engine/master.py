"""A DP-group master: the scheduler of one group (here one die) in a single-threaded loop.

```
 engine --(zmq PUSH: add, abort, shutdown, ping)--> master g --(step ring)--> die g
 engine <--(zmq PUSH: out, stats, pong, log)------ master g <--(result ring)-- die g
```
The loop sleeps in one `zmq.Poller` over its request socket and its result doorbell (no
spinning), and on every wake-up: takes requests (`sched.Scheduler.add` / `abort`), takes every
result (`on_result`: tokens, finishes), then plans as far as it may (`schedule`, up to
`async_depth` plans in flight: with 2, plan n+1 is written while the die runs plan n), and
sends what changed to the engine in one `out` message. When it has work but may not plan yet
it *promises* the die a command (`cmd_promised`), so the die waits for it instead of running a
dummy step; a promise is always kept (an empty plan if nothing is left).

Requests arrive as typed msgpack frames (`runtime.engine.wire`); a bad one is answered with an
`error` finish for its id and the loop goes on. What goes back to the engine (`out`, `stats`,
`pong`) is `runtime.engine.master_out`'s (a base class).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections import deque
from dataclasses import dataclass

import zmq

from memory import layout as L
from memory.region import Region, RegionHandle, region_name
from runtime.engine import wire
from runtime.engine.master_out import STATS_EVERY_S, MasterOut
from runtime.engine.pd_master import TICK_S, DecodeSide, PrefillSide
from runtime.engine.pool_master import PoolSide
from runtime.engine.spec_stats import add_spec_counts
from runtime.engine.step_ring import Bell, Ring, bell_path
from runtime.engine.wire import engine_socket, master_socket, output_socket
from runtime.pod.config import PodConfig
from runtime.pod.proc import batch_scheduling, default_sigterm, follow_parent
from sched import KVManager, Request, SamplingParams, Scheduler, SchedulerConfig

log = logging.getLogger(__name__)
MAX_SAMPLES = 200_000  # per-step samples kept for the final stats


@dataclass(frozen=True)
class MasterSpec:
    """Everything a master needs (picklable; given at start-up).

    Attributes:
        group: the DP group (= die id) it schedules.
        pod_id, run_dir, config: the pod (its config as a dict) and its run directory.
        vocab_size, eos_token_id: of the model (request checks, stop on EOS).
        num_blocks, block_size: the group's KV pool (the die has the same).
        max_num_seqs, max_num_batched_tokens, max_seq_len, long_prefill_threshold, async_depth:
            the scheduler's limits (`sched.SchedulerConfig`).
        prefix_cache: match prompts against cached blocks.
        log_steps: record every step (rows, tables, tokens, logits) for the schedule replay.
        gc_every: 0 = automatic GC; N = freeze after warm-up, collect every N results.
        pin_cpu: -1 = no pinning, else the CPU this master runs on.
        trace: record planning / result spans and per-step counters for the engine's trace.
        output_proc: tokens go to the group's output process (output shortcutting).
        stream_interval: send a streamed request's tokens every N (its first at once).
    """

    group: int
    pod_id: str
    run_dir: str
    config: dict
    vocab_size: int
    eos_token_id: int | None
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_seq_len: int
    long_prefill_threshold: int = 0
    async_depth: int = 2
    prefix_cache: bool = True
    log_steps: bool = False
    gc_every: int = 0
    pin_cpu: int = -1
    trace: bool = False
    output_proc: bool = False
    stream_interval: int = 1
    gen: int = 0  # the engine's incarnation (restarts): on every message, stale ones dropped
    pd: dict | None = None  # a PD pod's group: role, prefill / decode dies, KV row, lease, timeout
    spec_tokens: int = 0  # MTP drafts per decode row (sched.SchedulerConfig.spec_tokens)
    pool: dict | None = None  # the KV pool: servers' order sockets, KV row, load timeout


class Master(MasterOut):
    """One master's state; `run()` is its loop (see the module docstring)."""

    def __init__(self, spec: MasterSpec):
        self.spec = spec
        cfg = PodConfig.from_dict(spec.config)
        g = spec.group
        self.region = Region.attach(RegionHandle(region_name(spec.pod_id, g), g), cfg.layout())
        lo = self.region.layout
        self.words = self.region.words
        self.promised = lo.serve_word(L.SV_CMD_PROMISED)
        self.dummy_word = lo.serve_word(L.SV_DUMMY_STEPS)
        self.ping_word, self.pong_word = lo.serve_word(L.SV_PING), lo.serve_word(L.SV_PONG)
        self.phase_words = [lo.serve_word(i) for i in (L.SV_ATTN_NS, L.SV_MOE_NS, L.SV_STEP_NS)]
        self.vote_word = lo.serve_word(L.SV_VOTE_STEP)
        self.cmds = Ring(self.region, "cmd", writer=True)
        self.results = Ring(self.region, "res", writer=False)
        self.die_bell = Bell(bell_path(spec.run_dir, f"d{g}"))
        self.bell = Bell(bell_path(spec.run_dir, f"m{g}"))
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(master_socket(spec.run_dir, g))
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 1000)
        self.outbox.connect(engine_socket(spec.run_dir))
        # Output shortcutting (001 4.1): tokens go to this group's output process, which
        # detokenizes, renders and sends them on to the shell; stats and pongs go straight.
        self.tokens_out = self.outbox
        if spec.output_proc:
            self.tokens_out = self.ctx.socket(zmq.PUSH)
            self.tokens_out.setsockopt(zmq.LINGER, 1000)
            self.tokens_out.connect(output_socket(spec.run_dir, g))
        self.kv = KVManager(spec.num_blocks, spec.block_size, spec.prefix_cache)
        self.sched = Scheduler(
            SchedulerConfig(
                max_num_seqs=spec.max_num_seqs,
                max_num_batched_tokens=spec.max_num_batched_tokens,
                max_seq_len=spec.max_seq_len,
                long_prefill_threshold=spec.long_prefill_threshold,
                async_depth=spec.async_depth,
                spec_tokens=spec.spec_tokens,
            ),
            self.kv,
        )
        # (plan id or -1 for an empty promise-keeper, rows, the command's ring index)
        self.in_flight: deque = deque()
        self.deltas: dict[int, list[int]] = {}  # tokens to send now (streamed requests)
        self.held: dict[int, list[int]] = {}  # tokens sent with the finish (the others)
        self.streamed: set[int] = set()
        self.started: set[int] = set()  # streamed requests whose first tokens went out
        self.first: dict[int, float] = {}  # request -> time of its first token
        self.sched_at: dict[int, float] = {}  # request -> time it was first planned
        self.peer_outputs: dict[int, zmq.Socket] = {}  # a PD prefill's: decode output procs
        self.cached: list[list[int]] = []  # [id, prompt tokens not computed] of the admitted
        self.pings: list[int] = []  # heartbeats asked of the die, not echoed yet
        self.step_new: list[float] = []  # step times (ms) since the last stats message
        self.attn_new: list[list[int]] = []  # [step, attention ns] since the last stats
        self.done: list[list] = []
        self.sent_n: dict[int, int] = {}  # request -> output index of its next delta's token
        self.steps: list[dict] = []  # the replay log
        self.transcripts: dict[int, list[int]] = {}  # MTP oracle / synthetic drafts' source
        self.counters = {"results": 0, "busy_steps": 0, "empty_plans": 0, "bubble_ns": 0,
                         "dummy_steps": 0, "spec_drafts": 0, "spec_draft_tokens": 0,
                         "spec_accepted_tokens": 0, "spec_model_agree": 0, "spec_verify_rows": 0,
                         "spec_accepted_per_pos": [0] * max(spec.spec_tokens, 1),
                         "mtp_ns": 0,
                         "tokens": 0, "rows": 0, "bad_requests": 0, "kv_masked": 0,
                         "kv_recomputed": 0, "replayed_results": 0}  # fmt: skip
        self.masked: list[int] = []  # KV blocks masked (memory faults)
        self.spans: list[list] = []  # [t_ns, dur_ns, name, rows, tokens] (trace)
        self.counter_samples: list[list] = []  # [t_ns, running, waiting, kv used, ...] (trace)
        self.step_ms: list[float] = []  # forward time of every step with rows (die clock)
        self.bubble_ms: list[float] = []  # the die's wait for each command (async: ~0)
        self.stopping = self.stopped = False
        self.stats_at = 0.0
        self.results_n = 0
        self.die_step = 0
        self.stats_dirty = False
        self.pd = None  # a PD pod: runtime.engine.pd_master's side of this group's role
        if spec.pd is not None:
            side = PrefillSide if spec.pd["role"] == "prefill" else DecodeSide
            self.pd = side(self, spec.pd)
        self.pool = PoolSide(self, spec.pool) if spec.pool is not None else None

    # -- requests ------------------------------------------------------------------------------

    def on_message(self, frame: bytes) -> None:
        try:
            kind, body = wire.unpack(frame, {"add", "abort", "shutdown", "ping", "kv_dst",
                                             "kv_done", "kv_cancel", "loaded", "pool_release",
                                             "pool_dead", "pool_up"})  # fmt: skip
        except wire.WireError as e:
            log.warning("master %d: dropped a bad frame: %s", self.spec.group, e)
            return
        if kind == "add":
            self.add(body)
        elif kind == "abort":
            req = self.sched.abort(body.get("id"))
            if req is not None:
                self.finish(req)
            elif self.pool is not None and self.pool.abort(body.get("id")):
                pass
            elif isinstance(self.pd, DecodeSide):
                self.pd.abort(body.get("id"))
        elif kind in ("loaded", "pool_release", "pool_dead", "pool_up"):
            if self.pool is not None:
                self.pool.on_message(kind, body)
        elif kind in ("kv_dst", "kv_done", "kv_cancel"):
            if isinstance(self.pd, PrefillSide):
                {"kv_dst": self.pd.on_dst, "kv_done": self.pd.on_done,
                 "kv_cancel": self.pd.on_cancel}[kind](body)  # fmt: skip
        elif kind == "ping":
            # Through the die's loop: the die echoes the word (and rings back), `heartbeat`
            # answers once it has. A die that hangs never echoes, so the shell sees no pong.
            seq = body.get("seq", 0)
            if isinstance(seq, int) and seq > self.words[self.ping_word]:
                self.words[self.ping_word] = seq
                self.pings.append(seq)
                self.die_bell.ring()
        else:
            self.stopping = True
            for req in list(self.sched.waiting) + list(self.sched.running):
                if self.sched.abort(req.request_id) is not None:
                    self.finish(req)
            if isinstance(self.pd, DecodeSide):
                self.pd.abort_all()
            if self.pool is not None:
                self.pool.abort_all()

    def add(self, body: dict) -> None:
        rid = body.get("id")
        try:
            if self.stopping:
                raise ValueError("the engine is shutting down")
            if not isinstance(rid, int) or isinstance(rid, bool):
                raise ValueError(f"id {rid!r} must be an int")
            params = SamplingParams(**body.get("params", {}))
            params.validate(self.spec.vocab_size)
            prompt = body.get("prompt")
            if not isinstance(prompt, list) or not prompt:
                raise ValueError("prompt must be a non-empty list of token ids")
            if any(not isinstance(t, int) or not 0 <= t < self.spec.vocab_size for t in prompt):
                raise ValueError(f"prompt: token ids must be ints in [0, {self.spec.vocab_size})")
            base = body.get("base", 0)  # a resumed request: tokens it had delivered
            if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < len(prompt):
                raise ValueError(f"base {base!r} must be an int in [0, {len(prompt)})")
            ns = body.get("ns")  # its cache salt: every prefix-cache hash of it is rooted there
            if ns is not None and (not isinstance(ns, str) or not ns):
                raise ValueError(f"ns {ns!r} must be a non-empty string or nil")
            pd = body.get("pd")
            if pd is not None and self.pd is None:
                raise ValueError("pd: this group is not part of a PD pod")
            tr = body.get("transcript")
            if tr is not None:
                vocab = self.spec.vocab_size
                ok = isinstance(tr, list) and all(isinstance(t, int) and 0 <= t < vocab
                                                  for t in tr)  # fmt: skip
                if not self.spec.spec_tokens or not ok:
                    raise ValueError("transcript: a list of token ids, with MTP only")
                self.transcripts[rid] = tr
            if isinstance(self.pd, DecodeSide) and pd is not None:
                self.pd.add(rid, body, params, prompt, base)  # joins the batch once its KV is in
            else:
                if isinstance(self.pd, PrefillSide) and pd is not None:
                    params.max_tokens = 1  # the prefill and the first token only
                req = Request(rid, list(prompt), params, self.spec.eos_token_id,
                              time.monotonic(), index_base=base, ns=ns)  # fmt: skip
                hint = body.get("pool")  # a colocated or PD prefill die's pool hit
                if not (self.pool is not None and hint and self.pool.add(req, hint)):
                    self.sched.add(req)
                if isinstance(self.pd, PrefillSide) and pd is not None:
                    self.pd.add(rid, pd.get("peer"))
                    return  # its tokens and finish are the decode master's
                self.sent_n[rid] = base
                if body.get("stream", True):
                    self.streamed.add(rid)
            if self.spec.output_proc:
                self.tokens_out.send(wire.pack("open", {
                    "id": rid, "n_prompt": len(prompt) - base, "render": body.get("render"),
                    "replay": prompt[len(prompt) - base:] if base else []}))  # fmt: skip
        except (ValueError, TypeError) as e:
            self.counters["bad_requests"] += 1
            if isinstance(self.pd, PrefillSide) and body.get("pd") is not None:
                self.pd.refused(rid)
            if isinstance(rid, int):
                self.done.append([rid, "error", 0, 0, str(e), 0.0])

    def finish(self, req: Request) -> None:
        """A terminal record: id, reason, prompt tokens, cached tokens, error, and the time
        (CLOCK_MONOTONIC, shared by the processes) of its first token. The tokens of a request
        that is not streamed go with it, in this flush's deltas."""
        rid = req.request_id
        if self.pool is not None:  # before a PD prefill's lease takes its table
            self.pool.finished(req)
        if isinstance(self.pd, PrefillSide) and self.pd.finished(req):
            for d in (self.held, self.deltas, self.first, self.sched_at, self.transcripts):
                d.pop(rid, None)
            return
        reason = req.finish_reason.value if req.finish_reason else "abort"
        held = self.held.pop(rid, None)
        if held:
            self.deltas.setdefault(rid, []).extend(held)
        self.streamed.discard(rid)
        self.started.discard(rid)
        self.transcripts.pop(rid, None)

        first = self.first.pop(rid, 0.0)
        self.done.append([rid, reason, len(req.prompt), req.num_cached, "", first,
                          self.sched_at.pop(rid, 0.0)])  # fmt: skip

    # -- results and plans ---------------------------------------------------------------------

    def take_results(self) -> None:
        while self.results.available():
            _, body = wire.unpack(self.results.get(), {"result"})
            seq = body.get("seq")
            if seq is not None and self.in_flight and seq < self.in_flight[0][2]:
                self.counters["replayed_results"] += 1  # published again after a rollback
                continue
            plan_id, rows, _ = self.in_flight.popleft()
            if body["plan"] != plan_id:
                raise RuntimeError(f"master {self.spec.group}: result of plan {body['plan']},"
                                   f" expected {plan_id}")  # fmt: skip
            self.counters["results"] += 1
            self.counters["bubble_ns"] += body.get("bubble_ns", 0)
            if rows:
                self.counters["busy_steps"] += 1
                ms = (body["t1"] - body["t0"]) / 1e6
                if len(self.step_ms) < MAX_SAMPLES:
                    self.step_ms.append(ms)
                    self.bubble_ms.append(body.get("bubble_ns", 0) / 1e6)
                if len(self.step_new) < MAX_SAMPLES:
                    self.step_new.append(ms)
            if body["step"] and "attn_ns" in body and len(self.attn_new) < MAX_SAMPLES:
                self.attn_new.append([body["step"], body["attn_ns"]])
            if self.spec.log_steps and body["step"] and rows:
                self.log_step(body, rows)
            if plan_id < 0:
                continue
            for block in body.get("kv_fault", ()):  # before the samples: its holders' rows of
                self.mask(block)  # this result are then of an old epoch, and dropped
            if "spec" in body:
                add_spec_counts(self.counters, body)
                if isinstance(self.pd, PrefillSide):  # MTP: the drafts go with the first token
                    self.pd.on_drafted(body["drafted"])
            out = self.sched.on_result(plan_id, {i: t for i, t in body["sampled"]})
            now = time.monotonic()
            for rid, toks in out.new_tokens.items():
                if toks and isinstance(self.pd, DecodeSide):
                    toks = self.pd.first_tokens(rid, toks)
                if toks:
                    self.first.setdefault(rid, now)
                    to = self.deltas if rid in self.streamed else self.held
                    to.setdefault(rid, []).extend(toks)
                    self.counters["tokens"] += len(toks)
            for req in out.finished:
                self.finish(req)
            self._gc()

    def mask(self, block: int) -> None:
        """A KV block the die reported faulty: masked for good, its holders recompute."""
        if not 0 <= block < self.spec.num_blocks:
            log.warning("master %d: the die reported KV block %r, not a block", self.spec.group,
                        block)  # fmt: skip
            return
        hit = self.sched.mask_block(block)
        self.counters["kv_masked"] += 1
        self.counters["kv_recomputed"] += len(hit)
        self.masked.append(block)
        log.warning("master %d: KV block %d masked (a memory fault); requests %s recompute",
                    self.spec.group, block, hit)  # fmt: skip

    def log_step(self, body: dict, rows: list[dict]) -> None:
        fed = {i: t for i, t in body["fed"]}
        dropped = set(body.get("dropped", ()))
        rows = [r for r in rows if r["id"] not in dropped]  # the die did not run them

        def fed_of(r):
            if r["tokens"] is not None:
                return r["tokens"]
            f = fed[r["id"]]
            return list(f) if isinstance(f, list) else [f]

        rec = {
            "step": body["step"], "group": self.spec.group,
            "rows": [[r["id"], fed_of(r), r["start"], r["table"], r["sample"], r["index"],
                      r["temperature"], r["seed"]] for r in rows],
            "sampled": body["sampled"], "logits": body.get("logits"),
        }  # fmt: skip
        if "spec" in body:  # MTP: each row's drafts fed, drafts wanted, next token, transcript
            for row, r in zip(rec["rows"], rows, strict=True):
                row += [len(row[1]) - 1 if r["tokens"] is None else 0, r.get("want", 0),
                        r.get("next", -1), r.get("transcript")]  # fmt: skip
            rec["drafted"] = body["drafted"]
        self.steps.append(rec)

    def plan(self) -> None:
        """Publish plans while the scheduler may; promise one more if it has work but may not
        plan now; keep a promise with an empty plan when the work is gone."""
        w = self.words
        while self.cmds.can_put() and self.sched.can_plan():
            plan = self.sched.schedule()
            if plan is None:
                break
            rows = [{"id": r.request_id, "tokens": r.tokens, "start": r.start,
                     "table": r.block_table, "sample": r.sample, "index": r.token_index,
                     "temperature": r.temperature, "seed": r.seed} for r in plan.rows]  # fmt: skip
            if self.spec.spec_tokens:  # MTP: drafts to feed and to make, a chunk's next token
                for row, r in zip(rows, plan.rows, strict=True):
                    row.update(k=r.drafts, want=r.want, next=r.next_token)
                    if r.feed is not None:  # a PD decode's first row: [first] + drafts
                        row["feed"] = r.feed
                    if (r.tokens or r.feed) and r.request_id in self.transcripts:
                        row["transcript"] = self.transcripts[r.request_id]
            self.publish({"plan": plan.plan_id, "rows": rows, "released": plan.released}, rows)
            self.counters["rows"] += plan.num_tokens
            now = time.monotonic()
            for r in plan.rows:
                if r.request_id not in self.sched_at:  # admitted: its prefix hit is known
                    req = self.sched.get(r.request_id)
                    self.cached.append([r.request_id, req.num_cached if req else 0])
                    self._cached_to_peer(r.request_id, req.num_cached if req else 0)
                self.sched_at.setdefault(r.request_id, now)
        owed = w[self.promised] > self.cmds.published()
        if owed and not self.sched.has_work() and self.cmds.can_put():
            self.publish({"plan": -1, "rows": [], "released": []}, [], plan_id=-1)
            self.counters["empty_plans"] += 1
        elif not owed and self.sched.has_work():
            w[self.promised] = self.cmds.published() + 1
            self.die_bell.ring()

    def publish(self, body: dict, rows: list, plan_id: int | None = None) -> None:
        seq = self.cmds.published()
        self.cmds.put(wire.pack("step", body))
        if self.words[self.promised] < self.cmds.published():
            self.words[self.promised] = self.cmds.published()
        self.in_flight.append((body["plan"] if plan_id is None else plan_id, rows, seq))
        self.die_bell.ring()

    def stop_die(self) -> None:
        if self.stopping and not self.stopped and not self.in_flight and self.cmds.can_put():
            self.cmds.put(wire.pack("stop"))
            self.die_bell.ring()
            self.stopped = True

    # -- trace and GC --------------------------------------------------------------------------

    def trace(self, t0: int, t1: int, results: int, plans: int) -> None:
        """Spans of this wake-up (taking results, planning) and the counters after it."""
        t2 = time.perf_counter_ns()
        if results:
            self.spans.append([t0, t1 - t0, "results", results])
        if plans:
            self.spans.append([t1, t2 - t1, "plan", plans])
        if results or plans:
            s = self.sched
            self.counter_samples.append(
                [
                    t2,
                    len(s.running),
                    len(s.waiting),
                    self.kv.usage()["used"],
                    self.counters["tokens"],
                    self.words[self.dummy_word],
                    s.stats()["num_preemptions"],
                    s.stats()["prefix_hit_tokens"],
                ]
            )

    def _gc(self) -> None:
        every = self.spec.gc_every
        if not every:
            return
        self.results_n += 1
        if self.results_n == 8:
            gc.collect()
            gc.freeze()
            gc.disable()
        elif self.results_n % every == 0:
            gc.collect(1)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        poller.register(self.bell.fileno(), zmq.POLLIN)
        if self.pool is not None:  # its peer sockets (several hosts) join this poll
            self.pool.poller = poller
        self.send("ready", {"group": self.spec.group})
        while not self.stopped:
            busy = self.sched.has_work() or bool(self.in_flight) or self.deltas or self.done
            wait = STATS_EVERY_S if busy else 1.0
            if (self.pd is not None and self.pd.busy()) or (self.pool and self.pool.busy()):
                wait = TICK_S
            events = dict(poller.poll(int(wait * 1000)))
            self.bell.drain()
            if self.inbox in events:
                while True:
                    try:
                        frame = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.on_message(frame)
            if self.pool is not None and self.pool.peers:
                self.pool.poll_peers(events)
            self.stats_dirty = True
            t0 = time.perf_counter_ns()
            n = self.counters["results"]
            # The die publishes step s's result before it votes s + 1: read its step first.
            self.die_step = int(self.words[self.vote_word])
            self.take_results()
            if self.pings:
                self.heartbeat()
            if self.pd is not None:
                self.pd.tick(time.monotonic())
            if self.pool is not None:
                self.pool.tick(time.monotonic())
                self.pool.offer()
            t1 = time.perf_counter_ns()
            published = self.cmds.published()
            if not self.stopping:
                self.plan()
            if self.spec.trace:
                self.trace(t0, t1, self.counters["results"] - n, self.cmds.published() - published)
            self.flush()
            self.stop_die()
        if self.spec.output_proc:
            self.tokens_out.send(wire.pack("eof"))
        if self.spec.log_steps or self.spec.trace:
            trace = {"spans": self.spans, "counters": self.counter_samples}
            self.send("log", {"group": self.spec.group, "steps": self.steps, "trace": trace})
        self.send("stats", {**self.stats(), "final": True, "step_ms": self.step_ms,
                            "bubble_ms": self.bubble_ms})  # fmt: skip

    def _cached_to_peer(self, rid: int, n: int) -> None:
        """A PD prefill master's admission: the prompt tokens it did not compute go to the
        output process of the request's decode group, which renders its usage (its own
        master admits the request with every prompt token transferred). Sent now, before the
        prefill's step runs: the decode side's tokens come after the KV transfer."""
        if not self.spec.output_proc or not isinstance(self.pd, PrefillSide):
            return
        peer = self.pd.peer.get(rid)
        if peer is None:
            return
        sock = self.peer_outputs.get(peer)
        if sock is None:
            sock = self.peer_outputs[peer] = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(output_socket(self.spec.run_dir, peer))
        sock.send(wire.pack("cached", {"id": rid, "n": int(n)}))

    def close(self) -> None:
        for s in self.peer_outputs.values():
            s.close(linger=0)
        if self.pd is not None:
            self.pd.close()
        if self.pool is not None:
            self.pool.close()
        for s in {self.inbox, self.outbox, self.tokens_out}:
            s.close(linger=1000)
        self.ctx.term()
        self.bell.close()
        self.die_bell.close()
        self.words = None
        self.region.close()


def master_main(spec: MasterSpec, engine_pid: int) -> None:
    """Entry of a master process."""
    default_sigterm()  # not the handler of the shell it was forked from
    if not follow_parent(engine_pid):  # the engine is already gone
        os._exit(3)
    logging.basicConfig(format=f"master {spec.group} %(levelname)s %(name)s: %(message)s")
    if spec.pin_cpu >= 0:
        os.sched_setaffinity(0, {spec.pin_cpu})
    batch_scheduling()  # woken by its die's doorbell, it must not preempt the die mid-step
    master = None
    try:
        master = Master(spec)
        master.run()
    except Exception:  # noqa: BLE001 - logged with the group, then exit non-zero
        log.error("master %d failed:\n%s", spec.group, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if master is not None:
            master.close()
