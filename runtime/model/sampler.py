"""Choosing the next token from a row of logits: greedy, or seeded categorical draws."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
            `np.random.default_rng([seed, token_index])` (`sample_rows`) so a request's draws
            do not depend on which die, batch or step it is in, nor on its request id.

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


def seed_key(seed) -> list[int]:
    """A sampling seed as the leading ints of its generator's key (an int, or a tuple)."""
    return [int(x) for x in seed] if isinstance(seed, tuple | list) else [int(seed)]


def sample_rows(logits: np.ndarray, rows: list[dict]) -> list[int]:
    """One token per sampling row: greedy, or `rng([seed, token_index])` categorical.

    The draw depends on the seed and the token's output index only (vLLM's f(seed, position);
    OpenAI's `seed`: the same seed, prompt and parameters give the same stream): not on the
    request id, the batch mates, the step, or whether it was streamed. A request recomputed
    after a restart continues at `token_index = len(delivered)` with the same seed, hence the
    same draws. A `seed` may be a tuple of ints (`xpod decode` keys a request's draws by
    `(seed, request)`): the draw is then `rng([*seed, token_index])`."""
    out = np.argmax(logits, axis=-1).tolist() if len(rows) else []
    for i, r in enumerate(rows):
        if r["temperature"] > 0:
            rng = [np.random.default_rng([*seed_key(r["seed"]), r["index"]])]
            out[i] = int(sample(logits[i : i + 1], r["temperature"], rng)[0])
    return out
