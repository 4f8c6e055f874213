"""Allowed-token masks survive the wire, compress, and malformed ones are refused."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from meshllm.errors import MalformedMessage
from meshllm.transport.token_mask import mask_from_bytes, mask_to_bytes

VOCAB = 49152


def test_round_trip_and_size():
    rng = np.random.default_rng(0)
    sparse = np.zeros(VOCAB // 32, dtype=np.int32)
    sparse[rng.integers(0, VOCAB // 32, 5)] = 1 << 7
    dense = np.full(VOCAB // 32, -1, dtype=np.int32)
    dense[3] = 0x0FFF
    for words in (sparse, dense):
        data = mask_to_bytes(words)
        assert len(data) < 200  # from 6 KiB
        assert np.array_equal(mask_from_bytes(data).numpy(), words)


@pytest.mark.parametrize("data", [b"not zlib", zlib.compress(b"\x01" * 101), zlib.compress(b"\xff" * (VOCAB // 8 + 4)),
                                  zlib.compress(bytes(VOCAB // 8)), zlib.compress(b"\xff" * (VOCAB // 8))[:-3], b""])
def test_malformed_masks_are_refused(data):
    with pytest.raises(MalformedMessage):
        mask_from_bytes(data, max_words=VOCAB // 32)
