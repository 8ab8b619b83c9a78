"""The engine's books of its requests (the TE-shell role of 001 §4.3; vLLM's OutputProcessor):
what each request asked for, which DP group runs it, its tokens so far, who listens to it; every
finish and failure delivered to each listener once.

No processes, no sockets: the engine (`runtime.engine.engine`) gives it `send(group, kind,
body)` to reach the masters and feeds it their `out` messages. Every request goes to one group,
once, chosen by `sched.LoadBalancer` (skip groups at their batch limit, then the least KV usage
counting the space reserved for every in-flight request; `round_robin` for comparison); when
every group is full it waits here (`pending`).

Threads: the caller's threads submit and abort, the engine's receiver (a thread, or an event
loop: `Engine.attach_loop`) delivers; one lock guards the books. Deltas for a stream are queued
per event loop and handed over with one wake-up per loop (`deliver`).

The records it keeps and hands out (`TrackedRequest`, `CompletionOutput`, `Delta`,
`EngineError`) are `runtime.engine.records`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from runtime.engine.output import OutputHandler

# the records (runtime.engine.records) lived here: still importable from this module
from runtime.engine.records import CompletionOutput, Delta, EngineError, TrackedRequest
from runtime.engine.render import Renderer
from runtime.model import EOS, ModelConfig, decode, encode
from sched import LoadBalancer, SamplingParams

log = logging.getLogger(__name__)
Send = Callable[[int, str, dict], None]  # (group, message kind, body) to that group's master
MAX_NS_LEN = 256  # characters of a cache salt (a request's prefix-cache namespace)


class RequestTracker:
    """Every live request of an engine of `num_groups` DP groups (see the module docstring).

    Arguments:
        model: the served model (prompt checks: vocabulary, context).
        balancer: the DP load balancer.
        send: `send(group, kind, body)`: a message to that group's master.
        output_procs: the groups' output processes render (else `render` here does).
    """

    def __init__(self, model: ModelConfig, num_groups: int, balancer: LoadBalancer, send: Send,
                 output_procs: bool = False):  # fmt: skip
        self.model, self.num_groups, self.lb, self.send = model, num_groups, balancer, send
        self.output_procs = output_procs
        self.lock = threading.Lock()
        self.reqs: dict[int, TrackedRequest] = {}
        self.finished: dict[int, TrackedRequest] = {}  # of `submit`, until `result` takes them
        self.pending: deque[TrackedRequest] = deque()
        self.ids = itertools.count()
        self.render = OutputHandler()  # renders in this process when output_procs is off
        self.observer = None  # metrics: on_tokens(t, n, now), on_finish(t), on_stats(body)
        self.notes: dict = {}
        self.failure: BaseException | None = None
        self.accepting = True
        self.hold = False  # a restart is under way: accepted requests wait in `pending`
        self.gen = 0  # the engine's incarnation: `out` messages of an older one are dropped
        self.pd = None  # a PD pod's router (runtime.engine.pd_shell.PDRouter)
        self.pool = None  # the KV pool's shell side (runtime.engine.pool_shell.PoolShell)
        # request id -> the prompt its master got (kept when the engine logs its steps with
        # the pool on: the schedule replay lands the pool's loads from them)
        self.prompts: dict[int, list[int]] | None = None
        self.namespaces: dict[int, str] = {}  # and their cache salts (the others: None)
        # The ledger's counters: tokens a stream had already (trimmed: never sent twice), gaps
        # (a bug: must stay 0), requests re-admitted after a restart, stale messages dropped.
        self.ledger = {"tokens_replayed": 0, "token_gaps": 0, "requests_recomputed": 0,
                       "stale_messages": 0, "accepted": 0, "ended": 0, "failed": 0}  # fmt: skip

    # -- intake ---------------------------------------------------------------------------------

    def track(self, prompt, params: SamplingParams | None, group: int | None = None,
              ns: str | None = None) -> TrackedRequest:  # fmt: skip
        """A checked, not yet queued request (ValueError / TypeError for a bad one). `ns`: its
        cache salt (vLLM's `cache_salt`): the prompt shares cached KV, die-local or pooled, only
        with requests of the same ns (None: the default namespace)."""
        if ns is not None and (not isinstance(ns, str) or not ns or len(ns) > MAX_NS_LEN):
            raise ValueError(f"cache salt {ns!r:.60} must be a string of 1 to {MAX_NS_LEN}"
                             " characters")  # fmt: skip
        if group is not None and (
            isinstance(group, bool)
            or not isinstance(group, int)
            or not 0 <= group < self.num_groups
        ):
            raise ValueError(f"group {group!r} must be a DP group in [0, {self.num_groups})")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.model.vocab_size)
        tokens = self._tokens_of(prompt)
        limit = self.model.max_seq_len
        if len(tokens) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({params.max_tokens}) exceeds the"
                f" context of {limit} tokens"
            )
        if params.seed is None:  # drawn once, here, and recorded: a recomputation after a
            # restart continues the same stream (draws are keyed on (seed, token index))
            params = dataclasses.replace(params, seed=secrets.randbelow(1 << 31))
        t = TrackedRequest(next(self.ids), prompt, tokens, params)
        t.pin, t.ns = group, ns
        return t

    def _tokens_of(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt: empty (give at least one character)")
            tokens = encode(prompt)
        elif isinstance(prompt, list | tuple) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in prompt
        ):
            tokens = list(prompt)
        else:
            raise TypeError("prompt must be a str or a list of token ids")
        if not tokens:
            raise ValueError("prompt: empty (give at least one token)")
        bad = [x for x in tokens if not 0 <= x < self.model.vocab_size]
        if bad:
            raise ValueError(
                f"prompt: token ids must be in [0, {self.model.vocab_size}), got {bad[:3]}"
            )
        return tokens

    def enqueue(self, tracked: list[TrackedRequest]) -> None:
        """Accept the requests (EngineError if the engine is down or closed) and send what fits."""
        with self.lock:
            self.check_up()
            for t in tracked:
                self.reqs[t.id] = t
                self.pending.append(t)
                if t.id >= 0:
                    self.ledger["accepted"] += 1
            self.dispatch_pending()

    def check_up(self) -> None:
        if self.failure is not None:
            raise EngineError(f"the engine is down: {self.failure}")
        if not self.accepting:
            raise EngineError("the engine is closed")

    def dispatch_pending(self) -> None:
        """Send waiting requests to groups while the balancer finds room (caller holds lock)."""
        while self.pending and not self.hold:
            t = self.pending[0]
            base = len(t.out)
            if self.pd is not None and t.pin is None:  # PD: to a prefill and a decode die
                pair = self.pd.pick(t.tokens + t.out, t.params.max_tokens - base, t.ns)
                if pair is None:
                    return
                self.pending.popleft()
                t.prefill_group, t.group = pair
                self.pd.on_dispatch(t.id, *pair, t.tokens + t.out, t.params.max_tokens - base,
                                    t.ns)  # fmt: skip
            else:
                hs = self.lb.prefix_hashes(t.tokens + t.out, t.ns)  # lb "prefix" only, else []
                g = t.pin
                if g is None:
                    g = self.lb.pick(len(t.tokens), t.params.max_tokens, hs)
                if g is None:
                    return
                self.pending.popleft()
                self.lb.on_dispatch(g, t.id, len(t.tokens), t.params.max_tokens, hs)
                t.group = g
            p = t.params
            # A resumed request (token recomputation): its prompt is the prompt and the tokens
            # it delivered, its output indices go on from there (`base`: the seeded draws of
            # the continuation are those of the lost stream), and the rest of its max_tokens.
            body = {"id": t.id, "prompt": t.tokens + t.out, "stream": t.streamed, "base": base,
                    "params": {"max_tokens": p.max_tokens - base, "temperature": p.temperature,
                               "seed": p.seed, "stop_token_ids": list(p.stop_token_ids),
                               "ignore_eos": p.ignore_eos}}  # fmt: skip
            if t.transcript is not None:
                body["transcript"] = t.transcript
            if t.ns is not None:
                body["ns"] = t.ns
            to = t.prefill_group if t.prefill_group >= 0 else t.group  # the die that loads
            hint = self.pool.hint(body["prompt"], t.ns, to) if self.pool is not None else None
            if self.prompts is not None:
                self.prompts[t.id] = body["prompt"]
                if t.ns is not None:
                    self.namespaces[t.id] = t.ns
            if hint is not None and t.prefill_group < 0:  # the pod-wide prefix lookup
                body["pool"] = hint
            if t.render is not None:
                if self.output_procs:
                    body["render"] = t.render
                elif t.id not in self.render.renderers:  # a resumed one keeps its renderer
                    self.render.open(t.id, t.render, len(t.tokens))
            if t.prefill_group >= 0:  # a pool hit loads into the prefill die
                pool = {"pool": hint} if hint is not None else {}
                self.send(t.prefill_group, "add", {**body, "stream": False, "render": None,
                                                   "pd": {"peer": t.group}, **pool})  # fmt: skip
                body["pd"] = {"peer": t.prefill_group}
                if self.pool is not None:  # the decode die's own lease of the pooled prefix
                    dh = self.pool.decode_hint(body["prompt"], t.ns, t.group)
                    if dh is not None:
                        body["pool"] = dh
            self.send(t.group, "add", body)

    def abort(self, request_id: int) -> None:
        """End a request with finish reason "abort" (no-op if unknown or finished)."""
        with self.lock:
            t = self.reqs.get(request_id)
            if t is None:
                return
            if t in self.pending:
                self.pending.remove(t)
                self.reqs.pop(request_id, None)
                self._end(t, "abort", "", time.monotonic())
                self.deliver()
                if t.keep:
                    self.finished[t.id] = t
                return
            t.aborted = True
            self.send(t.group, "abort", {"id": request_id})
            if t.prefill_group >= 0:
                self.send(t.prefill_group, "abort", {"id": request_id})

    def result(self, request_id: int, timeout_s: float | None = None) -> CompletionOutput:
        """Wait for a request kept for `result` (`keep`); TimeoutError after `timeout_s`."""
        with self.lock:
            t = self.reqs.get(request_id) or self.finished.get(request_id)
        if t is None:
            raise KeyError(f"unknown request id {request_id}")
        if not t.done.wait(timeout_s):
            raise TimeoutError(f"request {request_id}: not finished after {timeout_s} s")
        with self.lock:
            self.finished.pop(request_id, None)
        return t.output()

    def wait_all(self, tracked: list[TrackedRequest], timeout_s: float | None) -> None:
        """Until every request finished; TimeoutError after `timeout_s` (they go on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in tracked:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not t.done.wait(left):
                raise TimeoutError(f"generate: not finished after {timeout_s} s")

    def open_stream(self, t: TrackedRequest) -> AsyncIterator[Delta]:
        """Queue `t` with a stream on the running event loop; its Deltas, in order."""
        q: asyncio.Queue = asyncio.Queue()
        t.listeners.append((asyncio.get_running_loop(), q))
        self.enqueue([t])
        return self._deltas(t, q)

    async def _deltas(self, t: TrackedRequest, q: asyncio.Queue) -> AsyncIterator[Delta]:
        try:
            while True:
                delta = await q.get()
                yield delta
                if delta.finish_reason is not None or delta.final:
                    return
        finally:
            if not t.done.is_set() and not t.final:
                self.abort(t.id)

    def info(self, request_id: int) -> TrackedRequest | None:
        with self.lock:
            return self.reqs.get(request_id)

    # -- from the masters -----------------------------------------------------------------------

    def on_out(self, body: dict) -> None:
        """A master's (or output process's) `out` message: tokens, rendered bytes, finishes.

        The ledger: every token delta carries the output index of its first token; tokens a
        request already has are trimmed (counted in `tokens_replayed`), a delta that starts
        past them is a gap (`token_gaps`, logged: a bug). Messages of an older incarnation of
        the engine (before a restart) are dropped: their requests were re-admitted."""
        now = time.monotonic()
        with self.lock:
            if body.get("gen", 0) != self.gen:
                self.ledger["stale_messages"] += 1
                return
            if self.pd is not None:  # a failed KV transfer the policy resends: not an end
                body["done"] = [rec for rec in body["done"] if not self._resend(rec)]
            body["deltas"] = [d for d in map(self._fresh, body["deltas"]) if d is not None]
            if "data" not in body:  # from a master: render here what is rendered
                body, stops = self.render.process(body)
                for rid in stops:
                    t = self.reqs.get(rid)
                    if t is not None and t.group >= 0:
                        self.send(t.group, "abort", {"id": rid})
            for rid, _start, toks in body["deltas"]:
                t = self.reqs.get(rid)
                if t is None or not toks:
                    continue
                self._tokens(t, len(toks), now)
                t.out.extend(toks)
                self._notify(t, Delta(rid, list(toks), decode(toks)))
            for rid, n, data, final, status, start, ids in body["data"]:
                t = self.reqs.get(rid)
                if t is None:
                    continue
                if ids:  # rendered ones: the renderer trimmed what its client had
                    if start != len(t.out):
                        self._gap(t, start)
                    t.out.extend(ids)
                self._tokens(t, n, now)
                t.final = t.final or final
                if data or final or n:
                    self._notify(t, Delta(rid, [], "", data=data, n_tokens=n, final=final,
                                          status=status))  # fmt: skip
            for rid, n in body.get("cached") or ():  # a PD request's: its prefill die's hit
                t = self.reqs.get(rid)
                if t is not None:
                    t.n_cached = max(t.n_cached, int(n))
            for ev in body.get("pd") or ():
                self._pd_event(ev)
            if self.pool is not None:
                for ev in body.get("pool") or ():
                    self.pool.on_event(body.get("group", -1), ev)
            for rec in body["done"]:
                self._done(rec, now)
            self.dispatch_pending()
            self.deliver()

    def _fresh(self, delta: list) -> list | None:
        """A token delta `[id, start, tokens]` cut to the tokens its request does not have yet
        (None if nothing is left, or the request is not live)."""
        rid, start, toks = delta
        t = self.reqs.get(rid)
        if t is None:
            return None
        have = len(t.out)
        if start < have:
            cut = min(len(toks), have - start)
            self.ledger["tokens_replayed"] += cut
            toks, start = toks[cut:], start + cut
        elif start > have:
            self._gap(t, start)
        return [rid, start, toks] if toks else None

    def _gap(self, t: TrackedRequest, start: int) -> None:
        self.ledger["token_gaps"] += 1
        log.error("request %d: tokens from output index %d arrived after %d delivered (a gap)",
                  t.id, start, len(t.out))  # fmt: skip

    def _pd_event(self, ev: list) -> None:
        """A PD request's progress: [id, "prefilled", t_sched, t] from its prefill master,
        [id, "landed", t, bytes, ns] from its decode master."""
        t = self.reqs.get(ev[0])
        if t is None:
            return
        if ev[1] == "prefilled":
            t.pd.update(sched=ev[2], prefilled=ev[3])
            if self.pd is not None:
                self.pd.on_prefilled(t.id)
        elif ev[1] == "ordered":
            t.pd["ordered"] = ev[2]
        elif ev[1] == "landed":
            t.pd.update(landed=ev[2], bytes=ev[3], ns=ev[4])

    def _resend(self, rec: list) -> bool:
        """A PD request whose KV transfer failed (`rec[7]`), under kv_policy recompute: placed
        again (a new prefill and decode die), from the tokens it delivered. True if so."""
        t = self.reqs.get(rec[0])
        if len(rec) < 8 or not rec[7] or t is None or t.prefill_group < 0:
            return False
        if self.pd.policy != "recompute" or t.aborted:
            return False
        self.pd.on_finish(t.id)
        self.pd.counters["pd_recomputed"] += 1
        log.warning("request %d: %s; sent again (kv_policy recompute)", t.id, rec[4])
        t.group = t.prefill_group = -1  # a rendered one keeps its renderer (what its client has)
        t.pd = {}
        self.pending.appendleft(t)
        return True

    def _done(self, rec: list, now: float) -> None:
        rid, reason, _n_prompt, n_cached, error, first = rec[:6]
        t = self.reqs.get(rid)
        if t is None:
            return
        if self.pd is not None and t.prefill_group >= 0:
            self.pd.on_finish(rid)
            self.pd.counters["pd_failed"] += len(rec) > 7 and bool(rec[7])
        self.reqs.pop(rid, None)
        if first and not t.streamed:  # the master sent the tokens with the finish
            t.t_first = first
        if len(rec) > 6:
            t.t_sched = t.pd.get("sched") or rec[6]  # a PD request's: its prefill die's
        self.lb.on_finish(rid)
        self._end(t, reason, error, now, n_cached)
        if t.keep:
            self.finished[rid] = t

    def readmit(self, gen: int) -> list[TrackedRequest]:
        """A restart (caller holds the lock; `hold` is set): from now on only messages of
        incarnation `gen` count. Every request a master had is re-queued, first and in order,
        to be resumed from what it delivered (token recomputation); one whose delivered tokens
        already end it (its last token, a stop string sent, max_tokens) ends now, once.
        Returns the re-queued requests."""
        self.gen = gen
        now = time.monotonic()
        queued = set(map(id, self.pending))
        back = []
        for t in sorted(self.reqs.values(), key=lambda r: r.id):
            if id(t) in queued:
                continue
            self.lb.on_finish(t.id)
            if self.pd is not None:
                self.pd.on_finish(t.id)
            t.group = t.prefill_group = -1
            t.pd = {}
            reason = self._over(t)
            if reason:
                self.reqs.pop(t.id, None)
                self._end(t, reason, "", now)
                if t.keep:
                    self.finished[t.id] = t
                continue
            t.resumed += 1
            t.t_resumed = 0.0
            if t.id >= 0:
                self.ledger["requests_recomputed"] += 1
            back.append(t)
        self.pending.extendleft(reversed(back))
        self.deliver()
        return back

    def _over(self, t: TrackedRequest) -> str:
        """The finish reason a request's delivered tokens already imply ("" if none)."""
        p = t.params
        if t.aborted:
            return "abort"
        if t.final:
            return "stop"  # a stop string: its client has its last bytes
        if t.out and (t.out[-1] in p.stop_token_ids or (t.out[-1] == EOS and not p.ignore_eos)):
            return "stop"
        return "length" if len(t.out) >= p.max_tokens else ""

    def live(self) -> int:
        """Accepted requests not ended yet."""
        return len(self.reqs)

    def fail(self, err: BaseException) -> None:
        """The engine is down: every request not finished ends with finish reason "error"."""
        with self.lock:
            if self.failure is None:
                self.failure = err
            now = time.monotonic()
            for t in list(self.reqs.values()) + list(self.pending):
                if not t.done.is_set():
                    self._end(t, "error", str(err), now)
                if t.keep:
                    self.finished[t.id] = t
            self.reqs.clear()
            self.pending.clear()
            self.deliver()

    def _tokens(self, t: TrackedRequest, n: int, now: float) -> None:
        if n and not t.t_first:
            t.t_first = now
        if n and t.resumed and not t.t_resumed:
            t.t_resumed = now
        if n and self.observer is not None and t.streamed:
            self.observer.on_tokens(t, n, now)
        t.n_out += n
        if n:
            t.t_last = now

    def _end(self, t: TrackedRequest, reason: str, error: str, now: float, n_cached: int = 0,
             ) -> None:  # fmt: skip
        t.reason, t.error, t.t_done = reason, error, now
        t.n_cached = max(t.n_cached, n_cached)
        if t.render is not None and not t.final:  # the engine ended it (error, abort, close)
            r = self.render.renderers.pop(t.id, None)
            if r is None:  # rendered in an output process, or never opened: the state of a
                r = Renderer(t.render, len(t.tokens))  # renderer that had these tokens
                r.cached = t.n_cached
                if t.out:
                    r.feed(list(t.out))
            data = r.finish(reason, error)
            t.final = True
            status = 503 if self.failure is not None else (500 if error else 200)
            self._notify(t, Delta(t.id, [], "", data=data, final=True, status=status))
        self._notify(t, Delta(t.id, [], "", reason, error))
        t.done.set()
        if t.id >= 0:
            self.ledger["ended"] += 1
            self.ledger["failed"] += reason == "error"
        if self.observer is not None and t.id >= 0:
            self.observer.on_finish(t)

    def _notify(self, t: TrackedRequest, delta: Delta) -> None:
        """Queue a delta for the request's streams (caller holds the lock; `deliver` sends)."""
        for loop, q in t.listeners:
            self.notes.setdefault(loop, []).append((q, delta))

    def deliver(self) -> None:
        """Hand the queued deltas to their event loops: one wake-up per loop, not per delta
        (none for the loop this runs on: `Engine.attach_loop`). Caller holds the lock."""
        notes, self.notes = self.notes, {}
        here = _running_loop()
        for loop, items in notes.items():
            if loop is here:
                _put_all(items)
                continue
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody listens
                loop.call_soon_threadsafe(_put_all, items)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _put_all(items: list) -> None:
    for q, delta in items:
        q.put_nowait(delta)
