"""A PD pod's decode die loading the pooled prefix itself (`PoolConfig.decode_load`, KVPOOL.md
§4.9 v2): it copies the pool's blocks of the prompt's prefix into its own new blocks while the
prefill die computes, and the KV link carries the rest. The prefill die sends from the decode
die's `skip` only when its own blocks have the same crcs (the same bytes), else the whole
prompt: the decode die's KV is the prefill die's either way.

A pod of one prefill die (0) and one decode die (1), small model; requests are not pinned (a
pinned request skips PD), so the router's pair is (0, 1). Waits are on finished requests and
on the index's complete entries (tests.integration.test_kv_pool).
"""

from __future__ import annotations

import numpy as np
import pytest

from memory import layout as L
from memory import pool_layout as P
from runtime.engine import Engine
from runtime.engine.pool_config import PoolConfig
from sched.pool import chain
from tests.integration.test_kv_pool import (
    BS,
    GREEDY,
    INVARIANT,
    SLOW_OK,
    logits_by_index,
    ok,
    prompt_of,
    wait_in_pool,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(180)

PD = dict(dies=2, model="small", prefill_dies=1, decode_dies=1, timeout_s=60.0, recover=False,
          rollback=False)  # fmt: skip


def run_pd(eng: Engine, prompts: list[list[int]]) -> list:
    ts = [eng.tracker.track(p, GREEDY) for p in prompts]
    eng.tracker.enqueue(ts)
    for t in ts:
        assert t.done.wait(60), f"request {t.id} did not finish"
    return ts


def link(eng: Engine, n: int) -> int:
    """The KV link's bytes once the decode master's stats count n transfers (they only grow:
    its stats come after the transfer, now or with its next message)."""

    def links() -> list[dict]:
        return list(eng.stats.get(1, {}).get("pd_links", {}).values())

    wait_for(lambda: sum(x["transfers"] for x in links()) >= n, what=f"{n} KV transfers")
    return sum(x["bytes"] for x in links())


def stat(eng: Engine, g: int, key: str) -> int:
    return eng.stats.get(g, {}).get(key, 0)


def two_turns(decode_load: bool, poison: bool = False) -> tuple[Engine, list, list]:
    """P (8 blocks + 5 tokens), then P' = P's 8 blocks + 5 other tokens. poison: one value of
    the prefill die's cached copy of P's first block changed before P' (its crc then differs
    from the pool's)."""
    p = prompt_of(61, 8 * BS + 5)
    q = p[: 8 * BS] + prompt_of(62, 5)
    log = dict(log_steps=True, keep_logits=True, model_overrides=INVARIANT)
    eng = Engine.launch(**PD, **log, kv_pool=PoolConfig(dram_mib=16, decode_load=decode_load,
                                                        **SLOW_OK))  # fmt: skip
    try:
        (a,) = run_pd(eng, [p])
        wait_in_pool(eng, p)
        first = link(eng, 1)
        if poison:
            poison_first_block(eng, p)
        (b,) = run_pd(eng, [q])
        second = link(eng, 2)
    finally:
        eng.close()
    return eng, [a, b], [first, second]


def poison_first_block(eng: Engine, prompt: list[int]) -> None:
    """Add 1.0 to one KV value of the prefill die's cached block of prompt's first block."""
    h = chain(prompt, BS)[0][0]
    reg = eng.pod.region(0)  # the prefill die's region
    with eng.lock:
        e = eng.pool.index.entry(h)
    assert e is not None
    # the prefill die computed P into the first blocks of its pool: its cache holds them;
    # find the block whose bytes equal the pool's slot (the copy stored from it)
    m, c = eng.model, eng.config
    off = int(reg.words[eng.pod.layout.serve_word(L.SV_KV_POOL)])
    shape = (m.kv_layers, c.blocks, c.block_size, m.kv_cache_dim)
    kv = reg.array[off : off + int(np.prod(shape)) * 4].view(np.float32).reshape(shape)
    seg = P.attach_pool(eng.pod_id, 0, eng.pool.fp)
    try:
        slot = seg.slots()[:, e.dram_slot].copy()
    finally:
        seg.close()
    match = [b for b in range(c.blocks) if np.array_equal(kv[:, b], slot)]
    assert match, "the prefill die's copy of the first block"
    kv[0, match[0], 0, 0] += 1.0


def test_the_decode_die_loads_the_prefix_and_the_link_carries_the_rest():
    """decode_load on vs off, the same two requests: tokens and logits bit-equal (batch-invariant);
    on, the decode die copied P's 8 pooled blocks and the second transfer carried the rest."""
    on, ts_on, link_on = two_turns(True)
    off, ts_off, link_off = two_turns(False)
    assert ok(ts_on) == ok(ts_off)
    for t_on, t_off in zip(ts_on, ts_off, strict=True):
        a, b = logits_by_index(on, t_on.id), logits_by_index(off, t_off.id)
        assert sorted(a) == sorted(b) == [0, 1, 2, 3]
        for i in a:
            assert np.array_equal(a[i], b[i]), f"request {t_on.id} token {i}: logits differ"
    assert link_on[0] == link_off[0]  # the first request: nothing pooled yet, all of it
    second_on, second_off = link_on[1] - link_on[0], link_off[1] - link_off[0]
    row = on.model.kv_layers * on.model.kv_cache_dim * 4  # bytes of one token's KV rows
    assert second_off == (8 * BS + 5) * row and second_on == 5 * row
    assert stat(on, 1, "pool_decode_tokens") == 8 * BS
    assert stat(on, 0, "pd_skipped_blocks") == 8 == stat(on, 1, "pd_skipped_blocks")
    assert stat(off, 1, "pool_decode_loads") == 0


def test_a_prefill_copy_that_differs_from_the_pool_is_sent_whole():
    """The prefill die's cached copy of the prefix changed (its crc no longer the pool's): it
    refuses the skip and sends the whole prompt, overwriting what the decode die loaded."""
    eng, ts, link = two_turns(True, poison=True)
    ok(ts)
    row = eng.model.kv_layers * eng.model.kv_cache_dim * 4
    assert link[1] - link[0] == (8 * BS + 5) * row
    assert stat(eng, 0, "pd_skip_refused") == 1 and stat(eng, 0, "pd_skipped_blocks") == 0
    assert stat(eng, 1, "pool_decode_tokens") == 8 * BS  # it had loaded them: overwritten
    assert stat(eng, 1, "pd_checksum_mismatches") == 0


def test_a_pool_copy_that_does_not_check_sends_the_request_again():
    """The pool's slot of P's first block corrupted after it was stored: the decode die's copy
    fails its crc (the block leaves the index), the prefill die, whose own copy has the stored
    crc, skips it all the same; the decode side fails the transfer, the request is sent again
    (no pool block to load now: the whole prompt over the link) and finishes with the tokens of
    an engine without the pool's decode load."""
    p = prompt_of(71, 8 * BS + 5)
    q = p[: 8 * BS] + prompt_of(72, 5)
    outs = []
    for poison in (True, False):
        eng = Engine.launch(**PD, kv_pool=PoolConfig(dram_mib=16, decode_load=poison, **SLOW_OK))
        try:
            (a,) = run_pd(eng, [p])
            wait_in_pool(eng, p)
            if poison:
                h = chain(p, BS)[0][0]
                with eng.lock:
                    slot = eng.pool.index.entry(h).dram_slot
                seg = P.attach_pool(eng.pod_id, 0, eng.pool.fp)
                try:
                    seg.slots()[0, slot, 0, 0] += 1.0
                finally:
                    seg.close()
            (b,) = run_pd(eng, [q])
            outs.append(ok([a, b]))
        finally:
            eng.close()
        if poison:
            assert stat(eng, 1, "pd_pool_copy_bad") == 1
            assert stat(eng, 1, "pool_crc_mismatches") == 1
            with eng.lock:
                assert eng.pool.index.entry(chain(p, BS)[0][0]) is None  # dropped
    assert outs[0] == outs[1]
