"""comm.reference: the plain-numpy collectives every all-to-all protocol is compared against.

Payloads name their sender: row `slot` of source rank `src` is `100 * src + slot + j / 8` in
column `j`, so a row delivered to the wrong place is visible in its first value.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.quant import INT8_ERROR_BOUND, dequantize_int8, quantize_int8
from comm.reference import (
    DispatchOut,
    a2e_ref,
    combine_ref,
    dequantize_dispatch,
    dispatch_ref,
    e2a_ref,
    moe_ref,
)
from comm.routing import Placement
from tests.routing_cases import random_topk, topk_rows

I64 = np.int64

# The hand case of test_routing.py, with a second source:
#   expert:        0      1      2      3
#   (die, local): (0,0)  (0,1)  (1,0)  (1,1)
HAND_TOPKS = [np.array([[1, 2], [3, -1], [0, 1]]), np.array([[2, 0], [-1, -1], [3, 2]])]
HAND_PLACEMENT = Placement.default(4, (0, 1))


def payload(src: int, batch: int, hidden: int = 2) -> np.ndarray:
    """float32 `[batch, hidden]`: row `slot` is `100 * src + slot + j / 8` in column `j`."""
    rows = 100.0 * src + np.arange(batch)[:, None] + np.arange(hidden)[None, :] / 8
    return rows.astype(np.float32)


def sender_of(row: np.ndarray) -> tuple[int, int]:
    v = int(row[0])
    return v // 100, v % 100


def hand_xs() -> list[np.ndarray]:
    return [payload(0, 3), payload(1, 3)]


# -- an independent, straightforward reference of the whole MoE layer ------------------------------


def bf16_trip(row: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest, ties to even, in integers) -> float32, finite rows."""
    u = row.astype(np.float32).view(np.uint32).astype(np.uint64)
    return (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)


def expert_input(x: np.ndarray, quant) -> np.ndarray:
    """The rows the expert die computes on: x, or its INT8 round trip, row by row."""
    if quant != "int8":
        return x
    q, scale = quantize_int8(x)
    out = np.zeros(q.shape, dtype=np.float32)
    for slot in range(q.shape[0]):
        out[slot] = q[slot].astype(np.float32) * scale[slot]
    return out


def loop_moe(xs, topk_idxs, topk_weights, expert_row, quant=None, combine_dtype="bfloat16"):
    """For every source token: acc = 0; for k ascending: acc = acc + f32(w) * expert_row(e, row)
    (the row through bfloat16 first with combine_dtype "bfloat16", as the combine sends it)."""
    trip = bf16_trip if combine_dtype == "bfloat16" else (lambda r: r)
    outs = []
    for x, topk, w in zip(xs, topk_idxs, topk_weights, strict=True):
        x = expert_input(x, quant)
        out = np.zeros(x.shape, dtype=np.float32)
        for slot in range(x.shape[0]):
            acc = np.zeros(x.shape[1], dtype=np.float32)
            for k in range(topk.shape[1]):
                e = int(topk[slot, k])
                if e >= 0:
                    acc = acc + np.float32(w[slot, k]) * trip(expert_row(e, x[slot]))
            out[slot] = acc
        outs.append(out)
    return outs


def identity_row(e, row):
    return row


def scaled_row(e, row):
    return np.float32(e + 1) * row


def scaled_expert(placement):
    """expert_fn for moe_ref: expert `e` multiplies its rows by `e + 1` (matches scaled_row)."""

    def fn(die, out: DispatchOut) -> np.ndarray:
        experts = placement.experts_on(die)[out.local_expert]
        factor = experts.astype(np.float32) + np.float32(1)
        return factor[:, None] * out.x

    return fn


# -- by hand ---------------------------------------------------------------------------------------


def test_dispatch_by_hand():
    outs = dispatch_ref(hand_xs(), HAND_TOPKS, HAND_PLACEMENT)
    assert sorted(outs) == [0, 1]
    # die 0: local 0 (e0): src0 (2,0), src1 (0,1);   local 1 (e1): src0 (0,0) (2,1)
    d0 = outs[0]
    np.testing.assert_array_equal(d0.src_rank, [0, 1, 0, 0])
    np.testing.assert_array_equal(d0.batch_slot, [2, 0, 0, 2])
    np.testing.assert_array_equal(d0.k_index, [0, 1, 0, 1])
    np.testing.assert_array_equal(d0.local_expert, [0, 0, 1, 1])
    np.testing.assert_array_equal(d0.expert_counts, [2, 2])
    np.testing.assert_array_equal(d0.x, [[2, 2.125], [100, 100.125], [0, 0.125], [2, 2.125]])
    assert d0.scales is None
    # die 1: local 0 (e2): src0 (0,1), src1 (0,0) (2,1);   local 1 (e3): src0 (1,0), src1 (2,0)
    d1 = outs[1]
    np.testing.assert_array_equal(d1.src_rank, [0, 1, 1, 0, 1])
    np.testing.assert_array_equal(d1.batch_slot, [0, 0, 2, 1, 2])
    np.testing.assert_array_equal(d1.k_index, [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(d1.local_expert, [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(d1.expert_counts, [3, 2])
    np.testing.assert_array_equal(
        d1.x, [[0, 0.125], [100, 100.125], [102, 102.125], [1, 1.125], [102, 102.125]]
    )


def test_dispatch_by_hand_int8():
    xs = hand_xs()
    outs = dispatch_ref(xs, HAND_TOPKS, HAND_PLACEMENT, quant="int8")
    plain = dispatch_ref(xs, HAND_TOPKS, HAND_PLACEMENT)
    quantized = [quantize_int8(x) for x in xs]
    # (src, slot) of each row, as in test_dispatch_by_hand
    origins = {0: [(0, 2), (1, 0), (0, 0), (0, 2)], 1: [(0, 0), (1, 0), (1, 2), (0, 1), (1, 2)]}
    for die, rows in origins.items():
        d = outs[die]
        assert d.x.dtype == np.int8 and d.scales.dtype == np.float32
        np.testing.assert_array_equal(d.x, [quantized[s][0][slot] for s, slot in rows])
        np.testing.assert_array_equal(d.scales, [quantized[s][1][slot] for s, slot in rows])
        for name in ("src_rank", "batch_slot", "k_index", "local_expert", "expert_counts"):
            np.testing.assert_array_equal(getattr(d, name), getattr(plain[die], name))
    # row (0, 0) = [0, 0.125]: scale 0.125 / 127, q = [0, 127]
    np.testing.assert_array_equal(outs[0].x[2], [0, 127])
    assert outs[0].scales[2] == np.float32(0.125) / np.float32(127)


HAND_WEIGHTS = [
    np.array([[0.5, 0.25], [2, 9], [1, -1]], np.float32),  # 9: k unrouted, must not count
    np.array([[1, 1], [3, 3], [0.5, 0.5]], np.float32),
]


def test_combine_by_hand_identity_experts():
    xs = hand_xs()  # source 0 rows [0, .125] [1, 1.125] [2, 2.125]; source 1 rows [100, ...] ...
    outs = moe_ref(xs, HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, lambda die, d: d.x,
                   combine_dtype="float32")  # fmt: skip
    np.testing.assert_array_equal(outs[0], [[0, 0.09375], [2, 2.25], [0, 0]])
    np.testing.assert_array_equal(outs[1], [[200, 200.25], [0, 0], [102, 102.125]])


def test_combine_by_hand_scaled_experts():
    # expert e multiplies by e + 1.  src0: slot0 .5*2*r + .25*3*r = 1.75 r;  slot1 2*4*r;
    # slot2 1*1*r - 1*2*r = -r.   src1: slot0 1*3*r + 1*1*r = 4 r;  slot2 .5*4*r + .5*3*r = 3.5 r
    outs = moe_ref(hand_xs(), HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT,
                   scaled_expert(HAND_PLACEMENT), combine_dtype="float32")  # fmt: skip
    np.testing.assert_array_equal(outs[0], [[0, 0.21875], [8, 9], [-2, -2.125]])
    np.testing.assert_array_equal(outs[1], [[400, 400.5], [0, 0], [357, 357.4375]])


def test_combine_by_hand_bfloat16_rows():
    # bfloat16 keeps 8 significant bits: 100.125 (10 bits) travels as 100, 102.125 as 102;
    # 0.125, 1.125, 2.125 and 200 are exact
    outs = moe_ref(hand_xs(), HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, lambda die, d: d.x)
    np.testing.assert_array_equal(outs[0], [[0, 0.09375], [2, 2.25], [0, 0]])
    np.testing.assert_array_equal(outs[1], [[200, 200], [0, 0], [102, 102]])


# -- properties over random routing ----------------------------------------------------------------


@st.composite
def scenarios(draw):
    n_dies = draw(st.integers(1, 4))
    dies = tuple(draw(st.lists(st.integers(0, 9), min_size=n_dies, max_size=n_dies, unique=True)))
    if draw(st.booleans()):
        placement = Placement.default(n_dies * draw(st.integers(1, 3)), dies)
    else:
        placement = Placement.from_table(draw(st.lists(st.sampled_from(dies), min_size=1)), dies)
    n_src = draw(st.integers(1, 3))
    src_ranks = draw(st.lists(st.integers(0, 9), min_size=n_src, max_size=n_src, unique=True))
    hidden, topks = draw(st.integers(1, 5)), []
    for _ in range(n_src):
        batch, k = draw(st.integers(0, 6)), draw(st.integers(1, 4))
        topks.append(draw(topk_rows(batch, k, placement.num_experts)))
    xs = [payload(r, len(t), hidden) for r, t in zip(src_ranks, topks, strict=True)]
    return placement, src_ranks, xs, topks, draw(st.sampled_from([None, "int8"]))


def check_dispatch(outs, placement, src_ranks, xs, topks, quant):
    """Every routed (src, slot, k) exactly once, on its expert's die, with its own payload row."""
    assert sorted(outs) == sorted(placement.dies)
    index = dict(zip(src_ranks, range(len(src_ranks)), strict=True))
    payloads = [quantize_int8(x) if quant else (x, None) for x in xs]
    seen = set()
    for die, d in outs.items():
        assert d.x.dtype == (np.int8 if quant else np.float32)
        assert d.x.shape == (d.num_rows, xs[0].shape[1])
        keys = list(zip(d.local_expert, d.src_rank, d.batch_slot, d.k_index, strict=True))
        assert keys == sorted(keys), "rows not in canonical order"
        np.testing.assert_array_equal(
            d.expert_counts, np.bincount(d.local_expert, minlength=placement.num_local(die))
        )
        for j, (local, src, slot, k) in enumerate(keys):
            i = index[int(src)]
            e = topks[i][slot, k]
            assert placement.die_of[e] == die and placement.local_of[e] == local
            q, scale = payloads[i]
            np.testing.assert_array_equal(d.x[j], q[slot])
            if quant:
                assert d.scales[j] == scale[slot]
            else:
                assert sender_of(d.x[j]) == (src, slot)
            assert (int(src), int(slot), int(k)) not in seen
            seen.add((int(src), int(slot), int(k)))
    expected = {
        (r, s, k) for r, t in zip(src_ranks, topks, strict=True) for s, k in np.argwhere(t >= 0)
    }
    assert seen == expected


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_dispatch_properties(case):
    placement, src_ranks, xs, topks, quant = case
    outs = dispatch_ref(xs, topks, placement, quant=quant, src_ranks=src_ranks)
    check_dispatch(outs, placement, src_ranks, xs, topks, quant)


@settings(max_examples=200, deadline=None)
@given(
    scenarios(),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["identity", "scaled"]),
    st.sampled_from(["bfloat16", "float32"]),
    st.booleans(),
)
def test_moe_matches_a_straightforward_loop_bit_for_bit(case, seed, kind, combine_dtype, dedup):
    placement, src_ranks, xs, topks, quant = case
    print(f"seed={seed} dedup={dedup}")
    rng = np.random.default_rng(seed)
    xs = [(x + rng.standard_normal(x.shape)).astype(np.float32) for x in xs]
    weights = [rng.standard_normal(t.shape).astype(np.float32) for t in topks]
    expert_fn = scaled_expert(placement) if kind == "scaled" else (lambda die, d: d.x)
    expert_row = scaled_row if kind == "scaled" else identity_row
    got = moe_ref(xs, topks, weights, placement, expert_fn, quant=quant, src_ranks=src_ranks,
                  combine_dtype=combine_dtype, dedup=dedup)  # fmt: skip
    if dedup:
        want = loop_moe_dedup(xs, topks, weights, expert_row, placement, quant=quant,
                              combine_dtype=combine_dtype)  # fmt: skip
    else:
        want = loop_moe(xs, topks, weights, expert_row, quant=quant, combine_dtype=combine_dtype)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed", range(5))
def test_combine_does_not_depend_on_row_arrival_order(seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    placement = Placement.from_table(rng.integers(0, 3, size=12), (0, 1, 2))
    topks = [random_topk(rng, 16, 4, 12) for _ in range(3)]
    xs = [rng.standard_normal((16, 32)).astype(np.float32) for _ in range(3)]
    weights = [rng.random((16, 4)).astype(np.float32) for _ in range(3)]
    outs = dispatch_ref(xs, topks, placement)
    want = combine_ref({die: d.x for die, d in outs.items()}, outs, topks, weights)
    shuffled, expert_outs = {}, {}
    for die, d in outs.items():
        perm = rng.permutation(d.num_rows)
        shuffled[die] = replace(
            d,
            x=d.x[perm],
            src_rank=d.src_rank[perm],
            batch_slot=d.batch_slot[perm],
            k_index=d.k_index[perm],
            local_expert=d.local_expert[perm],
        )
        expert_outs[die] = d.x[perm]
    got = combine_ref(expert_outs, shuffled, topks, weights)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()


@pytest.mark.parametrize("seed", range(4))
def test_int8_moe_is_close_to_float_moe(seed):
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    placement = Placement.default(8, (0, 1, 2, 3))
    topks = [random_topk(rng, 10, 3, 8) for _ in range(4)]
    xs = [rng.standard_normal((10, 64)).astype(np.float32) * 10 for _ in range(4)]
    weights = [rng.random((10, 3)).astype(np.float32) for _ in range(4)]
    identity = lambda die, d: d.x  # noqa: E731
    exact = moe_ref(xs, topks, weights, placement, identity, combine_dtype="float32")
    approx = moe_ref(xs, topks, weights, placement, identity, quant="int8",
                     combine_dtype="float32")  # fmt: skip
    for x, t, w, a, b in zip(xs, topks, weights, exact, approx, strict=True):
        _, scale = quantize_int8(x)
        limit = (np.abs(w) * (t >= 0)).sum(axis=1) * scale * INT8_ERROR_BOUND * 1.001 + 1e-5
        assert (np.abs(a - b) <= limit[:, None]).all()


# -- ranks, disaggregation, helpers ----------------------------------------------------------------


def test_src_ranks_order_rows_by_rank_value_not_list_position():
    xs = [payload(5, 3), payload(2, 3)]
    outs = dispatch_ref(xs, HAND_TOPKS, HAND_PLACEMENT, src_ranks=[5, 2])
    # die 0, local 0 (e0): rank 2 (0,1) before rank 5 (2,0)
    np.testing.assert_array_equal(outs[0].src_rank, [2, 5, 5, 5])
    np.testing.assert_array_equal(outs[0].batch_slot, [0, 2, 0, 2])
    assert [sender_of(r) for r in outs[0].x] == [(2, 0), (5, 2), (5, 0), (5, 2)]
    got = combine_ref({d: o.x for d, o in outs.items()}, outs, HAND_TOPKS, HAND_WEIGHTS, [5, 2])
    want = loop_moe(xs, HAND_TOPKS, HAND_WEIGHTS, identity_row)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("quant", [None, "int8"])
def test_a2e_e2a_disaggregated(quant):
    seed = 11
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    placement = Placement.default(8, (2, 3, 4, 5))  # expert dies; attention dies 0 and 1
    topks = [random_topk(rng, 6, 2, 8) for _ in range(2)]
    xs = [payload(a, 6, hidden=8) for a in (0, 1)]
    weights = [rng.random((6, 2)).astype(np.float32) for _ in range(2)]
    outs = a2e_ref(xs, topks, placement, att_dies=(0, 1), quant=quant)
    assert sorted(outs) == [2, 3, 4, 5]
    check_dispatch(outs, placement, [0, 1], xs, topks, quant)
    expert_outs = {die: dequantize_dispatch(d).x for die, d in outs.items()}
    got = e2a_ref(expert_outs, outs, topks, weights, att_dies=(0, 1))
    want = loop_moe(xs, topks, weights, identity_row, quant=quant)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a2e_rejects_attention_dies_that_host_experts():
    with pytest.raises(ValueError, match=r"att_dies: dies \[2\] are also expert dies"):
        a2e_ref(hand_xs(), HAND_TOPKS, Placement.default(4, (2, 3)), att_dies=(1, 2))


def test_moe_hands_experts_dequantized_rows():
    seen = {}

    def expert_fn(die, d):
        seen[die] = d
        return d.x

    xs = hand_xs()
    moe_ref(xs, HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, expert_fn, quant="int8")
    raw = dispatch_ref(xs, HAND_TOPKS, HAND_PLACEMENT, quant="int8")
    for die, d in seen.items():
        assert d.x.dtype == np.float32 and d.scales is None
        np.testing.assert_array_equal(d.x, dequantize_int8(raw[die].x, raw[die].scales))
    plain = dispatch_ref(xs, HAND_TOPKS, HAND_PLACEMENT)
    assert dequantize_dispatch(plain[0]) is plain[0]


def test_outputs_are_read_only():
    outs = dispatch_ref(hand_xs(), HAND_TOPKS, HAND_PLACEMENT, quant="int8")
    d = outs[0]
    for arr in (d.x, d.scales, d.src_rank, d.batch_slot, d.k_index, d.local_expert):
        with pytest.raises(ValueError, match="read-only"):
            arr[0] = 1


# -- edges -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", [None, "int8"])
def test_all_unrouted(quant):
    topks = [np.full((3, 2), -1), np.full((2, 2), -1)]
    xs = [payload(0, 3, 4), payload(1, 2, 4)]
    outs = dispatch_ref(xs, topks, HAND_PLACEMENT, quant=quant)
    for d in outs.values():
        assert d.x.shape == (0, 4) and d.num_rows == 0
        np.testing.assert_array_equal(d.expert_counts, [0, 0])
    weights = [np.ones((3, 2), np.float32), np.ones((2, 2), np.float32)]
    got = moe_ref(xs, topks, weights, HAND_PLACEMENT, lambda die, d: d.x, quant=quant)
    assert [g.tolist() for g in got] == [np.zeros((3, 4)).tolist(), np.zeros((2, 4)).tolist()]


def test_batch_zero_source():
    xs = [payload(0, 3), np.zeros((0, 2), np.float32)]
    topks = [HAND_TOPKS[0], np.zeros((0, 2), I64)]
    outs = dispatch_ref(xs, topks, HAND_PLACEMENT)
    check_dispatch(outs, HAND_PLACEMENT, [0, 1], xs, topks, None)
    weights = [HAND_WEIGHTS[0], np.zeros((0, 2), np.float32)]
    got = combine_ref({d: o.x for d, o in outs.items()}, outs, topks, weights)
    assert got[1].shape == (0, 2) and got[1].dtype == np.float32


def test_every_token_to_one_expert_leaves_other_dies_empty():
    topks = [np.array([[3, -1]] * 3), np.array([[-1, 3]] * 3)]
    outs = dispatch_ref(hand_xs(), topks, HAND_PLACEMENT)
    assert outs[0].num_rows == 0 and outs[0].x.shape == (0, 2)
    np.testing.assert_array_equal(outs[0].expert_counts, [0, 0])
    np.testing.assert_array_equal(outs[1].expert_counts, [0, 6])
    np.testing.assert_array_equal(outs[1].k_index, [0, 0, 0, 1, 1, 1])


def test_a_repeated_expert_in_one_token_is_refused():
    topks = [np.array([[3, 3], [0, 1], [2, -1]]), np.array([[-1, 3]] * 3)]
    with pytest.raises(ValueError, match=r"topk_idxs\[0\]\[0\] names expert 3 twice"):
        dispatch_ref(hand_xs(), topks, HAND_PLACEMENT)


def test_a_die_hosting_no_experts_receives_an_empty_output():
    placement = Placement.from_table([1, 1, 3, 3], dies=(1, 2, 3))
    outs = dispatch_ref(hand_xs(), HAND_TOPKS, placement)
    assert outs[2].num_rows == 0 and outs[2].expert_counts.shape == (0,)
    check_dispatch(outs, placement, [0, 1], hand_xs(), HAND_TOPKS, None)


# -- bad input -------------------------------------------------------------------------------------


def _dispatch(**over):
    args = dict(xs=hand_xs(), topk_idxs=HAND_TOPKS, placement=HAND_PLACEMENT)
    args.update(over)
    return lambda: dispatch_ref(**args)


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (_dispatch(xs=[payload(0, 3).astype(np.float64), payload(1, 3)]), TypeError, r"xs\[0\]"),
        (_dispatch(xs=[payload(0, 3), payload(1, 2)]), ValueError, r"topk_idxs\[1\]: has 3 rows"),
        (_dispatch(xs=[payload(0, 3), payload(1, 3, 3)]), ValueError, r"xs\[1\]: expected shape"),
        (_dispatch(xs=[payload(0, 3)]), ValueError, "one entry per source"),
        (_dispatch(xs=[], topk_idxs=[]), ValueError, "at least one"),
        (
            _dispatch(topk_idxs=[HAND_TOPKS[0], np.array([[0, 4], [0, 0], [0, 0]])]),
            ValueError,
            r"topk_idxs\[1\]\[0, 1\] = 4",
        ),
        (
            _dispatch(topk_idxs=[HAND_TOPKS[0], HAND_TOPKS[1].astype(float)]),
            TypeError,
            r"topk_idxs\[1\]: expected an integer array",
        ),
        (_dispatch(quant="fp8"), ValueError, "quant: expected one of"),
        (_dispatch(src_ranks=[1, 1]), ValueError, "src_ranks: source ranks must be distinct"),
        (_dispatch(src_ranks=[0]), ValueError, "src_ranks: expected 2 ranks"),
        (_dispatch(src_ranks=[0, -1]), TypeError, r"src_ranks\[1\]"),
        (_dispatch(placement=4), TypeError, "placement: expected a Placement"),
    ],
)
def test_dispatch_rejects_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


def _combine(expert_outs=None, topk_idxs=HAND_TOPKS, weights=HAND_WEIGHTS, src_ranks=None):
    outs = dispatch_ref(hand_xs(), HAND_TOPKS, HAND_PLACEMENT)
    if expert_outs is None:
        expert_outs = {die: d.x for die, d in outs.items()}
    return lambda: combine_ref(expert_outs, outs, topk_idxs, weights, src_ranks)


@pytest.mark.parametrize(
    "call, exc, msg",
    [
        (_combine(expert_outs={0: np.zeros((4, 2), np.float32)}), ValueError, "one entry per die"),
        (
            _combine(expert_outs={0: np.zeros((4, 2)), 1: np.zeros((5, 2), np.float32)}),
            TypeError,
            r"expert_outs\[0\]: expected float32",
        ),
        (
            _combine(
                expert_outs={0: np.zeros((3, 2), np.float32), 1: np.zeros((5, 2), np.float32)}
            ),
            ValueError,
            r"expert_outs\[0\]: expected shape \[4, hidden\]",
        ),
        (
            _combine(weights=[HAND_WEIGHTS[0], HAND_WEIGHTS[1][:, :1]]),
            ValueError,
            r"topk_weights\[1\]: expected shape \(3, 2\)",
        ),
        (
            _combine(weights=[HAND_WEIGHTS[0], HAND_TOPKS[1]]),
            TypeError,
            r"topk_weights\[1\]: expected a float array",
        ),
        (
            _combine(topk_idxs=[HAND_TOPKS[0], np.array([[2, 0], [1, -1], [3, 2]])]),
            ValueError,
            r"rank 1 \(slot 1, k 0\) has 0 rows, expected 1",
        ),
        (_combine(src_ranks=[0, 3]), ValueError, r"rows from ranks \[1\], not among"),
        (_combine(topk_idxs=[HAND_TOPKS[0]]), ValueError, "topk_weights: expected one entry"),
    ],
)
def test_combine_rejects_bad_input(call, exc, msg):
    with pytest.raises(exc, match=msg):
        call()


# -- dedup combine (docs/protocols.md §6.3): per-die partial sums, rounded once, then over dies --


def loop_moe_dedup(xs, topk_idxs, topk_weights, expert_row, placement, quant=None,
                   combine_dtype="bfloat16"):  # fmt: skip
    """For every source token: per die, part = 0; for k ascending on that die: part = part +
    f32(w) * expert_row(e, row); each part through bfloat16 once (with "bfloat16"); then
    acc = 0; for the dies in order of their first k: acc = acc + 1 * part."""
    trip = bf16_trip if combine_dtype == "bfloat16" else (lambda r: r)
    outs = []
    for x, topk, w in zip(xs, topk_idxs, topk_weights, strict=True):
        x = expert_input(x, quant)
        out = np.zeros(x.shape, dtype=np.float32)
        for slot in range(x.shape[0]):
            parts: dict[int, np.ndarray] = {}  # insertion order = order of each die's first k
            for k in range(topk.shape[1]):
                e = int(topk[slot, k])
                if e >= 0:
                    d = int(placement.die_of[e])
                    acc = parts.get(d, np.zeros(x.shape[1], dtype=np.float32))
                    parts[d] = acc + np.float32(w[slot, k]) * expert_row(e, x[slot])
            acc = np.zeros(x.shape[1], dtype=np.float32)
            for part in parts.values():
                acc = acc + np.float32(1) * trip(part)
            out[slot] = acc
        outs.append(out)
    return outs


def test_dedup_combine_by_hand():
    # float32, identity experts: dedup sums src0 slot2 (experts 0 and 1, both on die 0) as one
    # part 1 r - 1 r = 0 before the over-dies sum; the other tokens have one expert per die
    outs = moe_ref(hand_xs(), HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, lambda die, d: d.x,
                   combine_dtype="float32", dedup=True)  # fmt: skip
    np.testing.assert_array_equal(outs[0], [[0, 0.09375], [2, 2.25], [0, 0]])
    np.testing.assert_array_equal(outs[1], [[200, 200.25], [0, 0], [102, 102.125]])
    # bfloat16, rows scaled off the exact grid: against the loop
    rng = np.random.default_rng(7)
    xs = [(x * np.float32(1.0 + rng.random())).astype(np.float32) for x in hand_xs()]
    got = moe_ref(xs, HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, lambda die, d: d.x, dedup=True)
    want = loop_moe_dedup(xs, HAND_TOPKS, HAND_WEIGHTS, identity_row, HAND_PLACEMENT)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("seed", range(4))
def test_dedup_equals_plain_in_float32_when_no_token_has_two_experts_on_one_die(seed):
    rng = np.random.default_rng(seed)
    placement = Placement.default(8, (0, 1, 2, 3))  # experts 2d, 2d+1 on die d
    xs = [rng.standard_normal((6, 5)).astype(np.float32) for _ in range(4)]
    topks = []
    for _ in range(4):  # one expert of each of 3 dies per token, never two of one die
        dies = np.array([rng.permutation(4)[:3] for _ in range(6)])
        topks.append((2 * dies + rng.integers(0, 2, dies.shape)).astype(np.int64))
    weights = [rng.standard_normal(t.shape).astype(np.float32) for t in topks]
    fn = scaled_expert(placement)
    for cdt in ("float32", "bfloat16"):
        plain = moe_ref(xs, topks, weights, placement, fn, combine_dtype=cdt)
        dedup = moe_ref(xs, topks, weights, placement, fn, combine_dtype=cdt, dedup=True)
        same = all(np.array_equal(a, b) for a, b in zip(plain, dedup, strict=True))
        # float32: part = 0 + w r, then 0 + 1 part: the same arithmetic. bfloat16: the plain
        # combine rounds r before the weight, dedup w r after it: not the same bits
        assert same == (cdt == "float32")


def test_dedup_combine_rejects_a_non_bool():
    with pytest.raises(TypeError, match="dedup"):
        moe_ref(hand_xs(), HAND_TOPKS, HAND_WEIGHTS, HAND_PLACEMENT, lambda die, d: d.x,
                dedup="yes")  # fmt: skip
