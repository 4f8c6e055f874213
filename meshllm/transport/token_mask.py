"""Allowed-token bitmasks on the wire: int32 words (bit i of word j allows token 32 j + i),
little-endian, zlib-compressed.

A mask is 6 KiB for a 49152-token vocabulary, and constrained sequences need one per
scored position per step. Masks are long runs of zeros (inside a JSON structure a
handful of tokens fit) or of ones (inside a string almost anything does), so zlib at
its fastest level takes them to ~60 bytes median, ~250 mean, ~750 at most (SmolLM2, a
nested schema; ~15 us to compress). Decompression is bounded by the size the vocabulary
implies, so a peer cannot make a stage inflate a bomb.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
from torch import Tensor

from meshllm.errors import MalformedMessage


def mask_to_bytes(words: np.ndarray) -> bytes:
    assert words.dtype == np.int32 and words.ndim == 1, (words.dtype, words.shape)
    return zlib.compress(words.astype("<i4", copy=False).tobytes(), 1)


MAX_MASK_WORDS = (1 << 20) // 32  # vocabularies up to a million tokens


def mask_from_bytes(data: bytes, max_words: int = MAX_MASK_WORDS) -> Tensor:
    """int32 words (at most `max_words`); MalformedMessage when `data` is not such a mask. The
    stage that applies it treats tokens past the mask as not allowed."""
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(data, 4 * max_words)
    except zlib.error as e:
        raise MalformedMessage(f"allowed-token mask does not decompress: {e}") from None
    if inflater.unconsumed_tail or not inflater.eof or not raw or len(raw) % 4:
        raise MalformedMessage(f"allowed-token mask is not whole int32 words within {4 * max_words} bytes")
    words = torch.frombuffer(bytearray(raw), dtype=torch.int32)
    if not bool(words.any()):
        raise MalformedMessage("allowed-token mask allows no token at all")
    return words
