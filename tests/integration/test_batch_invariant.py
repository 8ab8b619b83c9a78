"""Batch-invariant mode (`ModelConfig.batch_invariant`, `--batch-invariant`): a request's logits
do not depend on its batch mates, chunked prefill or prefill against decode, so greedy output
does not change under load and a stream recomputed after a restart equals the fault-free run bit
for bit, logits included. The control (mode off) shows the logits do change with the batch."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from runtime.engine import Engine, wire
from sched import SamplingParams

TINY = dict(dies=2, model="tiny", timeout_s=20.0, max_num_batched_tokens=24, log_steps=True,
            keep_logits=True)  # fmt: skip
PROMPT = "a request that must not care about its neighbours"
OTHERS = [f"neighbour {i} " * (1 + i % 5) for i in range(10)]


def logits_by_index(eng: Engine, rid: int) -> dict[int, np.ndarray]:
    """Output index -> the logits row the request sampled it from (the masters' step logs)."""
    out = {}
    for records in eng.step_log.values():
        for rec in records:
            if rec.get("logits") is None:
                continue
            lg = wire.unpack_array(rec["logits"])
            samp = [r for r in rec["rows"] if r[4]]
            for row, vec in zip(samp, lg, strict=True):
                if row[0] == rid:
                    out[row[5]] = vec.copy()
    return out


def streamed(eng: Engine, prompt: str, p: SamplingParams, group: int) -> tuple[int, list[int]]:
    """A streamed request (its tokens reach the shell as they come: a restart resumes it from
    them): (request id, token ids)."""

    async def run() -> tuple[int, list[int]]:
        ids, rid = [], -1
        async for d in eng.stream(prompt, p, group=group):
            rid = d.request_id
            ids += d.token_ids
            assert d.finish_reason in (None, "length"), d
        return rid, ids

    return asyncio.run(run())


def alone_and_loaded(invariant: bool, **extra) -> tuple:
    """The same request alone (streamed), then among 10 others of other lengths (chunked
    prefills)."""
    with Engine.launch(**TINY, model_overrides={"batch_invariant": invariant}, **extra) as eng:
        p = SamplingParams(max_tokens=48, ignore_eos=True)
        a, toks = streamed(eng, PROMPT, p, 0)
        alone = SimpleNamespace(token_ids=toks)
        ids = [eng.submit(o, SamplingParams(max_tokens=20 + 5 * i, ignore_eos=True), group=i % 2)
               for i, o in enumerate(OTHERS[:5])]  # fmt: skip
        b = eng.submit(PROMPT, p, group=0)
        ids += [eng.submit(o, SamplingParams(max_tokens=30, ignore_eos=True), group=i % 2)
                for i, o in enumerate(OTHERS[5:])]  # fmt: skip
        loaded = eng.result(b, 60)
        for i in ids:
            eng.result(i, 60)
        rel = eng.reliability()
    return alone, loaded, logits_by_index(eng, a), logits_by_index(eng, b), rel


@pytest.mark.timeout(120)
def test_logits_do_not_depend_on_the_batch():
    alone, loaded, la, lb, _ = alone_and_loaded(True)
    assert loaded.token_ids == alone.token_ids
    assert sorted(la) == sorted(lb) == list(range(48))
    for i in range(48):
        assert np.array_equal(la[i], lb[i]), f"token {i}: logits differ"


@pytest.mark.timeout(120)
def test_control_without_the_mode_logits_change_with_the_batch():
    _, _, la, lb, _ = alone_and_loaded(False)
    assert any(not np.array_equal(la[i], lb[i]) for i in range(48))


@pytest.mark.timeout(150)
def test_a_recomputed_stream_equals_the_fault_free_run_bit_for_bit():
    ref_a, ref_b, ref_la, ref_lb, _ = alone_and_loaded(True)
    # die 1 killed while the first request runs alone (step 20 of its 48 tokens)
    got_a, got_b, got_la, got_lb, rel = alone_and_loaded(True, inject="kill:die=1,step=20")
    assert rel["counts"]["recovered"].get("restart") == 1 and rel["ledger"]["token_gaps"] == 0
    assert got_a.token_ids == ref_a.token_ids and got_b.token_ids == ref_b.token_ids
    # the new incarnation's logs: the resumed indices came from a prefill of prompt + delivered
    resumed = sorted(got_la)
    assert resumed and resumed[0] > 0 and resumed[-1] == 47, resumed
    for got, ref in ((got_la, ref_la), (got_lb, ref_lb)):
        for i, v in got.items():
            assert np.array_equal(v, ref[i]), f"token {i}"
