"""sched.lb.LoadBalancer: least-KV and round-robin picks over decode DP groups."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched import LoadBalancer


def test_least_kv_picks_the_lowest_reserved_usage():
    lb = LoadBalancer(3, max_num_seqs=4, num_blocks=100, block_size=4)
    lb.on_dispatch(0, 1, 30, 10)  # 10 blocks
    lb.on_dispatch(1, 2, 3, 2)  # 2 blocks
    lb.on_dispatch(2, 3, 17, 4)  # 6 blocks (21 tokens)
    assert lb.usage() == [0.10, 0.02, 0.06]
    assert lb.pick(5, 5) == 1
    lb.on_dispatch(1, 4, 40, 0)  # group 1: 12 blocks
    assert lb.pick(5, 5) == 2
    lb.on_finish(1)
    assert lb.pick(5, 5) == 0 and lb.usage()[0] == 0
    lb.on_finish(1)  # unknown now: no-op
    assert lb.inflight() == [0, 2, 1]


def test_least_kv_rotates_ties():
    lb = LoadBalancer(3, max_num_seqs=4, num_blocks=10, block_size=4)
    assert [lb.pick(4, 4) for _ in range(4)] == [0, 1, 2, 0]


def test_least_kv_skips_full_groups_and_none_when_all_full():
    lb = LoadBalancer(2, max_num_seqs=2, num_blocks=10, block_size=4)
    lb.on_dispatch(0, 1, 1, 1)
    lb.on_dispatch(0, 2, 1, 1)  # group 0: full, lowest usage still
    lb.on_dispatch(1, 3, 40, 0)
    assert lb.pick(1, 1) == 1
    lb.on_dispatch(1, 4, 1, 1)
    assert lb.pick(1, 1) is None
    lb.on_finish(2)
    assert lb.pick(1, 1) == 0


def test_round_robin_cycles_over_groups_that_are_not_full():
    lb = LoadBalancer(3, max_num_seqs=1, num_blocks=10, block_size=4, policy="round_robin")
    lb.on_dispatch(1, 7, 40, 0)  # heavy, but round robin ignores usage
    assert [lb.pick(1, 1) for _ in range(4)] == [0, 2, 0, 2]
    lb.on_finish(7)
    assert [lb.pick(1, 1) for _ in range(3)] == [0, 1, 2]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="policy"):
        LoadBalancer(2, 2, 10, 4, policy="random")
    with pytest.raises(ValueError, match="num_groups"):
        LoadBalancer(0, 2, 10, 4)
    lb = LoadBalancer(2, 2, 10, 4)
    with pytest.raises(ValueError, match="group"):
        lb.on_dispatch(2, 1, 1, 1)
    lb.on_dispatch(0, 1, 1, 1)
    with pytest.raises(ValueError, match="already dispatched"):
        lb.on_dispatch(1, 1, 1, 1)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["least_kv", "round_robin"]),
    groups=st.integers(1, 4),
    seqs=st.integers(1, 3),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 40)), max_size=60),
)
def test_pick_never_returns_a_full_group(policy, groups, seqs, ops):
    lb = LoadBalancer(groups, seqs, num_blocks=32, block_size=4, policy=policy)
    live: list[int] = []
    for rid, (dispatch, prompt_len, x) in enumerate(ops):
        if dispatch:
            g = lb.pick(prompt_len, 8)
            if g is None:
                assert all(n >= seqs for n in lb.inflight())
                continue
            assert lb.inflight()[g] < seqs
            if policy == "least_kv":
                open_ = [u for u, n in zip(lb.usage(), lb.inflight(), strict=True) if n < seqs]
                assert lb.usage()[g] == min(open_)
            lb.on_dispatch(g, rid, prompt_len, 8)
            live.append(rid)
        elif live:
            lb.on_finish(live.pop(x % len(live)))
        assert sum(lb.inflight()) == len(live)
    for rid in live:
        lb.on_finish(rid)
    assert lb.inflight() == [0] * groups and lb.usage() == [0.0] * groups
