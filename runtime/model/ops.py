"""The toy model's numerics on float32 rows: products, norms, SwiGLU, RoPE, MLA attention in
the absorbed form, the router's top-k. A die's few decode rows go through compiled kernels
(`runtime.model.kernels`, loaded on first use); any other shape through numpy, with the same
bits where the docstrings say so (tests compare the two)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from runtime.model.config import ModelConfig
from runtime.model.weights import FFNWeights, LayerWeights

F32 = np.float32


_KERNELS = None


def kernels():
    """`runtime.model.kernels` (numba), imported on first use (a pod loads it before its dies
    fork) and kept in a global: an import statement costs ~1-2 us, and a die's decode step
    makes ~100 calls that need it."""
    global _KERNELS
    if _KERNELS is None:
        from runtime.model import kernels as model_kernels

        _KERNELS = model_kernels
    return _KERNELS


_INVARIANT = [False]  # batch-invariant mode of this process (set by every DieModel)


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode (`ModelConfig.batch_invariant`): `mm`, `swiglu` and the attention
    compute each row independently of the others (the compiled kernels for every row count,
    `kernels.attend_rows` per row over exactly its causal context), so a row's bits depend on
    the row alone: not on batch mates, chunking, or prefill against decode."""
    _INVARIANT[0] = bool(on)


def batch_invariant() -> bool:
    return _INVARIANT[0]


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`x @ w` of float32 rows by a weight matrix (or per head, 3-D): up to a few rows a compiled
    kernel (`runtime.model.kernels`: BLAS GEMM's fixed cost dominates a die's 2-3 decode rows),
    BLAS above (batch-invariant mode: the kernel always). Every matrix product of the model
    with its weights goes through here."""
    return kernels().mm(x, w, _INVARIANT[0])


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`(x * 1/sqrt(mean(x^2) + eps)) * weight` over the last axis; x float32 `[..., d]`.

    Rows (`[n, d]`, every norm of the model) go through one compiled call
    (`runtime.model.kernels.rms_norm`: the mean of squares summed in float64 and rounded once);
    a die's few rows made the five numpy calls a fixed cost paid 17 times a decode step."""
    if x.ndim == 2 and x.dtype == F32 and weight.dtype == F32:
        return kernels().rms_norm(x, weight, eps)
    ms = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x * (F32(1.0) / np.sqrt(ms + F32(eps)))) * weight


def silu(x: np.ndarray) -> np.ndarray:
    """`x * sigmoid(x)` as `x / (1 + exp(-x))`, float32."""
    with np.errstate(over="ignore"):  # exp(-x) = inf for very negative x gives -0.0: correct
        return x / (F32(1.0) + np.exp(-x))


def swiglu(x: np.ndarray, w: FFNWeights) -> np.ndarray:
    """SwiGLU FFN on rows: x float32 `[m, hidden]` -> float32 `[m, hidden]`.

    2 to SMALL_ROWS rows of C-contiguous float32 weights take one compiled call
    (`runtime.model.kernels.swiglu`: the same products as `mm`, silu with libm's expf, which
    is within an ulp of numpy's SIMD exp but not always its bits); numpy's 8 calls otherwise."""
    K = kernels()
    lo = 1 if _INVARIANT[0] else 2
    if lo <= x.shape[0] and (x.shape[0] <= K.SMALL_ROWS or _INVARIANT[0]) and x.dtype == F32 and (
        _ffn_ok(w)
    ):  # fmt: skip
        return K.swiglu(np.ascontiguousarray(x), w.w_gate, w.w_up, w.w_down)
    return mm(silu(mm(x, w.w_gate)) * mm(x, w.w_up), w.w_down)


def _ffn_ok(w: FFNWeights) -> bool:
    return all(a.dtype == F32 and a.flags.c_contiguous for a in (w.w_gate, w.w_up, w.w_down))


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax over the last axis in float32, max subtracted first (-inf entries give 0)."""
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / np.sum(e, axis=-1, keepdims=True)


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 `[max_seq_len, qk_rope_dim // 2]`: angle `pos * theta^(-2i/rope_dim)`.

    Computed in float64 then rounded once, so every process gets the same tables.
    """
    p = cfg.qk_rope_dim
    inv_freq = cfg.rope_theta ** (-np.arange(0, p, 2, dtype=np.float64) / p)
    angles = np.arange(cfg.max_seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(F32), np.sin(angles).astype(F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate consecutive pairs `(x[2i], x[2i+1])` of the last axis.

    Arguments:
        x: float32 `[n, ..., rope_dim]`.
        cos, sin: float32 `[n, rope_dim // 2]`, the rows of `rope_tables` at each row's position.

    Returns:
        float32 like `x`: `(x0 cos - x1 sin, x0 sin + x1 cos)` per pair.
    """
    if x.dtype == F32 and x.ndim in (2, 3) and cos.dtype == F32 and sin.dtype == F32:
        rope = kernels().rope  # one compiled call, bit for bit the numpy below
        return rope(x, cos, sin) if x.ndim == 3 else rope(x[:, None], cos, sin)[:, 0]
    extra = (slice(None),) + (None,) * (x.ndim - 2)
    c, s = cos[extra], sin[extra]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def mla_project(
    cfg: ModelConfig, lw: LayerWeights, x: np.ndarray, cos: np.ndarray, sin: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """MLA projections of normalized rows, batched over every row of a die.

    Arguments:
        cfg, lw: config and the layer's weights.
        x: float32 `[n, hidden]`, the attention-normed hidden rows.
        cos, sin: float32 `[n, qk_rope_dim // 2]`, RoPE rows at each row's position.

    Returns:
        q_nope: float32 `[n, H, qk_nope_dim]`.
        q_pe: float32 `[n, H, qk_rope_dim]`, roped.
        kv_rows: float32 `[n, kv_lora_rank + qk_rope_dim]`, the rows to cache:
            `concat(rms_norm(c_kv), rope(k_pe))`.
    """
    n, nh, r = x.shape[0], cfg.n_heads, cfg.kv_lora_rank
    if lw.wq is None:  # q_lora_rank > 0: compress, norm, decompress (W_CQ, then W_DQ|W_RQ)
        x_q, w_q = rms_norm(mm(x, lw.wq_a), lw.q_norm, cfg.norm_eps), lw.wq_b
    else:
        x_q, w_q = x, lw.wq
    q = mm(x_q, w_q).reshape(n, nh, cfg.qk_head_dim)
    q_nope = q[:, :, : cfg.qk_nope_dim]
    q_pe = apply_rope(q[:, :, cfg.qk_nope_dim :], cos, sin)
    kv = mm(x, lw.wkv_a)
    kv_rows = np.empty((n, cfg.kv_cache_dim), dtype=F32)
    kv_rows[:, :r] = rms_norm(kv[:, :r], lw.kv_norm, cfg.norm_eps)
    kv_rows[:, r:] = apply_rope(kv[:, r:], cos, sin)
    return q_nope, q_pe, kv_rows


def absorbed_attention(
    cfg: ModelConfig,
    lw: LayerWeights,
    q_nope: np.ndarray,
    q_pe: np.ndarray,
    caches: Sequence[np.ndarray],
    bounds: Sequence[tuple[int, int, int]],
) -> np.ndarray:
    """MLA core attention in the weight-absorbed form, for decode and prefill alike.

    Per head h, q_nope is pulled into the latent space (`q_lat = q_nope @ W_UK[h]`, `[n, R]`), so
    scores are taken directly against the cached rows: `(concat(q_lat, q_pe) . row) * scale` with
    `row = concat(c_kv, k_pe)` and `scale = 1/sqrt(qk_nope_dim + qk_rope_dim)`; the context stays
    latent (`p @ c_kv`) until `W_UV[h]`, then `W_O`. Real DeepSeek prefill instead decompresses
    K/V (`k_nope = c_kv @ W_UK[h]^T`, `v = c_kv @ W_UV[h]`) and runs standard attention, which is
    cheaper when queries are many; it is the same function because matrix products associate:
    `q_nope . (W_UK c) = (q_nope W_UK) . c` and `p (c W_UV) = (p c) W_UV`. Only float32 rounding
    differs (tests/unit/test_model.py checks 1e-4 relative).

    Arguments:
        cfg, lw: config and the layer's weights.
        q_nope: float32 `[n, H, qk_nope_dim]`; q_pe: float32 `[n, H, qk_rope_dim]` (roped).
        caches: per segment, float32 `[T_s, kv_lora_rank + qk_rope_dim]`: every cached row of its
            request for this layer, this step's rows included (`T_s = start_s + hi_s - lo_s`).
        bounds: per segment `(lo, hi, start)`: its rows `lo:hi` of `q_*`, the position of row `lo`.
            Row `lo + i` sees cache rows `0 .. start + i` (the causal mask; none in decode).

    Returns:
        o: float32 `[n, hidden]`, the attention output after `W_O` (before the residual add).
    """
    # [H, n, nope] @ [H, nope, R] -> [H, n, R], batched over every row of the die
    q_lat = mm(np.ascontiguousarray(q_nope.transpose(1, 0, 2)), lw.w_uk)
    q_cat = np.concatenate([q_lat, q_pe.transpose(1, 0, 2)], axis=-1)  # [H, n, R+P]
    o = mm(attend(cfg, q_cat, caches, bounds), lw.w_uv)  # [H, n, v]
    n = q_nope.shape[0]
    return mm(o.transpose(1, 0, 2).reshape(n, cfg.n_heads * cfg.v_head_dim), lw.wo)


def attend(
    cfg: ModelConfig,
    q_cat: np.ndarray,
    caches: Sequence[np.ndarray],
    bounds: Sequence[tuple[int, int, int]],
) -> np.ndarray:
    """The latent attention core of `absorbed_attention`: per segment, scores of the absorbed
    queries against its cached rows, softmax, weighted sum of the rows' latent part.

    Arguments:
        q_cat: float32 `[H, n, R+P]`, per head `concat(q_nope @ W_UK[h], q_pe)`.
        caches, bounds: as `absorbed_attention`.

    Returns:
        o_lat: float32 `[H, n, R]` (before `W_UV`).
    """
    r = cfg.kv_lora_rank
    scale = F32(1.0 / np.sqrt(cfg.qk_head_dim))
    o_lat = np.empty((cfg.n_heads, q_cat.shape[1], r), dtype=F32)
    if _INVARIANT[0] and q_cat.dtype == F32:
        K = kernels()
        for cache, (lo, hi, start) in zip(caches, bounds, strict=True):
            K.attend_rows(q_cat[:, lo:hi], cache, start, scale, o_lat[:, lo:hi])
        return o_lat
    for cache, (lo, hi, start) in zip(caches, bounds, strict=True):
        scores = np.matmul(q_cat[:, lo:hi], cache.T) * scale  # [H, s, T]
        if hi - lo > 1:
            rows = np.arange(hi - lo)[:, None] + start
            scores[:, np.arange(cache.shape[0])[None, :] > rows] = -np.inf
        o_lat[:, lo:hi] = np.matmul(softmax(scores), cache[:, :r])
    return o_lat


def route_topk(
    logits: np.ndarray,
    topk: int,
    gating: str,
    routed_scaling: float,
    bias: np.ndarray | None = None,
    n_group: int = 1,
    topk_group: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k routing of gate logits, DeepSeek-V3's `Gate.forward` (inference/model.py).

    scores = sigmoid(logits) (or softmax); biased = scores + bias (float32, the choice only);
    with groups (n_group > 1, topk_group < n_group): the experts are n_group groups of
    consecutive ids, a group's score is the sum of its top-2 biased scores (its top-1 for
    groups of one expert), the best topk_group groups are kept (ties: lower group first) and
    every expert of the other groups gets -inf; the top-k of the biased scores are the experts.
    Their weights come from the UNBIASED scores, normalized to sum 1, times routed_scaling.

    Masked groups get -inf, as in DeepSeek-V3's reference code and transformers (5.24's
    `DeepseekV3TopkRouter`; older releases filled them with 0.0, which differs when a kept
    expert's biased score is negative: it ranks masked experts above it and picks an expert
    outside the kept groups). With -inf a token's experts always lie in <= topk_group groups.

    Arguments:
        logits: float32 `[n, num_experts]`, `xn @ gate`.
        topk: experts per token; gating: "sigmoid" or "softmax" scores; routed_scaling: > 0.
        bias: float32 `[num_experts]` correction bias (`expert_bias`), or None.
        n_group, topk_group: the groups and how many a token may use.

    Returns:
        topk_idx: int64 `[n, topk]`, expert ids by descending biased score; equal scores are
            ordered by lower expert id first (stable sort), so the choice is deterministic.
        topk_weights: float32 `[n, topk]`, the chosen unbiased scores divided by their sum,
            times `routed_scaling` (each row sums to `routed_scaling` up to float32 rounding).
    """
    if gating == "sigmoid":
        with np.errstate(over="ignore"):
            scores = F32(1.0) / (F32(1.0) + np.exp(-logits))
    else:
        scores = softmax(logits)
    choice = scores if bias is None else scores + bias.astype(F32, copy=False)
    if choice.dtype == F32 and choice.ndim == 2:  # one compiled pass, the same choice (below)
        topk_idx = kernels().topk_choice(choice, n_group, topk_group, topk)
    else:
        topk_idx = topk_numpy(choice, n_group, topk_group, topk)
    w = np.take_along_axis(scores, topk_idx, axis=1)
    topk_weights = (w / np.sum(w, axis=1, keepdims=True)) * F32(routed_scaling)
    return topk_idx, topk_weights.astype(F32, copy=False)


def topk_numpy(choice: np.ndarray, n_group: int, topk_group: int, topk: int) -> np.ndarray:
    """`route_topk`'s choice in numpy (the definition `runtime.model.kernels.topk_choice`
    compiles, bit for bit; tests compare the two)."""
    if n_group > 1 and topk_group < n_group:
        n, e = choice.shape
        grouped = choice.reshape(n, n_group, e // n_group)
        top2 = -np.sort(-grouped, axis=2)[:, :, : min(2, e // n_group)]
        group_score = top2.sum(axis=2, dtype=F32)
        keep = np.argsort(-group_score, axis=1, kind="stable")[:, :topk_group]
        masked = np.ones((n, n_group), bool)
        np.put_along_axis(masked, keep, False, axis=1)
        choice = np.where(masked[:, :, None], F32(-np.inf), grouped).reshape(n, e)
    return np.argsort(-choice, axis=1, kind="stable")[:, :topk].astype(np.int64)
