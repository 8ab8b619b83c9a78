"""The one sizing of a pod that runs the toy model: `xpod decode` and the serving engine ask for
the same areas (all-to-all buffers for their largest step, an app area for the KV pool and, with
EPLB, the expert bank; a pod laid out for the physical expert slots)."""

from __future__ import annotations

from typing import Any

from runtime.model.config import ModelConfig
from runtime.model.expert_balancer import EPLBConfig, bank_bytes
from runtime.pod.config import PodConfig


def kv_pool_bytes(model: ModelConfig, num_blocks: int, block_size: int) -> int:
    """Bytes of a die's paged latent KV pool (`runtime.model.forward.build_model`): every
    main layer's and every MTP module's (`kv_layers`)."""
    return model.kv_layers * max(num_blocks, 1) * block_size * model.kv_cache_dim * 4


def pod_config_for(
    model: ModelConfig,
    num_dies: int,
    *,
    max_rows: int,
    num_blocks: int,
    block_size: int,
    quant: str | None,
    combine_dtype: str,
    eplb: EPLBConfig | None = None,
    headroom_bytes: int = 1 << 20,
    trace: bool = False,
    expert_dies: int | None = None,
    **pod: Any,
) -> PodConfig:
    """A PodConfig for `num_dies` dies running `model`.

    Arguments:
        max_rows: the most token rows a die sends into one step's all-to-all.
        num_blocks, block_size: a die's KV pool (`kv_pool_bytes`).
        quant: "int8" or None (float32 dispatch); combine_dtype: "bfloat16" or "float32".
        eplb: expert load balancing, or None: adds the expert bank to the app area and lays the
            pod out for the physical slots.
        headroom_bytes: app-area bytes beyond the KV pool and the bank (the caller's buffers).
        trace: record the protocol trace (a larger trace ring).
        expert_dies: the dies hosting the experts (a split pod's; default every die): the
            expert areas (and EPLB's physical slots and bank) are sized over them.
        pod: any other PodConfig field (timeout_s, pin, wait, serve_slot_bytes, ...).
    """
    hosts = expert_dies or num_dies
    app = kv_pool_bytes(model, num_blocks, block_size) + headroom_bytes
    if eplb is not None:
        app += bank_bytes(model, hosts, eplb)
    physical = model.num_experts if eplb is None else eplb.physical(model, hosts)
    if expert_dies:
        pod.setdefault("a2a_max_local_experts", physical // hosts)
    return PodConfig(
        num_dies=num_dies,
        a2a_max_batch=max(1, max_rows),
        a2a_hidden=model.hidden,
        a2a_topk=model.topk,
        num_experts=physical,
        eplb_layers=0 if eplb is None else model.n_layers - model.n_dense_layers,
        eplb_window=0 if eplb is None else eplb.window,
        a2a_dispatch_dtype="int8" if quant == "int8" else "float32",
        a2a_combine_dtype=combine_dtype,
        app_bytes=app,
        trace=bool(trace),
        trace_capacity=1 << 20 if trace else 1 << 16,
        **pod,
    )
