"""sched.pool: the pod-wide KV pool's index. Keys and namespace roots (golden values), lookups
that stop at the first missing / writing / colliding entry, leases, put dedup, leaf-first
eviction with SSD demotion and promotion, admission, quotas, server death and inventory, a
random operation stream with check() after every step, and PoolIndex against ReferencePool
(a slow, obviously correct simulator of the same policies, below) hit for hit on a seeded trace."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from sched.kv import KVManager, block_hash
from sched.pool import (
    COMPLETE,
    WRITING,
    AlreadyStored,
    Dropped,
    Granted,
    Hit,
    HitBlock,
    PoolIndex,
    PoolIndexError,
    Writing,
    chain,
    ns_root,
)

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def toks(n_blocks: int, base: int, extra: int = 1) -> list[int]:
    """n_blocks full blocks of distinct tokens from base, plus `extra` tokens (lookup needs one
    more token than the blocks it may hit)."""
    return list(range(base, base + n_blocks * BS + extra))


def store(pool, tokens, ns=None, server=None, crc=7):
    """put_start + put_end every full block of tokens; returns the put states."""
    states = pool.put_start(chain(tokens, BS, ns), ns, server)
    for (h, _, _), st_ in zip(chain(tokens, BS, ns), states, strict=True):
        if isinstance(st_, Granted):
            assert pool.put_end(h, crc)
    return states


# ---- keys ----------------------------------------------------------------------------------


def test_block_hash_and_chain_golden_values():
    # Frozen: a change here changes every die-local and pool key (and invalidates SSD files).
    assert block_hash(None, (1, 2, 3, 4)) == 9121524398691793932
    assert block_hash(9121524398691793932, (5, 6, 7, 8)) == 5094574419050465977
    assert ns_root(None) is None
    assert ns_root("tenant-a") == 10927419291067916929
    assert ns_root("") == 13510657394282977892  # "" is a namespace, not the default
    assert chain(list(range(1, 10)), 4) == [
        (9121524398691793932, None, (1, 2, 3, 4)),
        (5094574419050465977, 9121524398691793932, (5, 6, 7, 8)),
    ]
    assert chain(list(range(1, 10)), 4, "tenant-a") == [
        (14367678107520158300, 10927419291067916929, (1, 2, 3, 4)),
        (2936530243135146245, 14367678107520158300, (5, 6, 7, 8)),
    ]
    assert chain([1, 2, 3], 4) == []
    with pytest.raises(TypeError):
        ns_root(b"x")


def test_kv_manager_root_default_unchanged_and_namespaces_isolated():
    t = list(range(1, 10))
    kv = KVManager(8, 4)
    table = kv.alloc_blocks(1, len(t))
    kv.cache_blocks(1, t, len(t))
    kv.free(1)
    assert kv._hash[table[0]] == 9121524398691793932  # the default root keeps today's hashes
    assert kv.match_by_prefix(t) == (table[:2], 8)
    assert kv.match_by_prefix(t, root=ns_root("a")) == ([], 0)  # other namespace: no hit
    kv.alloc_blocks(2, len(t))
    kv.cache_blocks(2, t, len(t), root=ns_root("a"))
    kv.free(2)
    blocks, n = kv.match_by_prefix(t, root=ns_root("a"))
    assert n == 8 and not set(blocks) & set(table)
    assert [kv._hash[b] for b in blocks] == [h for h, _, _ in chain(t, 4, "a")]
    kv.check()


# ---- lookup ---------------------------------------------------------------------------------


def test_lookup_walks_the_chain_and_never_the_last_token():
    pool = PoolIndex(BS, {0: 16})
    t = toks(3, 100, extra=0)  # 12 tokens: lookup may hit (12 - 1) // 4 = 2 blocks
    assert all(isinstance(s, Granted) for s in store(pool, t))
    hit = pool.lookup(t)
    assert hit.tokens == 8 and len(hit.blocks) == 2 and hit.lease > 0
    assert [b.h for b in hit.blocks] == [h for h, _, _ in chain(t, BS)[:2]]
    assert all(b.slot is not None and b.crc == 7 and b.promote_slot is None for b in hit.blocks)
    assert pool.lookup(t + [1]).tokens == 12
    assert pool.lookup(t, max_blocks=1).tokens == 4
    assert pool.lookup(t, ns="other") == Hit(0, [], 0)  # namespaces do not share
    assert pool.lookup([]) == Hit(0, [], 0)
    assert pool.stats()["pinned"] == 3
    pool.check()


def test_lookup_stops_at_missing_writing_and_colliding_entries():
    pool = PoolIndex(BS, {0: 16})
    t = toks(4, 0)
    c = chain(t, BS)
    assert all(isinstance(s, Granted) for s in pool.put_start(c[:2]))
    pool.put_end(c[0][0], 1)
    assert pool.lookup(t).tokens == 4  # block 1 is writing
    pool.put_end(c[1][0], 1)
    assert pool.lookup(t).tokens == 8  # block 2 missing
    store(pool, t)
    assert pool.lookup(t).tokens == 16
    # A colliding entry: same hash, other tokens (a 64-bit collision, injected).
    pool._e[c[1][0]].tokens = (9, 9, 9, 9)
    assert pool.lookup(t).tokens == 4
    pool._e[c[1][0]].tokens = c[1][2]
    pool._e[c[2][0]].parent = c[0][0]  # same hash, other parent
    assert pool.lookup(t).tokens == 8


def test_put_start_rejects_malformed_blocks():
    pool = PoolIndex(BS, {0: 4})
    (h, parent, tk), *_ = chain(toks(1, 0), BS)
    with pytest.raises(ValueError, match="not block_hash"):
        pool.put_start([(h + 1, parent, tk)])
    with pytest.raises(ValueError, match="tokens"):
        pool.put_start([(h, parent, tk[:3])])
    with pytest.raises(ValueError, match="unknown server"):
        pool.put_start([(h, parent, tk)], server=5)
    assert len(pool) == 0


# ---- leases ---------------------------------------------------------------------------------


def test_leases_pin_against_eviction_and_expire():
    clock = Clock()
    pool = PoolIndex(BS, {0: 2}, lease_s=10.0, now=clock)
    a, b, c, d = (toks(1, base) for base in (0, 100, 200, 300))
    store(pool, a)
    store(pool, b)
    hit_a, hit_b = pool.lookup(a), pool.lookup(b)  # both pinned until t = 10
    assert hit_a.tokens == hit_b.tokens == 4
    assert store(pool, c) == [Dropped("full")]
    pool.release(hit_a.lease)
    pool.release(hit_a.lease)  # twice: no-op
    pool.release(12345)  # unknown: no-op
    assert store(pool, c) == [Granted(0, hit_a.blocks[0].slot)]  # a evicted, b kept
    assert pool.lookup(a).tokens == 0
    clock.t = 5.0
    assert pool.lookup(c).tokens == 4  # pinned until t = 15
    clock.t = 9.9
    assert store(pool, d) == [Dropped("full")]
    clock.t = 10.0  # b's lease expired (lazily, at this call)
    assert store(pool, d) == [Granted(0, hit_b.blocks[0].slot)]
    assert pool.lookup(b).tokens == 0 and pool.lookup(c).tokens == 4
    assert pool.stats()["leases_expired"] == 1  # b's (a's was released)
    clock.t = 30.0
    stats = pool.stats()
    assert stats["pinned"] == 0 and stats["leases"] == 0 and stats["leases_expired"] == 3
    pool.check()


def test_empty_hit_takes_no_lease():
    pool = PoolIndex(BS, {0: 2})
    assert pool.lookup(toks(2, 0)) == Hit(0, [], 0)
    assert pool.stats()["leases"] == 0 and pool.stats()["misses"] == 1


# ---- put dedup ------------------------------------------------------------------------------


def test_concurrent_puts_of_a_shared_prefix_are_granted_once():
    pool = PoolIndex(BS, {0: 64, 1: 64})
    shared = toks(3, 0, extra=0)
    grants, states = 0, []
    for r in range(16):  # 16 requests, same 3-block prefix, each with its own 4th block
        t = shared + list(range(1000 + 10 * r, 1000 + 10 * r + BS))
        s = pool.put_start(chain(t, BS), server=r % 2)
        states.append(s)
        grants += sum(isinstance(x, Granted) for x in s)
    assert grants == 3 + 16
    assert all(s[:3] == [Writing()] * 3 for s in states[1:])
    for h, _, _ in chain(shared, BS):
        assert pool.put_end(h, 5)
        assert not pool.put_end(h, 5)  # already complete
    again = pool.put_start(chain(shared, BS))
    assert again == [AlreadyStored()] * 3
    assert pool.stats()["writing"] == 16
    pool.check()


def test_orphans_are_dropped_and_abort_takes_descendants():
    pool = PoolIndex(BS, {0: 16})
    c = chain(toks(3, 0), BS)
    assert pool.put_start(c[1:]) == [Dropped("orphan"), Dropped("orphan")]
    assert pool.put_start(c[:2], ns="x") == [Dropped("orphan")] * 2  # roots differ
    assert all(isinstance(s, Granted) for s in pool.put_start(c))
    pool.put_end(c[1][0], 3)  # a complete child under a writing parent
    assert pool.put_abort(c[0][0]) == 3
    assert len(pool) == 0 and pool.put_abort(c[0][0]) == 0
    assert pool.stats()["dram_used"] == {0: 0}
    pool.check()


def test_writing_entries_are_reclaimed_after_the_timeout():
    clock = Clock()
    pool = PoolIndex(BS, {0: 4}, put_timeout_s=30.0, now=clock)
    c = chain(toks(2, 0), BS)
    pool.put_start(c)
    clock.t = 29.0
    assert len(pool) == 2
    clock.t = 30.0
    assert len(pool) == 0 and pool.stats()["puts_reclaimed"] == 1
    assert not pool.put_end(c[0][0], 1)  # a late `stored`: ignored
    pool.check()


# ---- eviction and tiers ---------------------------------------------------------------------


def test_leaf_first_lru_eviction_without_ssd():
    pool = PoolIndex(BS, {0: 4})
    a = toks(3, 0)
    store(pool, a)  # a0 <- a1 <- a2, a2 the only leaf
    b = toks(1, 100)
    store(pool, b)  # b0 is the most recent
    ha = [h for h, _, _ in chain(a, BS)]
    order = []
    for i in range(3):  # new single blocks evict a's chain tail first, though a0 is older
        store(pool, toks(1, 200 + 10 * i))
        gone = [h for h in ha if h not in pool]
        order.append(gone)
        pool.check()
    assert order == [[ha[2]], [ha[1], ha[2]], ha]
    assert pool.stats()["removals"] == 3 and pool.stats()["orphans"] == 0
    assert pool.take_orders() == []  # no SSD tier: nothing for the server to do


def test_lookup_touches_the_tail_first_so_the_prefix_ends_most_recent():
    pool = PoolIndex(BS, {0: 3}, ssd_blocks={0: 8})
    a = toks(2, 0)
    store(pool, a)
    store(pool, toks(1, 100))
    pool.release(pool.lookup(a).lease)  # a0, a1 now the most recent, a0 the newest
    store(pool, toks(1, 200))  # evicts the LRU leaf: b0
    store(pool, toks(1, 300))  # then a1 (a leaf, older than a0)
    ha = [h for h, _, _ in chain(a, BS)]
    assert pool.entry(ha[0]).tick > pool.entry(ha[1]).tick  # the prefix is the most recent
    assert [o[0] for o in pool.take_orders()] == ["demote", "demote"]
    assert pool.entry(ha[1]).dram_slot is None and pool.entry(ha[0]).dram_slot is not None


def test_demotion_orders_promotion_and_ssd_deletes():
    pool = PoolIndex(BS, {0: 2}, ssd_blocks={0: 2})
    a, b = toks(2, 0), toks(1, 100)
    ha = [h for h, _, _ in chain(a, BS)]
    hb = chain(b, BS)[0][0]
    store(pool, a)  # slots 0, 1
    sa = [pool.entry(h).dram_slot for h in ha]
    store(pool, b)  # evicts a1 (the leaf), demoted to SSD
    assert pool.take_orders() == [("demote", 0, ha[1], sa[1])]
    e = pool.entry(ha[1])
    assert e.on_ssd and e.dram_slot is None and e.state == COMPLETE
    # a0 is now a DRAM leaf (its child is on SSD only); b0 is more recent
    store(pool, toks(1, 200))
    assert pool.take_orders() == [("demote", 0, ha[0], sa[0])]
    assert pool.stats()["ssd_used"] == {0: 2}
    # Lookup of a: both blocks SSD-only; each gets a DRAM slot and a promote order.
    hit = pool.lookup(a)
    assert hit.tokens == 8 and [blk.slot for blk in hit.blocks] == [None, None]
    assert all(blk.on_ssd and blk.promote_slot is not None for blk in hit.blocks)
    orders = pool.take_orders()
    # Room for them: the DRAM residents b0 and x200 (no child) leave the index without an
    # order, as the full SSD tier has nothing deletable (a0 has a child, a1 is pinned).
    assert [o[0] for o in orders] == ["promote", "promote"]
    assert [o[2:] for o in orders] == [(b.h, b.promote_slot) for b in hit.blocks]
    assert hb not in pool and pool.stats()["removals"] == 2
    hit2 = pool.lookup(a)  # pending: the same slots, no new order
    assert [b.promote_slot for b in hit2.blocks] == [b.promote_slot for b in hit.blocks]
    assert pool.take_orders() == []
    for blk in hit.blocks:
        assert pool.promoted(blk.h, blk.promote_slot)
        assert not pool.promoted(blk.h, blk.promote_slot)
    hit3 = pool.lookup(a)
    assert [b.slot for b in hit3.blocks] == [b.promote_slot for b in hit.blocks]
    for lease in (hit.lease, hit2.lease, hit3.lease):
        pool.release(lease)
    # Evicting a block that is on SSD too only drops its DRAM copy.
    store(pool, toks(1, 300))
    assert pool.take_orders() == [("drop", 0, ha[1], hit.blocks[1].promote_slot)]
    store(pool, toks(1, 400))
    assert pool.take_orders() == [("drop", 0, ha[0], hit.blocks[0].promote_slot)]
    # A full SSD tier (a0 <- a1) makes room by deleting its SSD-only leaf a1 for a demotion.
    h300 = chain(toks(1, 300), BS)[0][0]
    s300 = pool.entry(h300).dram_slot
    store(pool, toks(1, 500))
    assert pool.take_orders() == [("delete", 0, ha[1]), ("demote", 0, h300, s300)]
    assert ha[1] not in pool and pool.entry(ha[0]).on_ssd
    assert pool.stats()["ssd_deletes"] == 1 and pool.stats()["drops"] == 2
    pool.check()


def test_failed_and_timed_out_promotions_free_their_slot():
    clock = Clock()
    pool = PoolIndex(BS, {0: 4}, ssd_blocks={0: 4}, put_timeout_s=30.0, now=clock)
    a = toks(2, 0)
    rows = [(h, None, p, tk, 1) for h, p, tk in chain(a, BS)]
    pool.server_inventory(0, rows)
    hit = pool.lookup(a)
    s0, s1 = (b.promote_slot for b in hit.blocks)
    assert not pool.promoted(hit.blocks[0].h, s1)  # not its slot
    assert pool.promoted(hit.blocks[0].h, s0, ok=False)  # failed: slot freed, still on SSD
    e = pool.entry(hit.blocks[0].h)
    assert e.dram_slot is None and e.on_ssd and not e.promoting
    clock.t = 30.0  # the other promotion never reported: reclaimed
    e = pool.entry(hit.blocks[1].h)
    assert e.dram_slot is None and e.on_ssd and pool.stats()["promotions_reclaimed"] == 1
    assert pool.stats()["dram_used"] == {0: 0}
    hit = pool.lookup(a)  # promoted again, into the lowest free slots
    assert [b.promote_slot for b in hit.blocks] == [0, 1]
    pool.check()


def test_dropping_a_block_being_promoted_keeps_the_index_whole():
    """A crc mismatch reported for a block while its promotion is pending (`drop`): the entry
    and its descendants leave, the slot is free, every invariant holds (it used to raise a
    KeyError half-way, leaving an SSD entry out of its LRU)."""
    pool = PoolIndex(BS, {0: 4}, ssd_blocks={0: 4}, put_timeout_s=30.0, now=Clock())
    a = toks(2, 0)
    pool.server_inventory(0, [(h, None, p, tk, 1) for h, p, tk in chain(a, BS)])
    hit = pool.lookup(a)
    assert all(b.promote_slot is not None for b in hit.blocks)
    assert pool.drop(hit.blocks[0].h) == 2
    assert pool.entry(hit.blocks[0].h) is None and pool.entry(hit.blocks[1].h) is None
    assert pool.stats()["dram_used"] == {0: 0} and pool.stats()["promoting"] == 0
    pool.check()
    pool.release(hit.lease)
    pool.check()


def test_capacity_never_exceeded_under_oversubscription():
    rng = random.Random(3)
    pool = PoolIndex(BS, {0: 8, 1: 8}, ssd_blocks={0: 16, 1: 0})
    prompts = [toks(rng.randint(1, 6), 1000 * i) for i in range(60)]  # ~4x the 32 slots
    for _ in range(400):
        t = rng.choice(prompts)
        hit = pool.lookup(t)
        for b in hit.blocks:
            if b.promote_slot is not None:
                pool.promoted(b.h, b.promote_slot)
        store(pool, t, server=rng.choice([0, 1, None]))
        pool.release(hit.lease)
        st_ = pool.stats()
        assert all(st_["dram_used"][s] <= 8 for s in (0, 1)) and st_["ssd_used"][0] <= 16
        pool.check()
    assert pool.stats()["evictions"] > 100 and pool.stats()["demotions"] > 10


# ---- admission and quotas -------------------------------------------------------------------


def _hot_chain_hits(admit: str, scan: bool) -> int:
    """A hot 4-block prompt every 10th request among one-shot 4-block prompts (36 blocks in
    between), into 24 slots;
    each request looks up then stores its prompt. Returns the hot prompt's hit blocks."""
    pool = PoolIndex(BS, {0: 24}, admit=admit)
    hot, hits, k = toks(4, 10**6), 0, 0
    for i in range(1000):
        if i % 10 == 0:
            t = hot
        elif scan:
            k += 1
            t = toks(4, 100 * k)
        else:
            continue
        hit = pool.lookup(t)
        hits += len(hit.blocks) if t is hot else 0
        store(pool, t)
        pool.release(hit.lease)
    pool.check()
    return hits


def test_second_hit_admission_protects_a_hot_chain_from_a_scan():
    ideal = _hot_chain_hits("second_hit", scan=False)
    assert ideal >= 4 * 98  # 100 hot requests; the first two miss (ghost, then stored)
    assert _hot_chain_hits("second_hit", scan=True) >= 0.95 * ideal
    assert _hot_chain_hits("always", scan=True) < 0.5 * ideal  # the scan flushes it


def test_second_hit_admits_hashes_two_lookups_missed():
    pool = PoolIndex(BS, {0: 8}, admit="second_hit")
    t = toks(2, 0)
    dropped = [Dropped("admission"), Dropped("orphan")]
    assert store(pool, t) == dropped
    assert pool.lookup(t).tokens == 0  # seen once: a one-shot prompt's own store is dropped
    assert pool.stats()["ghost"] == 2 and store(pool, t) == dropped
    assert pool.lookup(t).tokens == 0  # seen twice
    assert all(isinstance(s, Granted) for s in store(pool, t))
    assert pool.stats()["admissions_dropped"] == 2 and pool.stats()["ghost"] == 0
    assert pool.ghost_capacity == 32


def test_quotas_bound_a_namespace_and_evict_within_it():
    pool = PoolIndex(BS, {0: 8}, quotas={"a": 2, "z": 0})
    assert store(pool, toks(1, 0), ns="z") == [Dropped("quota")]
    ca = chain(toks(3, 0), BS, "a")
    # a0, a1 fill a's quota; a2 would need an "a" victim: a0 has a child, a1 is a2's parent
    assert store(pool, toks(3, 0), ns="a") == [Granted(0, 0), Granted(0, 1), Dropped("quota")]
    store(pool, toks(2, 100))  # the default namespace has no quota
    x = chain(toks(1, 500), BS, "a")[0][0]
    assert store(pool, toks(1, 500), ns="a") == [Granted(0, 1)]  # a's LRU leaf a1 evicted
    assert ca[1][0] not in pool and ca[0][0] in pool and x in pool
    assert pool.stats()["quota_dropped"] == 2 and pool.stats()["removals"] == 1
    assert pool.stats()["dram_used"] == {0: 4}  # free slots elsewhere did not matter
    pool.check()


# ---- server death and inventory -------------------------------------------------------------


def test_server_dead_and_inventory():
    pool = PoolIndex(BS, {0: 4, 1: 4}, ssd_blocks={0: 4})
    a = toks(3, 0)
    ca, cb = chain(a, BS), chain(toks(2, 100), BS)
    rows = [(h, None, p, tk, 9) for h, p, tk in ca[:2]]
    assert pool.server_inventory(0, rows)["added"] == 2  # a0, a1 on server 0's SSD only
    hit = pool.lookup(a[: 2 * BS + 1])
    assert [b.promote_slot for b in hit.blocks] == [0, 1]
    assert [o[0] for o in pool._orders] == ["promote", "promote"]  # not taken yet
    assert pool.promoted(ca[0][0], 0)  # a1's promotion still pending
    pool.put_start(ca[2:], server=1)  # a2: server 1, child of a1
    pool.put_end(ca[2][0], 3)
    pool.put_start(cb[:1], server=0)  # b0: server 0, DRAM only
    pool.put_end(cb[0][0], 3)
    pool.put_start(cb[1:], server=1)  # b1: server 1, child of b0
    pool.put_end(cb[1][0], 3)
    c0 = chain(toks(1, 200), BS)
    pool.put_start(c0, server=0)  # writing on server 0
    pool.check()
    assert pool.server_dead(0) == {"removed": 3, "kept_on_ssd": 2}  # b0 (and b1), c0
    assert pool.take_orders() == []  # orders for the dead server are void
    e0, e1 = pool.entry(ca[0][0]), pool.entry(ca[1][0])
    assert e0.on_ssd and e1.on_ssd and e0.dram_slot is None and e1.dram_slot is None
    assert e0.pins == e1.pins == 0 and not e1.promoting and ca[2][0] in pool
    assert cb[1][0] not in pool and pool.stats()["orphans"] == 0
    pool.release(hit.lease)  # pins already dropped: no-op
    pool.check()
    assert pool.lookup(a).tokens == 0  # not served while down
    assert pool.put_start(chain(toks(1, 300), BS), server=0) == [Granted(1, 1)]  # not on 0
    orphan = chain(toks(2, 500), BS)[1]
    d0 = chain(toks(1, 600), BS)[0]
    inv = pool.server_inventory(0, rows + [(orphan[0], None, orphan[1], orphan[2], 1),
                                           (ca[2][0], None, None, (0, 0, 0, 0), 1),
                                           (d0[0], None, None, d0[2], 4)])  # fmt: skip
    assert inv == {"added": 1, "kept": 2, "orphans_skipped": 1, "invalid": 1, "duplicates": 0,
                   "over_capacity": 0, "lost": 0}  # fmt: skip
    assert pool.take_orders() == [("delete", 0, ca[2][0]), ("delete", 0, orphan[0])]
    hit = pool.lookup(a)
    assert hit.tokens == 12 and [b.promote_slot for b in hit.blocks] == [0, 1, None]
    pool.check()
    assert pool.server_dead(0, ssd_survives=False)["removed"] == 4  # a0, a1, d0 and a2
    assert len(pool) == 1 and pool.stats()["orphans"] == 0
    pool.check()
    assert pool.server_inventory(0, rows[:1])["added"] == 1
    pool.server_dead(0)
    changed = (*rows[0][:4], 10)  # the file was rewritten: another crc
    assert pool.server_inventory(0, [changed])["lost"] == 1
    assert pool.entry(ca[0][0]).crc == 10
    pool.server_dead(0)
    assert pool.server_inventory(0, [])["lost"] == 1  # the file did not come back
    assert len(pool) == 1
    pool.check()


def test_server_dead_takes_descendants_and_inventory_readds_chains():
    pool = PoolIndex(BS, {0: 4, 1: 4}, ssd_blocks={1: 8})
    a = toks(2, 0)
    ca = chain(a, BS)
    pool.put_start(ca[:1], server=0)
    pool.put_end(ca[0][0], 1)
    pool.put_start(ca[1:], server=1)
    pool.put_end(ca[1][0], 2)
    assert pool.server_dead(0)["removed"] == 2  # a0 (DRAM only) and its child on server 1
    assert len(pool) == 0 and pool.take_orders() == []  # a1 was in DRAM only: no file
    pool.check()
    # Server 1 restarts with both files (say a0 had been demoted there): child reported first.
    rows = [(h, None, p, tk, 9) for h, p, tk in reversed(ca)]
    inv = pool.server_inventory(1, rows)
    assert inv["added"] == 2 and inv["orphans_skipped"] == 0
    hit = pool.lookup(a)
    assert hit.tokens == 8 and all(b.promote_slot is not None for b in hit.blocks)
    pool.check()


# ---- check() can fail -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "corrupt, what",
    [
        (lambda p, e: setattr(e, "pins", 1), "pins"),
        (lambda p, e: setattr(e, "parent", 12345), "orphan"),
        (lambda p, e: p._free[0].append(e.dram_slot), "free"),
        (lambda p, e: setattr(e, "state", WRITING), "writing entry"),
        (lambda p, e: p._ns_used.__setitem__(None, 7), "ns DRAM"),
        (lambda p, e: setattr(e, "dram_slot", 9), "slot range"),
    ],
)
def test_check_catches_a_broken_invariant(corrupt, what):
    pool = PoolIndex(BS, {0: 4})
    store(pool, toks(2, 0))
    pool.check()
    corrupt(pool, pool._e[chain(toks(2, 0), BS)[1][0]])
    with pytest.raises(PoolIndexError, match=what):
        pool.check()


# ---- a random operation stream with check() after each step ---------------------------------


class PoolMachine(RuleBasedStateMachine):
    """Every public operation at random on a small pool: check() after each one."""

    @initialize(
        admit=st.sampled_from(["always", "second_hit"]),
        ssd=st.sampled_from([{}, {0: 3}, {0: 4, 1: 2}]),
        quota=st.sampled_from([None, {"a": 3}]),
    )
    def setup(self, admit, ssd, quota):
        self.clock = Clock()
        self.pool = PoolIndex(BS, {0: 4, 1: 3}, ssd, admit, 5.0, 8.0, quota, self.clock)
        self.leases: list[int] = []
        self.puts: list[int] = []
        self.promos: list[tuple[int, int]] = []

    def prompt(self, i: int, n: int) -> list[int]:
        return [i % 3] * BS + list(range(100 * i, 100 * i + n * BS))  # 3 shared first blocks

    @rule(i=st.integers(0, 8), n=st.integers(0, 4), ns=st.sampled_from([None, "a"]))
    def lookup(self, i, n, ns):
        hit = self.pool.lookup(self.prompt(i, n), ns)
        assert hit.tokens == BS * len(hit.blocks) and (hit.lease > 0) == bool(hit.blocks)
        self.leases.append(hit.lease)
        self.promos += [(b.h, b.promote_slot) for b in hit.blocks if b.promote_slot is not None]

    @rule(i=st.integers(0, 8), n=st.integers(0, 4), ns=st.sampled_from([None, "a"]),
          server=st.sampled_from([None, 0, 1]))  # fmt: skip
    def put(self, i, n, ns, server):
        c = chain(self.prompt(i, n), BS, ns)
        for (h, _, _), s in zip(c, self.pool.put_start(c, ns, server), strict=True):
            if isinstance(s, Granted):
                self.puts.append(h)

    @rule(k=st.integers(0, 50), ok=st.booleans())
    def finish_put(self, k, ok):
        if self.puts:
            h = self.puts.pop(k % len(self.puts))
            self.pool.put_end(h, 1) if ok else self.pool.put_abort(h)

    @rule(k=st.integers(0, 50), ok=st.booleans())
    def finish_promotion(self, k, ok):
        if self.promos:
            h, slot = self.promos.pop(k % len(self.promos))
            self.pool.promoted(h, slot, ok)

    @rule(k=st.integers(0, 50))
    def release(self, k):
        if self.leases:
            self.pool.release(self.leases.pop(k % len(self.leases)))

    @rule(dt=st.sampled_from([0.5, 3.0, 6.0]))
    def tick(self, dt):
        self.clock.t += dt

    @rule(s=st.sampled_from([0, 1]), survives=st.booleans())
    def restart(self, s, survives):
        rows = [(e.h, e.ns, e.parent, e.tokens, e.crc) for e in self.pool._e.values()
                if e.server == s and e.on_ssd]  # fmt: skip
        self.pool.server_dead(s, survives)
        self.pool.check()
        self.pool.server_inventory(s, rows)

    @rule()
    def orders(self):
        for o in self.pool.take_orders():
            assert o[0] in ("demote", "drop", "delete", "promote")

    @invariant()
    def invariants(self):
        if hasattr(self, "pool"):
            self.pool.check()
            assert self.pool.stats()["orphans"] == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- PoolIndex vs ReferencePool, hit for hit ------------------------------------------------


class ReferencePool:
    """Slow and obviously correct: entries in a dict, recency a list of hashes (least recent
    first), every count recomputed by scanning, pins = the live leases naming an entry. The
    same policies as PoolIndex (module docstring); no server_dead / server_inventory."""

    def __init__(self, bs, servers, ssd_blocks=None, admit="always", lease_s=10.0,
                 put_timeout_s=30.0, quotas=None, now=None):  # fmt: skip
        self.bs, self.servers, self.admit = bs, dict(sorted(servers.items())), admit
        self.ssd = {s: (ssd_blocks or {}).get(s) or 0 for s in self.servers}
        self.lease_s, self.timeout, self.quotas, self.now = (
            lease_s,
            put_timeout_s,
            quotas or {},
            now,
        )
        self.e: dict[int, SimpleNamespace] = {}
        self.lru: list[int] = []
        self.leases: dict[int, tuple[float, list]] = {}
        self.next_lease = 1
        self.ghost: list[int] = []  # least recently recorded first
        self.seen: dict[int, int] = {}  # lookups that missed a ghost hash, at most 2
        self.ghost_cap = 4 * sum(self.servers.values())
        self.orders: list[tuple] = []
        self.protect: list = []

    def pinned(self, x):
        live = [y for _, ys in self.leases.values() for y in ys] + self.protect
        return any(y is x for y in live)

    def kids(self, h, in_dram=False):
        return [k for k in self.e.values() if k.parent == h and (k.slot is not None or not in_dram)]

    def free(self, s):
        used = {x.slot for x in self.e.values() if x.server == s and x.slot is not None}
        return [i for i in range(self.servers[s]) if i not in used]

    def ssd_used(self, s):
        return sum(1 for x in self.e.values() if x.server == s and x.on_ssd)

    def touch(self, x):
        if x.h in self.lru:
            self.lru.remove(x.h)
        self.lru.append(x.h)

    def expire(self):
        now = self.now()
        self.leases = {k: v for k, v in self.leases.items() if v[0] > now}
        for x in [x for x in self.e.values() if x.state == WRITING]:
            if self.e.get(x.h) is x and x.since + self.timeout <= now:
                self.remove_tree(x)
        for x in self.e.values():
            if x.promoting and x.since + self.timeout <= now:
                x.slot, x.promoting = None, False
        return now

    def remove_tree(self, top):
        tree = [top]
        for x in tree:
            tree += sorted(self.kids(x.h), key=lambda k: k.h)
        for x in tree:
            del self.e[x.h]
            self.lru.remove(x.h)
        self.orders += [
            ("delete", s, h) for h, s in sorted((x.h, x.server) for x in tree if x.on_ssd)
        ]
        return len(tree)

    def evict(self, servers, ns):
        for h in self.lru:
            x = self.e[h]
            if x.server not in servers or x.slot is None or x.state != COMPLETE or x.promoting:
                continue
            if self.pinned(x) or self.kids(h, in_dram=True) or (ns is not None and x.ns != ns):
                continue
            s, cap = x.server, self.ssd[x.server]
            if x.on_ssd:
                self.orders.append(("drop", s, h, x.slot))
            elif cap and (self.ssd_used(s) < cap or self.ssd_evict(s)):
                self.orders.append(("demote", s, h, x.slot))
                x.on_ssd = True
            elif not self.kids(h):
                del self.e[h]
                self.lru.remove(h)
                return True
            else:
                continue
            x.slot = None
            return True
        return False

    def ssd_evict(self, s):
        for h in self.lru:
            x = self.e[h]
            if (
                x.server == s
                and x.on_ssd
                and x.slot is None
                and not self.pinned(x)
                and not self.kids(h)
            ):
                del self.e[h]
                self.lru.remove(h)
                self.orders.append(("delete", s, h))
                return True
        return False

    def alloc(self, ns, hint, only=None):
        up = list(self.servers)
        q = self.quotas.get(ns) if ns is not None else None
        used = sum(x.ns == ns and x.slot is not None for x in self.e.values())
        if q is not None and used >= q and not self.evict(up, ns):
            return "quota"
        if only is not None:
            if not self.free(only) and not self.evict([only], None):
                return "full"
            s = only
        elif hint is not None and self.free(hint):
            s = hint
        else:
            if not any(self.free(s) for s in up) and not self.evict(up, None):
                return "full"
            s = max(up, key=lambda s: (len(self.free(s)), -s))
        return s, min(self.free(s))

    def lookup(self, tokens, ns=None, max_blocks=None):
        now, bs = self.expire(), self.bs
        n = (len(tokens) - 1) // bs if tokens else 0
        found = []
        for h, parent, tk in chain(tokens, bs, ns)[:n]:
            x = self.e.get(h)
            if x is None or x.state != COMPLETE or (x.tokens, x.parent, x.ns) != (tk, parent, ns):
                break
            found.append(x)
        self.protect = list(found)
        blocks = []
        for x in found:
            promote = x.slot if x.promoting else None
            if x.slot is None:
                got = self.alloc(x.ns, None, only=x.server)
                if isinstance(got, str):
                    break
                x.slot, x.promoting, x.since, promote = got[1], True, now, got[1]
                self.orders.append(("promote", x.server, x.h, x.slot))
            slot = None if promote is not None else x.slot
            blocks.append(HitBlock(x.h, x.server, slot, x.crc, x.on_ssd, promote))
        self.protect, found = [], found[: len(blocks)]
        for x in reversed(found):
            self.touch(x)
        if self.admit == "second_hit":
            for h, _, _ in chain(tokens, bs, ns)[len(found) :]:
                if h in self.ghost:
                    self.ghost.remove(h)
                self.ghost.append(h)
                self.seen[h] = min(2, self.seen.get(h, 0) + 1)
            while len(self.ghost) > self.ghost_cap:
                del self.seen[self.ghost.pop(0)]
        if not found:
            return Hit(0, [], 0)
        self.leases[self.next_lease] = (now + self.lease_s, found)
        self.next_lease += 1
        return Hit(self.next_lease - 1, blocks, len(found) * bs)

    def put_start(self, blocks, ns=None, server=None):
        now, out = self.expire(), []
        for h, parent, tk in blocks:
            x = self.e.get(h)
            if x is not None:
                same = (x.parent, x.tokens, x.ns) == (parent, tk, ns)
                out.append(Dropped("collision") if not same else
                           Writing() if x.state == WRITING else AlreadyStored())  # fmt: skip
                continue
            p = self.e.get(parent)
            if parent != ns_root(ns) and (p is None or p.ns != ns):
                out.append(Dropped("orphan"))
            elif self.admit == "second_hit" and self.seen.get(h, 0) < 2:
                out.append(Dropped("admission"))
            else:
                self.protect = [p] if p is not None else []
                got = self.alloc(ns, server)
                self.protect = []
                if isinstance(got, str):
                    out.append(Dropped(got))
                    continue
                if h in self.ghost:
                    self.ghost.remove(h)
                    del self.seen[h]
                self.e[h] = SimpleNamespace(h=h, ns=ns, parent=parent, tokens=tk, crc=0,
                                            state=WRITING, server=got[0], slot=got[1],
                                            on_ssd=False, promoting=False, since=now)  # fmt: skip
                self.touch(self.e[h])
                out.append(Granted(*got))
        return out

    def put_end(self, h, crc):
        self.expire()
        x = self.e.get(h)
        if x is None or x.state != WRITING:
            return False
        x.state, x.crc = COMPLETE, crc
        return True

    def put_abort(self, h):
        self.expire()
        x = self.e.get(h)
        return self.remove_tree(x) if x is not None and x.state == WRITING else 0

    def promoted(self, h, slot):
        self.expire()
        x = self.e.get(h)
        if x is None or not x.promoting or x.slot != slot:
            return False
        x.promoting = False
        return True

    def release(self, lease):
        self.expire()
        self.leases.pop(lease, None)

    def take_orders(self):
        self.expire()
        out, self.orders = self.orders, []
        return out

    def snapshot(self):
        self.expire()
        return {h: (x.state, x.server, x.slot, x.on_ssd, x.promoting, x.crc,
                    sum(y is x for _, ys in self.leases.values() for y in ys))
                for h, x in self.e.items()}  # fmt: skip


def _snapshot(pool: PoolIndex):
    pool.stats()  # expire what is due
    return {h: (e.state, e.server, e.dram_slot, e.on_ssd, e.promoting, e.crc, e.pins)
            for h, e in pool._e.items()}  # fmt: skip


@pytest.mark.parametrize("admit", ["always", "second_hit"])
def test_pool_index_matches_the_reference_on_a_seeded_trace(admit):
    rng = random.Random(2024 + (admit == "second_hit"))
    clock = Clock()
    kw = dict(ssd_blocks={0: 6}, admit=admit, lease_s=4.0, put_timeout_s=6.0,
              quotas={"a": 5}, now=clock)  # fmt: skip
    pool, ref = PoolIndex(BS, {0: 6, 1: 5}, **kw), ReferencePool(BS, {0: 6, 1: 5}, **kw)
    stems = [[s] * BS for s in range(4)]  # shared first blocks: a prefix tree
    leases, puts, promos = [], [], []
    hits = 0
    for step in range(2000):
        op = rng.random()
        ns = rng.choice([None, None, "a"])
        t = rng.choice(stems) + list(range(rng.randrange(12) * 50, 10**4))[: rng.randint(1, 4) * BS]
        if op < 0.35:
            a, b = pool.lookup(t, ns), ref.lookup(t, ns)
            assert a == b, step
            hits += len(a.blocks)
            leases.append(a.lease)
            promos += [(x.h, x.promote_slot) for x in a.blocks if x.promote_slot is not None]
        elif op < 0.6:
            c, srv = chain(t, BS, ns), rng.choice([None, 0, 1])
            a, b = pool.put_start(c, ns, srv), ref.put_start(c, ns, srv)
            assert a == b, step
            puts += [h for (h, _, _), s in zip(c, a, strict=True) if isinstance(s, Granted)]
        elif op < 0.75 and puts:
            h = puts.pop(rng.randrange(len(puts)))
            if rng.random() < 0.85:
                assert pool.put_end(h, step) == ref.put_end(h, step), step
            else:
                assert pool.put_abort(h) == ref.put_abort(h), step
        elif op < 0.85 and leases:
            lease = leases.pop(rng.randrange(len(leases)))
            pool.release(lease)
            ref.release(lease)
        elif op < 0.9 and promos:
            h, slot = promos.pop(rng.randrange(len(promos)))
            assert pool.promoted(h, slot) == ref.promoted(h, slot), step
        elif op < 0.95:
            clock.t += rng.choice([0.5, 1.0, 2.5])
        else:
            assert pool.take_orders() == ref.take_orders(), step
        if step % 25 == 0:
            assert _snapshot(pool) == ref.snapshot(), step
            pool.check()
    assert _snapshot(pool) == ref.snapshot()
    assert pool.take_orders() == ref.take_orders()
    stats = pool.stats()
    # the trace exercised what it compares: evictions of every kind, promotions, expiries
    assert hits > 100 and stats["evictions"] > 10 and stats["promotions"] > 5, stats
    assert min(stats[k] for k in ("demotions", "drops", "removals", "puts_reclaimed")) > 0, stats
    assert stats["admissions_dropped" if admit == "second_hit" else "ssd_deletes"] > 0, stats
    pool.check()


def test_strict_placement_evicts_its_own_server_only():
    """A pod over hosts stores a die's blocks on its host's server only (`strict`): a full
    server evicts its own LRU leaf though another has free slots; non-strict spills over; a
    down server refuses a strict put (Dropped "full")."""
    pool = PoolIndex(BS, {0: 2, 1: 2})
    store(pool, toks(2, 0), server=0)
    old = [h for h, _, _ in chain(toks(2, 0), BS)]
    assert [pool.entry(h).server for h in old] == [0, 0]
    b = chain(toks(1, 100), BS)
    (st_,) = pool.put_start(b, None, 0, strict=True)
    assert isinstance(st_, Granted) and st_.server == 0
    assert old[1] not in pool and old[0] in pool  # its own leaf went; server 1 untouched
    assert pool.stats()["dram_used"] == {0: 2, 1: 0}
    (spill,) = pool.put_start(chain(toks(1, 200), BS), None, 0)  # preferred, not strict
    assert isinstance(spill, Granted) and spill.server == 1
    pool.server_dead(1)
    (down,) = pool.put_start(chain(toks(1, 300), BS), None, 1, strict=True)
    assert down == Dropped("full")
    pool.check()


def test_a_quota_for_the_default_namespace_bounds_it_alone():
    """quotas key None: the requests without a cache salt; evictions for it take its own LRU
    blocks only, a salted namespace beside it is not touched and has no bound."""
    pool = PoolIndex(BS, {0: 8}, quotas={None: 2})
    salted = toks(3, 500)
    assert all(isinstance(s_, Granted) for s_ in store(pool, salted, ns="a"))
    assert all(isinstance(s_, Granted) for s_ in store(pool, toks(2, 0)))
    hs = [h for h, _, _ in chain(toks(2, 0), BS)]
    b = toks(1, 100)
    assert store(pool, b) == [Granted(0, 4)]  # its own leaf evicted for it (slot 4 reused)
    assert hs[1] not in pool and hs[0] in pool
    assert all(h in pool for h, _, _ in chain(salted, BS, "a"))
    assert pool.stats()["quota_dropped"] == 0
    pool.check()


def test_a_second_lookup_counts_nothing_and_stops_before_ssd_blocks():
    """count=False (a PD decode die's lookup after its prefill die's): a lease like any, but no
    counter, recency, hit count or admission ghost changes; promote=False: the hit stops at the
    first block not in DRAM (no promotion ordered)."""
    pool = PoolIndex(BS, {0: 4}, {0: 8})
    t = toks(3, 0)
    store(pool, t)
    store(pool, toks(1, 100))
    store(pool, toks(1, 200))  # evicts t's leaf a2 (LRU): demoted to the SSD tier
    hs = [h for h, _, _ in chain(t, BS)]
    assert [pool.entry(h).dram_slot is not None for h in hs] == [True, True, False]
    pool.take_orders()
    before = (pool.stats(), {h: (e.hits, e.tick) for h, e in pool._e.items()})
    hit = pool.lookup(t, count=False, promote=False)
    after = (pool.stats(), {h: (e.hits, e.tick) for h, e in pool._e.items()})
    assert [b.h for b in hit.blocks] == hs[:2] and all(b.promote_slot is None for b in hit.blocks)
    assert pool.take_orders() == [] and before[1] == after[1]
    assert {k: v for k, v in before[0].items() if k not in ("pinned", "leases")} == \
        {k: v for k, v in after[0].items() if k not in ("pinned", "leases")}  # fmt: skip
    assert after[0]["pinned"] == 2
    pool.release(hit.lease)
    assert len(pool.lookup(t).blocks) == 3  # a counted lookup promotes a2
    pool.check()
    gate = PoolIndex(BS, {0: 4}, admit="second_hit")
    for _ in range(2):
        gate.lookup(t, count=False)  # no ghost: still never seen
    assert store(gate, t)[0] == Dropped("admission")
