"""A DeepSeek-shaped toy MoE model in plain numpy, float32 everywhere (docs/architecture.md §5).

Shapes follow DeepSeek-V3 (003 §II-B, Table II), shrunk: a byte-level tokenizer, an embedding,
`n_layers` decoder blocks of MLA attention (a latent KV cache of `kv_lora_rank + qk_rope_dim`
floats per token and layer, weight absorption) followed by a dense SwiGLU FFN (the first
`n_dense_layers` blocks) or an MoE (routed experts spread over dies, one shared expert, top-k
gating), then a final RMSNorm and the LM head. Weights are random from `cfg.seed`, built in every
process from per-tensor seeds, so nothing is shipped and a die builds only its own experts.

Glossary (003 Table II -> code): d_emb -> `hidden`, n_hd -> `n_heads`, d_Qco -> `q_lora_rank`,
d_KVco -> `kv_lora_rank`, d_RoPE -> `qk_rope_dim`, d_hd -> `qk_nope_dim` / `v_head_dim`,
d_MoE -> `moe_inter`, n_e -> `num_experts`, n_k -> `topk`, W_CQ -> `wq_a`, W_DQ|W_RQ -> `wq_b`,
W_CKV|W_RK -> `wkv_a`, W_DK -> `w_uk`, W_DV -> `w_uv`, W_attn_out -> `wo`, W_route -> `gate`.

`DieModel` is what ONE die computes, split into phases (embed, attention, gate, experts,
finish_moe / dense_ffn, logits) so that a driver can put the collectives in between. The
single-process `runtime.reference_model.ReferencePod` and the distributed pod call the same
phases on the same arrays, so they compute bit-identical results; the contract they share:

- a die's batch is a list of segments `(req_id, tokens, start_pos)`; its rows are the tokens of
  the segments concatenated in list order (`batch_rows`);
- `attention` appends each segment's latent rows to the KV store, then attends request by request
  in segment order;
- the routed-expert input of a die is the dispatch output in `comm.reference` canonical order
  (local expert, src die, batch slot, k), dequantized with `comm.quant.dequantize_int8` when
  INT8; `experts` runs one matmul chain per local expert over its contiguous group;
- the combine is `comm.reference.combine_ref`'s ascending-k float32 accumulation, and
  `finish_moe` adds `(h + shared) + routed` in that order;
- `logits` is called on the gathered last row of each segment (`last_rows`), not on all rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from memory.errors import ConfigError

__all__ = [
    "BOS",
    "EOS",
    "NUM_BYTE_TOKENS",
    "PAD",
    "PRESETS",
    "DictKV",
    "DieModel",
    "FFNWeights",
    "KVStore",
    "LayerWeights",
    "ModelConfig",
    "Segment",
    "Weights",
    "absorbed_attention",
    "apply_rope",
    "batch_rows",
    "build_weights",
    "decode",
    "encode",
    "last_rows",
    "mla_project",
    "rms_norm",
    "rope_tables",
    "expert_bias",
    "expert_ffn",
    "route_topk",
    "sample",
    "silu",
    "softmax",
    "swiglu",
]

F32 = np.float32

# -- tokenizer -------------------------------------------------------------------------------------

NUM_BYTE_TOKENS = 256  # ids 0..255 are the UTF-8 bytes
BOS, EOS, PAD = 256, 257, 258
MIN_VOCAB = 259  # bytes + the three specials


def encode(text: str, bos: bool = True) -> list[int]:
    """Byte-level tokens of `text`: its UTF-8 bytes (0..255), preceded by BOS if `bos`."""
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: Sequence[int] | np.ndarray) -> str:
    """Text of byte tokens; specials (>= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTE_TOKENS)
    return data.decode("utf-8", errors="replace")


# -- configuration ---------------------------------------------------------------------------------

_POSITIVE_INTS = (
    "vocab_size",
    "hidden",
    "n_layers",
    "n_heads",
    "kv_lora_rank",
    "qk_nope_dim",
    "qk_rope_dim",
    "v_head_dim",
    "dense_inter",
    "moe_inter",
    "shared_inter",
    "num_experts",
    "max_seq_len",
)
_GATINGS = ("sigmoid", "softmax")
SCORE_BIASES = ("none", "random", "skew")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and seed of the toy model; the defaults are the "small" preset.

    Attributes:
        vocab_size: token ids; >= 259 (256 bytes + BOS=256, EOS=257, PAD=258).
        hidden: width of the residual stream (d_emb).
        n_layers: decoder blocks; the first `n_dense_layers` use a dense FFN, the rest an MoE.
        n_heads: attention heads.
        q_lora_rank: rank of the compressed query (W_CQ then RMSNorm then W_DQ|W_RQ); 0 = direct.
        kv_lora_rank: rank of the compressed KV (d_KVco); the cached latent row per token and
            layer is `kv_lora_rank + qk_rope_dim` float32.
        qk_nope_dim, qk_rope_dim, v_head_dim: per-head query/key widths without and with RoPE
            (the RoPE key part is shared by all heads) and the per-head value width.
        dense_inter, moe_inter, shared_inter: SwiGLU widths of the dense FFN, of each routed
            expert and of the one shared expert.
        num_experts, topk: routed experts per MoE layer and experts per token.
        gating: "sigmoid" (DeepSeek-V3) or "softmax" (V2) scores; in both cases the top-k weights
            are normalized to sum 1, then multiplied by `routed_scaling`.
        n_group, topk_group: DeepSeek-V3's group-limited routing (`route_topk`): the experts
            are `n_group` equal groups of consecutive ids and a token picks its experts from
            its best `topk_group` groups only (1, 1: no limit).
        score_bias: the per-expert correction bias added to the scores for the choice only
            (`expert_bias`): "none", "random" (small, N(0, 0.01)) or "skew" (a Zipf-like
            offset `score_bias_scale / rank` over a seeded ranking of the experts: a few
            experts become hot, the workload knob of load balancing).
        score_bias_scale: the skew offset of the hottest expert (default 1.0).
        rope_theta: RoPE base; max_seq_len: positions 0..max_seq_len-1 are valid.
        seed: root of every weight's seed (>= 0); norm_eps: RMSNorm epsilon.

    Die-independent fields are checked on construction; `validate(num_dies)` adds the checks
    that need the pod's die count. Every error is a `ConfigError` naming the field.
    """

    vocab_size: int = MIN_VOCAB
    hidden: int = 256
    n_layers: int = 4
    n_dense_layers: int = 1
    n_heads: int = 4
    q_lora_rank: int = 128
    kv_lora_rank: int = 64
    qk_nope_dim: int = 32
    qk_rope_dim: int = 32
    v_head_dim: int = 32
    dense_inter: int = 512
    moe_inter: int = 128
    shared_inter: int = 128
    num_experts: int = 32
    topk: int = 4
    gating: str = "sigmoid"
    routed_scaling: float = 2.5
    n_group: int = 1
    topk_group: int = 1
    score_bias: str = "none"
    score_bias_scale: float = 1.0
    rope_theta: float = 10000.0
    max_seq_len: int = 512
    seed: int = 0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        self._check_fields()

    @classmethod
    def preset(cls, name: str, **overrides) -> ModelConfig:
        """The named preset of `PRESETS` with `overrides` applied (unknown keys: ConfigError)."""
        if name not in PRESETS:
            raise ConfigError(f"preset: unknown model preset {name!r}; presets are {list(PRESETS)}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(
                f"{unknown[0]}: not a ModelConfig field (unknown overrides {unknown}); "
                f"fields are {sorted(known)}"
            )
        return dataclasses.replace(PRESETS[name], **overrides)

    @property
    def kv_cache_dim(self) -> int:
        """Floats per cached token per layer: the latent `c_kv` then the roped `k_pe`."""
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_dim + self.qk_rope_dim

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense_layers

    def validate(self, num_dies: int, expert_dies: int | None = None) -> None:
        """Check the config for a pod of `num_dies` dies, `expert_dies` of which host experts.

        Arguments:
            num_dies: dies of the pod (>= 1).
            expert_dies: dies hosting routed experts (default: all `num_dies`); `num_experts`
                must split evenly over them (`comm.routing.Placement.default`).

        Raises:
            ConfigError naming the field and the allowed range.
        """
        self._check_fields()
        _check_int("num_dies", num_dies, 1)
        expert_dies = num_dies if expert_dies is None else expert_dies
        _check_int("expert_dies", expert_dies, 1)
        if expert_dies > num_dies:
            raise ConfigError(f"expert_dies: {expert_dies} is more than num_dies={num_dies}")
        if self.num_experts % expert_dies:
            raise ConfigError(
                f"num_experts: {self.num_experts} experts cannot be split evenly over "
                f"{expert_dies} expert dies (must be a multiple of {expert_dies})"
            )

    def _check_fields(self) -> None:
        for name in _POSITIVE_INTS:
            _check_int(name, getattr(self, name), 1)
        for name in ("n_dense_layers", "q_lora_rank", "seed"):
            _check_int(name, getattr(self, name), 0)
        _check_int("topk", self.topk, 1)
        if self.vocab_size < MIN_VOCAB:
            raise ConfigError(
                f"vocab_size: must be >= {MIN_VOCAB} (256 bytes + BOS, EOS, PAD), "
                f"got {self.vocab_size}"
            )
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(
                f"n_dense_layers: {self.n_dense_layers} is more than n_layers={self.n_layers}"
            )
        if self.qk_rope_dim % 2:
            raise ConfigError(
                f"qk_rope_dim: RoPE rotates pairs, so it must be even, got {self.qk_rope_dim}"
            )
        if self.topk > self.num_experts:
            raise ConfigError(
                f"topk: {self.topk} is more than num_experts={self.num_experts} (1 <= topk <= "
                f"num_experts)"
            )
        if self.gating not in _GATINGS:
            raise ConfigError(f"gating: expected one of {_GATINGS}, got {self.gating!r}")
        self._check_groups()
        for name in ("routed_scaling", "rope_theta", "norm_eps", "score_bias_scale"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name}: expected a number > 0, got {value!r}")

    def _check_groups(self) -> None:
        _check_int("n_group", self.n_group, 1)
        _check_int("topk_group", self.topk_group, 1)
        if self.num_experts % self.n_group:
            raise ConfigError(
                f"n_group: {self.num_experts} experts do not split into {self.n_group} equal groups"
            )
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group: {self.topk_group} is more than n_group={self.n_group}")
        kept = self.topk_group * (self.num_experts // self.n_group)
        if self.n_group > 1 and self.topk > kept:
            raise ConfigError(
                f"topk: {self.topk} experts cannot come from {self.topk_group} groups of"
                f" {self.num_experts // self.n_group} (raise topk_group or lower topk)"
            )
        if self.score_bias not in SCORE_BIASES:
            raise ConfigError(
                f"score_bias: expected one of {SCORE_BIASES}, got {self.score_bias!r}"
            )

    @property
    def groups_limited(self) -> bool:
        """Whether routing is group-limited (some groups are masked for each token)."""
        return self.n_group > 1 and self.topk_group < self.n_group


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ConfigError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")


# "medium" keeps these DeepSeek-V3 ratios (V3: hidden 7168): kv_lora_rank ~ hidden/14 (512 ->
# 73, rounded to 64), q_lora_rank ~ 0.21 * hidden (1536 -> 224), moe_inter ~ 0.29 * hidden
# (2048 -> 288, shared expert as wide), dense_inter ~ 2.5 * hidden (18432 = 2.57x -> 2560),
# qk_nope : qk_rope : v = 2 : 1 : 2 (128 : 64 : 128), top-8 routing. Shrunk: 64 experts instead
# of 256, 16 heads of 64 instead of 128 of 128, 6 layers (1 dense) instead of 61 (3 dense).
# All its routed experts take ~1.1 GB of float32 (a die of a D-die pod builds 1/D of them).
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        hidden=64,
        n_layers=3,
        n_dense_layers=1,
        n_heads=2,
        q_lora_rank=0,
        kv_lora_rank=32,
        qk_nope_dim=16,
        qk_rope_dim=16,
        v_head_dim=16,
        dense_inter=128,
        moe_inter=32,
        shared_inter=32,
        num_experts=16,
        topk=4,
        max_seq_len=256,
    ),
    "small": ModelConfig(),
    # DeepSeek-V3's routing ratios on the small model's body: 256 experts in 8 groups, a token's
    # top-8 from its best 4 groups (V3: n_group 8, topk_group 4, top-8 of 256), sigmoid scores
    # with a correction bias; narrow experts so that the 256 stay small.
    "v3": ModelConfig(
        num_experts=256,
        topk=8,
        moe_inter=32,
        n_group=8,
        topk_group=4,
        score_bias="random",
    ),
    "medium": ModelConfig(
        hidden=1024,
        n_layers=6,
        n_dense_layers=1,
        n_heads=16,
        q_lora_rank=224,
        kv_lora_rank=64,
        qk_nope_dim=64,
        qk_rope_dim=32,
        v_head_dim=64,
        dense_inter=2560,
        moe_inter=288,
        shared_inter=288,
        num_experts=64,
        topk=8,
        max_seq_len=1024,
    ),
}


# -- weights ---------------------------------------------------------------------------------------

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
)


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
class Weights:
    """Everything one die holds.

    Fields:
        embed: float32 `[vocab, hidden]`; lm_head: float32 `[hidden, vocab]` (not tied).
        layers: one `LayerWeights` per decoder block.
        final_norm: float32 `[hidden]`.
        experts: `{layer: {logical expert id: FFNWeights}}` for every MoE layer, holding only
            the experts this die was built with.
    """

    embed: np.ndarray
    layers: list[LayerWeights]
    final_norm: np.ndarray
    lm_head: np.ndarray
    experts: dict[int, dict[int, FFNWeights]] = field(default_factory=dict)


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
        [_layer(cfg, layer) for layer in range(cfg.n_layers)],
        np.ones(h, F32),
        _randn(cfg, _TAG["lm_head"], 0, 0, (h, vocab), 1.0 / np.sqrt(h)),
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
    elif isinstance(obj, LayerWeights | FFNWeights):
        for f in dataclasses.fields(obj):
            yield from _arrays(getattr(obj, f.name))


def build_weights(cfg: ModelConfig, experts: Sequence[int]) -> Weights:
    """Build a die's weights: every non-expert tensor, plus the routed experts `experts`.

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
    bad = [e for e in ids if not 0 <= e < cfg.num_experts]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"experts: expected distinct ids in [0, {cfg.num_experts}), got {sorted(ids)}"
        )
    h, vocab = cfg.hidden, cfg.vocab_size
    shared = _REPLICATED.get(cfg)
    if shared is not None:
        embed, layers, final_norm, lm_head = shared
        layers = [dataclasses.replace(lw) for lw in layers]  # own objects, shared arrays
    else:
        embed = _randn(cfg, _TAG["embed"], 0, 0, (vocab, h), 1.0)
        layers = [_layer(cfg, layer) for layer in range(cfg.n_layers)]
        final_norm = np.ones(h, F32)
        lm_head = _randn(cfg, _TAG["lm_head"], 0, 0, (h, vocab), 1.0 / np.sqrt(h))
    return Weights(
        embed=embed,
        layers=layers,
        final_norm=final_norm,
        lm_head=lm_head,
        experts={
            layer: {e: expert_ffn(cfg, layer, e) for e in sorted(ids)}
            for layer in range(cfg.n_layers)
            if cfg.is_moe(layer)
        },
    )


# -- kernels (float32 in, float32 out) -------------------------------------------------------------


_KERNELS = None


def kernels():
    """`runtime.model_kernels` (numba), imported on first use (a pod loads it before its dies
    fork) and kept in a global: an import statement costs ~1-2 us, and a die's decode step
    makes ~100 calls that need it."""
    global _KERNELS
    if _KERNELS is None:
        from runtime import model_kernels

        _KERNELS = model_kernels
    return _KERNELS


def mm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """`x @ w` of float32 rows by a weight matrix (or per head, 3-D): up to a few rows a compiled
    kernel (`runtime.model_kernels`: BLAS GEMM's fixed cost dominates a die's 2-3 decode rows),
    BLAS above. Every matrix product of the model with its weights goes through here."""
    return kernels().mm(x, w)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """`(x * 1/sqrt(mean(x^2) + eps)) * weight` over the last axis; x float32 `[..., d]`.

    Rows (`[n, d]`, every norm of the model) go through one compiled call
    (`runtime.model_kernels.rms_norm`: the mean of squares summed in float64 and rounded once);
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
    (`runtime.model_kernels.swiglu`: the same products as `mm`, silu with libm's expf, which
    is within an ulp of numpy's SIMD exp but not always its bits); numpy's 8 calls otherwise."""
    K = kernels()
    if 2 <= x.shape[0] <= K.SMALL_ROWS and x.dtype == F32 and _ffn_ok(w):
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

    Masked groups get -inf as in DeepSeek-V3's reference code, not 0.0 as transformers'
    `DeepseekV3TopkRouter`: the two differ when a kept expert's biased score is negative (a
    negative bias), where 0.0 would rank masked experts above it and pick an expert outside the
    kept groups; with -inf a token's experts always lie in <= topk_group groups.

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
        topk_idx = _topk_numpy(choice, n_group, topk_group, topk)
    w = np.take_along_axis(scores, topk_idx, axis=1)
    topk_weights = (w / np.sum(w, axis=1, keepdims=True)) * F32(routed_scaling)
    return topk_idx, topk_weights.astype(F32, copy=False)


def _topk_numpy(choice: np.ndarray, n_group: int, topk_group: int, topk: int) -> np.ndarray:
    """`route_topk`'s choice in numpy (the definition `runtime.model_kernels.topk_choice`
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


# -- batches and the KV store ----------------------------------------------------------------------

Segment = tuple[int, Sequence[int] | np.ndarray, int]  # (req_id, tokens, start_pos)


def batch_rows(segments: Sequence[Segment]) -> tuple[np.ndarray, np.ndarray, list[tuple]]:
    """Flatten a die's batch.

    Arguments:
        segments: `(req_id, tokens, start_pos)` each, at least one token per segment.

    Returns:
        tokens: int64 `[n]`, every segment's tokens concatenated in list order.
        positions: int64 `[n]`, `start_pos + i` for the i-th token of its segment.
        bounds: per segment `(req_id, lo, hi, start_pos)`: its rows are `lo:hi`.
    """
    toks, pos, bounds, lo = [], [], [], 0
    for i, (req, tokens, start) in enumerate(segments):
        t = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if t.size == 0 or int(start) < 0:
            raise ValueError(
                f"segments[{i}]: request {req} needs >= 1 token and start_pos >= 0, got "
                f"{t.size} tokens at {start}"
            )
        toks.append(t)
        pos.append(np.arange(int(start), int(start) + t.size, dtype=np.int64))
        bounds.append((int(req), lo, lo + t.size, int(start)))
        lo += t.size
    if not toks:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), []
    return np.concatenate(toks), np.concatenate(pos), bounds


def last_rows(segments: Sequence[Segment]) -> np.ndarray:
    """int64 `[n_segments]`: the row index (in `batch_rows` order) of each segment's last token."""
    _, _, bounds = batch_rows(segments)
    return np.array([hi - 1 for _, _, hi, _ in bounds], dtype=np.int64)


class KVStore(Protocol):
    """Where a die keeps its latent KV rows: per (request, layer), rows in position order."""

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        """Append float32 `[n, kv_lora_rank + qk_rope_dim]` rows after the request's rows."""

    def get(self, req: int, layer: int) -> np.ndarray:
        """Every row so far: contiguous float32 `[T, kv_lora_rank + qk_rope_dim]`."""


class DictKV:
    """A `KVStore` in process memory: one growing float32 array per (request, layer).

    Capacity doubles when full (amortized O(1) append). `get` returns a read-only view of the rows
    so far, valid until the next `append` to the same (request, layer).
    """

    def __init__(self, width: int, initial_rows: int = 16):
        self.width = int(width)
        self.initial_rows = max(1, int(initial_rows))
        self._bufs: dict[tuple[int, int], np.ndarray] = {}
        self._lens: dict[tuple[int, int], int] = {}

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        if rows.ndim != 2 or rows.shape[1] != self.width:
            raise ValueError(f"rows: expected shape [n, {self.width}], got {rows.shape}")
        key = (int(req), int(layer))
        n = self._lens.get(key, 0)
        buf = self._bufs.get(key)
        need = n + rows.shape[0]
        if buf is None or buf.shape[0] < need:
            cap = max(need, self.initial_rows, 0 if buf is None else 2 * buf.shape[0])
            grown = np.empty((cap, self.width), dtype=F32)
            if buf is not None:
                grown[:n] = buf[:n]
            self._bufs[key] = buf = grown
        buf[n:need] = rows
        self._lens[key] = need

    def get(self, req: int, layer: int) -> np.ndarray:
        key = (int(req), int(layer))
        if key not in self._bufs:
            return np.zeros((0, self.width), dtype=F32)
        view = self._bufs[key][: self._lens[key]]
        view.flags.writeable = False
        return view

    def num_rows(self, req: int, layer: int = 0) -> int:
        """Rows cached for `req` at `layer` (its next position)."""
        return self._lens.get((int(req), int(layer)), 0)

    def free(self, req: int) -> None:
        """Drop every layer of request `req`."""
        for key in [k for k in self._bufs if k[0] == int(req)]:
            del self._bufs[key], self._lens[key]


# -- one die ---------------------------------------------------------------------------------------

MoEFn = Callable[[int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class DieModel:
    """What one die computes, in phases a driver interleaves with the collectives.

    Every phase takes and returns float32 arrays; `n` is the die's row count (0 allowed: every
    phase then returns `[0, ...]` arrays). One forward step of a die:

        tokens, positions, bounds = batch_rows(segments)
        h = embed(tokens)
        for layer in range(n_layers):
            h = attention(layer, h, segments)
            if not is_moe(layer): h = dense_ffn(layer, h)
            else:
                xn, idx, w = gate(layer, h)          # then dispatch xn by idx to the expert dies
                y = experts(layer, rows, counts, ids)  # on each expert die, its received rows
                routed = ...                         # combine y with w back to the source
                h = finish_moe(layer, h, xn, routed)
        logits(h[last_rows(segments)])
    """

    def __init__(self, cfg: ModelConfig, weights: Weights, kv: KVStore):
        self.cfg = cfg
        self.weights = weights
        self.kv = kv
        self.cos, self.sin = rope_tables(cfg)
        self._bias = {layer: expert_bias(cfg, layer) for layer in range(cfg.n_layers)}
        self._attn_ok: dict[int, bool] = {}

    def embed(self, tokens: np.ndarray) -> np.ndarray:
        """int `[n]` token ids in `[0, vocab)` -> float32 `[n, hidden]` (a copy of the rows)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size):
            raise ValueError(f"tokens: ids must be in [0, {self.cfg.vocab_size}), got {tokens}")
        return self.weights.embed[tokens]

    def attention(
        self, layer: int, h: np.ndarray, segments: Sequence[Segment], rows: tuple | None = None
    ) -> np.ndarray:
        """Pre-norm MLA block with residual: h float32 `[n, hidden]` -> `[n, hidden]`.

        Appends each segment's latent rows (`kv_rows[lo:hi]`) to `kv` under its request, in
        segment order, then attends each segment against all its request's rows (absorbed form).
        Projections are batched over all `n` rows; scores/softmax loop over segments. `rows`:
        `batch_rows(segments)` if the caller has it (a step computes it once for every layer).

        A die's 2-3 decode rows take the projections in two compiled calls
        (`runtime.model_kernels.mla_in` / `attn_out`: the same kernels in the same order as the
        numpy path, so the same bits; ~35 us less per layer than its ~20 numpy calls).
        """
        cfg, lw = self.cfg, self.weights.layers[layer]
        _, positions, bounds = batch_rows(segments) if rows is None else rows
        n = h.shape[0]
        if positions.shape[0] != n:
            raise ValueError(f"h: {n} rows, but the segments hold {positions.shape[0]}")
        if positions.size and positions.max() >= cfg.max_seq_len:
            raise ValueError(f"segments: position {positions.max()} >= max_seq_len")
        cos, sin = self.cos[positions], self.sin[positions]
        K = kernels()
        small = 2 <= n <= K.SMALL_ROWS and h.dtype == F32 and self._compiled_attention(layer)
        if small:
            h = np.ascontiguousarray(h)
            w_q = lw.wq_b if lw.wq is None else lw.wq
            q_cat, kv_rows = K.mla_in(h, lw.attn_norm, cfg.norm_eps, lw.wq_a, lw.q_norm, w_q,
                                      lw.wkv_a, lw.kv_norm, lw.w_uk, cos, sin)  # fmt: skip
        else:
            x = rms_norm(h, lw.attn_norm, cfg.norm_eps)
            q_nope, q_pe, kv_rows = mla_project(cfg, lw, x, cos, sin)
        caches = []
        for req, lo, hi, start in bounds:
            self.kv.append(req, layer, kv_rows[lo:hi])
            cache = self.kv.get(req, layer)
            if cache.shape[0] != start + hi - lo:
                raise ValueError(
                    f"kv: request {req} layer {layer} holds {cache.shape[0]} rows after this "
                    f"step, expected start_pos + tokens = {start + hi - lo}"
                )
            caches.append(cache)
        seg_bounds = [(lo, hi, start) for _, lo, hi, start in bounds]
        if small:
            return K.attn_out(attend(cfg, q_cat, caches, seg_bounds), lw.w_uv, lw.wo, h)
        return h + absorbed_attention(cfg, lw, q_nope, q_pe, caches, seg_bounds)

    def _compiled_attention(self, layer: int) -> bool:
        """Whether layer's attention weights suit the compiled small-row path (C-contiguous
        float32, as `build_weights` makes them); checked once per layer."""
        ok = self._attn_ok.get(layer)
        if ok is None:
            lw = self.weights.layers[layer]
            ws = [
                lw.attn_norm,
                lw.wq_b if lw.wq is None else lw.wq,
                lw.wkv_a,
                lw.kv_norm,
                lw.w_uk,
                lw.w_uv,
                lw.wo,
            ] + ([] if lw.wq_a is None else [lw.wq_a, lw.q_norm])
            ok = self._attn_ok[layer] = all(
                w.dtype == F32 and w.flags.c_contiguous for w in ws
            )  # fmt: skip
        return ok

    def is_moe(self, layer: int) -> bool:
        return self.cfg.is_moe(layer)

    def dense_ffn(self, layer: int, h: np.ndarray) -> np.ndarray:
        """Dense layer: `h + swiglu(rms_norm(h))`, float32 `[n, hidden]`."""
        lw = self.weights.layers[layer]
        return h + swiglu(rms_norm(h, lw.ffn_norm, self.cfg.norm_eps), lw.dense)

    def gate(self, layer: int, h: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """MoE routing of the die's rows.

        Returns:
            xn: float32 `[n, hidden]`, `rms_norm(h)`: what is dispatched and fed to the shared
                expert.
            topk_idx: int64 `[n, topk]`, logical expert ids (see `route_topk` for the order).
            topk_weights: float32 `[n, topk]`, each row sums to `routed_scaling`.
        """
        lw, cfg = self.weights.layers[layer], self.cfg
        xn = rms_norm(h, lw.ffn_norm, cfg.norm_eps)
        idx, w = route_topk(mm(xn, lw.gate), cfg.topk, cfg.gating, cfg.routed_scaling,
                            self.bias(layer), cfg.n_group, cfg.topk_group)  # fmt: skip
        return xn, idx, w

    def bias(self, layer: int) -> np.ndarray | None:
        """The router's correction bias of `layer` (`expert_bias`), built once."""
        return self._bias[layer]

    def experts(
        self,
        layer: int,
        x_rows: np.ndarray,
        expert_counts: np.ndarray,
        local_expert_ids: Sequence[int],
    ) -> np.ndarray:
        """Routed experts on rows grouped by local expert (unweighted).

        Arguments:
            layer: an MoE layer.
            x_rows: float32 `[m, hidden]`, the dispatched rows; local expert `j`'s group is rows
                `sum(counts[:j]) : sum(counts[:j+1])` (`DispatchOut` order).
            expert_counts: int `[n_local]`, rows per local expert (0 allowed).
            local_expert_ids: logical id of each local expert, in local order.

        Returns:
            y: float32 `[m, hidden]`, row i = SwiGLU of its expert on `x_rows[i]`, computed by one
                matmul chain per expert over its whole group.
        """
        counts = np.asarray(expert_counts, dtype=np.int64).reshape(-1)
        ids = [int(e) for e in local_expert_ids]
        if counts.size != len(ids) or counts.sum() != x_rows.shape[0] or (counts < 0).any():
            raise ValueError(
                f"expert_counts: expected {len(ids)} counts >= 0 summing to {x_rows.shape[0]} "
                f"rows, got {counts.tolist()}"
            )
        table = self.weights.experts[layer]
        missing = [e for e in ids if e not in table]
        if missing:
            raise ValueError(f"local_expert_ids: experts {missing} are not built on this die")
        y = np.empty((x_rows.shape[0], self.cfg.hidden), dtype=F32)
        offsets = np.concatenate(([0], np.cumsum(counts)))
        for j, e in enumerate(ids):
            lo, hi = int(offsets[j]), int(offsets[j + 1])
            if hi > lo:
                y[lo:hi] = swiglu(x_rows[lo:hi], table[e])
        return y

    def finish_moe(
        self, layer: int, h: np.ndarray, xn: np.ndarray, routed_out: np.ndarray
    ) -> np.ndarray:
        """End of an MoE layer: `(h + swiglu_shared(xn)) + routed_out`, two float32 adds in that
        order (the order is part of the bit-exactness contract).

        Arguments: h, xn (from `gate`), routed_out (the combine's output): float32 `[n, hidden]`.
        """
        lw = self.weights.layers[layer]
        return (h + swiglu(xn, lw.shared)) + routed_out

    def logits(self, h_last_rows: np.ndarray) -> np.ndarray:
        """float32 `[m, hidden]` -> float32 `[m, vocab]`: final RMSNorm then LM head."""
        x = rms_norm(h_last_rows, self.weights.final_norm, self.cfg.norm_eps)
        return mm(x, self.weights.lm_head)

    def forward(self, segments: Sequence[Segment], moe_fn: MoEFn) -> np.ndarray:
        """The whole layer loop on this die alone.

        Arguments:
            segments: the die's batch.
            moe_fn: `moe_fn(layer, xn, topk_idx, topk_weights) -> routed_out` float32
                `[n, hidden]`, the routed part of the MoE (dispatch, experts, combine).

        Returns:
            h: float32 `[n, hidden]`, the final hidden rows (before the final norm).
        """
        rows = batch_rows(segments)
        h = self.embed(rows[0])
        for layer in range(self.cfg.n_layers):
            h = self.attention(layer, h, segments, rows)
            if not self.is_moe(layer):
                h = self.dense_ffn(layer, h)
                continue
            xn, idx, w = self.gate(layer, h)
            h = self.finish_moe(layer, h, xn, moe_fn(layer, xn, idx, w))
        return h


# -- sampling --------------------------------------------------------------------------------------


def sample(
    logits: np.ndarray,
    temperature: float,
    rngs: Sequence[np.random.Generator] | None = None,
) -> np.ndarray:
    """Next token per row.

    Arguments:
        logits: float32 `[m, vocab]`.
        temperature: 0 -> greedy (argmax; the first maximum on ties); > 0 -> categorical over
            `softmax(logits / temperature)` (computed in float64).
        rngs: one generator per row when temperature > 0, made by the caller as
            `np.random.default_rng([seed, req_id, step])` so a request's draws do not depend on
            which die or batch it is in.

    Returns:
        tokens: int64 `[m]`.
    """
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    if temperature == 0:
        return np.argmax(logits, axis=-1).astype(np.int64)
    if rngs is None or len(rngs) != logits.shape[0]:
        raise ValueError(f"rngs: expected one generator per row ({logits.shape[0]})")
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    cdf = np.cumsum(p, axis=-1)
    out = np.empty(logits.shape[0], dtype=np.int64)
    for i, rng in enumerate(rngs):
        u = rng.random() * cdf[i, -1]
        out[i] = min(int(np.searchsorted(cdf[i], u, side="right")), logits.shape[1] - 1)
    return out
