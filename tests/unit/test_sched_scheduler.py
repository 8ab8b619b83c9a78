"""sched.scheduler.Scheduler against a fake die.

The fake die executes plans in order like the real one: it keeps a paged KV (block, slot) ->
token, checks that every row reads the right tokens at every earlier position and carries the
right tokens, feeds decode rows its own last sampled token, and samples token i of request r
as `tok(r, i)` (EOS or a stop id at chosen indices). So a wrong block table, an early reused
block, a wrong prefix hit or a wrong recompute row fails at the die, like it would on a pod.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched import (
    FinishReason,
    KVManager,
    Request,
    RequestStatus,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
    StepPlan,
)

V, EOS = 50, 0


@dataclass
class Spec:
    """What the fake die samples for one request: tok(i) = EOS at eos_at, else a fixed stream."""

    rid: int
    prompt: list[int]
    eos_at: int | None = None

    def tok(self, i: int) -> int:
        return EOS if i == self.eos_at else (self.rid * 7 + i) % (V - 1) + 1

    def at(self, p: int) -> int:
        """Expected token at position p of prompt + output."""
        n = len(self.prompt)
        return self.prompt[p] if p < n else self.tok(p - n)


class FakeDie:
    def __init__(self, block_size: int):
        self.bs = block_size
        self.mem: dict[tuple[int, int], int] = {}
        self.last: dict[int, tuple[int, int, int]] = {}  # request -> (epoch, position, token)
        self.specs: dict[int, Spec] = {}

    def run(self, plan: StepPlan) -> dict[int, int]:
        for rid in plan.released:
            self.last.pop(rid, None)
        return {r.request_id: t for r in plan.rows if (t := self.row(r)) is not None}

    def row(self, r) -> int | None:
        spec, bs, end = self.specs[r.request_id], self.bs, r.start + r.num_tokens
        assert len(r.block_table) * bs >= end, "block table does not cover the row"
        if r.tokens is None:
            epoch, pos, t = self.last[r.request_id]
            assert (epoch, pos, r.num_tokens) == (r.epoch, r.start, 1), "decode row out of step"
            toks = [t]
        else:
            toks = r.tokens
            assert len(toks) == r.num_tokens >= 1
        assert toks == [spec.at(p) for p in range(r.start, end)], "row carries wrong tokens"
        for p in range(r.start):
            got = self.mem.get((r.block_table[p // bs], p % bs))
            assert got == spec.at(p), f"request {r.request_id} reads {got} at {p}"
        for p, t in zip(range(r.start, end), toks, strict=True):
            self.mem[(r.block_table[p // bs], p % bs)] = t
        if not r.sample:
            assert r.token_index == -1
            return None
        assert r.token_index == end - len(spec.prompt), "sample index differs from the position"
        t = spec.tok(r.token_index)
        self.last[r.request_id] = (r.epoch, end, t)
        return t


@dataclass
class Sim:
    """Drives a Scheduler with the fake die, keeping up to async_depth plans in flight."""

    cfg: SchedulerConfig
    kv: KVManager
    sched: Scheduler = None
    die: FakeDie = None
    inflight: collections.deque = field(default_factory=collections.deque)
    reqs: dict[int, Request] = field(default_factory=dict)
    finished: dict[int, FinishReason] = field(default_factory=dict)
    plans: list[StepPlan] = field(default_factory=list)
    next_id: int = 0

    def __post_init__(self):
        self.sched = Scheduler(self.cfg, self.kv)
        self.die = FakeDie(self.kv.block_size)

    def add(self, prompt, max_tokens, eos_at=None, stop_at=None, ignore_eos=False) -> Request:
        rid, self.next_id = self.next_id, self.next_id + 1
        spec = Spec(rid, list(prompt), eos_at)
        stop = () if stop_at is None else (spec.tok(stop_at),)
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop, ignore_eos=ignore_eos)
        req = Request(rid, list(prompt), params, eos_token_id=EOS)
        self.die.specs[rid] = spec
        self.sched.add(req)
        self.reqs[rid] = req
        return req

    def plan(self) -> StepPlan | None:
        plan = self.sched.schedule()
        if plan is not None:
            self.check_plan(plan)
            self.inflight.append(plan)
            self.plans.append(plan)
        self.check()
        return plan

    def result(self):
        plan = self.inflight.popleft()
        out = self.sched.on_result(plan.plan_id, self.die.run(plan))
        for req in out.finished:
            self.finish(req)
        self.check()
        return out

    def abort(self, rid: int) -> None:
        req = self.sched.abort(rid)
        assert (req is None) == (rid in self.finished or rid not in self.reqs)
        if req is not None:
            assert req.finish_reason is FinishReason.ABORT
            self.finish(req)
        self.check()

    def step(self):
        """One master-loop turn: plan if there is room and work, else take the oldest result."""
        if self.sched.can_plan() and self.plan() is not None:
            return True
        if self.inflight:
            self.result()
            return True
        return False

    def drain(self) -> None:
        for _ in range(20_000):
            if not self.step():
                break
        assert not self.sched.has_work(), "work left but nothing to plan or wait for"
        self.sched.drain_check()
        assert self.kv.usage()["used"] == 0
        assert set(self.finished) == set(self.reqs)

    def finish(self, req: Request) -> None:
        rid, spec = req.request_id, self.die.specs[req.request_id]
        assert rid not in self.finished, f"request {rid} finished twice"
        assert req.status is RequestStatus.FINISHED
        self.finished[rid] = req.finish_reason
        p = req.params
        assert req.output == [spec.tok(i) for i in range(len(req.output))]
        stops = [i for i, t in enumerate(req.output) if t in p.stop_token_ids or
                 (t == EOS and not p.ignore_eos)]  # fmt: skip
        if req.finish_reason is FinishReason.STOP:
            assert stops == [len(req.output) - 1]
        elif req.finish_reason is FinishReason.LENGTH:
            assert len(req.output) == p.max_tokens and not stops
        else:
            assert req.finish_reason is FinishReason.ABORT and len(req.output) <= p.max_tokens

    def check_plan(self, plan: StepPlan) -> None:
        assert 1 <= plan.num_tokens <= self.cfg.max_num_batched_tokens
        assert plan.plan_id == len(self.plans)
        ids = [r.request_id for r in plan.rows]
        assert len(set(ids)) == len(ids) and len(set(plan.released)) == len(plan.released)
        for r in plan.rows:
            req = self.reqs[r.request_id]
            assert r.request_id not in self.finished, "row of a finished request"
            assert not r.sample or r.token_index < req.params.max_tokens, "sample past max_tokens"
        live = [r for p in self.inflight for r in p.rows] + plan.rows
        for i, r in enumerate(plan.rows):
            for o in live[: len(live) - len(plan.rows) + i]:
                if (o.request_id, o.epoch) != (r.request_id, r.epoch):
                    self.check_no_overlap(r, o)

    def check_no_overlap(self, r, o) -> None:
        """Rows of different requests (or epochs) in flight together: neither writes a block the
        other holds (shared prefix blocks are read by both)."""
        bs = self.kv.block_size
        for a, b in ((r, o), (o, r)):
            written = set(a.block_table[a.start // bs : (a.start + a.num_tokens - 1) // bs + 1])
            assert not written & set(b.block_table), f"plans in flight share a written block {a}"

    def check(self) -> None:
        self.kv.check()
        s = self.sched
        assert len(s.running) <= self.cfg.max_num_seqs
        for req in s.running:
            assert req.status is RequestStatus.RUNNING
            assert 0 <= req.num_computed <= req.num_scheduled
            assert req.num_cached <= len(req.all_tokens) - 1
            assert len(self.kv.block_table(req.request_id)) * self.kv.block_size >= (
                req.num_scheduled
            )
            assert len(req.output) + req.pending_samples <= req.params.max_tokens
        for req in s.waiting:
            assert req.status is RequestStatus.WAITING and req.pending_samples == 0


def make(budget=64, seqs=4, max_len=64, blocks=64, bs=4, depth=2, threshold=0, cache=True):
    cfg = SchedulerConfig(seqs, budget, max_len, long_prefill_threshold=threshold,
                          async_depth=depth)  # fmt: skip
    return Sim(cfg, KVManager(blocks, bs, enable_prefix_cache=cache))


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


# ---- by hand ----------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_splits_and_the_final_chunk_samples(depth):
    sim = make(budget=4, depth=depth)
    req = sim.add(prompt(10), max_tokens=3)
    while sim.step():
        pass
    rows = [r for p in sim.plans for r in p.rows]
    assert [(r.start, r.num_tokens, r.sample) for r in rows[:3]] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, True),
    ]
    assert rows[2].tokens == prompt(10)[8:] and rows[2].token_index == 0
    assert [(r.start, r.tokens, r.token_index) for r in rows[3:]] == [(10, None, 1), (11, None, 2)]
    assert req.finish_reason is FinishReason.LENGTH and len(req.output) == 3
    sim.drain()


def test_long_prefill_threshold_caps_each_chunk():
    sim = make(budget=16, threshold=3)
    sim.add(prompt(7), max_tokens=1)
    sim.add(prompt(5, 300), max_tokens=1)
    plan = sim.plan()
    assert [(r.request_id, r.num_tokens) for r in plan.rows] == [(0, 3), (1, 3)]
    sim.drain()


def test_async_plans_run_ahead_and_length_never_overshoots():
    sim = make(depth=3)
    req = sim.add(prompt(5), max_tokens=2)
    p0, p1 = sim.plan(), sim.plan()
    assert p0.rows[0].sample and p0.rows[0].token_index == 0
    assert p1.rows[0].tokens is None and p1.rows[0].start == 5 and p1.rows[0].token_index == 1
    assert sim.sched.can_plan() and sim.plan() is None  # both samples planned: nothing more
    assert req.num_scheduled == 6 and req.num_computed == 0 and req.pending_samples == 2
    sim.result()
    assert req.num_computed == 5 and req.output == [sim.die.specs[0].tok(0)]
    out = sim.result()
    assert out.finished == [req] and req.finish_reason is FinishReason.LENGTH
    sim.drain()


def test_eos_seen_late_drops_the_next_row_and_releases_once():
    sim = make(depth=2)
    a = sim.add(prompt(4), max_tokens=5, eos_at=0)
    sim.plan()
    p1 = sim.plan()
    assert [r.request_id for r in p1.rows] == [0]  # decode of a before its EOS is known
    out = sim.result()
    assert out.finished == [a] and a.output == [EOS] and a.finish_reason is FinishReason.STOP
    assert sim.kv.usage()["used"] > 0  # p1 still writes a's blocks: free deferred
    sim.add(prompt(4, 200), max_tokens=1)
    p2 = sim.plan()
    assert p2.released == [0]
    out = sim.result()
    assert out.new_tokens == {0: []} and out.finished == [] and a.output == [EOS]
    assert sim.kv.usage()["used"] == 1  # only the second request's block
    sim.drain()
    assert all(0 not in p.released for p in sim.plans[3:])


def test_stop_token_is_part_of_output_and_ignore_eos():
    sim = make()
    a = sim.add(prompt(3), max_tokens=6, stop_at=2)
    b = sim.add(prompt(3, 200), max_tokens=3, eos_at=1, ignore_eos=True)
    sim.drain()
    assert a.finish_reason is FinishReason.STOP and len(a.output) == 3
    assert b.finish_reason is FinishReason.LENGTH and b.output[1] == EOS


def test_prefix_hit_skips_cached_blocks_and_keeps_one_token():
    sim = make(bs=4)
    a = sim.add(prompt(8), max_tokens=1)
    sim.drain()
    b = sim.add(prompt(8), max_tokens=2)
    c = sim.add(prompt(10), max_tokens=1)
    plan = sim.plan()
    assert (b.num_cached, c.num_cached) == (4, 8)  # b: hit <= len - 1
    assert [(r.start, r.num_tokens) for r in plan.rows] == [(4, 4), (8, 2)]
    assert sim.sched.stats()["prefix_hit_tokens"] == 12
    sim.drain()
    assert a.output and b.output and c.output


@pytest.mark.parametrize("depth", [1, 2])
def test_preemption_recomputes_prompt_plus_output_and_drops_old_epoch(depth):
    # 4 blocks of 2: two requests of 3 + 3 positions each cannot both grow to 4 blocks
    sim = make(blocks=4, bs=2, max_len=8, seqs=2, depth=depth)
    a = sim.add(prompt(3), max_tokens=5)
    b = sim.add(prompt(3, 200), max_tokens=5)
    while not b.num_preemptions:
        assert sim.step()
    assert a.num_preemptions == 0 and b.status is RequestStatus.WAITING and b.epoch == 1
    assert sim.sched.waiting[0] is b
    kept = list(b.output)
    assert kept, "b sampled before it was preempted"
    while not any(r.request_id == 1 and r.epoch == 1 for p in sim.plans for r in p.rows):
        out = sim.result() if sim.inflight else None
        if out is not None and 1 in out.new_tokens:
            assert out.new_tokens[1] == []  # an old-epoch row: dropped
        if sim.sched.can_plan():
            sim.plan()
    row = next(r for p in sim.plans for r in p.rows if r.request_id == 1 and r.epoch == 1)
    assert row.tokens[: len(prompt(3)) - row.start] == prompt(3, 200)[row.start :]
    assert b.output[: len(kept)] == kept
    assert any(1 in p.released for p in sim.plans)
    sim.drain()
    assert a.finish_reason is b.finish_reason is FinishReason.LENGTH
    assert sim.sched.stats()["num_preemptions"] >= 1


def test_blocks_are_cached_only_after_their_result():
    sim = make(budget=4, bs=4, depth=2)
    sim.add(prompt(8), max_tokens=1)
    sim.plan()
    sim.plan()  # writes block 1 (positions 4..7)
    sim.result()  # block 0 known written, block 1 still in flight
    b = sim.add(prompt(9), max_tokens=1)
    sim.plan()
    assert b.num_cached == 4
    sim.drain()


def test_a_pending_deferred_free_makes_a_request_wait_not_preempt():
    sim = make(budget=64, blocks=8, bs=2, max_len=16, depth=2)
    a = sim.add(prompt(4), max_tokens=2, eos_at=0)
    b = sim.add(prompt(9, 200), max_tokens=4)
    sim.plan()  # a: 2 blocks, b: 5 blocks
    sim.plan()  # decode both: a takes the last free block
    sim.result()  # a stops; its blocks come back after plan 1's result
    assert a.is_finished and sim.kv.num_free() == 0
    assert sim.sched.schedule() is None  # b needs a block: it waits, nobody is preempted
    sim.result()
    assert sim.kv.num_free() == 3 and sim.plan().rows[0].request_id == b.request_id
    sim.drain()
    assert sim.sched.stats()["num_preemptions"] == 0 and len(b.output) == 4


def test_abort_frees_at_once_or_after_the_last_plan():
    sim = make(depth=2)
    a = sim.add(prompt(5), max_tokens=4)
    b = sim.add(prompt(5, 200), max_tokens=4)
    assert sim.sched.abort(99) is None and sim.sched.abort([1]) is None
    sim.abort(1)  # waiting: no blocks
    assert b.finish_reason is FinishReason.ABORT and b.output == []
    sim.plan()
    sim.abort(0)
    assert sim.kv.usage()["used"] == 2  # plan 0 still writes a's blocks
    assert sim.sched.abort(0) is None
    out = sim.result()
    assert out.new_tokens == {0: []} and a.output == [] and sim.kv.usage()["used"] == 0
    assert sim.plan() is None and not sim.sched.has_work()
    sim.drain()


def test_results_must_come_in_plan_order():
    sim = make(depth=2)
    sim.add(prompt(3), max_tokens=3)
    sim.plan()
    sim.plan()
    with pytest.raises(ValueError, match="plan order"):
        sim.sched.on_result(1, {})
    with pytest.raises(ValueError, match="no token"):
        sim.sched.on_result(0, {})


def test_depth_limits_plans_in_flight():
    sim = make(depth=1)
    sim.add(prompt(3), max_tokens=3)
    assert sim.plan() is not None and not sim.sched.can_plan() and sim.sched.schedule() is None
    sim.drain()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, True]), "prompt"),
        (dict(prompt=(1, 2)), "prompt"),
        (dict(prompt=[1, -2]), "prompt"),
        (dict(params=SamplingParams(max_tokens=60)), "max_seq_len"),
        (dict(params=SamplingParams(max_tokens=0)), "max_tokens"),
        (dict(request_id=0), "already in use"),
    ],
)
def test_add_refuses_bad_requests(change, match):
    sim = make()
    sim.add(prompt(3), max_tokens=1)
    fields = dict(request_id=5, prompt=prompt(10), params=SamplingParams())
    with pytest.raises(ValueError, match=match):
        sim.sched.add(Request(**{**fields, **change}))


def test_config_is_checked():
    with pytest.raises(ValueError, match="async_depth"):
        SchedulerConfig(1, 1, 1, async_depth=0)
    with pytest.raises(ValueError, match="long_prefill_threshold"):
        SchedulerConfig(1, 1, 1, long_prefill_threshold=-1)
    with pytest.raises(ValueError, match="max_seq_len"):
        Scheduler(SchedulerConfig(1, 8, 17), KVManager(4, 4))


@pytest.mark.parametrize(
    ("params", "exc", "match"),
    [
        (SamplingParams(max_tokens=0), ValueError, "max_tokens"),
        (SamplingParams(max_tokens=True), TypeError, "max_tokens"),
        (SamplingParams(temperature=-0.5), ValueError, "temperature"),
        (SamplingParams(temperature=float("nan")), ValueError, "temperature"),
        (SamplingParams(temperature="1"), TypeError, "temperature"),
        (SamplingParams(seed=-1), ValueError, "seed"),
        (SamplingParams(seed=1.0), TypeError, "seed"),
        (SamplingParams(stop_token_ids=(3, 50)), ValueError, "stop_token_ids"),
        (SamplingParams(stop_token_ids=(False,)), TypeError, "stop_token_ids"),
        (SamplingParams(stop_token_ids=3), TypeError, "stop_token_ids"),
        (SamplingParams(ignore_eos=1), TypeError, "ignore_eos"),
    ],
)
def test_sampling_params_validate(params, exc, match):
    with pytest.raises(exc, match=match):
        params.validate(V)


def test_sampling_params_validate_accepts_good_values():
    SamplingParams(max_tokens=3, temperature=0.7, seed=9, stop_token_ids=(0, 49)).validate(V)
    SamplingParams(temperature=1).validate(V)


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_many_requests_tight_kv_all_finish(depth):
    sim = make(budget=8, seqs=4, max_len=24, blocks=8, bs=4, depth=depth, threshold=5)
    for i in range(12):
        sim.add(prompt(3 + i % 9, 100 * (i % 3)), max_tokens=1 + (i * 5) % 12,
                eos_at=(i % 4) if i % 3 == 0 else None)  # fmt: skip
        sim.step()
    sim.drain()
    assert sim.sched.stats()["num_preemptions"] > 0
    for rid, req in sim.reqs.items():
        spec = sim.die.specs[rid]
        n = req.params.max_tokens
        want = n if spec.eos_at is None or spec.eos_at >= n else spec.eos_at + 1
        assert len(req.output) == want


# ---- random streams -----------------------------------------------------------------------------

ADD = st.tuples(
    st.just("add"),
    st.integers(1, 14),  # prompt length
    st.integers(1, 8),  # max_tokens
    st.integers(0, 2),  # prompt family (shared prefixes)
    st.one_of(st.none(), st.integers(0, 7)),  # EOS index
    st.one_of(st.none(), st.integers(0, 7)),  # stop id index
    st.booleans(),  # ignore_eos
)
OP = st.one_of(
    ADD,
    st.tuples(st.just("step")),
    st.tuples(st.just("result")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(OP, max_size=50),
    depth=st.integers(1, 3),
    budget=st.integers(1, 12),
    seqs=st.integers(1, 4),
    bs=st.integers(1, 4),
    extra_blocks=st.integers(0, 6),
    threshold=st.integers(0, 5),
    cache=st.booleans(),
)
def test_random_streams(ops, depth, budget, seqs, bs, extra_blocks, threshold, cache):
    max_len = 16
    blocks = -(-max_len // bs) + extra_blocks  # tiny: one full-length request always fits
    sim = make(budget, seqs, max_len, blocks, bs, depth, threshold, cache)
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, fam, eos_at, stop_at, ignore = op
            n = min(n, max_len - max_tokens)
            if n >= 1:
                sim.add(prompt(n, 100 * fam), max_tokens, eos_at, stop_at, ignore)
        elif op[0] == "step" and sim.sched.can_plan():
            sim.plan()
        elif op[0] == "result" and sim.inflight:
            sim.result()
        elif op[0] == "abort":
            sim.abort(op[1])
    sim.drain()
    for rid, req in sim.reqs.items():
        if req.finish_reason is not FinishReason.ABORT:
            spec, n = sim.die.specs[rid], req.params.max_tokens
            want = [spec.tok(i) for i in range(n)]
            stops = [i for i, t in enumerate(want) if t in req.params.stop_token_ids
                     or (t == EOS and not req.params.ignore_eos)]  # fmt: skip
            assert req.output == want[: stops[0] + 1 if stops else n]
