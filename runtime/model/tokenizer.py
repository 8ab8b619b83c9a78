"""The toy model's byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then three specials;
and the short text the benchmarks' prompts (and the MTP head's fit) are cut from."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

NUM_BYTE_TOKENS = 256  # ids 0..255 are the UTF-8 bytes
BOS, EOS, PAD = 256, 257, 258
MIN_VOCAB = 259  # bytes + the three specials


# the text `xpod decode` cuts its prompts from, at seeded offsets (and `mtp_fit` its own)
CORPUS = (
    "The pod is a set of dies that share one memory fabric. Each die owns a region of high"
    " bandwidth memory and reads its peers' regions directly, so tokens travel to experts without"
    " a network stack in the way. Attention runs data parallel: every die keeps its own requests"
    " and their compressed latent cache. Experts run expert parallel: each die hosts a slice of"
    " the routed experts and serves every token that picks one of them. A decode step therefore"
    " alternates local work and pod-wide exchanges, and its latency is set by the slowest die."
)


def encode(text: str, bos: bool = True) -> list[int]:
    """Byte-level tokens of `text`: its UTF-8 bytes (0..255), preceded by BOS if `bos`."""
    ids = list(text.encode("utf-8"))
    return [BOS, *ids] if bos else ids


def decode(ids: Sequence[int] | np.ndarray) -> str:
    """Text of byte tokens; specials (>= 256) are skipped, invalid UTF-8 becomes U+FFFD."""
    data = bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTE_TOKENS)
    return data.decode("utf-8", errors="replace")
