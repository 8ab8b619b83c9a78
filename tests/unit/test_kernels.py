"""comm.kernels.weighted_sum against comm.reference.combine_ref's arithmetic written out in
numpy (ascending k, float32 products and sums, no fused multiply-add), bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm.kernels import weighted_sum
from comm.quant import BF16


def numpy_sum(contrib, idx, w) -> np.ndarray:
    rows = contrib.astype(np.float32)
    out = np.zeros((idx.shape[0], contrib.shape[2]), np.float32)
    for k in range(idx.shape[1]):
        sel = idx[:, k] >= 0
        out[sel] = out[sel] + w[sel, k][:, None] * rows[sel, k]
    return out


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("batch, k, hidden, stride", [(16, 8, 7168, 7168), (5, 3, 48, 64),
                                                      (1, 1, 1, 32), (7, 4, 100, 128),
                                                      (3, 2, 33, 33)])  # fmt: skip
def test_weighted_sum_equals_the_reference_order(dtype, batch, k, hidden, stride):
    rng = np.random.default_rng(batch * 100 + hidden)
    buf = (rng.standard_normal((batch * k, stride)) * 10.0 ** rng.integers(-3, 4)).astype(
        np.float32
    )
    buf[0, :3] = [np.inf, -np.inf, np.nan][: min(3, stride)]  # specials propagate the same way
    buf = buf.astype(dtype)
    contrib = buf[:, :hidden].reshape(batch, k, hidden)  # a combine buffer's rows, padded
    idx = rng.integers(-1, 6, (batch, k))
    w = rng.standard_normal((batch, k)).astype(np.float32)
    got = weighted_sum(contrib, idx, w)
    want = numpy_sum(contrib, idx, w)
    assert got.dtype == np.float32
    assert np.array_equal(got, want, equal_nan=True)
    assert (got[(idx < 0).all(axis=1)] == 0).all()  # a token with no routed k is zeros


def test_weighted_sum_refuses_rows_it_cannot_walk():
    w, idx = np.ones((2, 2), np.float32), np.zeros((2, 2), np.int64)
    with pytest.raises(ValueError):
        weighted_sum(np.zeros((2, 2, 8), np.float32)[:, :, ::2], idx, w)  # strided columns
    with pytest.raises(ValueError):
        weighted_sum(np.zeros((2, 2, 8), np.float32), idx[:1], w)
    with pytest.raises(TypeError):
        weighted_sum(np.zeros((2, 2, 8), np.float64), idx, w)
    assert weighted_sum(np.zeros((0, 2, 8), BF16), idx[:0], w[:0]).shape == (0, 8)


@pytest.mark.parametrize("seed", range(6))
def test_quantize_kernel_equals_comm_quant(seed):
    from comm import kernels, quant

    rng = np.random.default_rng(seed)
    for trial in range(60):
        n, h = int(rng.integers(0, 12)), int(rng.integers(1, 200))
        x = (rng.standard_normal((n, h)) * 10.0 ** rng.integers(-45, 38)).astype(np.float32)
        if n:  # the ends of the range: zero rows, -0, subnormals, values near float32 max
            x[trial % n, :] = [0.0, -0.0, 1e-45, -3.4028235e38][trial % 4]
        q, s = kernels.quantize_int8(x)
        q0, s0 = quant.quantize_int8(x)
        assert np.array_equal(q, q0) and np.array_equal(s, s0), (seed, trial, n, h)
        assert q.dtype == np.int8 and s.dtype == np.float32


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_kernel_raises_what_comm_quant_raises(bad):
    from comm import kernels

    x = np.ones((4, 9), np.float32)
    x[2, 7] = bad
    with pytest.raises(ValueError, match=r"x\[2, 7\]"):
        kernels.quantize_int8(x)


@pytest.mark.parametrize("src_dtype, buf_dtype", [(np.float32, BF16), (BF16, BF16),
                                                  (np.float32, np.float32)])  # fmt: skip
def test_scatter_rows_writes_each_row_once_where_lin_says(src_dtype, buf_dtype):
    from comm.kernels import scatter_rows

    rng = np.random.default_rng(5)
    rows = rng.standard_normal((9, 37)).astype(np.float32).astype(src_dtype)
    buf = np.full((12, 48), 3, buf_dtype)  # 12 rows of 48 (37 used), padding untouched
    sel = np.array([8, 0, 4, 4])
    lin = np.array([11, 0, 5, 7])
    scatter_rows(rows, sel, buf, lin)
    want = np.full((12, 48), 3, buf_dtype)
    for i, j in zip(sel, lin, strict=True):
        want[j, :37] = rows[i]  # numpy's cast: float32 -> bfloat16 rounds to nearest even
    assert np.array_equal(buf.view(np.uint8), want.view(np.uint8))


def test_scatter_rows_refuses_what_it_cannot_place():
    from comm.kernels import scatter_rows

    rows, buf = np.zeros((2, 8), np.float32), np.zeros((4, 8), BF16)
    for sel, lin in (([2], [0]), ([0], [4]), ([-1], [0]), ([0, 1], [0])):
        with pytest.raises(ValueError):
            scatter_rows(rows, np.array(sel), buf, np.array(lin))
    with pytest.raises(TypeError):
        scatter_rows(np.zeros((2, 8), BF16), np.array([0]), np.zeros((4, 8), np.float32),
                     np.array([0]))  # fmt: skip
    with pytest.raises(ValueError):
        scatter_rows(rows, np.array([0]), np.zeros((4, 6), BF16), np.array([0]))  # too narrow
    scatter_rows(rows, np.zeros(0, np.int64), buf, np.zeros(0, np.int64))  # nothing to write


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_pack_rows_writes_the_dispatch_packets(dtype):
    from comm.kernels import pack_rows

    rng = np.random.default_rng(2)
    payload = (rng.standard_normal((6, 40)) * 50).astype(dtype)
    scale = rng.random(6).astype(np.float32)
    slots, ks, locs = np.array([5, 0, 3, 3]), np.array([1, 2, 0, 3]), np.array([7, 0, 2, 1])
    for a in (slots, ks, locs):
        a.flags.writeable = False  # a DispatchLayout's arrays are read-only
    pb = payload.nbytes // 6
    stride = -(-(pb + 16) // 64) * 64
    rows = np.full((5, stride), 0xEE, np.uint8)
    pack_rows(payload, scale, slots, ks, locs, rows)
    want = np.full((5, stride), 0xEE, np.uint8)
    want[:4, :pb] = payload[slots].view(np.uint8).reshape(4, pb)
    meta = want[:4, stride - 16 :].view(np.int32)
    meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = scale[slots].view(np.int32), slots, ks, locs
    assert np.array_equal(rows, want)  # the padding and the fifth row untouched
    with pytest.raises(ValueError):
        pack_rows(payload, scale, slots, ks, locs, np.zeros((5, pb + 8), np.uint8))  # no meta room
    with pytest.raises(ValueError):
        pack_rows(payload, scale, np.array([6]), ks[:1], locs[:1], rows)  # no token 6


# -- the dedup kernels (docs/protocols.md §6.3) ----------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_pack_dedup_rows_writes_payload_entries_and_meta(dtype):
    from comm.kernels import pack_dedup_rows
    from memory.layout import dedup_entries_off

    rng = np.random.default_rng(3)
    batch, hidden = 5, 7
    payload = (rng.standard_normal((batch, hidden)) * 50).astype(dtype)
    scale = rng.random(batch).astype(np.float32)
    slots = np.array([4, 0, 2], np.int64)
    start = np.array([0, 2, 3, 6], np.int64)
    ks = np.array([1, 5, 0, 2, 3, 7], np.int64)
    locs = np.array([3, 0, 1, 2, 2, 0], np.int64)
    w = rng.standard_normal(6).astype(np.float32)
    pb = hidden * np.dtype(dtype).itemsize
    eoff = dedup_entries_off(pb)
    rows = np.full((4, eoff + 12 * 3 + 16 + 4), 0xAB, np.uint8)
    rows_before = rows.copy()
    for a in (payload, scale):
        a.flags.writeable = False  # x itself is the payload without quantization
    pack_dedup_rows(payload, scale, slots, start, ks, locs, w, rows, eoff)
    assert not np.array_equal(rows, rows_before)
    for i, slot in enumerate(slots):
        assert rows[i, :pb].tobytes() == payload[slot].tobytes()
        ent = rows[i, eoff : eoff + 12 * 3].view(np.int32).reshape(3, 3)
        a, b = start[i], start[i + 1]
        assert ent[: b - a, 0].tolist() == ks[a:b].tolist()
        assert ent[: b - a, 1].tolist() == locs[a:b].tolist()
        assert ent[: b - a, 2].tobytes() == w[a:b].tobytes()
        meta = rows[i, -16:].view(np.int32)
        assert meta[0] == scale[slot].view(np.int32) and meta[1] == slot
        assert meta[2] == b - a and meta[3] == -1
    assert (rows[3] == 0xAB).all()  # nothing past the rows asked for
    narrow = np.full((4, rows.shape[1] - 8), 0xAB, np.uint8)  # room for 2 entries a row, not 3
    with pytest.raises(ValueError, match="nothing written"):
        pack_dedup_rows(payload, scale, slots, start, ks, locs, w, narrow, eoff)
    assert (narrow == 0xAB).all()
    with pytest.raises(ValueError, match="nothing written"):
        pack_dedup_rows(payload, scale, np.array([4, 0, 5]), start, ks, locs, w, rows, eoff)
    with pytest.raises(ValueError, match="nothing written"):
        pack_dedup_rows(payload, scale, slots, start + 1, ks, locs, w, rows, eoff)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_reduce_groups_sums_each_group_in_order_then_rounds_once(dtype):
    from comm.kernels import reduce_groups
    from comm.quant import round_combine

    rng = np.random.default_rng(5)
    n, hidden = 9, 33
    rows = (rng.standard_normal((n, hidden)) * 10.0 ** rng.integers(-3, 4, (n, 1))).astype(
        np.float32
    )
    rows[2, 0] = np.nan
    rows[4, 1] = np.inf
    pos = rng.permutation(n).astype(np.int64)
    start = np.array([0, 3, 4, 4, 9], np.int64)  # an empty group writes zeros
    w = rng.standard_normal(n).astype(np.float32)
    buf = np.full((8, 40), 7, dtype)
    lin = np.array([6, 1, 3], np.int64)
    reduce_groups(rows, pos, start, w, 1, buf, lin)  # groups 1, 2, 3
    for i, g in enumerate(range(1, 4)):
        acc = np.zeros(hidden, np.float32)
        for j in range(start[g], start[g + 1]):
            acc = acc + w[j] * rows[pos[j]]
        want = round_combine(acc[None], np.dtype(dtype))[0]
        got = buf[lin[i], :hidden].astype(np.float32)
        assert np.array_equal(got, want, equal_nan=True), g
    untouched = [r for r in range(8) if r not in lin]
    assert (buf[untouched].astype(np.float32) == 7).all()
    assert (buf[lin, hidden:].astype(np.float32) == 7).all()
    with pytest.raises(ValueError):
        reduce_groups(rows, pos, start, w, 3, buf, lin)  # groups past start
    with pytest.raises(ValueError):
        reduce_groups(rows, pos + n, start, w, 1, buf, lin)  # row indices past rows
    with pytest.raises(ValueError):
        reduce_groups(rows, pos, start, w, 0, buf, np.array([8, 0, 1], np.int64))


# -- the dispatch bookkeeping: layout, grouping, the combine's send plan ---------------------------


def _placed_routing(seed, batch, k, dies, per, unrouted, table):
    """(rng, placement, routing) of the layout tests: a default placement over the dies in
    reverse, or (table) any die hosting any number of experts, including none."""
    from comm.routing import Placement

    experts = dies * per
    k = min(k, experts)
    rng = np.random.default_rng(seed + 1)
    if table:
        place = Placement.from_table(rng.integers(0, dies, experts), tuple(range(dies)))
    else:
        place = Placement.default(experts, tuple(range(dies))[::-1])
    return rng, place, _routing(seed, batch, k, experts, unrouted)


def _routing(draw_seed: int, batch: int, k: int, experts: int, unrouted: float) -> np.ndarray:
    rng = np.random.default_rng(draw_seed)
    if not batch:
        return np.zeros((0, k), np.int64)
    idx = np.stack([rng.choice(experts, k, replace=False) for _ in range(batch)]).astype(np.int64)
    idx[rng.random(idx.shape) < unrouted] = -1
    return idx


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(0, 9), k=st.integers(1, 6),
       dies=st.integers(1, 6), per=st.integers(1, 4), unrouted=st.sampled_from([0.0, 0.3, 1.0]),
       table=st.booleans())  # fmt: skip
def test_dispatch_layout_equals_the_routing_module(seed, batch, k, dies, per, unrouted, table):
    """The compiled layout is get_dispatch_layout, array for array (default and uneven
    placements, dies without experts, unrouted entries), and read-only."""
    from comm.kernels import dispatch_layout
    from comm.routing import get_dispatch_layout

    rng, place, idx = _placed_routing(seed, batch, k, dies, per, unrouted, table)
    want = get_dispatch_layout(idx, place)
    got = dispatch_layout(idx, place.pos_of, place.local_of, place.die_of, len(place.dies))
    names = ("num_tokens_per_die", "num_tokens_per_expert", "msg_slot", "msg_k", "msg_dest",
             "msg_local_expert", "dest_offsets")  # fmt: skip
    for name, arr in zip(names, got, strict=True):
        assert np.array_equal(arr, getattr(want, name)), name
        assert arr.dtype == np.int64 and not arr.flags.writeable


def test_dispatch_layout_refuses_bad_ids_and_repeats():
    from comm.kernels import dispatch_layout
    from comm.routing import Placement

    p = Placement.default(8, (0, 1))
    tables = (p.pos_of, p.local_of, p.die_of, 2)
    assert dispatch_layout(np.array([[0, 8]]), *tables) == -1
    assert dispatch_layout(np.array([[-2, 1]]), *tables) == -1
    assert dispatch_layout(np.array([[3, -1, 3]]), *tables) == -2
    assert dispatch_layout(np.array([[-1, -1, 3]]), *tables) != -2  # -1 may repeat


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_assemble_groups_packets_stably_by_local_expert(dtype):
    """assemble_count / assemble_place over packets from 3 sources equal the numpy stable sort
    by local expert of the concatenated packets (payload, scale, source, slot, k)."""
    from comm.kernels import assemble_count, assemble_place, pack_rows

    rng = np.random.default_rng(7)
    hidden, n_local = 12, 5
    pb = hidden * np.dtype(dtype).itemsize
    stride = pb + 16 + 4
    parts, metas = [], []
    for src in range(3):
        n = int(rng.integers(0, 7))
        payload = (rng.integers(-100, 100, (9, hidden)) * (src + 1)).astype(dtype)
        scale = rng.random(9).astype(np.float32)
        slots, ks = rng.integers(0, 9, n), rng.integers(0, 4, n)
        locs = rng.integers(0, n_local, n)
        rows = np.zeros((n, stride), np.uint8)
        pack_rows(payload, scale, slots, ks, locs, rows)
        parts.append((src, rows))
        for i in range(n):
            metas.append((locs[i], src, slots[i], ks[i], payload[slots[i]], scale[slots[i]]))
    counts = np.zeros(n_local, np.int64)
    for _, rows in parts:
        assert assemble_count(rows.reshape(-1).view(np.int32), len(rows), stride, counts) == 0
    total = int(counts.sum())
    cursor = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    x8 = np.zeros((total, pb), np.uint8)
    sb = np.zeros(total, np.int32)
    out = np.zeros((4, total), np.int64)
    for src, rows in parts:
        flat = rows.reshape(-1)
        assemble_place(flat, flat.view(np.int32), len(rows), stride, pb, src, cursor, x8, sb,
                       *out)  # fmt: skip
    want = sorted(enumerate(metas), key=lambda t: (t[1][0], t[0]))  # stable by local expert
    for p, (_, (loc, src, slot, k, row, scale)) in enumerate(want):
        assert out[:, p].tolist() == [src, slot, k, loc]
        assert np.array_equal(x8[p].view(dtype), row) and sb[p] == scale.view(np.int32)
    assert np.array_equal(counts, np.bincount([m[0] for m in metas], minlength=n_local))
    bad = parts[0][1].copy() if len(parts[0][1]) else np.zeros((1, stride), np.uint8)
    bad.reshape(-1).view(np.int32)[stride // 4 - 1] = n_local  # a local expert out of range
    assert assemble_count(bad.reshape(-1).view(np.int32), 1, stride, np.zeros(n_local,
                          np.int64)) == -1  # fmt: skip


def test_group_by_dest_is_a_stable_plan_and_refuses_out_of_range():
    from comm.kernels import group_by_dest

    rng = np.random.default_rng(3)
    n, dies, topk, batch = 40, 5, 4, 16
    dest = rng.integers(0, dies, n)
    slots, ks = rng.integers(0, batch, n), rng.integers(0, topk, n)
    order, lin = np.zeros((2, n), np.int64)
    starts = np.zeros(dies + 1, np.int64)
    assert group_by_dest(dest, slots, ks, topk, dies, batch * topk, order, lin, starts) == 0
    assert np.array_equal(order, np.argsort(dest, kind="stable"))
    assert np.array_equal(lin, (slots * topk + ks)[order])
    assert np.array_equal(np.diff(starts), np.bincount(dest, minlength=dies))
    for d2, s2, k2 in ((dies, 0, 0), (-1, 0, 0), (0, batch, 0), (0, 0, topk), (0, -1, 0)):
        d, s, k = dest.copy(), slots.copy(), ks.copy()
        d[5], s[5], k[5] = d2, s2, k2
        assert group_by_dest(d, s, k, topk, dies, batch * topk, order, lin, starts) == -1


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_weighted_sum_flat_equals_weighted_sum(dtype):
    """The fused combine's entry point over its own flat buffer gives weighted_sum's bits,
    whatever dtype, order or writeability its routing table has."""
    from comm.kernels import weighted_sum_flat

    rng = np.random.default_rng(7)
    batch, k, hidden, stride, cap = 5, 4, 40, 48, 8  # the buffer holds more rows than used
    buf = rng.standard_normal(cap * k * stride).astype(np.float32).astype(dtype)
    idx = rng.integers(-1, 9, (batch, k)).astype(np.int32)
    w = rng.standard_normal((batch, k)).astype(np.float64)
    contrib = buf[: batch * k * stride].reshape(batch, k, stride)[:, :, :hidden]
    want = weighted_sum(contrib, idx, w.astype(np.float32))
    flat = buf.view(np.uint16 if dtype == BF16 else np.float32)
    ro = idx.copy()
    ro.flags.writeable = False
    got = weighted_sum_flat(flat, stride, ro, w, hidden)
    assert np.array_equal(got, want, equal_nan=True)
    assert weighted_sum_flat(flat, stride, idx[:0], w[:0], hidden).shape == (
        0,
        hidden,
    )


def test_first_pending_and_first_bad_source():
    """The fused combine's readiness test and source check name the first unfinished slot and
    the lowest refusing (then mis-paired) die among those that owe rows, or -1."""
    from comm.kernels import first_bad_source, first_pending

    topk = 3
    flags = np.zeros(12, np.int64)
    slots, ks = np.array([0, 1, 3], np.int64), np.array([2, 0, 1], np.int64)
    flags[[2, 3, 10]] = [5, 4, 5]
    assert first_pending(flags, slots, ks, topk, 5) == 1
    flags[3] = 6  # a later operation's word also counts as done (words only grow)
    assert first_pending(flags, slots, ks, topk, 5) == -1
    assert first_pending(flags, slots[:0], ks[:0], topk, 5) == -1
    owners = np.array([3, 1, 3], np.int64)
    refuse, events = np.zeros(4, np.int64), np.full(4, 9, np.int64)
    assert first_bad_source(owners, refuse, events, 5, 9) == -1
    refuse[0] = 5  # die 0 refused, but owes nothing here
    events[2] = 8
    assert first_bad_source(owners, refuse, events, 5, 9) == -1
    events[3] = 8
    assert first_bad_source(owners, refuse, events, 5, 9) == 2 * 3 + 1
    refuse[3] = 5
    assert first_bad_source(owners, refuse, events, 5, 9) == 2 * 3
    refuse[1] = 5
    assert first_bad_source(owners, refuse, events, 5, 9) == 2 * 1


def _regions(n: int, nbytes: int = 1 << 14):
    """n fake regions as the fused kernels take them: their addresses and size."""
    arrays = [np.zeros(nbytes, np.uint8) for _ in range(n)]
    return arrays, np.array([a.ctypes.data for a in arrays], np.int64), nbytes


def test_fused_pack_counts_and_seq_write_what_the_per_destination_calls_write():
    """fused_pack writes each destination's packets where pack_rows would, fused_counts each
    die's counts and flag words, fused_seq the polled word; nothing else is touched."""
    from comm.kernels import fused_counts, fused_pack, fused_seq, pack_rows
    from comm.routing import Placement, get_dispatch_layout

    rng = np.random.default_rng(3)
    dies, experts, batch, topk, stride, base = 3, 6, 5, 2, 48, 256
    placement = Placement.default(experts, tuple(range(dies)))
    idx = np.stack([rng.choice(experts, topk, replace=False) for _ in range(batch)])
    idx[1, 1] = -1
    lay = get_dispatch_layout(idx, placement)
    payload = rng.integers(-127, 128, (batch, 16)).astype(np.int8)
    scale = rng.random(batch).astype(np.float32)
    arrays, addrs, nbytes = _regions(dies)
    offs = lay.dest_offsets
    fused_pack(addrs, nbytes, np.arange(dies, dtype=np.int64), offs, base,
               payload.view(np.uint8), scale.view(np.int32), lay.msg_slot, lay.msg_k,
               lay.msg_local_expert, stride)  # fmt: skip
    for d in range(dies):
        a, b = offs[d], offs[d + 1]
        want = np.zeros((b - a, stride), np.uint8)
        pack_rows(payload, scale, lay.msg_slot[a:b], lay.msg_k[a:b], lay.msg_local_expert[a:b],
                  want)  # fmt: skip
        got = arrays[d][base : base + (b - a) * stride].reshape(-1, stride)
        assert np.array_equal(got, want)
        assert not arrays[d][base + (b - a) * stride :].any() and not arrays[d][:base].any()
    exp = [placement.experts_on(d) for d in range(dies)]
    exp_start = np.concatenate([[0], np.cumsum([len(e) for e in exp])]).astype(np.int64)
    for a in arrays:
        a[:] = 0
    fused_counts(addrs, nbytes, np.arange(dies, dtype=np.int64), offs,
                 lay.num_tokens_per_expert, np.concatenate(exp).astype(np.int64), exp_start, 100,
                 200, 77, 3)  # fmt: skip
    fused_seq(addrs, nbytes, 202, 9)
    for d in range(dies):
        w = arrays[d].view(np.int64)
        assert w[100 : 100 + len(exp[d])].tolist() == lay.num_tokens_per_expert[exp[d]].tolist()
        assert w[200:204].tolist() == [77, offs[d + 1] - offs[d], 9, 3]


def test_fused_assemble_groups_every_source_and_checks_the_counts_words():
    from comm.kernels import assemble_count, assemble_place, fused_assemble, pack_rows

    rng = np.random.default_rng(4)
    n_local, stride, pb, block, cw0 = 3, 32, 16, 4 * 32, 8
    arrays, _, _ = _regions(1, 4096)
    m8, m32, m64 = arrays[0], arrays[0].view(np.int32), arrays[0].view(np.int64)
    base0 = 512
    cnts = np.array([2, 0, 4], np.int64)
    flat = []
    for s, n in enumerate(cnts):
        locs = rng.integers(0, n_local, n)
        payload = rng.integers(0, 255, (n, pb)).astype(np.uint8)
        rows = arrays[0][base0 + s * block : base0 + s * block + n * stride].reshape(n, stride)
        pack_rows(payload, np.ones(n, np.float32), np.arange(n), np.full(n, s), locs, rows)
        arrays[0].view(np.int64)[cw0 + s * n_local : cw0 + (s + 1) * n_local] = np.bincount(
            locs, minlength=n_local
        )
        flat.append((s, int(n), rows.reshape(-1)))
    want_counts = np.zeros(n_local, np.int64)
    for _, n, f in flat:
        assert assemble_count(f.view(np.int32), n, stride, want_counts) == 0
    cursor = np.concatenate([[0], np.cumsum(want_counts)[:-1]]).astype(np.int64)
    total = int(want_counts.sum())
    want = [np.zeros((total, pb), np.uint8), np.zeros(total, np.int32)] + [
        np.zeros(total, np.int64) for _ in range(4)
    ]
    for s, n, f in flat:
        assemble_place(f, f.view(np.int32), n, stride, pb, s, cursor, *want)
    got = [np.zeros((total, pb), np.uint8), np.zeros(total, np.int32)] + [
        np.zeros(total, np.int64) for _ in range(4)
    ]
    counts = np.zeros(n_local, np.int64)
    srcs = np.arange(3, dtype=np.int64)
    args = (m8, m32, m64, srcs, cnts, base0, block, cw0, n_local, stride, pb)
    assert fused_assemble(*args, counts, *got) == 0
    assert np.array_equal(counts, want_counts)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)
    arrays[0].view(np.int64)[cw0] += 1  # a counts word that disagrees with the packets
    assert fused_assemble(*args, np.zeros(n_local, np.int64), *got) == -(1 << 40)
    arrays[0].view(np.int64)[cw0] -= 1
    arrays[0].view(np.int32)[(base0 + 2 * block + stride) // 4 - 1] = n_local  # bad local
    assert fused_assemble(*args, np.zeros(n_local, np.int64), *got) == -1 - 2


@pytest.mark.parametrize("mode", ["round", "copy16", "copy32"])
def test_fused_scatter_and_cflags_write_rows_event_words_then_flags(mode):
    from comm.kernels import fused_cflags, fused_scatter

    rng = np.random.default_rng(5)
    dies, h, stride, base, cev, cfl, me = 3, 8, 12, 64, 90, 100, 1  # words past the rows
    arrays, addrs, nbytes = _regions(dies, 2048)
    rows32 = (rng.standard_normal((5, h)) * 100).astype(np.float32)
    order = np.array([4, 1, 0, 3, 2], np.int64)
    lin = np.array([3, 0, 1, 7, 2], np.int64)
    starts = np.array([0, 2, 2, 5], np.int64)  # die 1 gets nothing
    if mode == "round":
        fused_scatter(rows32.view(np.uint32), order, lin, starts, addrs, nbytes,
                      np.zeros(0, np.uint16), base, stride, cev, me, 42)  # fmt: skip
        want_rows, view = to_bf16_bits(rows32), np.uint16
    elif mode == "copy16":
        want_rows, view = to_bf16_bits(rows32), np.uint16
        fused_scatter(want_rows, order, lin, starts, addrs, nbytes, want_rows[:0], base, stride,
                      cev, me, 42)  # fmt: skip
    else:
        want_rows, view = rows32.view(np.int32), np.int32
        fused_scatter(want_rows, order, lin, starts, addrs, nbytes, want_rows[:0], base, stride,
                      cev, me, 42)  # fmt: skip
    fused_cflags(addrs, nbytes, lin, starts, cfl, 9)
    for d in range(dies):
        buf = arrays[d].view(view)
        words = arrays[d].view(np.int64)
        sent = range(starts[d], starts[d + 1])
        assert words[cev + me] == (42 if len(sent) else 0)
        for j in sent:
            at = base + lin[j] * stride
            assert np.array_equal(buf[at : at + h], want_rows[order[j]])
            assert words[cfl + lin[j]] == 9
        assert int((words[cfl : cfl + 8] == 9).sum()) == len(sent)


def to_bf16_bits(rows32: np.ndarray) -> np.ndarray:
    from comm.kernels import to_bfloat16

    return to_bfloat16(rows32).view(np.uint16)


# -- the dedup bookkeeping: layout and the combine's send plan -------------------------------------

_DEDUP_FIELDS = ("row_slot", "row_kfirst", "dest_offsets", "ent_start", "ent_k", "ent_local",
                 "ent_w", "idx_first", "num_tokens_per_expert")  # fmt: skip


def _assert_dedup_layout_equal(got, want) -> None:
    for name, arr in zip(_DEDUP_FIELDS, got, strict=True):
        ref = getattr(want, name)
        assert arr.dtype == ref.dtype and arr.shape == ref.shape, name
        assert np.array_equal(arr, ref), name
        assert not arr.flags.writeable, name


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), batch=st.integers(0, 9), k=st.integers(1, 6),
       dies=st.integers(1, 6), per=st.integers(1, 4), unrouted=st.sampled_from([0.0, 0.3, 1.0]),
       table=st.booleans())  # fmt: skip
def test_dedup_layout_equals_the_routing_module(seed, batch, k, dies, per, unrouted, table):
    """The compiled dedup layout is get_dedup_layout, array for array and dtype for dtype
    (default and uneven placements, dies without experts, one die, unrouted entries, an empty
    batch), and read-only."""
    from comm.kernels import dedup_layout
    from comm.routing import get_dedup_layout

    rng, place, idx = _placed_routing(seed, batch, k, dies, per, unrouted, table)
    w = (rng.standard_normal(idx.shape) * 10.0 ** rng.integers(-40, 38)).astype(np.float32)
    want = get_dedup_layout(idx, w, place)
    got = dedup_layout(idx, w, place.pos_of, place.local_of, len(place.dies))
    _assert_dedup_layout_equal(got, want)


def test_dedup_layout_edges_by_hand():
    """A token with every expert on one die is one row of all its entries; an unrouted token
    no row; an empty batch no rows; a single die takes every row."""
    from comm.kernels import dedup_layout
    from comm.routing import Placement, get_dedup_layout

    w = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    cases = [
        (Placement.default(8, (0, 1)), np.array([[3, 0, 2, 1], [-1, -1, -1, -1], [4, 1, -1, 7]])),
        (Placement.default(4, (5,)), np.array([[2, 0, 3, 1], [1, -1, 0, -1], [-1, 3, -1, -1]])),
        (Placement.default(8, (0, 1)), np.zeros((0, 4), np.int64)),
    ]
    for place, idx in cases:
        wi = w[: len(idx)]
        got = dedup_layout(idx, wi, place.pos_of, place.local_of, len(place.dies))
        _assert_dedup_layout_equal(got, get_dedup_layout(idx, wi, place))
    got = dedup_layout(cases[0][1], w, cases[0][0].pos_of, cases[0][0].local_of, 2)
    assert got[0].tolist() == [0, 2, 2] and got[3].tolist() == [0, 4, 5, 7]  # rows, entries
    assert got[4][:4].tolist() == [0, 1, 2, 3]  # token 0's four entries, ascending k


def test_dedup_layout_refuses_bad_ids_and_repeats_with_the_numpy_message():
    """The kernel's refusals (-1 an id out of range, -2 a repeat); through comm.alltoall, the
    same error (type and message) as the numpy get_dedup_layout, for every bad input."""
    from comm.alltoall.inputs import dedup_layout_of
    from comm.kernels import dedup_layout
    from comm.routing import Placement, get_dedup_layout

    p = Placement.default(8, (0, 1))
    tables = (p.pos_of, p.local_of, 2)
    one = np.ones((1, 3), np.float32)
    assert dedup_layout(np.array([[0, 8, 1]]), one, *tables) == -1
    assert dedup_layout(np.array([[-2, 1, 2]]), one, *tables) == -1
    assert dedup_layout(np.array([[3, -1, 3]]), one, *tables) == -2
    assert dedup_layout(np.array([[-1, -1, 3]]), one, *tables) != -2  # -1 may repeat
    bad = [
        (np.array([[0, 8, 1]]), one),  # out of range
        (np.array([[1, 2], [5, 5]]), np.ones((2, 2))),  # a repeat
        (np.array([[0, 1.5]]), np.ones((1, 2))),  # not integers
        (np.array([[0, 1]]), np.ones((1, 3))),  # weights of another shape
        (np.array([0, 1]), np.ones(2)),  # not [batch, k]
    ]
    for idx, w, place in [(i, w, p) for i, w in bad] + [(bad[1][0], bad[1][1], "p")]:
        with pytest.raises((ValueError, TypeError)) as want:
            get_dedup_layout(idx, w, place)
        with pytest.raises(want.type) as got:
            dedup_layout_of(idx, w, place)
        assert str(got.value) == str(want.value)


def test_dedup_plan_is_the_numpy_plan_and_refuses_out_of_range():
    from comm.kernels import dedup_plan

    rng = np.random.default_rng(4)
    n, dies, topk, batch = 50, 6, 8, 16
    src = np.sort(rng.integers(0, dies, n))
    slots, kfirst = rng.integers(0, batch, n), rng.integers(0, topk, n)
    lin, starts = np.zeros(n, np.int64), np.zeros(dies + 1, np.int64)
    assert dedup_plan(src, slots, kfirst, topk, dies, batch * topk, lin, starts) == 0
    assert np.array_equal(lin, slots * topk + kfirst)
    cuts = np.flatnonzero(src[1:] != src[:-1]) + 1  # the numpy cuts it replaces
    assert np.array_equal(np.diff(starts), np.bincount(src, minlength=dies))
    assert set(cuts.tolist()) <= set(starts.tolist())
    for d in range(dies):
        assert (src[starts[d] : starts[d + 1]] == d).all()
    empty = np.zeros(0, np.int64)
    assert dedup_plan(empty, empty, empty, topk, dies, batch * topk, empty, starts) == 0
    assert not starts.any()
    for d2, s2, k2 in ((dies, 0, 0), (-1, 0, 0), (0, batch, 0), (0, 0, topk), (0, -1, 0)):
        d, s, k = src.copy(), slots.copy(), kfirst.copy()
        d[-1], s[-1], k[-1] = d2, s2, k2
        assert dedup_plan(d, s, k, topk, dies, batch * topk, lin, starts) == -1
    shuffled = src[::-1].copy()  # groups out of source order
    assert dedup_plan(shuffled, slots, kfirst, topk, dies, batch * topk, lin, starts) == -1


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("dtype", [BF16, np.float32])
@pytest.mark.parametrize("hidden", [1, 33, 512, 1100])
def test_reduce_groups_every_group_size_equals_the_plain_loop(dtype, hidden):
    """Groups of 0..6 entries (the kernel has a path for up to two and a chunked one past
    them, chunks of 512 columns) equal the loop over j in float32 from +0.0, rounded once;
    -0.0 products come out +0.0 as from the loop."""
    from comm.kernels import reduce_groups
    from comm.quant import round_combine

    rng = np.random.default_rng(hidden)
    sizes = [0, 1, 2, 3, 4, 5, 6, 2, 1, 3]
    n = sum(sizes)
    rows = (rng.standard_normal((n, hidden)) * 10.0 ** rng.integers(-30, 30, (n, 1))).astype(
        np.float32
    )
    rows[rng.random(rows.shape) < 0.05] = -0.0
    rows[0, 0] = np.nan
    pos = rng.permutation(n).astype(np.int64)
    start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    w = rng.standard_normal(n).astype(np.float32)
    w[::7] = 0.0
    buf = np.full((len(sizes) + 2, hidden + 8), 5, dtype)
    lin = rng.permutation(len(sizes) + 2)[: len(sizes)].astype(np.int64)
    for a in (rows, pos, start, w, lin):
        a.flags.writeable = False  # a caller's expert_out may be read-only
    reduce_groups(rows, pos, start, w, 0, buf, lin)
    for g in range(len(sizes)):
        acc = np.zeros(hidden, np.float32)
        for j in range(start[g], start[g + 1]):
            acc = acc + w[j] * rows[pos[j]]
        want = round_combine(acc[None], np.dtype(dtype))[0]
        got = buf[lin[g], :hidden]
        assert np.array_equal(got.view(np.uint8), np.asarray(want, dtype).view(np.uint8)), g
    assert (buf[:, hidden:].astype(np.float32) == 5).all()


@pytest.mark.parametrize("dtype", [np.int8, np.float32])
def test_dedup_expansion_groups_entries_stably_by_local_expert(dtype):
    """dedup_count / dedup_place over dedup rows from 3 sources (packed by pack_dedup_rows):
    one output row per entry, equal to the numpy stable sort by local expert of the entries
    in (source, row, k) order, with the groups' source, slot, first k, entry ranges, the
    entries' output rows and weights; dedup_count refuses malformed rows."""
    from comm.kernels import dedup_count, dedup_place, pack_dedup_rows
    from memory.layout import dedup_entries_off

    rng = np.random.default_rng(11)
    hidden, n_local, topk = 10, 5, 4
    pb = hidden * np.dtype(dtype).itemsize
    eoff = dedup_entries_off(pb)
    stride = eoff + 12 * topk + 16
    parts, entries, groups = [], [], []
    for src in range(3):
        n = int(rng.integers(0, 6))
        payload = (rng.integers(-100, 100, (8, hidden)) * (src + 1)).astype(dtype)
        scale = rng.random(8).astype(np.float32)
        slots = np.sort(rng.choice(8, n, replace=False))
        sizes = rng.integers(1, topk + 1, n)
        start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        ks = np.concatenate([np.sort(rng.choice(topk, s, replace=False)) for s in sizes] or [[]])
        locs = np.concatenate([rng.choice(n_local, s, replace=False) for s in sizes] or [[]])
        w = rng.standard_normal(len(ks)).astype(np.float32)
        rows = np.zeros((n, stride), np.uint8)
        pack_dedup_rows(payload, scale, slots, start, ks.astype(np.int64),
                        locs.astype(np.int64), w, rows, eoff)  # fmt: skip
        parts.append((src, rows))
        for i in range(n):
            groups.append((src, slots[i], ks[start[i]], sizes[i]))
            for j in range(start[i], start[i + 1]):
                entries.append((locs[j], src, slots[i], ks[j], payload[slots[i]],
                                scale[slots[i]], w[j]))  # fmt: skip
    counts = np.zeros(n_local, np.int64)
    m = 0
    for _, rows in parts:
        m += dedup_count(rows.reshape(-1), len(rows), stride, eoff, topk, topk, counts)
    assert m == len(entries)
    assert np.array_equal(counts, np.bincount([e[0] for e in entries], minlength=n_local))
    cursor = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    x8 = np.zeros((m, pb), np.uint8)
    bits = np.zeros((2, m), np.int32)
    meta = np.zeros((5, m), np.int64)
    grp = np.zeros((3, len(groups)), np.int64)
    start = np.zeros(len(groups) + 1, np.int64)
    g0 = 0
    for src, rows in parts:
        dedup_place(rows.reshape(-1), len(rows), stride, eoff, src, cursor, g0, x8, bits, meta,
                    grp, start)  # fmt: skip
        g0 += len(rows)
    order = sorted(range(m), key=lambda q: (entries[q][0], q))  # stable by local expert
    for p, q in enumerate(order):
        loc, src, slot, k, row, scale, _ = entries[q]
        assert meta[:4, p].tolist() == [src, slot, k, loc]
        assert np.array_equal(x8[p].view(dtype), row) and bits[0, p] == scale.view(np.int32)
        assert meta[4, q] == p  # entry q's output row
    assert bits[1].tolist() == [e[6].view(np.int32) for e in entries]
    assert grp.T.tolist() == [list(g[:3]) for g in groups]
    assert np.array_equal(np.diff(start), [g[3] for g in groups])
    some = next(rows for _, rows in parts if len(rows))
    # malformed rows are refused before anything is counted: entry count 0 or past most,
    # meta word 3 not -1, a k or a local expert out of range
    for word, value in ((-2, 0), (-2, topk + 1), (-1, 0), (eoff // 4, topk),
                        (eoff // 4 + 1, n_local)):  # fmt: skip
        bad = some[:1].copy()
        w32 = bad.reshape(-1).view(np.int32)
        w32[word if word >= 0 else stride // 4 + word] = value
        c = np.zeros(n_local, np.int64)
        assert dedup_count(bad.reshape(-1), 1, stride, eoff, topk, topk, c) == -1
        assert not c.any()


@pytest.mark.parametrize("dtype", [BF16, np.float32])
def test_pull_reduce_reads_each_sources_rows_where_they_are(dtype):
    """pull_reduce over rows left in three 'dies' equals weighted_sum over the same rows
    gathered to their (slot, k), bit for bit; a routed entry without a row is refused."""
    from comm.kernels import pull_reduce

    rng = np.random.default_rng(6)
    batch, k, h, stride, base = 4, 3, 20, 24, 40
    idx = np.array([[0, -1, 2], [1, 3, -1], [-1, -1, -1], [5, 4, 0]], np.int64)
    slot, kk = np.nonzero(idx >= 0)
    dies = np.array([2, 0, 1], np.int64)
    offs = np.array([0, 3, 3, 7], np.int64)  # 7 messages: 3 from die 2, none from 0, 4 from 1
    first = np.array([5, 0, 2], np.int64)  # each source's first row of ours in its area
    regions = [np.zeros(base + 16 * stride, dtype) for _ in range(3)]
    contrib = np.zeros((batch, k, h), dtype)
    for p in range(3):
        for m in range(offs[p], offs[p + 1]):
            row = (rng.standard_normal(h) * 10).astype(np.float32).astype(dtype)
            at = base + (first[p] + m - offs[p]) * stride
            regions[dies[p]][at : at + h] = row
            contrib[slot[m], kk[m]] = row
    w = rng.standard_normal((batch, k)).astype(np.float32)
    addrs = np.array([r.ctypes.data for r in regions], np.int64)
    mem = (addrs, regions[0].nbytes, np.zeros(0, np.uint16 if dtype == BF16 else np.float32))
    out = np.empty((batch, h), np.float32)
    assert pull_reduce(*mem, dies, offs, first, base, stride, slot, kk, idx, w, out) == 0
    assert np.array_equal(out, weighted_sum(contrib, idx, w))
    short = offs.copy()
    short[3] = 6  # the last routed entry has no row
    assert pull_reduce(*mem, dies, short, first, base, stride, slot, kk, idx, w, out) == -1
