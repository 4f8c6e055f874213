"""A stage's copies of prefix-cache blocks: KV of prompt blocks, keyed by the
leader's chained block hashes (engine/prefix_index.py decides what is kept)."""

from __future__ import annotations

import torch
from torch import Tensor

from meshllm.engine.kv_cache import SequenceKV


class MissingBlock(KeyError):
    pass


class PrefixStore:
    def __init__(self):
        self._blocks: dict[int, tuple[Tensor, Tensor]] = {}  # hash -> k, v [layers, kv_heads, block, dim]

    def __len__(self) -> int:
        return len(self._blocks)

    def publish(self, kv: SequenceKV, first_block: int, hashes: tuple[int, ...], block_size: int) -> None:
        for i, h in enumerate(hashes):
            if h in self._blocks:
                continue
            start = (first_block + i) * block_size
            end = start + block_size
            assert end <= kv.length, f"publishing block [{start}, {end}) of a {kv.length}-token sequence"
            self._blocks[h] = (kv.k[:, :, start:end].clone(), kv.v[:, :, start:end].clone())

    def evict(self, hashes) -> None:
        for h in hashes:
            self._blocks.pop(h, None)

    def attach(self, kv: SequenceKV, hashes: tuple[int, ...]) -> None:
        """Start `kv` from the concatenated blocks `hashes`."""
        missing = [h for h in hashes if h not in self._blocks]
        if missing:
            raise MissingBlock(missing[0])
        kv.copy_prefix_from(torch.cat([self._blocks[h][0] for h in hashes], dim=2),
                            torch.cat([self._blocks[h][1] for h in hashes], dim=2))

