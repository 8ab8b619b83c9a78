"""sched.kv.KVManager: prefix matching, refcounts, LRU eviction, KVFull atomicity, and a random
stream of every operation with the invariants checked after each one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched import kv as kvmod
from sched.kv import KVFull, KVManager

BS = 4


def seq(n: int, base: int = 0) -> list[int]:
    """n distinct-ish tokens: base, base+1, ..."""
    return [base + i for i in range(n)]


def cached_request(kv: KVManager, rid: int, tokens: list[int]) -> list[int]:
    """Allocate rid for all of tokens, register its full blocks, free it; returns its table."""
    table = kv.alloc_blocks(rid, len(tokens))
    kv.cache_blocks(rid, tokens, len(tokens))
    kv.free(rid)
    kv.check()
    return table


def test_match_only_full_blocks_and_never_the_last_token():
    kv = KVManager(8, BS)
    toks = seq(10)  # blocks [0..3] [4..7] full, [8, 9] partial
    table = cached_request(kv, 1, toks)
    assert kv.match_by_prefix(toks) == (table[:2], 8)
    assert kv.match_by_prefix(toks[:9]) == (table[:2], 8)
    assert kv.match_by_prefix(toks[:8]) == (table[:1], 4)  # hit <= len - 1
    assert kv.match_by_prefix(toks[:5]) == (table[:1], 4)
    assert kv.match_by_prefix(toks[:4]) == ([], 0)
    assert kv.match_by_prefix([]) == ([], 0)
    assert kv.match_by_prefix([0, 1, 2, 99, 4, 5, 6, 7, 8]) == ([], 0)  # first block differs
    assert kv.match_by_prefix(toks[:4] + [99] * 5) == (table[:1], 4)


def test_match_is_chained_a_block_matches_only_after_its_parent():
    kv = KVManager(8, BS)
    table = cached_request(kv, 1, seq(4, 100) + seq(4) + [0])
    # block [0..3] is cached only as the second block: not a match at position 0
    assert kv.match_by_prefix(seq(4) + [0]) == ([], 0)
    assert kv.match_by_prefix(seq(4, 100) + seq(4) + [7])[0] == table[:2]


def test_collision_guard_compares_tokens_and_parent(monkeypatch):
    monkeypatch.setattr(kvmod, "block_hash", lambda parent, tokens: 42)
    kv = KVManager(8, BS)
    a, b = seq(4), seq(4, 10)
    table = cached_request(kv, 1, a + b + [0])  # only block 0 gets hash 42; block 1 collides
    assert kv.usage()["cached"] == 1
    assert kv.match_by_prefix(b + a + [0]) == ([], 0)  # hash found, tokens differ
    assert kv.match_by_prefix(a + b + [0]) == (table[:1], 4)  # stops at the colliding block
    assert kv.match_by_prefix(a + a + [0]) == (table[:1], 4)  # same tokens, other parent
    kv.check()


def test_refcounts_with_shared_prefix():
    kv = KVManager(8, BS)
    toks = seq(9)
    t1 = kv.alloc_blocks(1, 9)
    kv.cache_blocks(1, toks, 9)
    blocks, hit = kv.match_by_prefix(toks)
    assert hit == 8 and kv.usage()["used"] == 3  # match is pure
    t2 = kv.alloc_blocks(2, 9, blocks)
    assert t2[:2] == t1[:2] and t2[2] != t1[2]
    assert kv.usage()["used"] == 4
    kv.check()
    assert kv.free(1) == [t1[2]]  # shared blocks keep a reference
    assert kv.usage() == {
        "total": 8,
        "used": 3,
        "cached": 0,
        "free": 5,
        "usage": 3 / 8,
        "masked": 0,
    }
    assert kv.free(2) == [t2[2], t2[1], t2[0]]
    assert kv.usage()["cached"] == 2 and kv.usage()["used"] == 0
    assert kv.free(2) == [] and kv.free(77) == []
    kv.check()


def test_reverse_free_order_and_lru_eviction():
    kv = KVManager(4, BS)
    t1 = cached_request(kv, 1, seq(9))  # 3 blocks, 2 hashed: freed as t1[1], t1[0] (tail first)
    assert kv.usage() == {"total": 4, "used": 0, "cached": 2, "free": 2, "usage": 0.0, "masked": 0}
    t2 = kv.alloc_blocks(2, 8)  # plain free blocks first: the cache survives
    assert set(t2) == {b for b in range(4) if b not in t1[:2]}
    assert kv.match_by_prefix(seq(9))[1] == 8
    kv.append_block(2)  # evicts the least recently freed: the tail block t1[1]
    assert kv.block_table(2)[-1] == t1[1]
    assert kv.match_by_prefix(seq(9)) == ([t1[0]], 4)
    kv.check()


def test_lru_order_follows_free_time():
    kv = KVManager(4, BS)
    ta = cached_request(kv, 1, seq(5))  # a: 1 hashed block
    tb = cached_request(kv, 2, seq(5, 50))  # b: freed later
    kv.alloc_blocks(3, 4 * 2)  # the 2 plain free blocks
    assert kv.usage()["cached"] == 2
    kv.extend(3, 4 * 3)
    assert kv.block_table(3)[-1] == ta[0]  # a was freed first: evicted first
    assert kv.match_by_prefix(seq(5)) == ([], 0)
    assert kv.match_by_prefix(seq(5, 50)) == (tb[:1], 4)
    kv.check()


def test_prefix_block_taken_from_cache_leaves_the_lru():
    kv = KVManager(3, BS)
    t1 = cached_request(kv, 1, seq(5))
    blocks, hit = kv.match_by_prefix(seq(5))
    kv.alloc_blocks(2, 5, blocks)
    assert kv.usage() == {
        "total": 3,
        "used": 2,
        "cached": 0,
        "free": 1,
        "usage": 2 / 3,
        "masked": 0,
    }
    kv.append_block(2)
    with pytest.raises(KVFull):
        kv.append_block(2)
    assert kv.block_table(2)[0] == t1[0]
    kv.check()


def test_kvfull_changes_nothing():
    kv = KVManager(4, BS)
    cached_request(kv, 1, seq(9))
    kv.alloc_blocks(2, 4)
    blocks, _ = kv.match_by_prefix(seq(9))
    before = (kv.usage(), kv.block_table(2), kv.match_by_prefix(seq(9)))
    # 2 cached prefix blocks revived + 2 new > 3 allocatable
    with pytest.raises(KVFull):
        kv.alloc_blocks(3, 16, blocks)
    with pytest.raises(KVFull):
        kv.extend(2, 20)
    assert (kv.usage(), kv.block_table(2), kv.match_by_prefix(seq(9))) == before
    with pytest.raises(ValueError):
        kv.block_table(3)
    assert kv.can_alloc(3) and not kv.can_alloc(4)
    kv.check()


def test_bad_calls_are_refused():
    kv = KVManager(4, BS)
    kv.alloc_blocks(1, 3)
    with pytest.raises(ValueError, match="already has"):
        kv.alloc_blocks(1, 3)
    with pytest.raises(ValueError, match="not a cached block"):
        kv.alloc_blocks(2, 8, [0])
    with pytest.raises(ValueError, match="no block table"):
        kv.extend(5, 4)
    with pytest.raises(ValueError, match="num_blocks"):
        KVManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        KVManager(4, True)
    kv.check()


def test_cache_blocks_keeps_an_existing_hash_mapping():
    kv = KVManager(8, BS)
    kv.alloc_blocks(1, 5)
    kv.alloc_blocks(2, 5)
    kv.cache_blocks(1, seq(5), 5)
    kv.cache_blocks(2, seq(5), 5)  # same content: the index keeps request 1's block
    kv.cache_blocks(2, seq(5), 5)  # idempotent
    assert kv.match_by_prefix(seq(5)) == (kv.block_table(1)[:1], 4)
    kv.check()
    t2 = kv.block_table(2)
    assert kv.free(2) == t2[::-1]
    assert kv.usage()["cached"] == 0  # request 2's copy was never hashed: plain free
    kv.check()


def test_cache_blocks_only_full_written_blocks():
    kv = KVManager(8, BS)
    kv.alloc_blocks(1, 12)
    kv.cache_blocks(1, seq(12), 7)
    assert kv.match_by_prefix(seq(12))[1] == 4
    kv.cache_blocks(1, seq(12), 12)
    assert kv.match_by_prefix(seq(12))[1] == 8  # never the last token's block
    assert kv.match_by_prefix(seq(13))[1] == 12


def test_disabled_prefix_cache():
    kv = KVManager(4, BS, enable_prefix_cache=False)
    cached_request(kv, 1, seq(9))
    assert kv.match_by_prefix(seq(9)) == ([], 0)
    assert kv.usage() == {"total": 4, "used": 0, "cached": 0, "free": 4, "usage": 0.0, "masked": 0}
    kv.check()


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "extend", "append", "cache", "free", "match"]),
        st.integers(0, 5),  # request id
        st.integers(0, 30),  # tokens
        st.integers(0, 2),  # token stream: requests share prefixes when equal
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, num_blocks=st.integers(1, 10), enable=st.booleans())
def test_random_stream_keeps_invariants(ops, num_blocks, enable):
    kv = KVManager(num_blocks, BS, enable_prefix_cache=enable)
    stream: dict[int, int] = {}  # request -> its token stream
    length: dict[int, int] = {}  # request -> positions its table must cover
    for op, rid, n, s in ops:
        toks = seq(40, 1000 * s)
        before = kv.usage()
        try:
            if op == "alloc" and rid not in length:
                blocks, hit = kv.match_by_prefix(toks[: max(n, 1)])
                assert hit <= max(n, 1) - 1 and hit == len(blocks) * BS
                table = kv.alloc_blocks(rid, max(n, hit), blocks)
                assert table[: len(blocks)] == blocks
                stream[rid], length[rid] = s, max(n, hit)
            elif op == "extend" and rid in length:
                kv.extend(rid, n)
                length[rid] = max(length[rid], n)
            elif op == "append" and rid in length:
                kv.append_block(rid)
                length[rid] = len(kv.block_table(rid)) * BS
            elif op == "cache" and rid in length:
                kv.cache_blocks(rid, seq(40, 1000 * stream[rid]), min(n, length[rid]))
            elif op == "free":
                freed = kv.free(rid)
                assert rid in length or not freed
                length.pop(rid, None)
            elif op == "match":
                blocks, hit = kv.match_by_prefix(toks[:n])
                assert hit <= max(n - 1, 0) and (enable or hit == 0)
        except KVFull:
            assert kv.usage() == before
        kv.check()
        for r, ln in length.items():
            assert len(kv.block_table(r)) * BS >= ln
    for r in list(length):
        kv.free(r)
    kv.check()
    assert kv.usage()["used"] == 0


def test_a_masked_block_is_never_allocated_or_matched_again():
    kv = KVManager(4, 2)
    tokens = [1, 2, 3, 4, 5]
    kv.alloc_blocks(0, 5)  # blocks 0, 1, 2
    kv.cache_blocks(0, tokens, 5)
    kv.alloc_blocks(1, 4, kv.match_by_prefix(tokens)[0])  # shares 0 and 1
    assert kv.holders(0) == [0, 1]
    assert kv.mask(0) and not kv.mask(0)
    assert kv.match_by_prefix(tokens) == ([], 0)  # its hash is gone: no prefix hit on it
    kv.free(0)
    kv.free(1)
    kv.check()
    assert kv.masked == [0] and kv.usage()["total"] == 3 and kv.usage()["masked"] == 1
    for rid in range(2, 5):  # every block that can be allocated, none of them the masked one
        assert 0 not in kv.alloc_blocks(rid, 2)
    with pytest.raises(KVFull):
        kv.alloc_blocks(9, 1)
    kv.check()
    kv2 = KVManager(2, 2)
    assert kv2.mask(1) and kv2.usage()["free"] == 1  # a free block: just out of the pool
    with pytest.raises(ValueError):
        kv2.mask(2)


def test_masking_preempts_the_holders_only():
    from sched import Request, SamplingParams, Scheduler, SchedulerConfig

    kv = KVManager(16, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_seq_len=64), kv)
    for rid, prompt in ((0, [1] * 9), (2, [2] * 5)):
        s.add(Request(rid, prompt, SamplingParams(max_tokens=4)))
    plan = s.schedule()
    s.on_result(plan.plan_id, {0: 7, 2: 7})
    s.add(Request(1, [1] * 9, SamplingParams(max_tokens=4)))  # its prefix is 0's: shared blocks
    plan = s.schedule()
    s.on_result(plan.plan_id, {0: 7, 1: 7, 2: 7})
    shared = kv.block_table(0)[0]
    assert shared in kv.block_table(1) and shared not in kv.block_table(2)
    assert s.mask_block(shared) == [0, 1]
    assert [r.request_id for r in s.running] == [2]
    assert sorted(len(r.output) for r in s.waiting) == [1, 2]  # output kept: they recompute
    plan = s.schedule()
    assert all(shared not in r.block_table for r in plan.rows)
