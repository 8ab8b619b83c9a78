"""The step scheduler of one DP group: which rows run in the next step (vLLM v1 semantics,
nano-vllm size), under asynchronous execution.

The master calls `schedule()` while up to `async_depth` plans are in flight and feeds each
plan's sampled tokens back with `on_result` in plan order. So a request's `num_scheduled` runs
ahead of `num_computed`, decode rows carry no token (the die feeds its own last sample), stop
conditions are seen one or more plans late (later rows of a finished request are dropped), and
blocks of a finished, aborted or preempted request are freed only after the result of the last
plan that has a row of it (`Request.last_plan`): until then the die may still write them.

One step (`schedule`), one token budget, in this order:
1. decode: each running request whose prefill is done and that has samples left to plan;
2. prefill chunks of running requests that are partially prefilled (the prefill target is
   len(all_tokens) at admission: the prompt, or prompt + output when recomputing);
3. admission of waiting requests, FCFS, while the batch and KV have room (none in a step that
   preempted, as vLLM v1; a preempted request waits until its old blocks are back).
When a running request needs a block and none is free: if a deferred free is pending (blocks come
back with an in-flight result) the request waits a step; else the most recently admitted request
admitted after it and not yet in this plan is preempted (recompute), or the request itself if
there is none (an older request is never preempted for a younger one).

Multi-token prediction (`spec_tokens` k > 0, synchronous: `async_depth` 1, so every plan sees
exact positions): a decode row is `1 + k_r` positions, the die feeding its last token and k_r
drafts (k_r = min(k, tokens left - 1, room before max_seq_len)), counted against the budget;
its result is the 1..1 + k_r tokens the row emitted, appended one by one (a stop condition
drops the later ones). Positions past the accepted ones are not freed: the next row starts
there and overwrites them; the table also covers the MTP module's chained draft rows
(`want - 1` positions past the row). A non-final prefill chunk carries the prompt token after
it (the MTP row of its last position needs it). With MTP, a prefix hit drops its last matched
block: that block's last MTP row was computed with the token after it, which another request
may not share (vLLM's EAGLE rule); the prefill recomputes it. A PD decode die's request
(`add_prefilled`) with drafts from its prefill die starts with a verify row, a decode row
whose `feed` is its first token and those drafts (capped as a decode row's).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from .kv import KVFull, KVManager
from .pool_types import ns_root
from .request import FinishReason, Request, RequestStatus


@dataclass(slots=True)
class Row:
    """One request's segment of a step: positions [start, start + num_tokens)."""

    request_id: int
    epoch: int
    start: int
    tokens: list[int] | None  # None = decode: the die feeds its last sampled token
    num_tokens: int
    block_table: list[int]  # covers positions [0, start + num_tokens)
    sample: bool  # the last position samples the next token
    token_index: int  # output index of the sampled token (seeded rng); -1 if not sample
    temperature: float
    seed: int
    drafts: int = 0  # MTP: drafts the die feeds after the last token (decode rows)
    want: int = 0  # MTP: drafts the die makes for the next row (0: none)
    next_token: int = -1  # MTP: a non-final prefill chunk's next prompt token
    feed: list[int] | None = None  # MTP: a PD decode's first row: [first] + drafts to feed


@dataclass(slots=True)
class StepPlan:
    """One step for the die. `released`: ids whose last-sampled-token state the die drops
    before it runs the rows (a recomputed request may have a row in the same plan)."""

    plan_id: int
    rows: list[Row]
    released: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


@dataclass(slots=True)
class StepOutput:
    """What one result did. `new_tokens` has an entry per sampling row of the plan: [token]
    if accepted, [] if dropped (finished or older epoch). `preempted`: ids preempted by the
    schedule() calls since the previous result (informational)."""

    new_tokens: dict[int, list[int]]
    finished: list[Request]
    preempted: list[int]


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int  # running + prefilling requests of the group
    max_num_batched_tokens: int  # token budget of one step
    max_seq_len: int  # prompt + max_tokens must fit
    long_prefill_threshold: int = 0  # 0 = no cap; else max tokens of one request's chunk
    async_depth: int = 2  # plans in flight (1 = synchronous)
    spec_tokens: int = 0  # MTP drafts per decode row (module docstring); needs async_depth 1

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_seq_len", "async_depth"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        k = self.spec_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"spec_tokens must be an int >= 0, got {k!r}")
        if k and self.async_depth != 1:
            raise ValueError("spec_tokens: MTP plans synchronously (async_depth 1)")
        v = self.long_prefill_threshold
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ValueError(f"long_prefill_threshold must be an int >= 0, got {v!r}")


@dataclass(slots=True)
class _Step:
    """The plan being built."""

    plan_id: int
    budget: int
    rows: list[Row] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    planned: set[int] = field(default_factory=set)
    preempted: bool = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVManager):
        if kv.blocks_for(config.max_seq_len) > kv.num_blocks:
            raise ValueError(f"max_seq_len {config.max_seq_len} needs more than the KV's "
                             f"{kv.num_blocks} blocks of {kv.block_size}")  # fmt: skip
        self.config, self.kv = config, kv
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self._live: dict[int, Request] = {}  # waiting or running
        self._target: dict[int, int] = {}  # running request -> prefill target
        self._inflight: collections.deque[tuple[StepPlan, list[Request]]] = collections.deque()
        self._next_plan = 0
        self._last_result = -1
        self._deferred: dict[int, int] = {}  # request -> plan whose result frees its blocks
        self._released: dict[int, None] = {}  # ids for the next plan, in event order
        self._preempted: list[int] = []
        self._num_preemptions = self._hit_tokens = self._query_tokens = 0
        # PD prefill (runtime.engine.pd): requests whose blocks outlive them, under a lease
        # key, when they finish normally (their KV goes to a decode die); request -> key
        self.lease: dict[int, object] = {}
        self._seeded: dict[int, list[int]] = {}  # PD decode + MTP: drafts of its first row

    def add(self, req: Request) -> None:
        """Validate and enqueue (WAITING). ValueError / TypeError name the bad field."""
        rid, prompt, max_tokens = req.request_id, req.prompt, req.params.max_tokens
        if not isinstance(rid, int) or isinstance(rid, bool):
            raise TypeError(f"request_id must be an int, got {rid!r}")
        if rid in self._live or rid in self._deferred:
            raise ValueError(f"request_id {rid} is already in use")
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"request {rid}: prompt must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ValueError(f"request {rid}: prompt must hold ints >= 0")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"request {rid}: max_tokens must be an int >= 1, got {max_tokens!r}")
        if len(prompt) + max_tokens > self.config.max_seq_len:
            raise ValueError(f"request {rid}: prompt ({len(prompt)}) + max_tokens ({max_tokens})"
                             f" > max_seq_len ({self.config.max_seq_len})")  # fmt: skip
        if req.status is not RequestStatus.WAITING or req.output:
            raise ValueError(f"request {rid}: status must be WAITING with no output")
        if req.ns is not None and (not isinstance(req.ns, str) or not req.ns):
            raise ValueError(f"request {rid}: ns must be a non-empty string or None")
        self._live[rid] = req
        self.waiting.append(req)

    def add_prefilled(self, req: Request, num_computed: int, drafts=()) -> None:
        """Add a request whose positions [0, num_computed) already have their KV in the blocks
        of its table (made by the caller with `kv.alloc_blocks`): a PD decode die's request,
        written there by its prefill die. It runs at once (RUNNING, no admission: the caller
        counted it against max_num_seqs); its next row starts at num_computed. `drafts` (MTP,
        made by the prefill die after the prompt's last token, `req.prompt[num_computed]`):
        that row is a verify row feeding them after it."""
        self.kv.block_table(req.request_id)  # ValueError without a table
        self.add(req)
        if not 0 < num_computed < len(req.prompt):
            self._live.pop(req.request_id)
            self.waiting.pop()
            raise ValueError(f"request {req.request_id}: num_computed {num_computed} must be in"
                             f" [1, {len(req.prompt)})")  # fmt: skip
        self.waiting.pop()
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        req.num_computed = req.num_scheduled = num_computed
        self._target[req.request_id] = len(req.prompt)
        if drafts and self.config.spec_tokens and num_computed == len(req.prompt) - 1:
            self._seeded[req.request_id] = [int(t) for t in drafts]

    def abort(self, request_id: int) -> Request | None:
        """Finish with ABORT; None for an unknown or finished id. Blocks freed after its last
        plan's result."""
        req = self._live.get(request_id) if isinstance(request_id, int) else None
        if req is None:
            return None
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason.ABORT)
        self._free(req)
        return req

    def mask_block(self, block: int) -> list[int]:
        """A faulty KV block (001 §6.3, "masking a faulty memory region"): out of service for
        good (`KVManager.mask`), and every running request that holds it is preempted to
        recompute (its output kept; rows of its in-flight plans are dropped by epoch).
        Returns their ids."""
        if not self.kv.mask(block):
            return []
        hit = [r for r in list(self.running) if r.request_id in self.kv.holders(block)]
        for req in hit:
            self._preempt(req)
        return [r.request_id for r in hit]

    def get(self, request_id: int) -> Request | None:
        """A waiting or running request (None: unknown or finished)."""
        return self._live.get(request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def can_plan(self) -> bool:
        return len(self._inflight) < self.config.async_depth

    def schedule(self) -> StepPlan | None:
        """The next plan, or None (no row to run, or async_depth plans in flight)."""
        if not self.can_plan():
            return None
        step = _Step(self._next_plan, self.config.max_num_batched_tokens)
        self._schedule_running(step, decode=True)
        self._schedule_running(step, decode=False)
        if not step.preempted:  # as vLLM v1: no admission in a step that had to preempt
            self._admit(step)
        if not step.rows:
            return None
        self._next_plan += 1
        plan = StepPlan(step.plan_id, step.rows, list(self._released))
        self._released.clear()
        self._inflight.append((plan, step.reqs))
        return plan

    def on_result(self, plan_id: int, sampled: dict[int, int]) -> StepOutput:
        """Accept the sampled tokens of the oldest plan in flight; finish, cache, free."""
        if not self._inflight or self._inflight[0][0].plan_id != plan_id:
            expect = self._inflight[0][0].plan_id if self._inflight else None
            raise ValueError(f"plan_id {plan_id}: results must arrive in plan order ({expect})")
        plan, reqs = self._inflight.popleft()
        self._last_result = plan_id
        out = StepOutput({}, [], self._preempted)
        self._preempted = []
        done = []
        for row, req in zip(plan.rows, reqs, strict=True):
            live = not req.is_finished and row.epoch == req.epoch
            if live:
                req.num_computed += self._valid(row, req, sampled.get(req.request_id))
                done.append(req)
            if row.sample:
                out.new_tokens[req.request_id] = self._accept(req, sampled, out) if live else []
        for req in done:  # a namespace (cache salt) roots the chain: `ns_root`
            self.kv.cache_blocks(req.request_id, req.all_tokens, req.num_computed, ns_root(req.ns))
        for req in out.finished:
            self._free(req)
        for rid in [r for r, p in self._deferred.items() if p <= plan_id]:
            del self._deferred[rid]
            self.kv.free(rid)
        return out

    def _valid(self, row: Row, req: Request, got) -> int:
        """Positions of `row` whose KV holds the right tokens: all of them, or of a decode row
        with drafts the last token's and the accepted drafts' (one per token emitted); the
        rest are overwritten by the next row (its num_scheduled goes back to them)."""
        if not row.drafts:
            return row.num_tokens
        n = len(got) if isinstance(got, list | tuple) else 1
        if not 1 <= n <= row.num_tokens:
            raise ValueError(f"request {row.request_id}: {n} tokens from a row of"
                             f" {row.num_tokens} positions")  # fmt: skip
        req.num_scheduled -= row.num_tokens - n
        return n

    def stats(self) -> dict:
        return {"running": len(self.running), "waiting": len(self.waiting),
                "num_preemptions": self._num_preemptions, "prefix_hit_tokens": self._hit_tokens,
                "prefix_query_tokens": self._query_tokens,
                "prefix_hit_rate": self._hit_tokens / max(self._query_tokens, 1),
                "kv": self.kv.usage(), "inflight": len(self._inflight),
                "deferred_frees": len(self._deferred)}  # fmt: skip

    def drain_check(self) -> None:
        """Tests: once nothing is running, waiting or in flight, no block is used."""
        busy = (len(self.running), len(self.waiting), len(self._inflight), len(self._deferred))
        if any(busy):
            raise AssertionError(f"not drained: running, waiting, inflight, deferred = {busy}")
        if self.kv.usage()["used"] or self._live or self._target:
            raise AssertionError(f"drained but KV still used: {self.kv.usage()}")
        self.kv.check()

    def _schedule_running(self, step: _Step, decode: bool) -> None:
        """Phase 1 (decode rows) or 2 (continued prefill chunks) over running, in order."""
        k = self.config.spec_tokens
        for req in list(self.running):
            if step.budget == 0:
                return
            if req.status is not RequestStatus.RUNNING or req.request_id in step.planned:
                continue
            start, target = req.num_scheduled, self._target[req.request_id]
            if decode and start >= target:
                left = req.params.max_tokens - len(req.output) - req.pending_samples
                if left <= 0:
                    continue
                drafts = max(0, min(k, left - 1, self.config.max_seq_len - start - 1 - k,
                                    step.budget - 1))  # fmt: skip
                want = self._want(start + drafts)
                if self._grow(req, start + max(1 + drafts, drafts + want), step):
                    self._add_row(step, req, None, 1 + drafts, sample=True, drafts=drafts,
                                  want=want)  # fmt: skip
            elif not decode and req.request_id in self._seeded:
                self._verify_first(step, req)
            elif not decode and start < target:
                n = self._chunk(target - start, step.budget)
                final = start + n == target
                want = self._want(target - 1) if final else 0
                if self._grow(req, start + n + max(0, want - 1), step):
                    toks = req.all_tokens[start : start + n]
                    nxt = req.all_tokens[start + n] if k and not final else -1
                    self._add_row(step, req, toks, n, sample=final, want=want, next_token=nxt)

    def _verify_first(self, step: _Step, req: Request) -> None:
        """A PD request's first row on its decode die (`add_prefilled` with drafts): its last
        prompt token and the prefill die's drafts, k_r capped as a decode row's."""
        start, seeded, k = req.num_scheduled, self._seeded[req.request_id], self.config.spec_tokens
        left = req.params.max_tokens - len(req.output) - req.pending_samples
        drafts = max(0, min(len(seeded), k, left - 1, step.budget - 1,
                            self.config.max_seq_len - start - 1 - k))  # fmt: skip
        want = self._want(start + drafts)
        if self._grow(req, start + max(1 + drafts, drafts + want), step):
            del self._seeded[req.request_id]
            feed = [req.all_tokens[start], *seeded[:drafts]]  # the die has no last token yet
            self._add_row(step, req, None, 1 + drafts, sample=True, drafts=drafts, want=want,
                          feed=feed)  # fmt: skip

    def _want(self, last: int) -> int:
        """MTP drafts a row whose last verified position is `last` can make: the chain's rows
        go past it, before max_seq_len."""
        return max(0, min(self.config.spec_tokens, self.config.max_seq_len - 1 - last))

    def _admit(self, step: _Step) -> None:
        """Phase 3: waiting requests FCFS; stop at the first that cannot start now."""
        while self.waiting and len(self.running) < self.config.max_num_seqs and step.budget:
            req = self.waiting[0]
            rid = req.request_id
            if rid in self._deferred:
                return  # a preempted request's old blocks are not back yet
            tokens = req.all_tokens
            blocks, hit = self.kv.match_by_prefix(tokens, ns_root(req.ns))
            if self.config.spec_tokens and blocks:  # MTP: its last MTP row may not be ours
                blocks, hit = blocks[:-1], hit - self.kv.block_size
            n = self._chunk(len(tokens) - hit, step.budget)
            final = hit + n == len(tokens)
            want = self._want(len(tokens) - 1) if final else 0
            try:
                self.kv.alloc_blocks(rid, hit + n + max(0, want - 1), blocks)
            except KVFull:
                return
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            req.num_computed = req.num_scheduled = hit
            if not req.num_preemptions:  # the prompt's own hit; a recompute's is not the user's
                req.num_cached = min(hit, len(req.prompt))
                self._hit_tokens += hit
                self._query_tokens += len(tokens)
            self._target[rid] = len(tokens)
            nxt = tokens[hit + n] if self.config.spec_tokens and not final else -1
            self._add_row(step, req, tokens[hit : hit + n], n, sample=final, want=want,
                          next_token=nxt)  # fmt: skip

    def _chunk(self, remaining: int, budget: int) -> int:
        cap = self.config.long_prefill_threshold or remaining
        return min(remaining, budget, cap)

    def _grow(self, req: Request, num_tokens: int, step: _Step) -> bool:
        """Make req's table cover num_tokens positions, preempting if needed. False: skip req."""
        while True:
            try:
                self.kv.extend(req.request_id, num_tokens)
                return True
            except KVFull:
                if self._deferred:
                    return False  # blocks come back with an in-flight result: wait, keep all
            later = self.running[self.running.index(req) + 1 :]  # never preempt an older one
            victim = next((r for r in reversed(later) if r.request_id not in step.planned), req)
            self._preempt(victim)
            step.preempted = True
            if victim is req or victim.request_id in self._deferred:
                return False

    def _add_row(self, step: _Step, req: Request, tokens: list[int] | None, n: int,
                 sample: bool, drafts: int = 0, want: int = 0, next_token: int = -1,
                 feed: list[int] | None = None) -> None:  # fmt: skip
        assert n >= 1 and n <= step.budget and req.request_id not in step.planned
        index = req.index_base + len(req.output) + req.pending_samples if sample else -1
        assert index - req.index_base < req.params.max_tokens, (
            f"request {req.request_id}: sample past max_tokens"
        )
        row = Row(req.request_id, req.epoch, req.num_scheduled, tokens, n,
                  self.kv.block_table(req.request_id), sample, index,
                  req.params.temperature, req.params.seed or 0, drafts, want,
                  next_token, feed)  # fmt: skip
        req.num_scheduled += n
        req.pending_samples += sample
        req.last_plan = step.plan_id
        step.budget -= n
        step.rows.append(row)
        step.reqs.append(req)
        step.planned.add(req.request_id)

    def _accept(self, req: Request, sampled: dict, out: StepOutput) -> list[int]:
        """Append the row's sampled token(s) (an int, or an MTP row's list) to req.output, one
        by one; finish on a stop condition (the tokens after it are dropped). Returns the
        tokens appended."""
        if req.request_id not in sampled:
            raise ValueError(f"sampled has no token for request {req.request_id}")
        got = sampled[req.request_id]
        toks = [int(t) for t in got] if isinstance(got, list | tuple) else [int(got)]
        req.pending_samples -= 1
        p = req.params
        kept = []
        for tok in toks:
            req.output.append(tok)
            kept.append(tok)
            if (tok == req.eos_token_id and not p.ignore_eos) or tok in p.stop_token_ids:
                self._finish(req, FinishReason.STOP)
                out.finished.append(req)
                break
            if len(req.output) >= p.max_tokens:
                self._finish(req, FinishReason.LENGTH)
                out.finished.append(req)
                break
        return kept

    def _preempt(self, req: Request) -> None:
        """Recompute later: drop KV (deferred), keep output, back to the front of waiting."""
        self._seeded.pop(req.request_id, None)
        self.running.remove(req)
        del self._target[req.request_id]
        req.status = RequestStatus.WAITING
        req.epoch += 1
        req.num_computed = req.num_scheduled = req.pending_samples = 0
        req.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(req)
        self._released[req.request_id] = None
        self._preempted.append(req.request_id)
        self._free(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        assert not req.is_finished, f"request {req.request_id} finished twice"
        self._seeded.pop(req.request_id, None)
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            del self._target[req.request_id]
        del self._live[req.request_id]
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        self._released[req.request_id] = None

    def _free(self, req: Request) -> None:
        """Free req's blocks now, or after the result of its last plan if that is in flight."""
        if req.request_id in self._deferred:
            return
        if req.is_finished and req.request_id in self.lease:
            key = self.lease.pop(req.request_id)
            if req.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                self.kv.rename(req.request_id, key)  # its last plan's result is in: KV written
                return
        if req.last_plan > self._last_result:
            self._deferred[req.request_id] = req.last_plan
        else:
            self.kv.free(req.request_id)
