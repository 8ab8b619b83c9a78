"""comm.routing: Placement, get_dispatch_layout and get_dedup_layout: by hand, by property, at
the edges."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.routing import (
    DispatchLayout,
    Placement,
    check_topk_idx,
    get_dedup_layout,
    get_dispatch_layout,
)
from tests.routing_cases import random_topk, topk_rows

# The hand-checked case shared with test_reference.py: 2 dies, 4 experts (2 per die), batch 3,
# top-2. Slot 1 has an unrouted k; slot 2 sends both its experts to die 0 (two messages).
#   expert:  0      1      2      3
#   (die, local): (0,0)  (0,1)  (1,0)  (1,1)
HAND_TOPK = np.array([[1, 2], [3, -1], [0, 1]])


def _i64(*values):
    return np.array(values, dtype=np.int64)


# -- Placement -------------------------------------------------------------------------------------


def test_default_placement_by_hand():
    p = Placement.default(6, (4, 7, 5))
    assert p.dies == (4, 7, 5)
    np.testing.assert_array_equal(p.die_of, _i64(4, 4, 7, 7, 5, 5))
    np.testing.assert_array_equal(p.local_of, _i64(0, 1, 0, 1, 0, 1))
    np.testing.assert_array_equal(p.pos_of, _i64(0, 0, 1, 1, 2, 2))
    np.testing.assert_array_equal(p.experts_on(7), _i64(2, 3))
    assert [p.num_local(d) for d in p.dies] == [2, 2, 2]
    assert p.die_pos(5) == 2


def test_disaggregated_expert_dies():
    p = Placement.default(8, (2, 3, 4, 5))
    np.testing.assert_array_equal(p.die_of, _i64(2, 2, 3, 3, 4, 4, 5, 5))
    np.testing.assert_array_equal(p.experts_on(5), _i64(6, 7))
    with pytest.raises(ValueError, match=r"die: 0 is not one of the expert dies \(2, 3, 4, 5\)"):
        p.experts_on(0)


def test_from_table_with_a_permuted_table():
    # expert -> die: 0->1, 1->0, 2->1, 3->0; local index = order among the die's experts.
    p = Placement.from_table([1, 0, 1, 0], dies=(0, 1))
    np.testing.assert_array_equal(p.die_of, _i64(1, 0, 1, 0))
    np.testing.assert_array_equal(p.local_of, _i64(0, 0, 1, 1))
    np.testing.assert_array_equal(p.experts_on(0), _i64(1, 3))
    np.testing.assert_array_equal(p.experts_on(1), _i64(0, 2))


def test_from_table_allows_an_empty_die_and_matches_default():
    p = Placement.from_table(np.array([3, 3, 3]), dies=(1, 3))
    assert p.num_local(1) == 0 and p.experts_on(1).size == 0
    assert Placement.from_table([0, 0, 1, 1], (0, 1)) == Placement.default(4, [0, 1])
    assert hash(Placement.from_table([0, 0, 1, 1], (0, 1))) == hash(Placement.default(4, (0, 1)))
    assert Placement.from_table([1, 0], (0, 1)) != Placement.default(2, (0, 1))


def test_placement_arrays_are_read_only_copies():
    table = np.array([0, 1, 0, 1])
    p = Placement.from_table(table, (0, 1))
    table[0] = 1  # the caller's array is not shared
    assert p.die_of[0] == 0
    for arr in (p.die_of, p.local_of, p.pos_of, p.experts_on(0)):
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 5
    with pytest.raises(AttributeError):
        p.num_experts = 3


@pytest.mark.parametrize(
    "build, exc, msg",
    [
        (lambda: Placement.default(6, (0, 1, 2, 3)), ValueError, "6 experts cannot be split"),
        (lambda: Placement.default(0, (0,)), ValueError, "num_experts: must be >= 1"),
        (lambda: Placement.default(4.0, (0, 1)), TypeError, "num_experts: expected an int"),
        (lambda: Placement.default(4, ()), ValueError, "dies: at least one die"),
        (lambda: Placement.default(4, (0, 0)), ValueError, "dies: die ids must be distinct"),
        (lambda: Placement.default(4, 2), TypeError, "dies: expected a sequence"),
        (lambda: Placement.default(4, (0, -1)), ValueError, r"dies\[1\]: must be >= 0"),
        (lambda: Placement.default(4, (0, True)), TypeError, r"dies\[1\]: expected an int"),
        (lambda: Placement.from_table([0, 2], (0, 1)), ValueError, "die 2 is not one of dies"),
        (lambda: Placement.from_table([0.0, 1.0], (0, 1)), TypeError, "table: expected an int"),
        (lambda: Placement.from_table([], (0, 1)), ValueError, "table: expected a non-empty"),
        (lambda: Placement(2, (0,), [0, 0], [0, 0]), ValueError, "local indices 0..1"),
        (lambda: Placement(2, (0,), [0, 0, 0], [0, 1, 2]), ValueError, r"die_of: expected shape"),
    ],
)
def test_placement_rejects_bad_input(build, exc, msg):
    with pytest.raises(exc, match=msg):
        build()


# -- get_dispatch_layout: by hand ------------------------------------------------------------------


def test_layout_by_hand():
    lay = get_dispatch_layout(HAND_TOPK, Placement.default(4, (0, 1)))
    # messages (slot, k, expert): (0,0,1) (0,1,2) (1,0,3) (2,0,0) (2,1,1), sorted by
    # (dest position, local expert, slot, k):
    #   die 0: local 0: (2,0)        local 1: (0,0) (2,1)
    #   die 1: local 0: (0,1)        local 1: (1,0)
    np.testing.assert_array_equal(lay.num_tokens_per_die, _i64(3, 2))
    np.testing.assert_array_equal(lay.num_tokens_per_expert, _i64(1, 2, 1, 1))
    np.testing.assert_array_equal(lay.msg_slot, _i64(2, 0, 2, 0, 1))
    np.testing.assert_array_equal(lay.msg_k, _i64(0, 0, 1, 1, 0))
    np.testing.assert_array_equal(lay.msg_dest, _i64(0, 0, 0, 1, 1))
    np.testing.assert_array_equal(lay.msg_local_expert, _i64(0, 1, 1, 0, 1))
    np.testing.assert_array_equal(lay.dest_offsets, _i64(0, 3, 5))
    assert lay.num_msgs == 5


def test_layout_by_hand_with_permuted_placement_and_die_order():
    # experts 0,2 on die 5 (pos 0), experts 1,3 on die 3 (pos 1).
    p = Placement.from_table([5, 3, 5, 3], dies=(5, 3))
    lay = get_dispatch_layout(HAND_TOPK, p)
    #   die 5: local 0 = e0: (2,0)   local 1 = e2: (0,1)
    #   die 3: local 0 = e1: (0,0) (2,1)   local 1 = e3: (1,0)
    np.testing.assert_array_equal(lay.num_tokens_per_die, _i64(2, 3))
    np.testing.assert_array_equal(lay.msg_slot, _i64(2, 0, 0, 2, 1))
    np.testing.assert_array_equal(lay.msg_k, _i64(0, 1, 0, 1, 0))
    np.testing.assert_array_equal(lay.msg_dest, _i64(5, 5, 3, 3, 3))
    np.testing.assert_array_equal(lay.msg_local_expert, _i64(0, 1, 0, 0, 1))
    np.testing.assert_array_equal(lay.dest_offsets, _i64(0, 2, 5))


def test_layout_arrays_are_int64_and_read_only():
    lay = get_dispatch_layout(HAND_TOPK.astype(np.int32), Placement.default(4, (0, 1)))
    for name in DispatchLayout.__dataclass_fields__:
        arr = getattr(lay, name)
        assert arr.dtype == np.int64, name
        assert not arr.flags.writeable, name


# -- get_dispatch_layout: edges --------------------------------------------------------------------


@pytest.mark.parametrize(
    "topk, per_die, per_expert",
    [
        (np.zeros((0, 2), np.int64), (0, 0), (0, 0, 0, 0)),  # batch 0
        (np.full((3, 2), -1), (0, 0), (0, 0, 0, 0)),  # all unrouted
        (np.array([[2, 3]] * 3), (0, 6), (0, 0, 3, 3)),  # every token to die 1; die 0: nothing
        (np.zeros((5, 0), np.int64), (0, 0), (0, 0, 0, 0)),  # k = 0
    ],
)
def test_layout_edges(topk, per_die, per_expert):
    lay = get_dispatch_layout(topk, Placement.default(4, (0, 1)))
    np.testing.assert_array_equal(lay.num_tokens_per_die, per_die)
    np.testing.assert_array_equal(lay.num_tokens_per_expert, per_expert)
    np.testing.assert_array_equal(lay.dest_offsets, np.concatenate(([0], np.cumsum(per_die))))
    assert lay.num_msgs == sum(per_die)


def test_layout_every_token_to_one_die_is_in_expert_slot_then_k_order():
    lay = get_dispatch_layout(np.array([[2, 3], [3, 2], [2, -1]]), Placement.default(4, (0, 1)))
    np.testing.assert_array_equal(lay.msg_local_expert, _i64(0, 0, 0, 1, 1))
    np.testing.assert_array_equal(lay.msg_slot, _i64(0, 1, 2, 0, 1))
    np.testing.assert_array_equal(lay.msg_k, _i64(0, 1, 0, 1, 0))


@pytest.mark.parametrize(
    "topk, exc, msg",
    [
        (np.array([[0, 4]]), ValueError, r"topk_idx\[0, 1\] = 4: expert ids must be -1"),
        (np.array([[0, 1], [-2, 0]]), ValueError, r"topk_idx\[1, 0\] = -2"),
        (np.array([[0.0, 1.0]]), TypeError, "topk_idx: expected an integer array, got dtype float"),
        (np.array([[True, False]]), TypeError, "got dtype bool"),
        (np.array([0, 1]), ValueError, r"expected shape \[batch, k\], got shape \(2,\)"),
        (
            np.array([[0, 1], [3, 3]]),
            ValueError,
            r"topk_idx\[1\] names expert 3 twice \(k = \[0, 1\]\)",
        ),
        (
            np.array([[2, -1, 2, 0]]),
            ValueError,
            r"topk_idx\[0\] names expert 2 twice \(k = \[0, 2\]\)",
        ),
        (np.array([[0, 0], [1, 1]], np.uint8), ValueError, "names expert 0 twice"),
    ],
)
def test_layout_rejects_bad_topk(topk, exc, msg):
    with pytest.raises(exc, match=msg):
        get_dispatch_layout(topk, Placement.default(4, (0, 1)))


def test_layout_rejects_a_non_placement():
    with pytest.raises(TypeError, match="placement: expected a Placement, got int"):
        get_dispatch_layout(HAND_TOPK, 4)


# -- get_dispatch_layout: properties ---------------------------------------------------------------


@st.composite
def placements(draw) -> Placement:
    n_dies = draw(st.integers(1, 5))
    dies = tuple(draw(st.lists(st.integers(0, 15), min_size=n_dies, max_size=n_dies, unique=True)))
    if draw(st.booleans()):
        return Placement.default(n_dies * draw(st.integers(1, 3)), dies)
    table = draw(st.lists(st.sampled_from(dies), min_size=1, max_size=12))
    return Placement.from_table(table, dies)


@st.composite
def routing(draw):
    p = draw(placements())
    batch, k = draw(st.integers(0, 8)), draw(st.integers(0, 4))
    return p, draw(topk_rows(batch, k, p.num_experts))


@settings(max_examples=200, deadline=None)
@given(routing())
def test_layout_properties(case):
    p, topk = case
    lay = get_dispatch_layout(topk, p)
    routed = topk >= 0
    assert lay.num_tokens_per_expert.sum() == lay.num_tokens_per_die.sum() == routed.sum()
    for pos, die in enumerate(p.dies):
        assert lay.num_tokens_per_die[pos] == lay.num_tokens_per_expert[p.experts_on(die)].sum()
        lo, hi = lay.dest_offsets[pos], lay.dest_offsets[pos + 1]
        assert (lay.msg_dest[lo:hi] == die).all()
    # every routed pair exactly once, sent to the die and local index of its expert
    pairs = list(zip(lay.msg_slot.tolist(), lay.msg_k.tolist(), strict=True))
    assert sorted(pairs) == [tuple(v) for v in np.argwhere(routed).tolist()]
    expert = topk[lay.msg_slot, lay.msg_k]
    np.testing.assert_array_equal(lay.msg_dest, p.die_of[expert])
    np.testing.assert_array_equal(lay.msg_local_expert, p.local_of[expert])
    # canonical order: (dest position, local expert, slot, k) non-decreasing lexicographically
    keys = list(zip(p.pos_of[expert], lay.msg_local_expert, lay.msg_slot, lay.msg_k, strict=True))
    assert keys == sorted(keys)


@settings(max_examples=100, deadline=None)
@given(placements())
def test_placement_properties(p):
    # every expert is on exactly one die, at its local index, and experts_on inverts the map
    seen = np.zeros(p.num_experts, dtype=np.int64)
    for die in p.dies:
        experts = p.experts_on(die)
        seen[experts] += 1
        np.testing.assert_array_equal(p.local_of[experts], np.arange(experts.size))
        assert (p.die_of[experts] == die).all()
        assert p.num_local(die) == experts.size
    assert (seen == 1).all()
    assert sum(p.num_local(d) for d in p.dies) == p.num_experts


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(2, 6), st.integers(1, 9), st.data())
def test_a_repeated_expert_is_always_refused_and_distinct_rows_never(batch, k, experts, data):
    rows = data.draw(topk_rows(batch, k, experts))
    check_topk_idx(rows, experts)  # distinct: accepted
    routed = np.argwhere(rows >= 0)
    if len(routed) and k > 1:
        slot, col = (int(v) for v in routed[data.draw(st.integers(0, len(routed) - 1))])
        other = (col + 1 + data.draw(st.integers(0, k - 2))) % k
        rows[slot, other] = rows[slot, col]
        with pytest.raises(ValueError, match=f"names expert {rows[slot, col]} twice"):
            check_topk_idx(rows, experts)


def test_dedup_layout_by_hand():
    # the hand case above: die 0 hosts experts 0, 1; die 1 experts 2, 3
    topk = np.array([[1, 2], [3, -1], [0, 1]])
    w = np.array([[0.5, 0.25], [2, 9], [1, -1]], np.float32)
    dl = get_dedup_layout(topk, w, Placement.default(4, (0, 1)))
    # die 0: slot 0 (k0 -> e1), slot 2 (k0 -> e0, k1 -> e1: one row); die 1: slot 0, slot 1
    assert dl.row_slot.tolist() == [0, 2, 0, 1]
    assert dl.row_kfirst.tolist() == [0, 0, 1, 0]
    assert dl.dest_offsets.tolist() == [0, 2, 4]
    assert dl.ent_start.tolist() == [0, 1, 3, 4, 5]
    assert dl.ent_k.tolist() == [0, 0, 1, 1, 0]
    assert dl.ent_local.tolist() == [1, 0, 1, 0, 1]
    assert dl.ent_w.tolist() == [0.5, 1, -1, 0.25, 2]
    assert dl.idx_first.tolist() == [[1, 2], [3, -1], [0, -1]]
    assert dl.num_tokens_per_expert.tolist() == [1, 2, 1, 1]
    assert dl.num_rows == 4
    for arr in (dl.row_slot, dl.ent_w, dl.idx_first, dl.num_tokens_per_expert):
        assert not arr.flags.writeable


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 12), st.integers(1, 6), st.integers(1, 4))
def test_dedup_layout_covers_every_routed_pair_once(seed, batch, k, dies):
    rng = np.random.default_rng(seed)
    experts = max(k, dies * int(rng.integers(1, 4)))
    placement = Placement.from_table(rng.integers(0, dies, experts), tuple(range(dies)))
    topk = random_topk(rng, batch, k, experts)
    w = rng.standard_normal((batch, k)).astype(np.float32)
    dl = get_dedup_layout(topk, w, placement)
    lay = get_dispatch_layout(topk, placement)
    # rows = distinct (token, die) pairs, entries = routed (token, k) pairs
    routed = zip(*np.nonzero(topk >= 0), strict=True)
    pairs = {(s, int(placement.die_of[topk[s, j]])) for s, j in routed}
    assert dl.num_rows == len(pairs)
    assert len(dl.ent_k) == lay.num_msgs
    assert np.array_equal(dl.num_tokens_per_expert, lay.num_tokens_per_expert)
    row_of = np.repeat(np.arange(dl.num_rows), np.diff(dl.ent_start))
    got = sorted(zip(dl.row_slot[row_of].tolist(), dl.ent_k.tolist(), strict=True))
    assert got == sorted(zip(lay.msg_slot.tolist(), lay.msg_k.tolist(), strict=True))
    for p, d in enumerate(placement.dies):
        a, b = dl.dest_offsets[p], dl.dest_offsets[p + 1]
        assert np.all(np.diff(dl.row_slot[a:b]) > 0)  # one row per token, slot order
        ea, eb = dl.ent_start[a], dl.ent_start[b]
        experts_of = topk[dl.row_slot[row_of[ea:eb]], dl.ent_k[ea:eb]]
        assert np.all(placement.die_of[experts_of] == d)
        assert np.array_equal(placement.local_of[experts_of], dl.ent_local[ea:eb])
    for i in range(dl.num_rows):  # ascending k inside a row, kfirst the first
        ks = dl.ent_k[dl.ent_start[i] : dl.ent_start[i + 1]]
        assert np.all(np.diff(ks) > 0) and ks[0] == dl.row_kfirst[i]
    assert np.array_equal(dl.ent_w, w[dl.row_slot[row_of], dl.ent_k])
    firsts = set(zip(dl.row_slot.tolist(), dl.row_kfirst.tolist(), strict=True))
    for s in range(batch):
        for j in range(k):
            want = topk[s, j] if (s, j) in firsts else -1
            assert dl.idx_first[s, j] == want
