"""Routing tables for tests: every token's routed experts distinct (a gate's top-k never repeats
an expert; `comm.routing.check_topk_idx` refuses a repeat), some entries unrouted (-1)."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


def random_topk(
    rng: np.random.Generator, batch: int, k: int, num_experts: int, unrouted: float = 0.2
) -> np.ndarray:
    """int64 [batch, k]: each row `k` distinct experts (or fewer, with -1 where unrouted)."""
    idx = np.full((batch, k), -1, np.int64)
    for slot in range(batch):
        picks = rng.permutation(num_experts)[: min(k, num_experts)]
        idx[slot, : len(picks)] = picks
        rng.shuffle(idx[slot])
    idx[rng.random((batch, k)) < unrouted] = -1
    return idx


@st.composite
def topk_rows(draw, batch: int, k: int, num_experts: int) -> np.ndarray:
    """Hypothesis: int64 [batch, k], distinct experts per row, -1 anywhere."""
    rows = []
    for _ in range(batch):
        routed = draw(
            st.lists(st.integers(0, num_experts - 1), unique=True, max_size=min(k, num_experts))
        )
        row = routed + [-1] * (k - len(routed))
        rows.append(draw(st.permutations(row)) if k else row)
    return np.array(rows, dtype=np.int64).reshape(batch, k)
