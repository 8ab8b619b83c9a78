"""runtime.model and runtime.model.reference: the toy DeepSeek-shaped model and its D-die reference.

Everything runs on the "tiny" preset. Prompts are random bytes from a printed seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from memory.errors import ConfigError
from runtime.model import (
    BOS,
    EOS,
    PAD,
    PRESETS,
    DictKV,
    DieModel,
    ModelConfig,
    batch_rows,
    build_weights,
    decode,
    encode,
    mla_project,
    rms_norm,
    route_topk,
    sample,
    swiglu,
)
from runtime.model.reference import ReferencePod, mla_decompressed

TINY = ModelConfig.preset("tiny")
SEED = 1234


def prompts_for(num_dies: int, per_die: list[int], seed: int = SEED) -> list[list[list[int]]]:
    """`per_die[d]` requests on die d, random byte prompts of lengths 3..20 after a BOS."""
    print(f"prompt seed {seed}")
    rng = np.random.default_rng(seed)
    return [
        [[BOS, *rng.integers(0, 256, size=int(rng.integers(3, 21))).tolist()] for _ in range(n)]
        for n in per_die[:num_dies]
    ]


def full_die(cfg: ModelConfig = TINY) -> DieModel:
    return DieModel(cfg, build_weights(cfg, range(cfg.num_experts)), DictKV(cfg.kv_cache_dim))


# -- config ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_validate(name):
    cfg = ModelConfig.preset(name)
    cfg.validate(1)
    cfg.validate(4)
    assert cfg.kv_cache_dim == cfg.kv_lora_rank + cfg.qk_rope_dim
    assert ModelConfig.preset(name, seed=7).seed == 7


def test_small_is_the_default():
    assert ModelConfig() == ModelConfig.preset("small")


@pytest.mark.parametrize(
    "overrides, num_dies, field",
    [
        (dict(num_experts=16), 3, "num_experts"),
        (dict(num_experts=8, topk=9), 1, "topk"),
        (dict(topk=0), 1, "topk"),
        (dict(n_dense_layers=4), 1, "n_dense_layers"),
        (dict(qk_rope_dim=15), 1, "qk_rope_dim"),
        (dict(hidden=0), 1, "hidden"),
        (dict(vocab_size=100), 1, "vocab_size"),
        (dict(gating="relu"), 1, "gating"),
        (dict(routed_scaling=0.0), 1, "routed_scaling"),
        ({}, 0, "num_dies"),
    ],
)
def test_bad_config_names_the_field(overrides, num_dies, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.preset("tiny", **overrides).validate(num_dies)


def test_validate_expert_dies():
    cfg = ModelConfig.preset("tiny", num_experts=8)
    cfg.validate(6, expert_dies=4)
    with pytest.raises(ConfigError, match="num_experts"):
        cfg.validate(6)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ConfigError, match="tiny.*small.*medium"):
        ModelConfig.preset("huge")


def test_unknown_override_is_named():
    with pytest.raises(ConfigError, match="num_expert"):
        ModelConfig.preset("tiny", num_expert=8)


def test_reference_pod_validates_first():
    with pytest.raises(ConfigError, match="num_experts"):
        ReferencePod(TINY, 3)


# -- tokenizer -------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "hello", "héllo wörld ✓ 数据 🚀"])
def test_tokenizer_round_trip(text):
    ids = encode(text)
    assert ids[0] == BOS and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert decode(ids + [EOS, PAD]) == text
    assert encode(text, bos=False) == ids[1:]


def test_decode_replaces_invalid_utf8():
    assert decode([0xE2, 0x9C]) == "\ufffd"


# -- weights ---------------------------------------------------------------------------------------


def _arrays(obj, prefix=""):
    """Every array in a weights tree, keyed by its path."""
    if isinstance(obj, np.ndarray):
        return {prefix: obj}
    if dataclasses.is_dataclass(obj):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict | list):
        items = obj.items() if isinstance(obj, dict) else enumerate(obj)
        return {k: v for key, val in items for k, v in _arrays(val, f"{prefix}/{key}").items()}
    return {}


def test_weights_deterministic_and_float32():
    a, b = _arrays(build_weights(TINY, [0, 5])), _arrays(build_weights(TINY, [5, 0]))
    assert a.keys() == b.keys() and a
    for key in a:
        assert a[key].dtype == np.float32, key
        assert np.array_equal(a[key], b[key]), key
    other = _arrays(build_weights(dataclasses.replace(TINY, seed=1), [0, 5]))
    assert not np.array_equal(a["/embed"], other["/embed"])


def test_expert_subset_equals_full_build():
    full, part = build_weights(TINY, range(TINY.num_experts)), build_weights(TINY, [3, 9])
    for layer, table in part.experts.items():
        assert sorted(table) == [3, 9]
        for e in (3, 9):
            for name in ("w_gate", "w_up", "w_down"):
                got, want = getattr(table[e], name), getattr(full.experts[layer][e], name)
                assert np.array_equal(got, want), (layer, e, name)
    assert np.array_equal(part.layers[1].gate, full.layers[1].gate)
    assert sorted(part.experts) == [1, 2]  # layer 0 is dense


def test_build_weights_rejects_bad_expert_ids():
    with pytest.raises(ValueError, match="experts"):
        build_weights(TINY, [16])


# -- attention: absorbed == decompressed -----------------------------------------------------------


def _absorbed_vs_naive(cfg: ModelConfig, chunks: list[int]):
    """Feed one request in chunks through layer 0; compare each chunk with textbook MLA."""
    die = full_die(cfg)
    lw = die.weights.layers[0]
    rng = np.random.default_rng(SEED)
    start = 0
    for s in chunks:
        h = rng.standard_normal((s, cfg.hidden), dtype=np.float32)
        got = die.attention(0, h, [(7, np.zeros(s, np.int64), start)]) - h
        pos = np.arange(start, start + s)
        x = rms_norm(h, lw.attn_norm, cfg.norm_eps)
        q_nope, q_pe, _ = mla_project(cfg, lw, x, die.cos[pos], die.sin[pos])
        want = mla_decompressed(cfg, lw, q_nope, q_pe, die.kv.get(7, 0), start)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        start += s
    assert die.kv.get(7, 0).shape == (start, cfg.kv_cache_dim)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
def test_absorbed_prefill_then_decode_equals_decompressed(q_lora_rank):
    cfg = dataclasses.replace(TINY, q_lora_rank=q_lora_rank)
    _absorbed_vs_naive(cfg, [9, 1, 1, 5, 1])  # prefill, decode, decode, chunk, decode


def test_attention_is_causal_within_a_prefill():
    """The first rows of a prefill do not depend on the tokens after them."""
    die_a, die_b = full_die(), full_die()
    rng = np.random.default_rng(SEED)
    h = rng.standard_normal((8, TINY.hidden), dtype=np.float32)
    h2 = h.copy()
    h2[5:] += 1.0
    a = die_a.attention(0, h, [(0, np.zeros(8, np.int64), 0)])
    b = die_b.attention(0, h2, [(0, np.zeros(8, np.int64), 0)])
    np.testing.assert_allclose(a[:5], b[:5], rtol=1e-5, atol=1e-6)
    assert not np.allclose(a[5:], b[5:])


def test_attention_rejects_a_kv_gap():
    die = full_die()
    h = np.zeros((1, TINY.hidden), np.float32)
    with pytest.raises(ValueError, match="start_pos"):
        die.attention(0, h, [(0, [1], 3)])


# -- KV cache: prefill + decode == recompute -------------------------------------------------------


def test_prefill_then_decode_equals_full_recompute():
    prompts = prompts_for(2, [2, 1])
    steps = 5
    res = ReferencePod(TINY, 2).generate(prompts, steps)
    # Recompute: prefill prompt + every fed generated token (all but the last) in one step.
    pod = ReferencePod(TINY, 2)
    batches = [
        [(r, p + t[:-1], 0) for r, p, t in zip(ids, ps, ts, strict=True)]
        for ids, ps, ts in zip(res.request_ids, prompts, res.tokens, strict=True)
    ]
    recomputed = pod.step(batches)
    for d in range(2):
        want = res.logits[d][steps]
        np.testing.assert_allclose(recomputed[d], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


# -- gating ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
def test_gate_weights_sum_to_scaling_and_ids_distinct(gating):
    cfg = dataclasses.replace(TINY, gating=gating, routed_scaling=2.5)
    die = full_die(cfg)
    h = np.random.default_rng(SEED).standard_normal((33, cfg.hidden), dtype=np.float32)
    xn, idx, w = die.gate(1, h)
    assert xn.dtype == np.float32 and w.dtype == np.float32 and idx.dtype == np.int64
    assert idx.shape == w.shape == (33, cfg.topk)
    np.testing.assert_allclose(w.sum(axis=1), 2.5, rtol=1e-6)
    assert all(len(set(row)) == cfg.topk for row in idx.tolist())
    assert (w > 0).all() and (np.diff(w, axis=1) <= 0).all()  # by descending score
    assert len(np.unique(idx)) > cfg.topk  # routing is spread, not degenerate
    idx2, w2 = die.gate(1, h)[1:]
    assert np.array_equal(idx, idx2) and np.array_equal(w, w2)


@pytest.mark.parametrize("gating", ["sigmoid", "softmax"])
def test_route_topk_ties_go_to_the_lower_expert(gating):
    logits = np.zeros((2, 8), np.float32)
    logits[1, [2, 6]] = 1.0  # two winners tied, then six tied losers
    idx, w = route_topk(logits, 4, gating, 1.0)
    assert idx.tolist() == [[0, 1, 2, 3], [2, 6, 0, 1]]
    np.testing.assert_allclose(w[0], 0.25, rtol=1e-6)


def test_gate_on_zero_rows():
    xn, idx, w = full_die().gate(1, np.zeros((0, TINY.hidden), np.float32))
    assert xn.shape == (0, TINY.hidden) and idx.shape == w.shape == (0, TINY.topk)


# -- experts ---------------------------------------------------------------------------------------


def test_experts_with_empty_groups():
    die = DieModel(TINY, build_weights(TINY, [4, 5, 6, 7]), DictKV(TINY.kv_cache_dim))
    counts = np.array([3, 0, 2, 0], np.int64)
    ids = [4, 5, 6, 7]
    x = np.random.default_rng(SEED).standard_normal((5, TINY.hidden), dtype=np.float32)
    y = die.experts(1, x, counts, ids)
    assert y.shape == x.shape and y.dtype == np.float32
    table = die.weights.experts[1]
    owner = [4, 4, 4, 6, 6]
    for i, e in enumerate(owner):
        np.testing.assert_allclose(y[i], swiglu(x[i : i + 1], table[e])[0], rtol=1e-5, atol=1e-6)
    # Exact: the same group through the same matmul chain.
    assert np.array_equal(y[3:5], swiglu(x[3:5], table[6]))
    assert die.experts(1, x[:0], np.zeros(4, np.int64), ids).shape == (0, TINY.hidden)


def test_experts_rejects_bad_counts_and_missing_experts():
    die = DieModel(TINY, build_weights(TINY, [0, 1]), DictKV(TINY.kv_cache_dim))
    x = np.zeros((3, TINY.hidden), np.float32)
    with pytest.raises(ValueError, match="expert_counts"):
        die.experts(1, x, np.array([1, 1]), [0, 1])
    with pytest.raises(ValueError, match="not built"):
        die.experts(1, x, np.array([3]), [2])


# -- KV store, batches, sampling -------------------------------------------------------------------


def test_dict_kv_grows_and_frees():
    kv = DictKV(4, initial_rows=2)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    for i in range(0, 10, 3):
        kv.append(1, 0, rows[i : i + 3])
    got = kv.get(1, 0)
    assert np.array_equal(got, rows) and got.flags.c_contiguous and got.dtype == np.float32
    assert kv.get(2, 0).shape == (0, 4) and kv.num_rows(1) == 10
    kv.free(1)
    assert kv.num_rows(1) == 0


def test_batch_rows_order():
    tokens, positions, bounds = batch_rows([(5, [1, 2, 3], 0), (2, np.array([9]), 7)])
    assert tokens.tolist() == [1, 2, 3, 9] and positions.tolist() == [0, 1, 2, 7]
    assert bounds == [(5, 0, 3, 0), (2, 3, 4, 7)]


def test_sample_greedy_and_seeded():
    logits = np.array([[0.0, 2.0, 2.0], [5.0, 0.0, 0.0]], np.float32)
    assert sample(logits, 0.0).tolist() == [1, 0]  # first maximum
    draw = [sample(logits, 1.0, [np.random.default_rng([0, r, 3]) for r in (0, 1)]) for _ in "ab"]
    assert np.array_equal(draw[0], draw[1])
    many = [sample(logits[:1], 1.0, [np.random.default_rng([0, 0, s])])[0] for s in range(200)]
    assert set(many) == {0, 1, 2}


# -- ReferencePod ----------------------------------------------------------------------------------


def _flat_logits(res, step):
    return np.concatenate([res.logits[d][step] for d in range(len(res.logits))])


@pytest.mark.parametrize("num_dies", [2, 4])
def test_reference_pod_matches_one_die(num_dies):
    """The same 8 requests spread over D dies or all on one: same tokens, logits within 1e-5.

    With float32 combine rows: a bfloat16 combine rounds each expert row to 2^-8, so a 1-ulp
    difference of a grouping (BLAS over other row counts) can move a rounding (~5e-4 here)."""
    per_die = [8 // num_dies] * num_dies
    spread = prompts_for(num_dies, per_die)
    one = [[p for d in spread for p in d]]
    a = ReferencePod(TINY, 1, combine_dtype="float32").generate(one, 4)
    b = ReferencePod(TINY, num_dies, combine_dtype="float32").generate(spread, 4)
    assert [t for d in b.tokens for t in d] == a.tokens[0]
    assert [r for d in b.request_ids for r in d] == list(range(8))
    for step in range(5):
        got, want = _flat_logits(b, step), _flat_logits(a, step)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert b.num_decode_tokens == 32 and b.decode_tokens_per_s > 0


def test_reference_pod_is_deterministic():
    prompts = prompts_for(2, [2, 3])
    a = ReferencePod(TINY, 2).generate(prompts, 3, temperature=0.8, seed=5)
    b = ReferencePod(TINY, 2).generate(prompts, 3, temperature=0.8, seed=5)
    assert a.tokens == b.tokens
    for d in range(2):
        for la, lb in zip(a.logits[d], b.logits[d], strict=True):
            assert np.array_equal(la, lb)


def test_die_without_requests():
    prompts = prompts_for(4, [2, 0, 1, 0])
    res = ReferencePod(TINY, 4).generate(prompts, 3)
    assert [len(t) for t in res.tokens] == [2, 0, 1, 0]
    assert all(len(t) == 4 for d in res.tokens for t in d)
    assert res.logits[1][0].shape == (0, TINY.vocab_size)
    assert res.logits[0][3].shape == (2, TINY.vocab_size)
    empty = ReferencePod(TINY, 2).step([[], []])
    assert [lg.shape for lg in empty] == [(0, TINY.vocab_size)] * 2


def test_int8_dispatch_close_to_float32():
    """Same batches (teacher-forced) through float32 and INT8 dispatch.

    Observed on tiny (seed 1234): max |delta logits| 0.8e-2 .. 1.8e-2 with |logits| up to ~4;
    asserted bound 0.1.
    """
    prompts = prompts_for(4, [2, 2, 1, 1])
    ref = ReferencePod(TINY, 4).generate(prompts, 3)
    q_pod = ReferencePod(TINY, 4, quant="int8")
    batches = [
        [(r, p, 0) for r, p in zip(ids, ps, strict=True)]
        for ids, ps in zip(ref.request_ids, prompts, strict=True)
    ]
    for step in range(4):
        got = q_pod.step(batches)
        for d in range(4):
            diff = np.abs(got[d] - ref.logits[d][step]).max(initial=0.0)
            print(f"int8 step {step} die {d}: max |delta| {diff:.2e}")
            assert diff < 0.1, (step, d, diff)
        batches = [
            [(r, [t[step]], len(p) + step) for r, p, t in zip(ids, ps, ts, strict=True)]
            for ids, ps, ts in zip(ref.request_ids, prompts, ref.tokens, strict=True)
        ]
    assert not np.array_equal(got[0], ref.logits[0][3])  # quantization did happen


def test_rope_scores_depend_on_relative_position_only():
    """q_pe . k_pe from `mla_project` is unchanged when every position shifts by 37."""
    die = full_die()
    lw = die.weights.layers[0]
    x = np.random.default_rng(SEED).standard_normal((6, TINY.hidden), dtype=np.float32)
    r = TINY.kv_lora_rank

    def rope_scores(shift: int) -> np.ndarray:
        pos = np.arange(6) + shift
        _, q_pe, kv_rows = mla_project(TINY, lw, x, die.cos[pos], die.sin[pos])
        return np.einsum("nhd,md->hnm", q_pe, kv_rows[:, r:])

    base, shifted = rope_scores(0), rope_scores(37)
    np.testing.assert_allclose(shifted, base, rtol=1e-4, atol=1e-4)
    _, q0, _ = mla_project(TINY, lw, x, die.cos[:6], die.sin[:6])
    _, q1, _ = mla_project(TINY, lw, x, die.cos[37:43], die.sin[37:43])
    assert not np.allclose(q0, q1)  # the rotation itself did move


def test_bfloat16_combine_rounds_the_expert_rows_and_stays_close():
    """The default combine sends expert rows in bfloat16: the logits move (by the rounding of
    8-bit mantissas, well under the INT8 dispatch's 0.1), and float32 is the option."""
    prompts = prompts_for(4, [2, 2, 1, 1])
    bf = ReferencePod(TINY, 4).generate(prompts, 2)
    f32 = ReferencePod(TINY, 4, combine_dtype="float32").generate(prompts, 2)
    assert ReferencePod(TINY, 4).combine_dtype == "bfloat16"
    diffs = [np.abs(a - b).max(initial=0.0) for a, b in
             zip(bf.logits[0], f32.logits[0], strict=True)]  # fmt: skip
    print(f"bfloat16 vs float32 combine, die 0: max |delta logits| per step {diffs}")
    assert max(diffs) > 0, "bfloat16 must change something, or the option proves nothing"
    assert diffs[0] < 0.05
    with pytest.raises(ConfigError, match="combine_dtype"):
        ReferencePod(TINY, 4, combine_dtype="float16")


# -- the small-row products (runtime.model.kernels) ------------------------------------------------


@pytest.mark.parametrize("shape", [(2, 256, 512), (3, 128, 256), (2, 7, 5)])
def test_small_row_products_are_exact_sums_rounded_once(shape):
    """2-3 rows go to the kernel: within one float32 rounding of the float64 product, and each
    row's result is the same whatever rows share the call (batch-invariant)."""
    from runtime.model import kernels as K
    from runtime.model import ops as M

    m, k, n = shape
    assert 2 <= m <= K.SMALL_ROWS
    rng = np.random.default_rng(m * k + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    got = M.mm(x, w)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float32))
    assert got.dtype == np.float32 and np.all(np.abs(got - exact) <= ulp)
    other = rng.standard_normal((1, k)).astype(np.float32)
    for i in range(m):
        pair = M.mm(np.concatenate([other, x[i : i + 1]]), w)
        assert np.array_equal(pair[1], got[i])


def test_small_row_products_per_head_and_blas_elsewhere():
    from runtime.model import ops as M

    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 2, 32)).astype(np.float32)
    w = rng.standard_normal((4, 32, 64)).astype(np.float32)
    got = M.mm(x, w)
    for h in range(4):
        assert np.array_equal(got[h], M.mm(x[h], w[h]))
    np.testing.assert_allclose(got, np.matmul(x, w), rtol=1e-5, atol=1e-5)
    for rows in (1, 4, 8):  # one row (GEMV) and 4 or more rows: BLAS, bit for bit
        y = rng.standard_normal((rows, 32)).astype(np.float32)
        assert np.array_equal(M.mm(y, w[0]), y @ w[0])
    wt = np.asfortranarray(w[0])  # a weight that is not C-contiguous: BLAS
    y = rng.standard_normal((2, 32)).astype(np.float32)
    assert np.array_equal(M.mm(y, wt), y @ wt)


@pytest.mark.parametrize("rows, d", [(1, 7), (2, 256), (3, 64), (8, 100), (0, 16)])
def test_rms_norm_rows_sum_squares_exactly_and_round_once(rows, d):
    """The compiled RMSNorm of rows (any strides): the mean of squares summed in float64 and
    rounded once, then float32 operations in the order of the formula; each row alone."""
    from runtime.model import ops as M

    rng = np.random.default_rng(rows * 1000 + d)
    base = (rng.standard_normal((rows, d + 5)) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
    x = base[:, 2 : d + 2]  # not contiguous
    w = rng.standard_normal(d).astype(np.float32)
    got = M.rms_norm(x, w, 1e-6)
    ms = (x.astype(np.float64) ** 2).sum(axis=-1, keepdims=True) / d
    inv = np.float32(1.0) / np.sqrt(ms.astype(np.float32) + np.float32(1e-6))
    assert got.dtype == np.float32 and np.array_equal(got, (x * inv) * w)
    for i in range(rows):
        assert np.array_equal(M.rms_norm(x[i : i + 1], w, 1e-6)[0], got[i])


@pytest.mark.parametrize("shape", [(2, 4, 32), (3, 32), (1, 1, 2), (0, 2, 8)])
def test_rope_kernel_equals_the_numpy_rotation(shape):
    from runtime.model import ops as M

    rng = np.random.default_rng(len(shape) * 10 + shape[-1])
    x = rng.standard_normal((*shape[:-1], shape[-1] + 8)).astype(np.float32)[..., 8:]
    n, half = shape[0], shape[-1] // 2
    cos, sin = rng.standard_normal((2, n, half)).astype(np.float32)
    extra = (slice(None),) + (None,) * (x.ndim - 2)
    c, s = cos[extra], sin[extra]
    want = np.empty_like(x)
    want[..., 0::2] = x[..., 0::2] * c - x[..., 1::2] * s
    want[..., 1::2] = x[..., 0::2] * s + x[..., 1::2] * c
    assert np.array_equal(M.apply_rope(x, cos, sin), want)


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@pytest.mark.parametrize("rows", [2, 3])
def test_compiled_attention_projections_equal_the_numpy_path(q_lora_rank, rows):
    """A die's 2-3 rows take the attention projections in two compiled calls (mla_in,
    attn_out): the same kernels in the same order as the numpy path, so the same bits."""
    from runtime.model import kernels as K
    from runtime.model import ops as M

    cfg = dataclasses.replace(TINY, q_lora_rank=q_lora_rank)
    lw = full_die(cfg).weights.layers[1]
    rng = np.random.default_rng(rows + q_lora_rank)
    h = rng.standard_normal((rows, cfg.hidden)).astype(np.float32)
    cos, sin = M.rope_tables(cfg)
    pos = np.arange(rows) + 11
    c, s = cos[pos], sin[pos]
    w_q = lw.wq_b if lw.wq is None else lw.wq
    q_cat, kv_rows = K.mla_in(h, lw.attn_norm, cfg.norm_eps, lw.wq_a, lw.q_norm, w_q, lw.wkv_a,
                              lw.kv_norm, lw.w_uk, c, s)  # fmt: skip
    q_nope, q_pe, want_kv = mla_project(cfg, lw, rms_norm(h, lw.attn_norm, cfg.norm_eps), c, s)
    want_q = np.concatenate(
        [M.mm(np.ascontiguousarray(q_nope.transpose(1, 0, 2)), lw.w_uk), q_pe.transpose(1, 0, 2)],
        axis=-1,
    )
    assert np.array_equal(q_cat, want_q) and np.array_equal(kv_rows, want_kv)
    o_lat = rng.standard_normal((cfg.n_heads, rows, cfg.kv_lora_rank)).astype(np.float32)
    o = M.mm(o_lat, lw.w_uv).transpose(1, 0, 2).reshape(rows, -1)
    assert np.array_equal(K.attn_out(o_lat, lw.w_uv, lw.wo, h), h + M.mm(o, lw.wo))


def test_decode_attention_of_two_rows_takes_the_compiled_path_and_matches_one_row_each():
    """Two decode segments in one call (compiled) and each alone (numpy, one row): equal within
    float32 noise; the KV store gets the same rows either way."""
    a, b = full_die(), full_die()
    rng = np.random.default_rng(SEED)
    prefill = rng.standard_normal((2, 5, TINY.hidden), dtype=np.float32)
    for die in (a, b):
        for req in (0, 1):
            die.attention(1, prefill[req], [(req, np.zeros(5, np.int64), 0)])
    h = rng.standard_normal((2, TINY.hidden), dtype=np.float32)
    both = a.attention(1, h, [(0, [1], 5), (1, [2], 5)])
    one = np.concatenate([b.attention(1, h[i : i + 1], [(i, [1 + i], 5)]) for i in (0, 1)])
    np.testing.assert_allclose(both, one, rtol=1e-5, atol=1e-6)
    for req in (0, 1):
        np.testing.assert_allclose(a.kv.get(req, 1), b.kv.get(req, 1), rtol=1e-5, atol=1e-6)


def test_topk_choice_kernel_equals_the_numpy_choice():
    """route_topk's compiled choice against its numpy definition, bit for bit: group limits,
    ties (lower id / lower group first), -inf and NaN scores."""
    from runtime.model import kernels as K
    from runtime.model import ops as M

    rng = np.random.default_rng(11)
    shapes = [(16, 4, 2, 4), (32, 8, 4, 8), (8, 8, 8, 2), (12, 1, 1, 3), (6, 3, 1, 2),
              (256, 8, 4, 8), (5, 5, 2, 5)]  # fmt: skip
    for trial in range(700):
        e, n_group, topk_group, topk = shapes[trial % len(shapes)]
        x = (rng.standard_normal((int(rng.integers(0, 6)), e)) * 2).astype(np.float32)
        if trial % 3 == 0:
            x = np.round(x)  # ties
        if trial % 5 == 0 and len(x):
            x[0, : min(3, e)] = [-np.inf, np.nan, np.inf][: min(3, e)]
        if trial % 7 == 0 and len(x):
            x[-1] = np.nan
        got = K.topk_choice(x, n_group, topk_group, topk)
        assert np.array_equal(got, M.topk_numpy(x, n_group, topk_group, topk)), (trial, x)


@pytest.mark.parametrize("rows", [2, 3])
def test_compiled_swiglu_is_the_numpy_ffn_within_float32_noise_and_batch_invariant(rows):
    from runtime.model import ops as M

    w = full_die().weights.layers[0].dense
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, TINY.hidden)).astype(np.float32)
    got = M.swiglu(x, w)
    x64 = x.astype(np.float64)
    g = x64 @ w.w_gate
    want = ((g / (1 + np.exp(-g))) * (x64 @ w.w_up)) @ w.w_down
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    other = rng.standard_normal((1, TINY.hidden)).astype(np.float32)
    for i in range(rows):
        assert np.array_equal(M.swiglu(np.concatenate([other, x[i : i + 1]]), w)[1], got[i])


def test_replicated_weights_are_one_read_only_copy_with_the_same_values():
    """Under `replicated_weights`, every die's build shares one read-only copy of the tensors
    all dies hold alike (a launcher forks its dies inside it); its experts stay its own; the
    values equal a build without it; leaving restores private builds."""
    from runtime.model import replicated_weights

    plain = build_weights(TINY, [1, 2])
    with replicated_weights(TINY):
        a, b = build_weights(TINY, [1, 2]), build_weights(TINY, [3])
        with replicated_weights(TINY):  # nested: the outer one owns the copy
            c = build_weights(TINY, [])
    for w in (a, b, c):
        assert np.shares_memory(w.layers[0].wkv_a, a.layers[0].wkv_a)
        assert np.shares_memory(w.embed, a.embed) and np.shares_memory(w.lm_head, a.lm_head)
        assert not w.layers[1].wo.flags.writeable and not w.embed.flags.writeable
    assert a.layers[0] is not b.layers[0]  # own objects, shared arrays
    assert sorted(b.experts[1]) == [3] and a.experts[1][1].w_gate.flags.writeable
    for x, y in ((plain.embed, a.embed), (plain.lm_head, a.lm_head),
                 (plain.layers[1].wq, a.layers[1].wq), (plain.layers[0].dense.w_up,
                                                        a.layers[0].dense.w_up)):  # fmt: skip
        assert np.array_equal(x, y)
    after = build_weights(TINY, [1])
    assert not np.shares_memory(after.embed, a.embed) and after.embed.flags.writeable
