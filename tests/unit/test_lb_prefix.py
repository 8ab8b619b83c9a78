"""sched.lb's "prefix" policy (KVPOOL.md §4.7: the KV-centric baseline, Dynamo's approximate KV
indexer): the open group minimising reserved blocks - w x blocks of the prompt it was sent in
the last 120 s; a group at its batch limit is never picked, and load outweighs a small match."""

from __future__ import annotations

import pytest

from sched import LoadBalancer, block_hash
from sched.pool import chain

BS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _lb(groups: int = 3, seqs: int = 4, w: float = 1.0, clock=None) -> LoadBalancer:
    return LoadBalancer(groups, max_num_seqs=seqs, num_blocks=100, block_size=BS,
                        policy="prefix", prefix_weight=w,
                        clock=clock or Clock())  # fmt: skip


def _send(lb: LoadBalancer, rid: int, prompt: list[int], max_tokens: int = 4) -> int:
    hs = lb.prefix_hashes(prompt)
    g = lb.pick(len(prompt), max_tokens, hs)
    assert g is not None
    lb.on_dispatch(g, rid, len(prompt), max_tokens, hs)
    return g


SYSTEM = list(range(1, 17))  # 4 full blocks


def test_hashes_are_the_prefix_caches_and_the_pools():
    lb = _lb()
    prompt = [*SYSTEM, 99, 98]  # 4 full blocks and a partial one
    hs = lb.prefix_hashes(prompt)
    assert hs == [h for h, _, _ in chain(prompt, BS)]  # sched.pool's keys (ns None)
    assert hs[0] == block_hash(None, tuple(SYSTEM[:4]))
    assert LoadBalancer(2, 4, 100, BS).prefix_hashes(prompt) == []  # least_kv: not needed


def test_a_shared_prefix_goes_where_it_was_sent_while_loads_are_equal():
    lb = _lb()
    first = _send(lb, 1, [*SYSTEM, 7])
    lb.on_finish(1)  # loads equal again (all 0)
    for rid in range(2, 6):  # the same system prompt, other user turns: the same group
        assert _send(lb, rid, [*SYSTEM, 10 + rid, 11, 12]) == first
        lb.on_finish(rid)
    # a prompt sharing nothing: least reserved, ties in scan order (not stuck on `first`)
    other = _send(lb, 9, [50, 51, 52, 53, 54, 55, 56, 57])
    assert other != first
    lb.on_finish(9)
    # the longest match wins between two groups that were each sent part of it
    longer = [*SYSTEM, 60, 61, 62, 63, 64]
    lb.on_dispatch(other, 20, 8, 0, lb.prefix_hashes(longer[:8]))  # 2 blocks of it
    lb.on_finish(20)
    assert lb.matched(first, lb.prefix_hashes(longer)) == 4
    assert lb.matched(other, lb.prefix_hashes(longer)) == 2
    assert lb.pick(len(longer), 4, lb.prefix_hashes(longer)) == first


def test_load_still_wins_when_a_group_is_full():
    lb = _lb(groups=2, seqs=2, w=10.0)  # a match worth more than any reservation here
    home = _send(lb, 1, [*SYSTEM, 1])
    assert _send(lb, 2, [*SYSTEM, 2]) == home  # 6 reserved - 10 x 4 matched < 0
    hs = lb.prefix_hashes([*SYSTEM, 3])
    assert lb.pick(17, 4, hs) == 1 - home  # home at max_num_seqs: the other group
    lb.on_dispatch(1 - home, 3, 17, 4, hs)
    lb.on_dispatch(1 - home, 4, 1, 1)
    assert lb.pick(17, 4, hs) is None  # every group full
    lb.on_finish(1)
    assert lb.pick(17, 4, hs) == home


def test_load_outweighs_a_match_smaller_than_the_reserved_gap():
    lb = _lb(groups=2)
    home = _send(lb, 1, [*SYSTEM, 1], max_tokens=40)  # 15 blocks reserved > 4 matched
    assert _send(lb, 2, [*SYSTEM, 2]) == 1 - home
    lb.on_finish(1)
    lb.on_finish(2)
    # weight 4: the same 4 matched blocks are worth 16, more than the 15 reserved
    lb = _lb(groups=2, w=4.0)
    home = _send(lb, 1, [*SYSTEM, 1], max_tokens=40)
    assert _send(lb, 2, [*SYSTEM, 2]) == home


def test_what_was_sent_is_forgotten_after_the_window():
    clock = Clock()
    lb = _lb(clock=clock)
    home = _send(lb, 1, [*SYSTEM, 1])
    lb.on_finish(1)
    clock.t += 119.0
    hs = lb.prefix_hashes([*SYSTEM, 2])
    assert lb.pick(17, 4, hs) == home
    clock.t += 2.0  # 121 s since it was sent there: nothing matches, least_kv's scan order
    assert lb.pick(17, 4, hs) == (home + 1) % 3
    assert lb.matched(home, hs) == 0


def test_bad_prefix_arguments_are_refused():
    with pytest.raises(ValueError, match="prefix_weight"):
        LoadBalancer(2, 2, 10, 4, policy="prefix", prefix_weight=-1)
    with pytest.raises(ValueError, match="prefix_window_s"):
        LoadBalancer(2, 2, 10, 4, policy="prefix", prefix_window_s="x")
