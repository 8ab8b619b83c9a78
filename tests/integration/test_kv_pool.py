"""The pod-wide KV pool in the engine (issue 33, KVPOOL.md §4.4-4.8, §5.5): bytes, dedup,
eviction to and promotion from the SSD tier, a pool server killed or stopped under load, a load
aborted mid-way, and the schedule replay of a run with pool hits.

Every engine here is 2 dies of the small model (3 for the PD replay); requests are pinned to a
die (`group`) so a prompt stored from one die is loaded by the other. Stores are asynchronous: a
test waits until the prompt's blocks are complete entries of the pool's index (or for the
`pool_stored_blocks` counter) before a request that should hit. A stopped (SIGSTOP) pool server
holds its loads: the master's `pool_loads` counter (it only grows) says they are in flight.
"""

from __future__ import annotations

import glob
import os
import random
import signal

import numpy as np
import pytest

from comm.kvlink import KVGeometry
from memory import layout as L
from memory import pool_layout as P
from runtime.engine import Engine, wire
from runtime.engine.pool_config import PoolConfig
from runtime.engine.replay import replay_engine
from runtime.engine.tracker import TrackedRequest
from runtime.model import ModelConfig
from sched import SamplingParams
from sched.pool import chain
from tests.waiting import stopped, wait_for

pytestmark = pytest.mark.timeout(120)

BS = 16
# No supervisor and no iteration rollback: nothing here may depend on the machine's speed (a
# loaded machine must not look like a hung die); a collective waits up to timeout_s.
BASE = dict(dies=2, model="small", timeout_s=30.0, recover=False, rollback=False)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
INVARIANT = {"batch_invariant": True}
# A load times out (falls back to recompute) and a lease expires only when a test stops the
# server: on a loaded machine a slow load is not a failure.
SLOW_OK = dict(load_timeout_s=300.0, lease_s=300.0)
MODEL = ModelConfig.preset("small")


def prompt_of(seed: int, n: int = 4 * BS + 5, prefix: list[int] | None = None) -> list[int]:
    """A prompt of n byte tokens from seed (after `prefix`, if given)."""
    head = list(prefix or [])
    rng = random.Random(seed)
    return head + [rng.randrange(1, 256) for _ in range(n - len(head))]


def run(eng: Engine, prompts: list[list[int]], group: int, params=GREEDY) -> list[TrackedRequest]:
    """The prompts pinned to `group`, enqueued together; returns them finished."""
    ts = [eng.tracker.track(p, params, group=group) for p in prompts]
    eng.tracker.enqueue(ts)
    for t in ts:
        assert t.done.wait(60), f"request {t.id} did not finish"
    return ts


def ok(ts: list[TrackedRequest]) -> list[list[int]]:
    """The tokens of finished requests, each checked to have run to its length."""
    for t in ts:
        assert t.reason == "length", (t.id, t.reason, t.error)
    return [list(t.out) for t in ts]


def mstat(eng: Engine, g: int, key: str):
    """A master's counter or gauge as its latest stats message says (0 before any)."""
    return eng.stats.get(g, {}).get(key, 0)


def pstat(eng: Engine, key: str):
    with eng.lock:
        return eng.pool.stats()[key]


def wait_stored(eng: Engine, n: int) -> None:
    """Every store ordered so far is answered and `n` blocks are stored in all."""
    wait_for(lambda: pstat(eng, "pool_stored_blocks") >= n, what=f"{n} stored blocks")

    def answered() -> bool:
        with eng.lock:
            return not eng.pool.stores

    wait_for(answered, what="no store in flight")


def wait_in_pool(eng: Engine, prompt: list[int]) -> list[int]:
    """Wait until every block a request for `prompt` could hit is stored; their hashes."""
    hs = [h for h, _, _ in chain(prompt, BS)][: (len(prompt) - 1) // BS]

    def there() -> bool:
        with eng.lock:
            es = [eng.pool.index.entry(h) for h in hs]
        return all(e is not None and e.state == "complete" for e in es)

    wait_for(there, what=f"{len(hs)} blocks in the pool")
    return hs


def kv_used(eng: Engine, g: int) -> int:
    return (mstat(eng, g, "kv") or {}).get("used", -1)


def die_kv(eng: Engine, g: int) -> np.ndarray:
    """A copy of die g's KV pool, float32 [kv_layers, blocks, block_size, row]."""
    reg, m, c = eng.pod.region(g), eng.model, eng.config
    off = int(reg.words[eng.pod.layout.serve_word(L.SV_KV_POOL)])
    shape = (m.kv_layers, c.blocks, c.block_size, m.kv_cache_dim)
    n = int(np.prod(shape)) * 4
    return reg.array[off : off + n].view(np.float32).reshape(shape).copy()


def crc_of(kv: np.ndarray, block: int) -> int:
    """`block_crc` of block `block` of a die KV copy (the crc a stored block carries)."""
    geo = KVGeometry(0, kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[3])
    return P.block_crc(np.ascontiguousarray(kv).view(np.uint8).reshape(-1), geo, block)


def first_row(eng: Engine, rid: int) -> list:
    """The first logged row of request rid (its table is the request's blocks)."""
    for recs in eng.step_log.values():
        for rec in sorted(recs, key=lambda r: r["step"]):
            for r in rec["rows"]:
                if r[0] == rid:
                    return r
    raise AssertionError(f"request {rid} not in the step log")


def logits_by_index(eng: Engine, rid: int) -> dict[int, np.ndarray]:
    """Output index -> the logits row request rid sampled it from (the masters' step logs)."""
    out = {}
    for records in eng.step_log.values():
        for rec in records:
            if rec.get("logits") is None:
                continue
            samp = [r for r in rec["rows"] if r[4]]
            for row, vec in zip(samp, wire.unpack_array(rec["logits"]), strict=True):
                if row[0] == rid:
                    out[row[5]] = vec.copy()
    return out


# -- 1. bytes: a pool hit is bit-equal to no cache at all ----------------------------------------


def test_pool_hit_is_bit_equal_to_no_cache():
    """Batch-invariant mode: a prompt stored from die 0 and loaded on die 1 gives the tokens and
    logits of the same request on an engine with no cache at all; each stored block's bytes in
    the pool segment equal that engine's recomputed block (and its crc the entry's)."""
    prompt = prompt_of(1)
    n_blocks = (len(prompt) - 1) // BS
    log = dict(log_steps=True, keep_logits=True, model_overrides=INVARIANT)
    with Engine.launch(**BASE, **log, prefix_cache=False) as ref:
        (r,) = run(ref, [prompt], 1)
        ref_kv = die_kv(ref, 1)
    ref_logits = logits_by_index(ref, r.id)
    ref_table = first_row(ref, r.id)[3]
    assert sorted(ref_logits) == [0, 1, 2, 3]

    with Engine.launch(**BASE, **log, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        (a,) = run(eng, [prompt], 0)
        wait_stored(eng, n_blocks)
        (b,) = run(eng, [prompt], 1)
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") > 0, what="die 1's pool hit")
        assert mstat(eng, 1, "pool_hit_tokens") == n_blocks * BS
        assert mstat(eng, 1, "pool_crc_mismatches") == 0
        assert b.n_cached == n_blocks * BS
        with eng.lock:
            es = [eng.pool.index.entry(h) for h, _, _ in chain(prompt, BS)]
        seg = P.attach_pool(eng.pod_id, 0, eng.pool.fp)
        try:
            slots = seg.slots()
            for i, e in enumerate(es):
                assert e is not None and e.state == "complete" and e.dram_slot is not None, i
                blk = ref_table[i]
                assert np.array_equal(slots[:, e.dram_slot], ref_kv[:, blk]), f"block {i} bytes"
                assert e.crc == crc_of(ref_kv, blk), f"block {i} crc"
            del slots
        finally:
            seg.close()
    assert ok([a, b]) == [list(r.out)] * 2
    got = logits_by_index(eng, b.id)
    assert sorted(got) == sorted(ref_logits)
    for i in ref_logits:
        assert np.array_equal(got[i], ref_logits[i]), f"token {i}: logits differ"


# -- 2. dedup: concurrent stores of one prefix keep one copy -------------------------------------


def test_concurrent_stores_of_a_prefix_are_deduplicated():
    """16 requests at once (8 per die) sharing a 4-block prefix, each with one block of its own:
    both dies compute and offer the prefix, the pool stores each distinct block once."""
    prefix = prompt_of(2, 4 * BS)
    prompts = [prompt_of(100 + i, 5 * BS + 3, prefix) for i in range(16)]
    distinct = {h for p in prompts for h, _, _ in chain(p, BS)}
    assert len(distinct) == 4 + 16
    with Engine.launch(**BASE, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        ts = [eng.tracker.track(p, GREEDY, group=i % 2) for i, p in enumerate(prompts)]
        eng.tracker.enqueue(ts)  # all dispatched now, before any store: no pool hint
        for t in ts:
            assert t.done.wait(60)
        ok(ts)
        # each die offers the prefix once (dedup is exercised) and its own blocks
        wait_for(lambda: mstat(eng, 0, "pool_put_blocks") + mstat(eng, 1, "pool_put_blocks")
                 == len(distinct) + 4, what="every new block offered")  # fmt: skip
        wait_stored(eng, len(distinct))
        wait_for(lambda: mstat(eng, 0, "pool_holds") == mstat(eng, 1, "pool_holds") == 0,
                 what="every offer answered (its hold released)")  # fmt: skip
        with eng.lock:
            st = eng.pool.stats()
            idx = eng.pool.index
            idx.check()
            entries = {h: idx.entry(h) for h in distinct}
        assert st["pool_stored_blocks"] == len(distinct), st
        assert st["index_entries"] == len(distinct) and st["index_writing"] == 0, st
        assert st["index_dram_used"] == {0: len(distinct)}, st
        assert st["pool_store_failed"] == 0 and st["index_collisions"] == 0, st
        assert all(e is not None and e.state == "complete" for e in entries.values())
        slots = [e.dram_slot for e in entries.values()]
        assert len(set(slots)) == len(slots), "a slot held twice"
        seg = P.attach_pool(eng.pod_id, 0, eng.pool.fp)
        try:
            geo = KVGeometry(*seg.kv_args())
            for h, e in entries.items():
                assert P.block_crc(seg.array, geo, e.dram_slot) == e.crc, f"{h:x}: slot bytes"
        finally:
            seg.close()


# -- 3. eviction with an SSD tier ------------------------------------------------------------------


def _hit_rate(dram_slots: int | None, ssd_blocks: int, prompts: list[list[int]]) -> dict:
    """Store the prompts from die 0 (one at a time), then run them twice on die 1, whose own
    cache holds a few of them (16 blocks: it misses each on the way round, asks the pool).
    dram_slots None: a DRAM tier that holds everything."""
    slot = P.slot_bytes(MODEL.kv_layers, BS, MODEL.kv_cache_dim)
    dram = 16.0 if dram_slots is None else (dram_slots * slot + P.HEADER_BYTES) / P.MiB
    pool = PoolConfig(dram_mib=dram, ssd_mib=ssd_blocks * slot / P.MiB, **SLOW_OK)
    seen = {"dram": 0, "ssd": 0}
    with Engine.launch(
        **BASE, num_blocks=16, model_overrides={"max_seq_len": 128}, kv_pool=pool
    ) as eng:
        assert dram_slots is None or eng.pool.n_slots == dram_slots
        assert eng.pool.ssd_blocks == ssd_blocks

        def check() -> None:
            with eng.lock:
                eng.pool.index.check()
                st = eng.pool.index.stats()
            assert st["dram_used"][0] <= eng.pool.n_slots and st["ssd_used"][0] <= ssd_blocks, st
            seen["dram"] = max(seen["dram"], st["dram_used"][0])
            seen["ssd"] = max(seen["ssd"], st["ssd_used"][0])

        for i, p in enumerate(prompts):
            ok(run(eng, [p], 0))
            wait_stored(eng, 4 * (i + 1))
            check()
        outs = []
        for _ in range(2):
            for p in prompts:
                outs += ok(run(eng, [p], 1))
                check()
        with eng.lock:
            st = eng.pool.stats()
    s1 = eng.stats[1]  # its final stats (close reads them)
    assert s1.get("final") and s1["pool_load_fallbacks"] == 0 and s1["pool_crc_mismatches"] == 0
    return {"rate": s1["pool_hit_tokens"] / s1["pool_query_tokens"], "outs": outs, "pool": st,
            "seen": seen, "die1": s1}  # fmt: skip


def test_eviction_to_ssd_keeps_the_hit_rate():
    """DRAM at 1/4 of the working set (8 of 32 blocks), SSD for all: evicted blocks are demoted
    and promoted back inside the loads; the hit rate stays within 10 % of an unbounded pool."""
    prompts = [prompt_of(300 + i) for i in range(8)]
    big = _hit_rate(None, 0, prompts)
    small = _hit_rate(8, 64, prompts)
    assert big["rate"] > 0.5, big["die1"]
    assert small["rate"] >= 0.9 * big["rate"], (small["rate"], big["rate"])
    assert small["outs"] == big["outs"]
    st = small["pool"]
    assert small["seen"]["dram"] == 8 and small["seen"]["ssd"] > 8, small["seen"]
    assert st["index_demotions"] > 0 and st["index_promotions"] > 0, st
    assert st["index_promoting"] == 0 and st["pool_demote_failed"] == 0, st
    assert st["pool_load_failed"] == 0 and st["pool_crc_bad"] == 0, st
    assert st["pool_stores"] == len(prompts), "a block was lost (stored again from die 1)"
    assert st["pool_landed_blocks"] == st["pool_hint_blocks"] == 2 * 4 * len(prompts), st
    assert big["pool"]["index_evictions"] == 0 and big["pool"]["index_promotions"] == 0


# -- 4. failures ---------------------------------------------------------------------------------


def test_server_killed_with_loads_pending():
    """The pool server SIGKILLed while it holds die 1's loads (stopped first, so they are surely
    in flight): every request completes with the tokens of the run that stored the prompts
    (batch-invariant), the loads fell back, the server restarted, and a prompt stored after
    it is a hit again."""
    pool = PoolConfig(
        dram_mib=16, load_by="server", **SLOW_OK
    )  # only the server's death ends a load here
    prompts = [prompt_of(400 + i) for i in range(3)]
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        want = ok(run(eng, prompts, 0))
        for p in prompts:
            wait_in_pool(eng, p)
        old = eng.pool.handle.pid
        with stopped(old):
            ts = [eng.tracker.track(p, GREEDY, group=1) for p in prompts]
            eng.tracker.enqueue(ts)
            wait_for(lambda: mstat(eng, 1, "pool_loads") == len(prompts), what="3 loads sent")
            assert mstat(eng, 1, "pool_waiting") == len(prompts)
            os.kill(old, signal.SIGKILL)
        for t in ts:
            assert t.done.wait(60)
        assert ok(ts) == want
        assert [t.n_cached for t in ts] == [0, 0, 0]
        wait_for(lambda: mstat(eng, 1, "pool_load_fallbacks") == len(prompts), what="fallbacks")
        assert mstat(eng, 1, "pool_hit_tokens") == 0
        wait_for(lambda: pstat(eng, "index_down") == [], what="the new server's inventory")
        assert pstat(eng, "pool_server_deaths") == pstat(eng, "pool_server_restarts") == 1
        assert eng.pool.handle.pid != old and eng.pool.handle.is_alive()
        wait_for(lambda: mstat(eng, 1, "pool_quarantined") == 0 and kv_used(eng, 1) == 0,
                 what="die 1's quarantined blocks freed")  # fmt: skip
        late = prompt_of(450)
        (a,) = run(eng, [late], 0)
        wait_in_pool(eng, late)
        (b,) = run(eng, [late], 1)
        assert ok([b]) == ok([a]) and b.n_cached == 4 * BS
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") == 4 * BS, what="die 1's pool hit")
        with eng.lock:
            eng.pool.index.check()


def test_server_stopped_past_the_load_timeout():
    """A stopped pool server: die 1's loads time out and its requests recompute (right tokens)
    while it is still stopped, their blocks quarantined; its late completions, once it runs
    again, free them (no leak), and it is not counted dead."""
    pool = PoolConfig(dram_mib=16, load_by="server", load_timeout_s=0.3, lease_s=300.0)
    prompts = [prompt_of(500 + i) for i in range(2)]
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        want = ok(run(eng, prompts, 0))
        for p in prompts:
            wait_in_pool(eng, p)
        wait_for(lambda: kv_used(eng, 1) == 0, what="die 1 idle")
        with stopped(eng.pool.handle.pid):
            ts = run(eng, prompts, 1)  # they end while the server is stopped
            assert ok(ts) == want and [t.n_cached for t in ts] == [0, 0]
            wait_for(lambda: mstat(eng, 1, "pool_load_fallbacks") == 2, what="fallbacks")
            wait_for(lambda: mstat(eng, 1, "pool_quarantined") == 2, what="quarantine")
            wait_for(lambda: kv_used(eng, 1) == 2 * 4, what="the quarantined blocks held")
        wait_for(lambda: mstat(eng, 1, "pool_quarantined") == 0, what="the late completions")
        wait_for(lambda: kv_used(eng, 1) == 0, what="die 1's KV back to idle")
        assert pstat(eng, "pool_server_deaths") == 0 and mstat(eng, 1, "pool_hit_tokens") == 0
        late = prompt_of(550)
        (a,) = run(eng, [late], 0)
        wait_in_pool(eng, late)
        (b,) = run(eng, [late], 1)  # a hit, unless its load is slower than 0.3 s here
        assert ok([b]) == ok([a])


def test_a_hit_on_blocks_another_load_promotes_is_cut_there():
    """DRAM for 4 blocks, an SSD tier: prompt A stored, then B (A demoted). With the server
    stopped, A on die 1 is a hit on SSD blocks: its load carries their promotion and waits.
    A second A on die 1 meanwhile: its lookup finds A's blocks being promoted by that load (not
    in DRAM yet): its hint stops before them (no hit), so it computes A; nothing reads a slot
    before its bytes are there (0 crc mismatches, nothing dropped). Once the server runs, the
    first lands its hit; the tokens are die 0's."""
    slot = P.slot_bytes(MODEL.kv_layers, BS, MODEL.kv_cache_dim)
    pool = PoolConfig(dram_mib=(4 * slot + P.HEADER_BYTES) / P.MiB, ssd_mib=16 * slot / P.MiB,
                      **SLOW_OK)  # fmt: skip
    a, b = prompt_of(650), prompt_of(651)
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        want = ok(run(eng, [a], 0))
        wait_in_pool(eng, a)
        run(eng, [b], 0)
        hs = wait_in_pool(eng, b)
        with eng.lock:
            ha = [h for h, _, _ in chain(a, BS)][:4]
            assert all(eng.pool.index.entry(h).dram_slot is None for h in ha), "A demoted"
        with stopped(eng.pool.handle.pid):
            first = eng.tracker.track(a, GREEDY, group=1)
            eng.tracker.enqueue([first])
            wait_for(lambda: mstat(eng, 1, "pool_loads") == 1, what="the first load sent")
            (second,) = run(eng, [a], 1)
            assert ok([second]) == want and second.n_cached == 0
            assert not first.done.is_set()
        assert first.done.wait(60)
        assert ok([first]) == want and first.n_cached == 4 * BS
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") == 4 * BS, what="die 1's hit")
        assert mstat(eng, 1, "pool_crc_mismatches") == 0 and pstat(eng, "pool_crc_bad") == 0
        with eng.lock:
            eng.pool.index.check()
            assert all(eng.pool.index.entry(h) is not None for h in ha + hs)


def test_ssd_entries_come_back_after_a_kill(tmp_path):
    """DRAM for 4 blocks, an SSD tier in a persistent directory: 3 prompts stored, the first two
    demoted. The server is killed (after one block file is corrupted): the restarted server's
    inventory brings the SSD entries back but the corrupt one (skipped at the re-index); the
    DRAM-only prompt is gone. Hits after it are promoted from the SSD tier; a second engine on
    the same directory starts with them. No temp file is left."""
    slot = P.slot_bytes(MODEL.kv_layers, BS, MODEL.kv_cache_dim)
    pool = PoolConfig(dram_mib=(4 * slot + P.HEADER_BYTES) / P.MiB, ssd_mib=64 * slot / P.MiB,
                      pool_dir=str(tmp_path), **SLOW_OK)  # fmt: skip
    prompts = [prompt_of(600 + i) for i in range(3)]
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        assert eng.pool.n_slots == 4
        want = []
        hs = []
        for p in prompts:
            want += ok(run(eng, [p], 0))
            hs.append(wait_in_pool(eng, p))
        with eng.lock:
            on_ssd = {h for c in hs for h in c if eng.pool.index.entry(h).on_ssd}
        assert on_ssd == set(hs[0] + hs[1]), "the first two prompts demoted"
        bad = hs[0][-1]  # a leaf: only it goes
        (path,) = glob.glob(str(tmp_path / "*" / "*" / f"{bad:016x}.blk"))
        assert len(glob.glob(str(tmp_path / "*" / "*" / "*.blk"))) == len(on_ssd)
        old = eng.pool.handle.pid
        with stopped(old):
            with open(path, "r+b") as f:  # flip payload bytes: the crc no longer matches
                f.seek(-64, os.SEEK_END)
                tail = f.read(64)
                f.seek(-64, os.SEEK_END)
                f.write(bytes(x ^ 0xFF for x in tail))
            os.kill(old, signal.SIGKILL)
        wait_for(lambda: pstat(eng, "pool_server_restarts") == 1, what="the restart")
        wait_for(lambda: pstat(eng, "index_down") == [], what="the new server's inventory")
        with eng.lock:
            eng.pool.index.check()
            back = {h for c in hs for h in c if eng.pool.index.entry(h) is not None}
            assert all(eng.pool.index.entry(h).on_ssd for h in back)
        assert back == on_ssd - {bad}, "SSD entries back, the corrupt one skipped"
        assert pstat(eng, "pool_inventory_blocks") == len(on_ssd) - 1
        for i in (1, 0):  # one at a time: a hit's promotions take all 4 DRAM slots
            (t,) = run(eng, [prompts[i]], 1)
            assert ok([t]) == [want[i]] and t.n_cached == (4 if i else 3) * BS
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") == (4 + 3) * BS, what="die 1's hits")
        assert mstat(eng, 1, "pool_load_fallbacks") == 0
    assert not glob.glob(str(tmp_path / "**" / "*.tmp.*"), recursive=True)
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        wait_for(lambda: pstat(eng, "pool_inventory_blocks") > 0, what="the inventory")
        (t,) = run(eng, [prompts[1]], 1)
        assert ok([t]) == [want[1]] and t.n_cached == 4 * BS
    assert not glob.glob(str(tmp_path / "**" / "*.tmp.*"), recursive=True)


def test_master_loads_while_the_server_is_stopped():
    """`load_by="master"` (the default): a die's master copies a DRAM hit from the server's
    mapped tier itself, so a stopped (SIGSTOP) server costs no hit: die 1's loads land while it
    is stopped (tokens those of die 0's run, batch-invariant); nothing falls back."""
    pool = PoolConfig(dram_mib=16, load_timeout_s=0.3, lease_s=300.0)
    prompts = [prompt_of(560 + i) for i in range(2)]
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        want = ok(run(eng, prompts, 0))
        for p in prompts:
            wait_in_pool(eng, p)
        with stopped(eng.pool.handle.pid):
            ts = run(eng, prompts, 1)
            assert ok(ts) == want and [t.n_cached for t in ts] == [4 * BS, 4 * BS]
            wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") == 2 * 4 * BS, what="die 1's hits")
            assert mstat(eng, 1, "pool_direct_loads") == 2
            assert mstat(eng, 1, "pool_load_fallbacks") == 0
            assert mstat(eng, 1, "pool_crc_mismatches") == 0
        with eng.lock:
            eng.pool.index.check()
            assert eng.pool.index.stats()["pinned"] == 0, "the loads' leases released"


def test_blocks_offered_while_the_server_is_down_are_offered_again():
    """Blocks a master offers while the pool's server is down (the index refuses them) are
    offered again once the server's inventory came (`pool_up`): a later request with the same
    prefix on the same die stores them, and die 1 hits them. The down window is made here by
    telling the index its server died, under the engine's lock (the process runs on)."""
    pool = PoolConfig(dram_mib=16, **SLOW_OK)
    first = prompt_of(900)
    again = prompt_of(901, prefix=first[: 4 * BS])
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        wait_for(lambda: pstat(eng, "pool_inventories") == 1, what="the server's inventory")
        with eng.lock:
            eng.pool.index.server_dead(0)
        want = ok(run(eng, [first], 0))
        wait_for(lambda: mstat(eng, 0, "pool_put_blocks") >= 4, what="die 0's blocks offered")
        wait_for(lambda: mstat(eng, 0, "pool_holds") == 0, what="the refused offer released")
        assert pstat(eng, "pool_stored_blocks") == 0
        with eng.lock:  # the restarted server's inventory (nothing on an SSD tier)
            eng.pool.on_server("inventory", {"server": 0, "pid": eng.pool.handle.pid,
                                             "entries": []})  # fmt: skip
        (t,) = run(eng, [again], 0)
        assert t.n_cached == 4 * BS, "a die-local hit"
        wait_in_pool(eng, first)
        (b,) = run(eng, [first], 1)
        assert ok([b]) == want and b.n_cached == 4 * BS
        wait_for(lambda: mstat(eng, 1, "pool_direct_loads") == 1, what="die 1's pool hit")
        with eng.lock:
            eng.pool.index.check()


def test_store_all_stores_a_replys_blocks_for_the_next_turn():
    """`store="all"`: a finished request's generated blocks are offered too, so the next turn
    of a conversation (prompt = history + the reply + a new message) hits its whole history on
    another die, the reply's blocks included; `store="prompt"` hits the first prompt's blocks
    only. Tokens equal those of an engine with no cache (batch-invariant)."""
    first = prompt_of(950, 2 * BS + 5)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    outs, cached = {}, {}
    for mode in ("all", "prompt"):
        pool = PoolConfig(dram_mib=16, store=mode, **SLOW_OK)
        with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
            (a,) = run(eng, [first], 0, params)
            turn2 = first + list(a.out) + prompt_of(951, 9)
            computed = len(first) + len(a.out) - 1  # the last sampled token has no KV yet
            want = (computed // BS if mode == "all" else len(first) // BS) * BS
            wait_stored(eng, want // BS)
            (b,) = run(eng, [turn2], 1, params)
            outs[mode], cached[mode] = list(b.out), b.n_cached
            assert b.n_cached == want, (mode, b.n_cached, want)
            assert mstat(eng, 1, "pool_crc_mismatches") == 0
    with Engine.launch(**BASE, model_overrides=INVARIANT, prefix_cache=False) as eng:
        (c,) = run(eng, [turn2], 1, params)
    assert outs["all"] == outs["prompt"] == list(c.out) and c.n_cached == 0
    assert cached["all"] > cached["prompt"]


# -- 5. a load aborted mid-way -------------------------------------------------------------------


def test_abort_while_loading():
    """A request aborted while its load is held (server stopped) ends "abort"; its blocks stay
    held until the completion arrives, then are freed; the next request hits and runs."""
    pool = PoolConfig(dram_mib=16, load_by="server", **SLOW_OK)
    prompt = prompt_of(700)
    with Engine.launch(**BASE, model_overrides=INVARIANT, kv_pool=pool) as eng:
        want = ok(run(eng, [prompt], 0))
        wait_in_pool(eng, prompt)
        wait_for(lambda: kv_used(eng, 1) == 0, what="die 1 idle")
        with stopped(eng.pool.handle.pid):
            t = eng.tracker.track(prompt, GREEDY, group=1)
            eng.tracker.enqueue([t])
            wait_for(lambda: mstat(eng, 1, "pool_loads") == 1, what="the load sent")
            eng.abort(t.id)
            assert t.done.wait(30)
            assert t.reason == "abort" and t.out == []
            wait_for(lambda: mstat(eng, 1, "pool_waiting") == 1 and kv_used(eng, 1) == 4,
                     what="the aborted load's blocks held")  # fmt: skip
        wait_for(lambda: mstat(eng, 1, "pool_waiting") == 0 and kv_used(eng, 1) == 0,
                 what="die 1's KV back to idle")  # fmt: skip
        assert mstat(eng, 1, "pool_hit_tokens") == 0 and mstat(eng, 1, "pool_load_fallbacks") == 0
        (b,) = run(eng, [prompt], 1)
        assert ok([b]) == want and b.n_cached == 4 * BS
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") == 4 * BS, what="die 1's pool hit")
        with eng.lock:
            eng.pool.index.check()
            assert eng.pool.index.stats()["pinned"] == 0, "the aborted load's lease released"


# -- 6. the schedule replay of a run with pool hits ----------------------------------------------


@pytest.mark.parametrize("layout", ["colocated", "pd", "split"])
def test_replay_of_a_pool_run_is_bit_equal(layout):
    """Default mode (logits depend on the batch): prompts computed on die 0 in batches (chunked
    prefill, local prefix hits), stored, then loaded by die 1 among other requests (PD: dies 0
    and 1 prefill, die 2 decodes; split: attention dies 0 and 1, expert dies 2 and 3). The
    replay lands each loaded block from the replayed step that computed it: tokens and logits
    bit-equal. Without the prompts it cannot (the loaded blocks replay as zeros)."""
    shared = prompt_of(800, 2 * BS)
    first = [prompt_of(810 + i, 4 * BS + 3, shared) for i in range(3)] + [prompt_of(820)]
    then = [first[0], first[3], prompt_of(830, 3 * BS + 7, shared), prompt_of(840, 40)]
    cfg = dict(log_steps=True, keep_logits=True, max_num_batched_tokens=48)
    pod = {"colocated": BASE, "pd": dict(BASE, dies=3, prefill_dies=2, decode_dies=1),
           "split": dict(BASE, expert_dies=2)}[layout]  # fmt: skip
    with Engine.launch(**pod, **cfg, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        a = run(eng, first, 0)
        for p in first:
            wait_in_pool(eng, p)
        b = run(eng, then + [prompt_of(850, 30)], 1)
        c = run(eng, [prompt_of(860, 50)], 0)
        ok(a + b + c)
        assert [t.out for t in b[:2]] == [a[0].out, a[3].out]
        assert [t.n_cached for t in b[:3]] == [4 * BS, 4 * BS, 2 * BS]
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") >= 8 * BS, what="die 1's pool hits")
    prompts = {t.id: list(t.tokens) for t in a + b + c}
    rep = replay_engine(eng.config, eng.step_log, prompts)
    assert rep.bit_equal, (rep.token_mismatches[:3], rep.logit_mismatches[:3])
    assert rep.sampled == rep.logits_compared >= 4 * len(prompts)
    # the 4 + 4 distinct blocks die 1 loaded (the shared prefix's 2 once: the die-local
    # cache serves them to the other request, whether its own load landed first or not)
    assert rep.pool_landed == 8 and rep.pool_missing == 0, (rep.pool_landed, rep.pool_missing)
    blind = replay_engine(eng.config, eng.step_log)
    assert not blind.bit_equal and blind.pool_landed == 0


def test_a_pool_load_is_a_span_on_the_masters_kv_pool_track(tmp_path):
    import json

    path = str(tmp_path / "trace.json")
    p = prompt_of(41)
    eng = Engine.launch(**BASE, kv_pool=PoolConfig(dram_mib=8, **SLOW_OK), trace=path)
    try:
        ok(run(eng, [p], 0))
        wait_in_pool(eng, p)
        ok(run(eng, [p[:-1] + [7]], 1))  # the same prefix on the other die: a pool load
    finally:
        eng.close()
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    loads = [e for e in events if str(e.get("name", "")).startswith("kv pool load")]
    assert len(loads) == 1 and loads[0]["args"]["n"] == 4 and loads[0]["dur"] > 0
    assert (loads[0]["pid"], "kv pool") in tracks
