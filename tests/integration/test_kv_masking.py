"""A memory fault in a die's KV (001 §6.3, "masking a faulty memory region"): the die poisons the
block and drops the rows that hold it, the master masks it for good (never allocated or
prefix-matched again) and recomputes only the requests that held it; everyone else goes on.
Batch-invariant mode makes the recomputed streams bit-equal to the fault-free run."""

from __future__ import annotations

import pytest

from runtime.engine import Engine, EngineConfig
from sched import SamplingParams
from tests.waiting import stopped, wait_for

TINY = dict(dies=2, model="tiny", timeout_s=20.0, max_num_batched_tokens=32, log_steps=True,
            block_size=8, model_overrides={"batch_invariant": True})  # fmt: skip
# die 0 and master 0 are stopped on purpose while the requests are placed: no hang detection
HELD = dict(stall_timeout_s=120.0, heartbeat_timeout_s=120.0, op_timeout_s=60.0)
SHARED = "a shared prefix of several full blocks, then more"  # > 2 blocks of 8
OTHER = ["someone else entirely", "and one more on the other group"]
TINY_BLOCKS = EngineConfig(**{k: v for k, v in TINY.items() if k != "log_steps"}).blocks


def run(fault: str | None = None, block: int = -1) -> tuple[list, dict, Engine]:
    """Five long requests, three of them sharing SHARED's cached blocks, all in group 0's first
    step; with `fault`, a KV fault report is in die 0's word before that step runs (die 0 is
    stopped meanwhile), so it hits `block` (-1: the first row's first block, a shared one)
    whatever the machine's speed."""
    with Engine.launch(**TINY, **HELD) as eng:
        p = SamplingParams(max_tokens=120, ignore_eos=True)
        eng.generate(SHARED, SamplingParams(max_tokens=2), group=0)  # its blocks are cached
        with stopped(eng.pod.procs[0].pid):
            with stopped(eng.masters[0].pid):  # its inbox holds them: one plan admits them all
                ids = [eng.submit(SHARED, p, group=0) for _ in range(3)]
                ids += [eng.submit(OTHER[0], p, group=0), eng.submit(OTHER[1], p, group=1)]
            wait_for(lambda: (eng.stats.get(0) or {}).get("running") == 4, what="4 running")
            if fault == "now":
                eng.report_kv_fault(0, block)
        outs = [eng.result(i, 60) for i in ids]
        if fault:
            wait_for(lambda: eng.masked_blocks(0), what="the block masked in the stats")
        stats = dict(eng.stats[0])
        rel = eng.reliability()
    return outs, {**stats, "rel": rel}, eng


@pytest.fixture(scope="module")
def fault_free():
    outs, stats, _ = run()
    assert stats["prefix_hit_tokens"] >= 3 * 48, stats  # the three shared the cached blocks
    return [o.token_ids for o in outs]


@pytest.mark.timeout(120)
def test_a_poisoned_shared_block_is_masked_and_only_its_holders_recompute(fault_free):
    outs, stats, eng = run("now")
    assert [o.finish_reason for o in outs] == ["length"] * 5
    assert [o.token_ids for o in outs] == fault_free  # recomputed ones too, bit for bit
    (b,) = stats["kv_masked_blocks"]
    assert stats["kv"]["masked"] == 1 and stats["kv"]["total"] == eng.config.blocks - 1
    assert stats["kv_recomputed"] == 3, stats  # the three holders of the shared block only
    assert stats["num_preemptions"] == 3
    rows = [(rec["step"], r) for rec in eng.step_log[0] for r in rec["rows"]]
    last = max(s for s, r in rows if b in r[3])
    restarted = [s for s, r in rows if r[0] == outs[0].request_id and r[1] is not None]
    assert max(restarted) > last, "the holders recomputed after the block was last used"
    assert not any(b in r[3] for s, r in rows if s > last)  # never allocated again


@pytest.mark.timeout(120)
def test_control_a_free_block_affects_nobody(fault_free):
    outs, stats, _ = run("now", block=TINY_BLOCKS - 1)
    assert [o.token_ids for o in outs] == fault_free
    assert stats["kv_masked_blocks"] == [TINY_BLOCKS - 1]
    assert stats["kv_recomputed"] == 0 and stats["num_preemptions"] == 0


@pytest.mark.timeout(120)
def test_a_planned_kv_fault_is_verified_detected_and_masked(tmp_path):
    with Engine.launch(**TINY, inject="kvfault:die=1,step=40") as eng:
        p = SamplingParams(max_tokens=150, ignore_eos=True)
        # die 1 waits at the start of its step 40 until the report is in its word: the fault
        # hits a block its rows of step 40 hold, however fast the steps are
        outs = eng.generate([SHARED, OTHER[0], OTHER[1]], p, timeout_s=60)
        wait_for(lambda: eng.reliability()["counts"]["recovered"], what="the block masked")
        rel = eng.reliability()
    assert [o.finish_reason for o in outs] == ["length"] * 3
    c = rel["counts"]
    assert c["verified"] == {"kvfault-die": 1} and c["detected"] == {"kv": 1}, rel
    assert c["recovered"].get("mask") == 1 and rel["gen"] == 0  # no restart
