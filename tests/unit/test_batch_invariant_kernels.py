"""The kernels of batch-invariant mode: a row's bits do not depend on the other rows of the call
(`kernels.mm(..., invariant=True)` for any row count, `kernels.attend_rows` per segment row),
and they stay close to the numpy path they replace."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.model import ModelConfig
from runtime.model import kernels as K
from runtime.model.ops import attend, set_batch_invariant


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 40), n=st.integers(1, 20), seed=st.integers(0, 99))
def test_mm_rows_do_not_depend_on_their_batch(m, k, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    full = K.mm(x, w, invariant=True)
    for i in {0, m // 2, m - 1}:
        assert np.array_equal(full[i], K.mm(x[i : i + 1], w, invariant=True)[0])
    np.testing.assert_allclose(full, x @ w, rtol=1e-4, atol=1e-4)


@settings(max_examples=20, deadline=None)
@given(s=st.integers(1, 12), start=st.integers(0, 20), seed=st.integers(0, 99))
def test_attend_rows_prefill_equals_decode_row_by_row(s, start, seed):
    cfg = ModelConfig.preset("tiny")
    rng = np.random.default_rng(seed)
    width = cfg.kv_lora_rank + cfg.qk_rope_dim
    q = rng.standard_normal((cfg.n_heads, s, width)).astype(np.float32)
    cache = rng.standard_normal((start + s, width)).astype(np.float32)
    scale = np.float32(1.0 / np.sqrt(cfg.qk_head_dim))
    out = np.empty((cfg.n_heads, s, cfg.kv_lora_rank), np.float32)
    K.attend_rows(q, cache, start, scale, out)  # a prefill chunk of s rows
    for i in range(s):  # each row as a decode step sees it: one row, its context only
        one = np.empty((cfg.n_heads, 1, cfg.kv_lora_rank), np.float32)
        K.attend_rows(np.ascontiguousarray(q[:, i : i + 1]), cache[: start + i + 1], start + i,
                      scale, one)  # fmt: skip
        assert np.array_equal(one[:, 0], out[:, i])
    set_batch_invariant(False)
    ref = attend(cfg, q, [cache], [(0, s, start)])
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
