"""DeepSeek-V3 routing (`runtime.model.route_topk`, issue 12.1): group-limited top-k with a
correction bias, against a per-token loop written from V3's `Gate.forward`."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.errors import ConfigError
from runtime.model import ModelConfig, expert_bias, route_topk

F32 = np.float32


def loop_gate(logits, topk, scale, bias, n_group, topk_group):
    """Token by token: sigmoid, biased = scores + bias, group score = sum of the group's two
    largest biased scores, keep the best topk_group groups (lower group first on ties), -inf
    elsewhere, top-k biased (lower id first on ties), weights = unbiased scores normalized x
    scale."""
    n, e = logits.shape
    size = e // n_group
    idx = np.zeros((n, topk), np.int64)
    w = np.zeros((n, topk), F32)
    for t in range(n):
        scores = (F32(1) / (F32(1) + np.exp(-logits[t]))).astype(F32)
        biased = scores + (bias if bias is not None else F32(0))
        gscore = [sum(sorted(biased[g * size : (g + 1) * size].tolist(), reverse=True)[:2])
                  for g in range(n_group)]  # fmt: skip
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group]
        cand = [(-float(biased[x]), x) for x in range(e) if x // size in kept]
        chosen = [x for _, x in sorted(cand)[:topk]]
        idx[t] = chosen
        sel = scores[chosen]
        w[t] = (sel / np.sum(sel)) * F32(scale)
    return idx, w


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**32 - 1),
    st.sampled_from([(16, 4, 2, 4), (32, 8, 4, 8), (64, 8, 4, 8), (8, 8, 8, 2), (12, 1, 1, 3)]),
    st.sampled_from(["none", "random", "negative"]),
)
def test_route_topk_equals_the_v3_gate_loop(seed, shape, bias_kind):
    e, n_group, topk_group, topk = shape
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal((9, e)) * 2).astype(F32)
    bias = {"none": None, "random": (rng.standard_normal(e) * 0.05).astype(F32),
            "negative": (-1.5 - rng.random(e)).astype(F32)}[bias_kind]  # fmt: skip
    idx, w = route_topk(logits, topk, "sigmoid", 2.5, bias, n_group, topk_group)
    want_idx, want_w = loop_gate(logits, topk, 2.5, bias, n_group, topk_group)
    assert np.array_equal(idx, want_idx)
    np.testing.assert_allclose(w, want_w, rtol=1e-6)
    # every token's experts lie in <= topk_group groups
    groups = idx // (e // n_group)
    assert max(len(set(row)) for row in groups.tolist()) <= topk_group


def test_masked_groups_get_minus_inf_not_zero_a_case_with_negative_biased_scores():
    # 2 groups of 2 experts; a negative bias makes every biased score negative. Group 0 wins
    # (its top-2 sum is larger), so a token must take both experts of group 0. Filling the masked
    # group with 0.0 (transformers' DeepseekV3TopkRouter before it took -inf) would rank experts
    # 2 and 3 (0.0) above the kept ones (negative) and pick outside the kept group; -inf (V3's
    # reference, transformers 5.24) never does.
    logits = np.array([[2.0, 1.0, -3.0, -3.0]], F32)
    bias = np.full(4, -2.0, F32)
    idx, _ = route_topk(logits, 2, "sigmoid", 1.0, bias, n_group=2, topk_group=1)
    assert sorted(idx[0].tolist()) == [0, 1]
    scores = F32(1) / (F32(1) + np.exp(-logits[0]))
    zero_filled = np.where(np.arange(4) < 2, scores + bias, F32(0.0))
    assert sorted(np.argsort(-zero_filled, kind="stable")[:2].tolist()) == [2, 3]


def test_weights_come_from_the_unbiased_scores():
    logits = np.array([[0.0, 1.0, 2.0, 3.0]], F32)
    bias = np.array([5.0, 0.0, 0.0, 0.0], F32)  # expert 0 chosen for its bias
    idx, w = route_topk(logits, 2, "sigmoid", 2.0, bias)
    assert idx[0].tolist() == [0, 3]
    s = F32(1) / (F32(1) + np.exp(-logits[0]))
    np.testing.assert_allclose(w[0], F32(2) * s[[0, 3]] / (s[0] + s[3]), rtol=1e-6)


def test_no_groups_and_no_bias_is_the_plain_top_k():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((7, 16)).astype(F32)
    idx, _ = route_topk(logits, 4, "sigmoid", 1.0)
    assert np.array_equal(idx, np.argsort(-logits, axis=1, kind="stable")[:, :4])
    idx2, _ = route_topk(logits, 4, "sigmoid", 1.0, None, n_group=4, topk_group=4)
    assert np.array_equal(idx, idx2)  # keeping every group limits nothing


def test_expert_bias_is_seeded_and_skew_makes_hot_experts():
    cfg = ModelConfig.preset("small", score_bias="skew")
    a, b = expert_bias(cfg, 1), expert_bias(cfg, 1)
    assert a.dtype == F32 and np.array_equal(a, b)
    assert expert_bias(ModelConfig(), 1) is None
    rnd = expert_bias(ModelConfig(score_bias="random"), 1)
    assert abs(float(rnd.std()) - 0.01) < 0.005
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4096, cfg.num_experts)) * 0.7).astype(F32)
    idx, _ = route_topk(logits, cfg.topk, "sigmoid", 1.0, a)
    load = np.bincount(idx.ravel(), minlength=cfg.num_experts)
    assert load.max() / load.mean() >= 6  # at most num_experts / topk = 8
    idx0, _ = route_topk(logits, cfg.topk, "sigmoid", 1.0)
    plain = np.bincount(idx0.ravel(), minlength=cfg.num_experts)
    assert plain.max() / plain.mean() < 2


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"n_group": 3}, "n_group"),  # 32 experts do not split into 3 groups
        ({"n_group": 4, "topk_group": 5}, "topk_group"),
        ({"n_group": 8, "topk_group": 1, "topk": 8}, "topk"),  # 4 experts per group < 8
        ({"score_bias": "hot"}, "score_bias"),
        ({"score_bias_scale": 0}, "score_bias_scale"),
        ({"n_group": 0}, "n_group"),
    ],
)
def test_bad_routing_config_names_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**kw)


def test_v3_preset_has_v3_ratios():
    cfg = ModelConfig.preset("v3")
    assert (cfg.num_experts, cfg.topk, cfg.n_group, cfg.topk_group) == (256, 8, 8, 4)
    assert cfg.groups_limited
