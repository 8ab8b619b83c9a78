"""sched.eplb: the deepseek EPLB port (golden worked example, upstream equivalence), the greedy
policy, ExpertMap, replica_for, by hand and by property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched.eplb import (
    ExpertMap,
    balanced_packing,
    greedy_placement,
    plan,
    rebalance_experts,
    rebalance_experts_hierarchical,
    replica_for,
    replicate_experts,
)

# deepseek-ai/EPLB README, "Interface and Example": 2 layers, 12 experts, 16 replicas, 4 groups,
# 2 nodes, 8 GPUs; the printed phy2log.
README_WEIGHT = np.array(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_PHY2LOG = np.array(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)


def die_duplicates(phy2log: np.ndarray, num_dies: int) -> list[tuple[int, int]]:
    """(layer, die) pairs where the die holds two replicas of one expert."""
    per_die = phy2log.shape[1] // num_dies
    blocks = phy2log.reshape(phy2log.shape[0], num_dies, per_die)
    return [
        (layer, die)
        for layer in range(blocks.shape[0])
        for die in range(num_dies)
        if len(set(blocks[layer, die].tolist())) < per_die
    ]


def check_triple(phy2log, log2phy, logcnt, num_experts: int, num_replicas: int, num_dies: int):
    """Every invariant of a placement, recomputed from scratch (independent of ExpertMap)."""
    num_layers = phy2log.shape[0]
    for arr in (phy2log, log2phy, logcnt):
        assert arr.dtype == np.int64
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape == (num_layers, num_experts, logcnt.max())
    assert num_replicas % num_dies == 0  # equal slots per die
    for layer in range(num_layers):
        counts = np.bincount(phy2log[layer], minlength=num_experts)
        assert counts.size == num_experts  # no id >= num_experts
        np.testing.assert_array_equal(counts, logcnt[layer])
        assert (logcnt[layer] >= 1).all()
        seen = []
        for e in range(num_experts):
            c = logcnt[layer, e]
            slots = log2phy[layer, e, :c]
            assert (phy2log[layer, slots] == e).all()
            assert (log2phy[layer, e, c:] == -1).all()
            seen += slots.tolist()
        assert sorted(seen) == list(range(num_replicas))
    assert die_duplicates(phy2log, num_dies) == []


# -- golden worked example -----------------------------------------------------------------------


def test_golden_readme_example():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, 16, 4, 2, 8)
    np.testing.assert_array_equal(phy2log, README_PHY2LOG)
    np.testing.assert_array_equal(
        logcnt, [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    )
    check_triple(phy2log, log2phy, logcnt, 12, 16, 8)
    # log2phy by replica rank (rank 0 = the original), with the stable tie rule: e.g. layer 0's
    # expert 1 has its original in slot 15 and its replica in slot 13
    np.testing.assert_array_equal(log2phy[0, [1, 4, 5, 10]], [[15, 13], [7, 5], [0, 2], [8, 10]])
    np.testing.assert_array_equal(log2phy[1, [1, 5, 6, 8]], [[15, 11], [10, 12], [2, 4], [6, 3]])
    # the upstream algorithm (no fix) gives the same: the example has no duplicate on a die
    raw, _, raw_cnt = rebalance_experts_hierarchical(README_WEIGHT, 16, 4, 2, 8, distinct=False)
    np.testing.assert_array_equal(raw, README_PHY2LOG)
    np.testing.assert_array_equal(raw_cnt, logcnt)
    assert ExpertMap(phy2log, log2phy, logcnt, 8).slots_per_die == 2


def test_golden_global_policy_when_nodes_do_not_divide_groups():
    # 4 groups over 3 nodes: upstream falls back to the global policy (1 group, 1 node)
    a = rebalance_experts(README_WEIGHT, 16, 4, 3, 8)
    b = rebalance_experts(README_WEIGHT, 16, 1, 1, 8)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    check_triple(*a, 12, 16, 8)


# -- the no-duplicate fix --------------------------------------------------------------------------


def test_packing_induced_duplicate_is_fixed():
    # found by search: upstream packs 3, 3 on die 0 and 0, 0 on die 1 (replica counts <= dies)
    w = np.array([[32, 12, 30, 38, 19, 23]])
    raw, _, raw_cnt = rebalance_experts_hierarchical(w, 10, 1, 1, 2, distinct=False)
    np.testing.assert_array_equal(raw, [[3, 3, 2, 1, 5, 4, 0, 0, 2, 5]])
    assert die_duplicates(raw, 2) == [(0, 0), (0, 1)]
    phy2log, log2phy, logcnt = rebalance_experts(w, 10, 1, 1, 2)
    np.testing.assert_array_equal(logcnt, raw_cnt)  # same replicas, only the packing differs
    np.testing.assert_array_equal(phy2log, [[3, 0, 2, 1, 5, 4, 3, 0, 2, 5]])
    check_triple(phy2log, log2phy, logcnt, 6, 10, 2)


def test_replication_beyond_the_die_count_is_capped():
    # one hot expert: upstream gives it 3 replicas on 2 dies, so one die holds it twice
    w = np.array([[100, 1, 1, 1]])
    raw, _, raw_cnt = rebalance_experts_hierarchical(w, 6, 1, 1, 2, distinct=False)
    assert raw_cnt[0, 0] == 3 and die_duplicates(raw, 2)
    phy2log, log2phy, logcnt = rebalance_experts(w, 6, 1, 1, 2)
    np.testing.assert_array_equal(logcnt, [[2, 2, 1, 1]])  # the cap is 2, then expert 1 (tie)
    check_triple(phy2log, log2phy, logcnt, 4, 6, 2)


def test_balanced_packing_repair_when_every_open_pack_holds_the_label():
    # heaviest first: 0 -> pack 0, then 1, 2, 3 fill pack 1; both 4s are left for pack 0
    w = np.array([[10, 1, 1, 1, 0.5, 0.5]])
    labels = np.array([[0, 1, 2, 3, 4, 4]])
    raw, _ = balanced_packing(w, 2)
    np.testing.assert_array_equal(raw, [[0, 1, 1, 1, 0, 0]])
    pack, rank = balanced_packing(w, 2, labels)
    assert sorted(pack[0, 4:].tolist()) == [0, 1]  # the two 4s on different packs
    for p in range(2):
        mine = pack[0] == p
        assert sorted(rank[0, mine].tolist()) == [0, 1, 2]
        assert len(set(labels[0, mine].tolist())) == 3


def test_no_duplicate_needs_enough_experts_per_node():
    # one die per node: a redundant replica can only go to a die that has the expert already
    with pytest.raises(ValueError, match="num_replicas.*two replicas"):
        rebalance_experts(README_WEIGHT, 16, 4, 4, 4)
    raw, _, _ = rebalance_experts_hierarchical(README_WEIGHT, 16, 4, 4, 4, distinct=False)
    assert die_duplicates(raw, 4)  # what upstream does instead


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 3),
    nodes=st.sampled_from([1, 2]),
    gpus_per_node=st.sampled_from([1, 2, 3]),
    groups_per_node=st.sampled_from([1, 2]),
    group_size=st.integers(1, 3),
    slots_per_gpu=st.integers(1, 4),
    data=st.data(),
)
def test_fix_matches_upstream_whenever_upstream_has_no_duplicate(
    layers, nodes, gpus_per_node, groups_per_node, group_size, slots_per_gpu, data
):
    num_groups = nodes * groups_per_node
    num_experts = num_groups * group_size
    num_gpus = nodes * gpus_per_node
    num_replicas = num_gpus * slots_per_gpu
    if num_replicas < num_experts or slots_per_gpu > num_experts // nodes:
        return  # too few slots, or no placement without a duplicate exists
    weight = np.array(
        data.draw(
            st.lists(
                st.lists(st.integers(0, 60), min_size=num_experts, max_size=num_experts),
                min_size=layers,
                max_size=layers,
            )
        )
    )
    args = (weight, num_replicas, num_groups, nodes, num_gpus)
    raw, raw_rank, raw_cnt = rebalance_experts_hierarchical(*args, distinct=False)
    ours, ours_rank, ours_cnt = rebalance_experts_hierarchical(*args)
    assert die_duplicates(ours, num_gpus) == []
    dup_layers = {layer for layer, _ in die_duplicates(raw, num_gpus)}
    for layer in sorted(set(range(layers)) - dup_layers):
        np.testing.assert_array_equal(ours[layer], raw[layer])
        np.testing.assert_array_equal(ours_rank[layer], raw_rank[layer])
        np.testing.assert_array_equal(ours_cnt[layer], raw_cnt[layer])


# -- both policies, by property --------------------------------------------------------------------

loads = st.one_of(st.integers(0, 10), st.integers(0, 10**6), st.just(0))


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(["deepseek", "greedy"]),
    layers=st.integers(1, 3),
    num_dies=st.sampled_from([1, 2, 3, 4, 8]),
    per_die=st.integers(1, 4),
    redundant_per_die=st.integers(0, 3),
    data=st.data(),
)
def test_plan_properties(policy, layers, num_dies, per_die, redundant_per_die, data):
    num_experts = num_dies * per_die
    load = np.array(
        data.draw(
            st.lists(
                st.lists(loads, min_size=num_experts, max_size=num_experts),
                min_size=layers,
                max_size=layers,
            )
        )
    )
    num_groups, num_nodes, nodes_used = 1, 1, 1
    if policy == "deepseek":
        num_groups = data.draw(st.sampled_from([g for g in (1, 2, 3, 4) if num_experts % g == 0]))
        num_nodes = data.draw(st.sampled_from([n for n in (1, 2, 4) if num_dies % n == 0]))
        nodes_used = num_nodes if num_groups % num_nodes == 0 else 1
    num_replicas = num_experts + num_dies * redundant_per_die
    slots_per_die = per_die + redundant_per_die
    if slots_per_die > num_experts // nodes_used:  # a die would need two copies of an expert
        with pytest.raises(ValueError, match="redundant_per_die.*two replicas"):
            plan(load, num_dies, redundant_per_die, policy, num_groups, num_nodes)
        return
    em = plan(load, num_dies, redundant_per_die, policy, num_groups, num_nodes)
    assert em.num_physical == num_replicas and em.slots_per_die == slots_per_die
    check_triple(em.phy2log, em.log2phy, em.logcnt, num_experts, num_replicas, num_dies)
    np.testing.assert_array_equal(np.bincount(em.die_of_physical()), [slots_per_die] * num_dies)
    b = em.balancedness(load)
    assert b.shape == (layers,) and ((b > 0) & (b <= 1 + 1e-12)).all()
    # splitting each expert's load over its replicas conserves the layer's load
    np.testing.assert_allclose(em.die_load(load).sum(axis=1), load.sum(axis=1))
    if policy == "greedy":
        # each extra replica went to the expert with the highest load per replica among those
        # below the cap (one replica per die), and per-replica loads only fall as replicas are
        # added: no expert still below the cap beats one replicated, before its last replica
        for layer in range(layers):
            w, c = load[layer], em.logcnt[layer]
            replicated, below_cap = c >= 2, c < num_dies
            if replicated.any() and below_cap.any():
                assert (w[below_cap] / c[below_cap]).max() <= (
                    w[replicated] / (c[replicated] - 1)
                ).min()


@settings(max_examples=40, deadline=None)
@given(
    num_dies=st.sampled_from([2, 4]),
    per_die=st.integers(2, 4),
    redundant=st.integers(0, 2),
    seed=st.integers(0, 2**32 - 1),
)
def test_greedy_equals_global_deepseek_without_ties(num_dies, per_die, redundant, seed):
    # continuous random loads: no two per-replica loads tie, so only the tie order could differ
    weight = np.random.default_rng(seed).random((2, num_dies * per_die)) + 0.01
    num_replicas = num_dies * (per_die + redundant)
    greedy = greedy_placement(weight, num_replicas, num_dies)
    deepseek = rebalance_experts(weight, num_replicas, 1, 1, num_dies)
    np.testing.assert_array_equal(greedy[0], deepseek[0])
    np.testing.assert_array_equal(greedy[2], deepseek[2])


# -- load balance ----------------------------------------------------------------------------------


def zipf_load(num_layers: int, num_experts: int, s: float = 1.2, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = 10_000 / np.arange(1, num_experts + 1) ** s
    return np.stack([rng.permutation(base) for _ in range(num_layers)])


def test_greedy_beats_identity_on_a_zipf_load():
    load = zipf_load(4, 64)
    ident = ExpertMap.identity(4, 64, 16).balancedness(load)
    greedy = plan(load, 16, 1, "greedy").balancedness(load)
    deepseek = plan(load, 16, 1, "deepseek", num_groups=8, num_nodes=2).balancedness(load)
    assert (greedy > ident).all()
    assert (greedy > 0.8).all() and (ident < 0.6).all()
    assert (deepseek > ident).all()
    assert (
        plan(load, 16, 1, "greedy").max_per_die(load)
        < ExpertMap.identity(4, 64, 16).max_per_die(load)
    ).all()


def test_die_load_and_balancedness_by_hand():
    # 2 dies x 2 slots: expert 0 (load 8) replicated on both dies, experts 1, 2 once each
    em = ExpertMap.from_phy2log([[0, 1, 2, 0]], num_experts=3, num_dies=2)
    np.testing.assert_array_equal(em.logcnt, [[2, 1, 1]])
    np.testing.assert_array_equal(em.log2phy, [[[0, 3], [1, -1], [2, -1]]])
    np.testing.assert_array_equal(em.die_of_physical(), [0, 0, 1, 1])
    load = np.array([[8, 2, 6]])
    np.testing.assert_allclose(em.die_load(load), [[4 + 2, 6 + 4]])
    np.testing.assert_allclose(em.max_per_die(load), [10])
    np.testing.assert_allclose(em.balancedness(load), [8 / 10])
    np.testing.assert_allclose(em.balancedness(np.zeros((1, 3))), [1.0])


def test_identity():
    em = ExpertMap.identity(2, 8, 4)
    assert em.slots_per_die == 2 and em.num_layers == 2 and em.num_experts == 8
    np.testing.assert_array_equal(em.die_of_physical()[em.log2phy[1, :, 0]], np.arange(8) // 2)
    assert (em.logcnt == 1).all() and em.log2phy.shape == (2, 8, 1)
    assert em == ExpertMap.from_phy2log(np.tile(np.arange(8), (2, 1)), 8, 4)


# -- replica_for -----------------------------------------------------------------------------------


def test_replica_for_cycles_positions_over_replicas_and_keeps_minus_one():
    em = ExpertMap.from_phy2log([[0, 1, 2, 0, 1, 0]], num_experts=3, num_dies=3)
    # expert 0: slots 0, 3, 5; expert 1: slots 1, 4; expert 2: slot 2
    ids = np.array([[0, 1], [0, -1], [0, 2], [0, 1], [-1, -1]])
    got = replica_for(em, 0, ids, np.array([0, 1, 2, 3, 7]))
    np.testing.assert_array_equal(got, [[0, 1], [3, -1], [5, 2], [0, 4], [-1, -1]])
    assert got.dtype == np.int64
    # many positions: each replica of expert 0 gets a third of them, deterministically
    pos = np.arange(300)
    phys = replica_for(em, 0, np.zeros((300, 1), np.int64), pos)[:, 0]
    np.testing.assert_array_equal(np.bincount(phys, minlength=6)[[0, 3, 5]], [100, 100, 100])
    np.testing.assert_array_equal(phys, replica_for(em, 0, np.zeros((300, 1), np.int64), pos)[:, 0])
    assert (em.phy2log[0, phys] == 0).all()


# -- bad input -------------------------------------------------------------------------------------

W = np.ones((2, 8))
EM = ExpertMap.identity(1, 4, 2)


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: plan(-W, 2, 1), ValueError, r"load\[0, 0\].*>= 0"),
        (lambda: plan(W * np.nan, 2, 1), ValueError, "load.*finite"),
        (lambda: plan(np.ones(8), 2, 1), ValueError, "load.*2-D"),
        (lambda: plan(W.astype(bool), 2, 1), TypeError, "load.*dtype"),
        (lambda: plan(W, 3, 1), ValueError, "load.*num_dies = 3"),
        (lambda: plan(W, 0, 1), ValueError, "num_dies"),
        (lambda: plan(W, 2, -1), ValueError, "redundant_per_die"),
        (lambda: plan(W, 2, 1.0), TypeError, "redundant_per_die"),
        (lambda: plan(W, 2, 1, "random"), ValueError, "policy"),
        (lambda: plan(W, 2, 1, num_groups=3), ValueError, "num_groups"),
        (lambda: plan(W, 2, 1, num_nodes=4), ValueError, "num_nodes"),
        (lambda: plan(W, 2, 1, "greedy", num_groups=2), ValueError, "num_groups"),
        (
            lambda: plan(W, 2, 5),
            ValueError,
            "redundant_per_die.*two replicas",
        ),  # 9 slots per die, 8 experts
        (lambda: rebalance_experts(W, 9, 1, 1, 2), ValueError, "num_replicas.*multiple"),
        (lambda: rebalance_experts(W, 6, 1, 1, 2), ValueError, "num_replicas.*fewer"),
        (lambda: rebalance_experts(W, 8, 3, 3, 2), ValueError, "num_groups"),
        (lambda: rebalance_experts(W, 8, 2, 2, 3), ValueError, "num_gpus"),
        (lambda: rebalance_experts(-W, 8, 1, 1, 2), ValueError, r"weight\[0, 0\]"),
        (lambda: greedy_placement(W, 9, 2), ValueError, "num_replicas.*multiple"),
        (lambda: greedy_placement(W, 4, 2), ValueError, "num_replicas.*fewer"),
        (lambda: greedy_placement(W, 18, 1), ValueError, "two replicas"),
        (lambda: greedy_placement(W, 8, 0), ValueError, "num_dies"),
        (lambda: replicate_experts(W, 7), ValueError, "num_phy"),
        (lambda: balanced_packing(W, 3), ValueError, "num_packs"),
        (lambda: balanced_packing(W, 2, np.zeros((2, 8), np.int64)), ValueError, "labels"),
        (lambda: replica_for(EM, 1, [[0]], [0]), ValueError, "layer"),
        (lambda: replica_for(EM, 0, [[4]], [0]), ValueError, r"logical_ids\[0, 0\]"),
        (lambda: replica_for(EM, 0, [[-2]], [0]), ValueError, "logical_ids"),
        (lambda: replica_for(EM, 0, [[0.5]], [0]), TypeError, "logical_ids"),
        (lambda: replica_for(EM, 0, [0], [0]), ValueError, "logical_ids"),
        (lambda: replica_for(EM, 0, [[0], [1]], [0]), ValueError, "positions"),
        (lambda: replica_for(EM, 0, [[0]], [-1]), ValueError, "positions"),
        (lambda: replica_for("map", 0, [[0]], [0]), TypeError, "expert_map"),
        (lambda: ExpertMap.identity(1, 5, 2), ValueError, "num_experts"),
    ],
)
def test_bad_input_names_the_argument(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_plan_with_just_enough_experts_is_fine():
    em = plan(W, 2, 4)  # 8 slots per die, 8 experts: every die holds every expert
    assert em.slots_per_die == 8 and (em.logcnt == 2).all()


def test_expert_map_refuses_inconsistent_arrays():
    good = ExpertMap.from_phy2log([[0, 1, 2, 0]], 3, 2)
    p, l2p, cnt = good.phy2log, good.log2phy, good.logcnt
    with pytest.raises(ValueError, match="die 0 holds two replicas of expert 0"):
        ExpertMap.from_phy2log([[0, 0, 1, 2]], 3, 2)
    with pytest.raises(ValueError, match="logcnt"):
        ExpertMap(p, l2p, np.array([[1, 1, 2]]), 2)
    with pytest.raises(ValueError, match="log2phy"):
        ExpertMap(p, l2p[:, [1, 0, 2]], cnt, 2)
    with pytest.raises(ValueError, match="log2phy.*-1"):
        ExpertMap(p, np.where(l2p < 0, 7, l2p), cnt, 2)
    with pytest.raises(ValueError, match="num_dies"):
        ExpertMap(p, l2p, cnt, 3)
    with pytest.raises(ValueError, match="phy2log"):
        ExpertMap.from_phy2log([[0, 1, 0, 1]], 3, 2)  # expert 2 has no replica
    assert not good.phy2log.flags.writeable
