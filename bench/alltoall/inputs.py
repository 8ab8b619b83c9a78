"""The inputs of a run, the same in the dies, the launcher and the peers: `Point` (one pod and
its all-to-all shape), each die's routing and tokens, and what they make every die send."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from comm.quant import combine_dtype
from comm.routing import Placement, get_dedup_layout, get_dispatch_layout

SCALE_BYTES = 4  # an int8 token's float32 scale travels with it


@dataclass(frozen=True, slots=True)
class Point:
    """One pod of the run: its size, the all-to-all shape and the routing seed.

    attention_dies is 0 for an expert-parallel pod (every die sends and hosts experts); for an
    A2E pod dies 0..attention_dies-1 send and dies attention_dies..dies-1 host the experts.
    """

    dies: int
    batch: int
    hidden: int
    topk: int
    num_experts: int
    seed: int
    attention_dies: int = 0
    combine_dtype: str = "bfloat16"
    routing: str = "uniform"

    @property
    def senders(self) -> int:
        return self.attention_dies or self.dies

    @property
    def expert_dies(self) -> tuple[int, ...]:
        return tuple(range(self.attention_dies, self.dies))

    @property
    def label(self) -> str:
        skew = " skew" if self.routing == "skew" else ""
        if self.attention_dies:
            return (f"A2E {self.attention_dies}+{self.dies - self.attention_dies}"
                    f" b{self.batch}{skew}")  # fmt: skip
        return f"EP{self.dies} b{self.batch}{skew}"


def routing(pt: Point, die_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(topk_idx int64 [batch, topk] of distinct experts, topk_weights float32 [batch, topk])."""
    rng = np.random.default_rng([pt.seed, die_id])
    scores = rng.random((pt.batch, pt.num_experts))
    if pt.routing == "skew":  # weighted sampling without replacement (Efraimidis-Spirakis)
        rank = np.random.default_rng([pt.seed, 1 << 20]).permutation(pt.num_experts)
        popularity = 1.0 / (rank + 1.0)
        scores = -np.log(np.maximum(scores, 1e-300)) / popularity  # smallest first = sampled
    idx = np.argsort(scores, axis=1)[:, : pt.topk].astype(np.int64)
    return idx, rng.random((pt.batch, pt.topk), dtype=np.float32)


def split_protocol(protocol: str) -> tuple[str, bool]:
    """("fused", True) of "fused-dedup": the comm protocol and the dedup option of a row."""
    base, _, dedup = protocol.partition("-")
    return base, dedup == "dedup"


def tokens(pt: Point, die_id: int) -> np.ndarray:
    rng = np.random.default_rng([pt.seed, die_id, 1])
    return rng.standard_normal((pt.batch, pt.hidden), dtype=np.float32)


def counts_matrix(pt: Point, dedup: bool = False) -> np.ndarray:
    """int64 [dies, dies]: messages each sending die dispatches to each die (rows of the
    attention dies only, for A2E: the expert dies they end up on); with `dedup`, one message
    per (token, destination die)."""
    placement = Placement.default(pt.num_experts, pt.expert_dies)
    counts = np.zeros((pt.dies, pt.dies), np.int64)
    for src in range(pt.senders):
        idx, w = routing(pt, src)
        if dedup:
            per_die = np.diff(get_dedup_layout(idx, w, placement).dest_offsets)
        else:
            per_die = get_dispatch_layout(idx, placement).num_tokens_per_die
        counts[src, list(placement.dies)] = per_die
    return counts


def hottest_over_mean(pt: Point) -> float:
    """Routed (token, expert) pairs of the hottest expert over the mean, all dies' tokens."""
    load = np.zeros(pt.num_experts, np.int64)
    for src in range(pt.senders):
        idx = routing(pt, src)[0]
        load += np.bincount(idx[idx >= 0], minlength=pt.num_experts)
    return float(load.max() / load.mean()) if load.sum() else 0.0


def msg_bytes(pt: Point, quant: str) -> tuple[int, int]:
    """(dispatch, combine) bytes of one message (combine rows: bfloat16 or float32)."""
    dispatch = pt.hidden + SCALE_BYTES if quant == "int8" else 4 * pt.hidden
    return dispatch, combine_dtype(pt.combine_dtype).itemsize * pt.hidden


def default_experts(expert_dies: int) -> int:
    return 256 if 256 % expert_dies == 0 else 8 * expert_dies
