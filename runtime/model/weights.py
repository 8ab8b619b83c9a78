"""The toy model's weights: random from `cfg.seed`, every tensor from its own seed, so any
process builds any tensor alone (nothing is shipped, a die builds only its own experts), and a
launcher can build the replicated tensors once for every die it forks (`replicated_weights`)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from runtime.model.config import ModelConfig

F32 = np.float32

# Seed tag of every tensor: its generator is default_rng([seed, tag, layer, index]), so any
# process builds any tensor alone. Never renumber: it would change every model.
_TAG = dict(
    embed=1,
    lm_head=2,
    wq=10,
    wq_a=11,
    wq_b=12,
    wkv_a=13,
    wkv_b=14,
    wo=15,
    gate=16,
    dense=20,  # + 0/1/2 for w_gate/w_up/w_down
    shared=30,
    expert=40,
    score_bias=50,
    eh_proj=60,  # the MTP modules' (2 hidden -> hidden) projection
)
# The fitted `eh_proj` of each model config with `mtp_fit` (runtime.model.mtp_fit puts it here
# before any weights of that config are built: a launcher before it forks its dies).
FITTED_EH_PROJ: dict[ModelConfig, np.ndarray] = {}
FIT_PROVIDER = None  # runtime.model.mtp_fit.ensure_fit, set when that module loads


def expert_bias(cfg: ModelConfig, layer: int) -> np.ndarray | None:
    """The correction bias of `layer`'s router, float32 `[num_experts]`, or None ("none").

    Seeded by (cfg.seed, layer) like every weight, so each die and the reference build the same
    bytes. "random": N(0, 0.01). "skew": `score_bias_scale / (1 + rank)` over a seeded
    permutation of the experts (the same one in every layer): the first ranks are picked by
    almost every token, so the hottest expert's load approaches num_experts / topk times the
    mean."""
    if cfg.score_bias == "none":
        return None
    rng = np.random.default_rng([cfg.seed, _TAG["score_bias"], layer])
    if cfg.score_bias == "random":
        return (rng.standard_normal(cfg.num_experts) * 0.01).astype(F32)
    rank = np.random.default_rng([cfg.seed, _TAG["score_bias"]]).permutation(cfg.num_experts)
    return (F32(cfg.score_bias_scale) / (F32(1.0) + rank.astype(F32))).astype(F32)


@dataclass(slots=True)
class FFNWeights:
    """A SwiGLU FFN: `(silu(x @ w_gate) * (x @ w_up)) @ w_down`.

    Fields: w_gate, w_up float32 `[hidden, inter]`; w_down float32 `[inter, hidden]`.
    """

    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass(slots=True)
class LayerWeights:
    """One decoder block (float32; H = n_heads, R = kv_lora_rank, P = qk_rope_dim).

    Fields:
        attn_norm, ffn_norm: `[hidden]` RMSNorm weights before attention and before the FFN.
        wq: `[hidden, H*(nope+P)]` when q_lora_rank == 0, else None.
        wq_a, q_norm, wq_b: `[hidden, q_lora]`, `[q_lora]`, `[q_lora, H*(nope+P)]`, or None.
        wkv_a: `[hidden, R+P]` (W_CKV and W_RK side by side); kv_norm: `[R]`.
        wkv_b: `[R, H*(nope+v)]`, the up-projection of the latent as stored by DeepSeek.
        w_uk: `[H, nope, R]`, per head the key part of `wkv_b` transposed (absorbed into q).
        w_uv: `[H, R, v]`, per head the value part of `wkv_b` (applied after attention).
        wo: `[H*v, hidden]`.
        dense: the dense FFN (dense layers) or None; gate: `[hidden, num_experts]` and shared:
            the shared expert (MoE layers) or None.
    """

    attn_norm: np.ndarray
    wq: np.ndarray | None
    wq_a: np.ndarray | None
    q_norm: np.ndarray | None
    wq_b: np.ndarray | None
    wkv_a: np.ndarray
    kv_norm: np.ndarray
    wkv_b: np.ndarray
    w_uk: np.ndarray
    w_uv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    dense: FFNWeights | None
    gate: np.ndarray | None
    shared: FFNWeights | None


@dataclass(slots=True)
class MTPWeights:
    """An MTP module's own tensors (its decoder block is `Weights.layers[n_layers + j]`).

    Fields: enorm, hnorm: `[hidden]` RMSNorms of the next token's embedding and of the hidden
    row; eh_proj: `[2 hidden, hidden]` over `concat(enorm(embed), hnorm(hidden))` (the order of
    the released checkpoint's code); norm: `[hidden]` the module's own norm before the shared
    LM head.
    """

    enorm: np.ndarray
    hnorm: np.ndarray
    eh_proj: np.ndarray
    norm: np.ndarray


@dataclass(slots=True)
class Weights:
    """Everything one die holds.

    Fields:
        embed: float32 `[vocab, hidden]`; lm_head: float32 `[hidden, vocab]` (not tied).
        layers: one `LayerWeights` per decoder block: the `n_layers` main blocks, then one per
            MTP module.
        final_norm: float32 `[hidden]`.
        experts: `{layer: {logical expert id: FFNWeights}}` for every MoE layer (MTP modules'
            included), holding only the experts this die was built with.
        mtp: one `MTPWeights` per MTP module (`cfg.mtp_layers`).
    """

    embed: np.ndarray
    layers: list[LayerWeights]
    final_norm: np.ndarray
    lm_head: np.ndarray
    experts: dict[int, dict[int, FFNWeights]] = field(default_factory=dict)
    mtp: list[MTPWeights] = field(default_factory=list)


def _randn(cfg: ModelConfig, tag: int, layer: int, index: int, shape, std: float) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, tag, layer, index])
    return rng.standard_normal(shape, dtype=F32) * F32(std)


def _ffn(cfg: ModelConfig, tag: int, layer: int, index: int, inter: int) -> FFNWeights:
    """SwiGLU with std 1/sqrt(fan_in), the output also scaled by 1/sqrt(2 n_layers) (residual)."""
    h, out_std = cfg.hidden, 1.0 / np.sqrt(inter * 2 * cfg.n_layers)
    return FFNWeights(
        w_gate=_randn(cfg, tag, layer, 3 * index, (h, inter), 1.0 / np.sqrt(h)),
        w_up=_randn(cfg, tag, layer, 3 * index + 1, (h, inter), 1.0 / np.sqrt(h)),
        w_down=_randn(cfg, tag, layer, 3 * index + 2, (inter, h), out_std),
    )


def expert_ffn(cfg: ModelConfig, layer: int, expert: int) -> FFNWeights:
    """Routed expert `expert` of `layer` as `build_weights` makes it (from its seed alone)."""
    return _ffn(cfg, _TAG["expert"], layer, expert, cfg.moe_inter)


def _layer(cfg: ModelConfig, layer: int) -> LayerWeights:
    h, nh, r, p = cfg.hidden, cfg.n_heads, cfg.kv_lora_rank, cfg.qk_rope_dim
    nope, v, ql = cfg.qk_nope_dim, cfg.v_head_dim, cfg.q_lora_rank
    q_out = nh * (nope + p)
    ones = np.ones
    wq = wq_a = q_norm = wq_b = None
    if ql == 0:
        wq = _randn(cfg, _TAG["wq"], layer, 0, (h, q_out), 1.0 / np.sqrt(h))
    else:
        wq_a = _randn(cfg, _TAG["wq_a"], layer, 0, (h, ql), 1.0 / np.sqrt(h))
        q_norm = ones(ql, F32)
        wq_b = _randn(cfg, _TAG["wq_b"], layer, 0, (ql, q_out), 1.0 / np.sqrt(ql))
    wkv_b = _randn(cfg, _TAG["wkv_b"], layer, 0, (r, nh * (nope + v)), 1.0 / np.sqrt(r))
    per_head = wkv_b.reshape(r, nh, nope + v)
    moe = cfg.is_moe(layer)
    return LayerWeights(
        attn_norm=ones(h, F32),
        wq=wq,
        wq_a=wq_a,
        q_norm=q_norm,
        wq_b=wq_b,
        wkv_a=_randn(cfg, _TAG["wkv_a"], layer, 0, (h, r + p), 1.0 / np.sqrt(h)),
        kv_norm=ones(r, F32),
        wkv_b=wkv_b,
        w_uk=np.ascontiguousarray(per_head[:, :, :nope].transpose(1, 2, 0)),
        w_uv=np.ascontiguousarray(per_head[:, :, nope:].transpose(1, 0, 2)),
        wo=_randn(cfg, _TAG["wo"], layer, 0, (nh * v, h), 1.0 / np.sqrt(nh * v * 2 * cfg.n_layers)),
        ffn_norm=ones(h, F32),
        dense=None if moe else _ffn(cfg, _TAG["dense"], layer, 0, cfg.dense_inter),
        gate=_randn(cfg, _TAG["gate"], layer, 0, (h, cfg.num_experts), h**-0.5) if moe else None,
        shared=_ffn(cfg, _TAG["shared"], layer, 0, cfg.shared_inter) if moe else None,
    )


# The replicated tensors (every die's copy of everything but its experts), built by
# `replicated_weights` in a launcher before it forks its dies, keyed by the model config.
_REPLICATED: dict[ModelConfig, tuple] = {}


@contextlib.contextmanager
def replicated_weights(cfg: ModelConfig):
    """While open, `build_weights(cfg, ...)` in this process, and in every process forked from
    it meanwhile (a pod's dies), returns one read-only copy of the tensors every die holds
    alike (embedding, attention, dense FFN, shared expert, router, final norm, LM head) instead
    of building its own: forked dies share those pages, so 4 dies on 2 cores keep one copy in
    the cache instead of four (`xpod decode --dies 4`: ~8 % faster, measured in alternating
    runs). The values are the same either way (each tensor comes from its own seed)."""
    if cfg in _REPLICATED:  # nested: the outer one owns it
        yield
        return
    h, vocab = cfg.hidden, cfg.vocab_size
    shared = (
        _randn(cfg, _TAG["embed"], 0, 0, (vocab, h), 1.0),
        [_layer(cfg, layer) for layer in range(cfg.kv_layers)],
        np.ones(h, F32),
        _randn(cfg, _TAG["lm_head"], 0, 0, (h, vocab), 1.0 / np.sqrt(h)),
        mtp_weights(cfg),
    )
    for a in _arrays(shared):
        a.flags.writeable = False  # shared by every die: never written
    _REPLICATED[cfg] = shared
    try:
        yield
    finally:
        del _REPLICATED[cfg]


def _arrays(obj):
    """Every numpy array inside nested tuples / lists / weight dataclasses."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _arrays(o)
    elif isinstance(obj, LayerWeights | FFNWeights | MTPWeights):
        for f in dataclasses.fields(obj):
            yield from _arrays(getattr(obj, f.name))


def mtp_weights(cfg: ModelConfig) -> list[MTPWeights]:
    """The MTP modules' own tensors: norms of ones, `eh_proj` seeded (std 1/sqrt(2 hidden)) or,
    with `cfg.mtp_fit`, the fitted one (`FITTED_EH_PROJ`, ConfigError if it was not fitted)."""
    out = []
    h = cfg.hidden
    for j in range(cfg.mtp_layers):
        layer = cfg.n_layers + j
        if cfg.mtp_fit:
            eh = FITTED_EH_PROJ.get(cfg)
            if eh is None and FIT_PROVIDER is not None:
                eh = FIT_PROVIDER(cfg)
            if eh is None:
                from memory.errors import ConfigError

                raise ConfigError("mtp_fit: this config's MTP head is not fitted yet"
                                  " (runtime.model.mtp_fit.ensure_fit(cfg) first)")  # fmt: skip
        else:
            eh = _randn(cfg, _TAG["eh_proj"], layer, 0, (2 * h, h), 1.0 / np.sqrt(2 * h))
        out.append(MTPWeights(np.ones(h, F32), np.ones(h, F32), eh, np.ones(h, F32)))
    return out


def build_weights(cfg: ModelConfig, experts: Sequence[int],
                  mtp_experts: Sequence[int] | None = None) -> Weights:  # fmt: skip
    """Build a die's weights: every non-expert tensor, plus the routed experts `experts`
    (of the MTP modules' MoE too, or `mtp_experts` there: a die whose main experts live in an
    EPLB bank builds the MTP module's default ones).

    Each tensor comes from its own `np.random.default_rng([cfg.seed, tag, layer, index])`, so two
    processes building the same tensor get identical bytes, and an expert's tensors do not depend
    on which other experts are built. Init: normal with std 1/sqrt(fan_in) (the embedding std 1);
    the projections writing into the residual stream (`wo`, every `w_down`) are scaled down by a
    further 1/sqrt(2 n_layers) so activations stay O(1) over layers; norms are ones; the router
    `gate` has std 1/sqrt(hidden), so gate logits are O(1) and routing is spread, not degenerate.

    Arguments:
        cfg: the model config.
        experts: logical expert ids in `[0, num_experts)` this die hosts (any order, no repeats).

    Returns:
        weights: a `Weights` with `experts[layer][e]` for every MoE layer and every `e` given.
    """
    ids = [int(e) for e in experts]
    mtp_ids = None if mtp_experts is None else [int(e) for e in mtp_experts]
    bad = [e for e in ids + (mtp_ids or []) if not 0 <= e < cfg.num_experts]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"experts: expected distinct ids in [0, {cfg.num_experts}), got {sorted(ids)}"
        )
    h, vocab = cfg.hidden, cfg.vocab_size
    shared = _REPLICATED.get(cfg)
    if shared is not None:
        embed, layers, final_norm, lm_head, mtp = shared
        layers = [dataclasses.replace(lw) for lw in layers]  # own objects, shared arrays
    else:
        embed = _randn(cfg, _TAG["embed"], 0, 0, (vocab, h), 1.0)
        layers = [_layer(cfg, layer) for layer in range(cfg.kv_layers)]
        final_norm = np.ones(h, F32)
        lm_head = _randn(cfg, _TAG["lm_head"], 0, 0, (h, vocab), 1.0 / np.sqrt(h))
        mtp = mtp_weights(cfg)
    return Weights(
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        experts={
            layer: {
                e: expert_ffn(cfg, layer, e)
                for e in sorted(ids if mtp_ids is None or layer < cfg.n_layers else mtp_ids)
            }
            for layer in range(cfg.kv_layers)
            if cfg.is_moe(layer)
        },
        mtp=mtp,
    )
