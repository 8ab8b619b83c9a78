"""`ModelConfig`: the shape and seed of the DeepSeek-shaped toy model, and its presets.

Glossary (003 Table II -> code): d_emb -> `hidden`, n_hd -> `n_heads`, d_Qco -> `q_lora_rank`,
d_KVco -> `kv_lora_rank`, d_RoPE -> `qk_rope_dim`, d_hd -> `qk_nope_dim` / `v_head_dim`,
d_MoE -> `moe_inter`, n_e -> `num_experts`, n_k -> `topk`, W_CQ -> `wq_a`, W_DQ|W_RQ -> `wq_b`,
W_CKV|W_RK -> `wkv_a`, W_DK -> `w_uk`, W_DV -> `w_uv`, W_attn_out -> `wo`, W_route -> `gate`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from memory.errors import ConfigError
from runtime.model.tokenizer import MIN_VOCAB

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
        mtp_layers: multi-token prediction modules after the main layers (DeepSeek-V3's
            `num_nextn_predict_layers`; 0 = none, at most 1): each an `eh_proj` over the
            normed embedding of the next token and the normed hidden row, one decoder block
            (MLA with its own latent KV layer, an MoE through the same all-to-all) and its own
            final norm before the shared LM head (`runtime.model.mtp`).
        mtp_fit: the MTP module's `eh_proj` fitted by least squares on the model's own greedy
            text (`runtime.model.mtp_fit`, the `fit` draft mode) instead of its seeded random
            init; needs `mtp_layers`.
        batch_invariant: every row computed independently of its batch mates, prefill and
            decode alike (`runtime.model.ops.set_batch_invariant`): the compiled products
            (ascending inner dimension, float64 sums) for any row count and a per-row
            attention kernel; greedy output does not change under load and a recomputed
            stream equals the fault-free one bit for bit. Costs speed (docs/benchmarks.md).

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
    mtp_layers: int = 0
    mtp_fit: bool = False
    batch_invariant: bool = False

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

    @property
    def kv_layers(self) -> int:
        """Latent KV layers of a request: the main layers, then one per MTP module."""
        return self.n_layers + self.mtp_layers

    def mtp_layer(self, j: int) -> int:
        """The model layer index of the MTP sub-forward j (0-based): the MTP module after the
        main layers; a second draft reuses the one module (001 §4.6: the released layer)."""
        if not self.mtp_layers:
            raise ConfigError("mtp_layers: the model has no MTP module (mtp_layers = 0)")
        return self.n_layers + j % self.mtp_layers

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
        _check_int("mtp_layers", self.mtp_layers, 0)
        if self.mtp_layers > 1:
            raise ConfigError(
                f"mtp_layers: at most 1 MTP module (a second draft reuses it), got"
                f" {self.mtp_layers}"
            )
        if not isinstance(self.mtp_fit, bool) or (self.mtp_fit and not self.mtp_layers):
            raise ConfigError(f"mtp_fit: a bool, true only with mtp_layers, got {self.mtp_fit!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant: expected a bool, got {self.batch_invariant!r}")
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
