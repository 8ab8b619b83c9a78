"""The toy model's byte-level tokenizer: ids 0..255 are the UTF-8 bytes, then three specials."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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
