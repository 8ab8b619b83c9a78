"""The serving engine end to end: real dies, masters and rings (issue 9).

- schedule replay: what was served equals, bit for bit, the single-process reference replaying
  the masters' step log (chunked prefill, prefix hits, forced preemption, seeded sampling);
- no request lost or duplicated under load with aborts; KV fully free afterwards;
- lockstep corner cases: idle pod, a burst on one group, every group finishing in one step;
- bad inputs get clear errors and the engine keeps serving; streams and early exits.
"""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import zmq

from memory import layout as L
from runtime.engine import Engine, EngineError
from runtime.engine.replay import replay
from runtime.engine.wire import master_socket
from runtime.model import EOS
from sched import SamplingParams
from tests.waiting import wait_for

TINY = dict(model="tiny", timeout_s=20.0)


def settled(eng: Engine) -> dict:
    """Wait until every group reports nothing running, waiting or in use; return the stats."""

    def idle():
        st = eng.stats
        return (
            len(st) == eng.config.dies
            and all(
                s["running"] == 0
                and s["waiting"] == 0
                and s["kv"]["used"] == 0
                and s["inflight"] == 0
                for s in st.values()
            )
            and st
        )

    return wait_for(idle, what=f"the groups to settle: {eng.stats}")


def parked(eng: Engine) -> None:
    """Wait until every die is parked (its progress word's state: idle, asleep on its bell)."""
    park = L.PROGRESS_STATES.index("park")
    wait_for(lambda: all(L.unpack_progress(w)[3] == park for w in eng.progress_words() or [0]),
             what="every die to park")  # fmt: skip


@pytest.fixture(scope="module")
def engine():
    with Engine.launch(dies=2, max_num_seqs=4, max_num_batched_tokens=32, **TINY) as eng:
        yield eng


# -- correctness: the schedule replay ----------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_depth", [2, 1])
def test_served_tokens_and_logits_equal_a_replay_of_the_schedule(async_depth):
    """Prompts longer than the token budget (chunked prefill), shared prefixes (prefix hits),
    a KV pool of 16 blocks for 4 sequences of up to 200 tokens (preemption by recompute), greedy
    and seeded sampling, EOS allowed: every sampled token and its logits equal the replay."""
    base = "the quick brown fox jumps over the lazy dog, " * 2
    prompts = [base + "x" * (i % 7) for i in range(10)] + ["y" * 70, "short", "z" * 33]
    params = [
        SamplingParams(max_tokens=40 + 7 * (i % 5), temperature=0.8 * (i % 2), seed=i)
        for i in range(len(prompts))
    ]
    with Engine.launch(dies=2, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=16,
                       async_depth=async_depth, log_steps=True, keep_logits=True,
                       **TINY) as eng:  # fmt: skip
        outs = eng.generate(prompts, params, timeout_s=120)
        stats = settled(eng)
        m, c = eng.model, eng.config
    logs = eng.step_log
    assert {o.finish_reason for o in outs} <= {"stop", "length"}, outs
    assert sum(s["num_preemptions"] for s in stats.values()) > 0, "the pool must force preemption"
    assert sum(s["prefix_hit_tokens"] for s in stats.values()) > 0, "shared prefixes must hit"
    rows = [r for g in logs.values() for step in g for r in step["rows"]]
    assert any(len(r[1]) == 32 and not r[4] for r in rows), "a long prompt must be chunked"
    rep = replay(m, c.dies, c.quant, c.blocks, c.block_size, logs, c.combine_dtype)
    assert rep.sampled == sum(len(o.token_ids) for o in outs) + _dropped(logs, outs)
    assert rep.token_mismatches == [] and rep.logit_mismatches == [], rep
    assert rep.bit_equal and rep.logits_compared == rep.sampled


def _dropped(logs: dict, outs: list) -> int:
    """Sampled rows whose token was dropped (EOS seen a step late, an older epoch)."""
    sampled = sum(len(step["sampled"]) for g in logs.values() for step in g)
    return sampled - sum(len(o.token_ids) for o in outs)


# -- no lost or duplicated requests ---------------------------------------------------------------


@pytest.mark.timeout(240)
def test_many_requests_with_random_aborts_each_end_exactly_once(engine):
    rng = random.Random(7)
    n = 520
    params = [SamplingParams(max_tokens=rng.randint(1, 6), ignore_eos=rng.random() < 0.5,
                             temperature=rng.choice([0.0, 1.0]), seed=i)
              for i in range(n)]  # fmt: skip
    prompts = [rng.choice(["a", "hello pod", "lorem ipsum dolor sit amet " * 3]) + str(i)
               for i in range(n)]  # fmt: skip
    ids = [engine.submit(p, sp) for p, sp in zip(prompts, params, strict=True)]
    aborted = set(rng.sample(ids, n // 10))
    for rid in aborted:
        time.sleep(rng.random() * 0.002)
        engine.abort(rid)
    outs = [engine.result(rid, timeout_s=180) for rid in ids]
    assert [o.request_id for o in outs] == ids  # one terminal result each, in order
    for o, sp in zip(outs, params, strict=True):
        assert o.finish_reason in ("stop", "length", "abort"), o
        assert len(o.token_ids) <= sp.max_tokens
        if o.finish_reason == "length":
            assert len(o.token_ids) == sp.max_tokens
        if o.finish_reason == "stop":
            assert o.token_ids[-1] == EOS and not sp.ignore_eos
        if o.request_id not in aborted:
            assert o.finish_reason != "abort", o
    assert sum(o.finish_reason == "abort" for o in outs) <= len(aborted)
    st = settled(engine)
    assert all(s["kv"]["used"] == 0 for s in st.values())
    for rid in ids:  # each result is handed out once
        with pytest.raises(KeyError):
            engine.result(rid, timeout_s=0)


def test_stream_yields_every_token_then_finishes(engine):
    async def collect():
        deltas = []
        async for d in engine.stream("stream me", SamplingParams(max_tokens=7, ignore_eos=True)):
            deltas.append(d)
        return deltas

    deltas = asyncio.run(collect())
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 7


def test_leaving_a_stream_early_aborts_the_request_and_frees_its_blocks(engine):
    async def first_two():
        got = []
        async for d in engine.stream("abort me", SamplingParams(max_tokens=200, ignore_eos=True)):
            got.append(d)
            if len(got) == 2:
                break
        return got

    assert len(asyncio.run(first_two())) == 2
    settled(engine)


# -- lockstep corner cases -----------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_idle_then_a_burst_on_one_group_then_every_group_finishing_together(engine):
    settled(engine)
    parked(engine)
    outs = engine.generate(["burst"] * 6, SamplingParams(max_tokens=5, ignore_eos=True),
                           timeout_s=60, group=1)  # fmt: skip
    assert [len(o.token_ids) for o in outs] == [5] * 6 and {o.group for o in outs} == {1}
    settled(engine)
    same = SamplingParams(max_tokens=9, ignore_eos=True)  # equal lengths: they end in one step
    ids = [engine.submit("together", same, group=g) for g in (0, 1) for _ in range(4)]
    outs = [engine.result(i, timeout_s=60) for i in ids]
    assert all(len(o.token_ids) == 9 for o in outs)
    settled(engine)
    parked(engine)  # idle again, then one more request
    assert engine.generate("again", SamplingParams(max_tokens=3), timeout_s=30)[0].token_ids


# -- bad input ------------------------------------------------------------------------------------

BAD = [
    ("", SamplingParams(), ValueError, "empty"),
    ([], SamplingParams(), ValueError, "empty"),
    ("x" * 300, SamplingParams(max_tokens=4), ValueError, "context"),
    ("hi", SamplingParams(max_tokens=255), ValueError, "context"),
    ([1, 2, 99999], SamplingParams(), ValueError, "token ids"),
    ([1, -1], SamplingParams(), ValueError, "token ids"),
    ("hi", SamplingParams(max_tokens=-1), ValueError, "max_tokens"),
    ("hi", SamplingParams(max_tokens=0), ValueError, "max_tokens"),
    ("hi", SamplingParams(temperature=-0.5), ValueError, "temperature"),
    ("hi", SamplingParams(stop_token_ids=(1000,)), ValueError, "stop_token_ids"),
    ("hi", SamplingParams(seed=-1), ValueError, "seed"),
    (42, SamplingParams(), TypeError, "prompt"),
    ([1.5, 2], SamplingParams(), TypeError, "prompt"),
    ("hi", {"max_tokens": 3}, TypeError, "SamplingParams"),
]


@pytest.mark.parametrize("prompt, params, exc, words", BAD)
def test_bad_request_is_refused_and_the_engine_keeps_serving(engine, prompt, params, exc, words):
    with pytest.raises(exc, match=words):
        engine.submit(prompt, params)
    out = engine.generate("still here", SamplingParams(max_tokens=2), timeout_s=30)[0]
    assert out.finish_reason in ("stop", "length")


def test_bad_group_and_unknown_ids(engine):
    with pytest.raises(ValueError, match="group"):
        engine.submit("x", group=7)
    engine.abort(10**9)  # unknown: no-op
    with pytest.raises(KeyError):
        engine.result(10**9, timeout_s=0)


def test_garbage_frames_to_a_master_are_dropped(engine):
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 500)
    s.connect(master_socket(engine.run_dir, 0))
    for frame in (b"not msgpack \xff", b"\x93\x01\x02\x03", b"\x94\xa4xpod\xa3add\x01\xc0"):
        s.send(frame)
    s.close()
    ctx.term()
    out = engine.generate("after garbage", SamplingParams(max_tokens=3), timeout_s=30, group=0)
    assert out[0].finish_reason in ("stop", "length")


def test_closed_engine_refuses_requests():
    eng = Engine.launch(dies=2, **TINY)
    eng.close()
    with pytest.raises(EngineError, match="closed"):
        eng.submit("late")
    eng.close()  # idempotent


@pytest.mark.timeout(120)
def test_trace_has_master_tracks_above_the_dies_and_the_serving_loop(tmp_path):
    import json

    path = tmp_path / "serve.json"
    with Engine.launch(dies=2, trace=str(path), **TINY) as eng:
        eng.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=5))
    events = json.loads(path.read_text())["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert procs == {0: "die 0", 1: "die 1", -1: "master 0", -2: "master 1"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e["name"] == "process_sort_index"}
    assert max(order[-1], order[-2]) < min(order[0], order[1])  # masters above the dies
    names = {e["name"] for e in events}
    assert {"serve step", "serve vote", "model attention", "model dispatch"} <= names
    assert any(n.startswith("plan (") for n in names) and any(
        n.startswith("results (") for n in names
    )
    counters = [e for e in events if e["ph"] == "C"]
    assert counters and {"running", "waiting", "kv_blocks_used"} <= set(counters[0]["args"])


@pytest.mark.timeout(120)
def test_concurrent_streams_deliver_every_token_once(engine):
    """40 streams at once, every fourth left early: the others see exactly max_tokens tokens
    over their deltas, then one finish; the left ones are aborted and their blocks freed."""

    async def one(i: int):
        n = 3 + i % 5
        got, reasons = [], []
        async for d in engine.stream(f"s{i}", SamplingParams(max_tokens=n, ignore_eos=True)):
            got.extend(d.token_ids)
            if d.finish_reason:
                reasons.append(d.finish_reason)
            if i % 4 == 3 and got:
                break
        return i, n, got, reasons

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(40)))

    for i, n, got, reasons in asyncio.run(all_of_them()):
        if i % 4 == 3:
            assert reasons == [] and 0 < len(got) <= n
        else:
            assert reasons == ["length"] and len(got) == n, (i, got, reasons)
    settled(engine)
