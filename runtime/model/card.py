"""Model cards: the sizes a projection charges for each op of a forward step
(docs/projection.md §6), the toy model's own or a real model's (DeepSeek-V3 / R1).

A capture pod of `xpod decode` records every compute op of a step (`record`) with its
*structural* sizes in `dims` (rows, each row's context, rows per local expert) and its FLOPs
and HBM bytes under the toy model's card (`card_of(cfg)`). A projection on a real model's card
(`apply_card`) recomputes every op from its dims with the card's widths and dtypes, and the
all-to-all's messages with the card's row bytes: the toy run supplies the structure (its
routing, its schedule, its collectives), the card the sizes. The capture's model must have
the card's structure (layers, dense layers, experts, top-k, groups: `structure`), so that a
layer of the run is a layer of the card.

Op names and their sizes (n = the op's rows on this die; H hidden, nh heads, ql / kl the
query / KV latent ranks, dn / dr / dv the per-head no-RoPE / RoPE / value dims; w, a, kv the
bytes of a weight, an activation, a cached KV value):

| op | unit (dtype) | FLOPs | bytes read / written |
| --- | --- | --- | --- |
| `embed` | aiv | 0 | n H a / n H a |
| `mla_prolog` | aic (w) | 2 n (Wq + Wkv + nh dn kl) | weights + n H a / q + KV rows (1) |
| `mla` | aic (bf16) | sum over rows 2 nh c (2 kl + dr) | KV rows (2) / n nh kl a |
| `o_proj` | aic (w) | 2 n nh (kl dv + dv H) | weights + n nh kl a / n H a |
| `gate` | aic (w) | 2 n H E | H E w + n H a / n E 4 |
| `shared_expert` | aic (w) | 2 n 3 H Is | 3 H Is w + n H a / n H a |
| `experts` | aic (w) | sum 2 r_e 3 H Im | each expert with rows: 3 H Im w, + rows H a / rows H a |
| `dense_ffn` | aic (w) | 2 n 3 H Id | 3 H Id w + n H a / n H a |
| `norms` | aiv | 0 | k n H a / k n H a (the layer's norms and residual adds) |
| `mtp_in` | aic (w) | 2 n 2 H H | 2 H H w + 2 n H a / n H a |
| `lm_head` | aic (w) | 2 n H V | H V w + n H a / n V 4 |
| `sample` | aiv | 0 | n V 4 / n 8 |

Wq = H ql + ql nh (dn + dr) (or H nh (dn + dr) without a query latent), Wkv = H (kl + dr).
(1) n nh (kl + dr) a of absorbed queries and n (kl + dr) kv of latent KV rows written. (2) the
sum over requests of c (kl + dr) kv (each request's cache read once), plus n nh (kl + dr) a.
`c` is the row's context (positions it attends to). The all-to-all's ops (`quantize`,
`assemble`, `weighted_sum`, `reduce_groups`) and messages keep their rows; their widths become
the card's (a dispatch row of H bytes plus its scale slot, a combine row of 2 H bytes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.model.config import ModelConfig

WEIGHT_OPS = ("mla_prolog", "o_proj", "gate", "shared_expert", "experts", "dense_ffn",
              "mtp_in", "lm_head")  # fmt: skip
MODEL_OPS = (*WEIGHT_OPS, "embed", "mla", "norms", "sample")
COMM_OPS = ("quantize", "assemble", "weighted_sum", "reduce_groups")
DISPATCH_AREAS = ("fused_disp", "pull_disp", "a2e_in")
COMBINE_AREAS = ("fused_comb", "pull_comb")


@dataclass(frozen=True)
class ModelCard:
    """The widths and dtypes of a model (see the module docstring for how ops use them)."""

    name: str
    hidden: int
    n_layers: int
    n_dense_layers: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_head_dim: int
    dense_inter: int
    moe_inter: int
    shared_inter: int
    num_experts: int
    topk: int
    vocab_size: int
    n_group: int = 1
    topk_group: int = 1
    weight_bytes: float = 1.0  # INT8 weights
    weight_dtype: str = "int8"
    act_bytes: int = 2  # BF16 activations
    kv_bytes: int = 2  # BF16 latent KV cache
    scale_slot: int = 512  # a dispatch row's scale slot (000 §4.2.1: 7,168 + 512 = 7.5 KB)
    source: str = ""

    @property
    def dispatch_row_bytes(self) -> int:
        return self.hidden + self.scale_slot

    @property
    def combine_row_bytes(self) -> int:
        return 2 * self.hidden


# 003 Table II (l.150-160), 000 §3.5.1 (l.287), 001 §4.4 / §7.1 (l.232, l.428); V3's config
CARDS: dict[str, ModelCard] = {
    "deepseek-v3": ModelCard(
        name="deepseek-v3", hidden=7168, n_layers=61, n_dense_layers=3, n_heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_dim=128, qk_rope_dim=64, v_head_dim=128,
        dense_inter=18432, moe_inter=2048, shared_inter=2048, num_experts=256, topk=8,
        vocab_size=129280, n_group=8, topk_group=4,
        source="003 Table II (l.150-160): hidden 7168, 128 heads of 128, Q latent 1536, KV"
        " latent 512, RoPE 64, MoE intermediate 2048, 256 experts top-8; 000 §3.5.1 (l.287): one"
        " shared expert; 001 §7.1 (l.428) / §4.4 (l.232): 61 layers, the first 3 dense;"
        " DeepSeek-V3 config: dense intermediate 18432, vocabulary 129280, 8 groups / 4; INT8"
        " weights and BF16 activations and KV as 000 deploys them (§4.3, §5.3)",
    ),
}  # fmt: skip


def card_of(cfg: ModelConfig) -> ModelCard:
    """The toy model's own card: its widths, float32 everywhere."""
    return ModelCard(
        name="toy", hidden=cfg.hidden, n_layers=cfg.n_layers, n_dense_layers=cfg.n_dense_layers,
        n_heads=cfg.n_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_dim=cfg.qk_nope_dim, qk_rope_dim=cfg.qk_rope_dim, v_head_dim=cfg.v_head_dim,
        dense_inter=cfg.dense_inter, moe_inter=cfg.moe_inter, shared_inter=cfg.shared_inter,
        num_experts=cfg.num_experts, topk=cfg.topk, vocab_size=cfg.vocab_size,
        n_group=cfg.n_group, topk_group=cfg.topk_group, weight_bytes=4.0,
        weight_dtype="bf16", act_bytes=4, kv_bytes=4, scale_slot=0,
    )  # fmt: skip


def structure(card: ModelCard) -> dict:
    """ModelConfig overrides that give a toy model `card`'s structure (its layers, dense
    layers, experts, top-k and groups; the widths stay the toy's): a capture of that model
    has one layer per card layer and the card's routing fan-out."""
    return {"n_layers": card.n_layers, "n_dense_layers": card.n_dense_layers,
            "num_experts": card.num_experts, "topk": card.topk, "n_group": card.n_group,
            "topk_group": card.topk_group}  # fmt: skip


def _wq(c: ModelCard) -> int:
    qk = c.n_heads * (c.qk_nope_dim + c.qk_rope_dim)
    return c.hidden * c.q_lora_rank + c.q_lora_rank * qk if c.q_lora_rank else c.hidden * qk


def op_size(c: ModelCard, name: str, dims: dict) -> tuple[float, float, float, str, str]:
    """(FLOPs, bytes read, bytes written, unit, dtype) of op `name` with `dims` under card `c`
    (module docstring). ValueError for an op this module does not size."""
    n = int(dims.get("rows", 0))
    h, w, a = c.hidden, c.weight_bytes, c.act_bytes
    nh, kl, dr, dn, dv = c.n_heads, c.kv_lora_rank, c.qk_rope_dim, c.qk_nope_dim, c.v_head_dim
    wd = c.weight_dtype
    if name == "embed":
        return 0.0, n * h * a, n * h * a, "aiv", "bf16"
    if name == "norms":
        k = int(dims.get("count", 2))
        return 0.0, k * n * h * a, k * n * h * a, "aiv", "bf16"
    if name == "mla_prolog":
        weights = _wq(c) + h * (kl + dr) + nh * dn * kl
        return (2.0 * n * weights, weights * w + n * h * a,
                n * nh * (kl + dr) * a + n * (kl + dr) * c.kv_bytes, "aic", wd)  # fmt: skip
    if name == "mla":
        ctx = [int(x) for x in dims.get("ctx", ())]
        req = [int(x) for x in dims.get("req_ctx", ctx)]
        flops = sum(2.0 * nh * x * ((kl + dr) + kl) for x in ctx)
        rd = sum(x * (kl + dr) * c.kv_bytes for x in req) + n * nh * (kl + dr) * a
        return flops, rd, n * nh * kl * a, "aic", "bf16"
    if name == "o_proj":
        weights = nh * kl * dv + nh * dv * h
        return 2.0 * n * weights, weights * w + n * nh * kl * a, n * h * a, "aic", wd
    if name == "gate":
        e = c.num_experts
        return 2.0 * n * h * e, h * e * w + n * h * a, n * e * 4, "aic", wd
    if name in ("shared_expert", "dense_ffn"):
        inter = c.shared_inter if name == "shared_expert" else c.dense_inter
        weights = 3 * h * inter
        return 2.0 * n * weights, weights * w + n * h * a, n * h * a, "aic", wd
    if name == "experts":
        counts = [int(x) for x in dims.get("counts", ())]
        we = 3 * h * c.moe_inter
        rows = sum(counts)
        return (2.0 * rows * we, sum(we * w for x in counts if x) + rows * h * a,
                rows * h * a, "aic", wd)  # fmt: skip
    if name == "mtp_in":
        return 2.0 * n * 2 * h * h, 2 * h * h * w + 2 * n * h * a, n * h * a, "aic", wd
    if name == "lm_head":
        v = c.vocab_size
        return 2.0 * n * h * v, h * v * w + n * h * a, n * v * 4, "aic", wd
    if name == "sample":
        return 0.0, n * c.vocab_size * 4, n * 8, "aiv", "bf16"
    raise ValueError(f"op {name!r}: not a model op ({', '.join(MODEL_OPS)})")


def record(cap, cfg: ModelConfig, name: str, t0: int | None = None, **dims) -> None:
    """Record model op `name` in capture `cap` (a die's `comm.capture.Capture`): its dims (and
    the capture's current `tags`, e.g. a micro-batch's `mb`) and its FLOPs and bytes under the
    toy model's card."""
    flops, rd, wr, unit, dtype = op_size(card_of(cfg), name, dims)
    cap.op(name, flops, rd, wr, t0, unit=unit, dtype=dtype, **getattr(cap, "tags", {}), **dims)


def comm_op_size(c: ModelCard, name: str, dims: dict, rd: float, wr: float,
                 flops: float) -> tuple[float, float, float]:  # fmt: skip
    """An all-to-all op's (FLOPs, read, written) with the card's widths: scaled by the card's
    hidden over the recorded one (`dims.hidden`, else the op keeps its sizes)."""
    old = dims.get("hidden")
    if not old:
        return flops, rd, wr
    f = c.hidden / float(old)
    return flops * f, rd * f, wr * f


def apply_card(events: list[list], card: ModelCard, context: int | None = None) -> list[list]:
    """A die's capture events with every model op and all-to-all message sized by `card`
    (module docstring); `context`: every row attends to `context` positions (a row j of a
    multi-row segment to `context + j`) instead of the run's. Other events are unchanged."""
    out = []
    for ev in events:
        kind = ev[0]
        if kind == "op" and ev[4] in MODEL_OPS:
            dims = dict(ev[8])
            if context is not None and ev[4] == "mla":
                dims = _with_context(dims, context)
            flops, rd, wr, unit, dtype = op_size(card, ev[4], dims)
            dims.update(unit=unit, dtype=dtype)
            ev = [*ev[:5], flops, round(rd), round(wr), dims]  # bytes: whole (a capture's ints)
        elif kind == "op" and ev[4] in COMM_OPS:
            flops, rd, wr = comm_op_size(card, ev[4], ev[8], ev[6], ev[7], ev[5])
            ev = [*ev[:5], flops, round(rd), round(wr), ev[8]]
        elif kind in ("put", "get"):
            ev = _message(ev, card)
        out.append(ev)
    return out


def _with_context(dims: dict, context: int) -> dict:
    offs = [int(x) for x in dims.get("offsets", [0] * int(dims.get("rows", 0)))]
    d = dict(dims)
    d["ctx"] = [context + o for o in offs]
    d["req_ctx"] = [context + int(x) for x in dims.get("req_span", [0] * len(dims.get(
        "req_ctx", ())))]  # fmt: skip
    return d


def _message(ev: list, card: ModelCard) -> list:
    """A put / get of the all-to-all's areas with the card's row bytes (rows kept)."""
    area = ev[6]
    rows_at = 7
    rows = ev[rows_at]
    if not rows:
        return ev
    if area in DISPATCH_AREAS:
        rb = card.dispatch_row_bytes
    elif area in COMBINE_AREAS:
        rb = card.combine_row_bytes
    else:
        return ev
    ev = list(ev)
    ev[5] = rows * rb
    ev[-1] = rb  # row_bytes, the last field of a put and of a get
    return ev


def with_structure(cfg: ModelConfig, card: ModelCard) -> ModelConfig:
    """`cfg` with `card`'s structure (`structure`)."""
    return dataclasses.replace(cfg, **structure(card))


__all__ = ["CARDS", "COMM_OPS", "MODEL_OPS", "ModelCard", "apply_card", "card_of", "op_size",
           "record", "structure", "with_structure"]  # fmt: skip
