"""The DeepSeek-shaped toy MoE model (docs/architecture.md §5): its config and presets, the
byte tokenizer, the seeded weights, the numerics and their compiled kernels, what one die
computes (`DieModel`), the KV stores, the sampler, the forward step over a pod, the
single-process reference (`ReferencePod`), expert load balancing (`ExpertBalancer`) and the
sizing of a pod that runs it. Imports the pod (`runtime.pod`), `comm`, `memory` and `sched`.
"""

from runtime.model.config import PRESETS, SCORE_BIASES, ModelConfig
from runtime.model.die_model import DieModel, Segment, batch_rows, last_rows
from runtime.model.expert_balancer import EPLBConfig, ExpertBalancer, initial_map
from runtime.model.forward import Clock, build_model, forward, prepared_for_fork
from runtime.model.kv import DictKV, KVStore, PagedKV
from runtime.model.mtp import SpecConfig, spec_config
from runtime.model.mtp_fit import ensure_fit
from runtime.model.ops import (
    absorbed_attention,
    apply_rope,
    mla_project,
    rms_norm,
    rope_tables,
    route_topk,
    silu,
    softmax,
    swiglu,
)
from runtime.model.reference import GenerateResult, ReferencePod
from runtime.model.sampler import sample, sample_rows
from runtime.model.sizing import pod_config_for
from runtime.model.tokenizer import BOS, EOS, NUM_BYTE_TOKENS, PAD, decode, encode
from runtime.model.weights import (
    FFNWeights,
    LayerWeights,
    Weights,
    build_weights,
    expert_bias,
    expert_ffn,
    replicated_weights,
)

__all__ = [
    "BOS",
    "EOS",
    "NUM_BYTE_TOKENS",
    "PAD",
    "PRESETS",
    "SCORE_BIASES",
    "Clock",
    "DictKV",
    "DieModel",
    "EPLBConfig",
    "ExpertBalancer",
    "FFNWeights",
    "GenerateResult",
    "KVStore",
    "LayerWeights",
    "ModelConfig",
    "PagedKV",
    "ReferencePod",
    "Segment",
    "SpecConfig",
    "Weights",
    "absorbed_attention",
    "apply_rope",
    "batch_rows",
    "build_model",
    "build_weights",
    "decode",
    "encode",
    "ensure_fit",
    "expert_bias",
    "expert_ffn",
    "forward",
    "initial_map",
    "last_rows",
    "mla_project",
    "pod_config_for",
    "prepared_for_fork",
    "replicated_weights",
    "rms_norm",
    "rope_tables",
    "route_topk",
    "sample",
    "sample_rows",
    "silu",
    "softmax",
    "spec_config",
    "swiglu",
]
