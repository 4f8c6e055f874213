"""A stage's copies of prefix-cache blocks: KV of prompt blocks, keyed by the
leader's chained block hashes (engine/prefix_index.py decides what is kept).

Bounded: at most `capacity_blocks` blocks (the plan's budget, counted by the planner),
the least recently published or attached dropped first when a new one needs room. Each
block belongs to the owner (a leader's stream) that last published or attached it, and
hashes are salted per leader, so when that stream ends nobody can use its blocks again:
`drop_owner` frees them. One leader's index never holds more than the capacity and its
evictions are applied before its publications, so the LRU only bites when several
leaders share a plan; a leader that then attaches a dropped block gets kv_missing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from meshllm.engine.kv_cache import LOCAL_OWNER, Owner, SequenceKV
from meshllm.engine.step_limits import DEFAULT_PREFIX_BLOCKS
from meshllm.errors import MalformedMessage


class MissingBlock(KeyError):
    pass


@dataclass(slots=True)
class _Block:
    k: Tensor  # [layers, kv_heads, block, dim]
    v: Tensor
    owner: Owner

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class PrefixStore:
    def __init__(self, capacity_blocks: int = DEFAULT_PREFIX_BLOCKS):
        self._blocks: OrderedDict[int, _Block] = OrderedDict()  # least recently used first
        self.capacity_blocks = capacity_blocks
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def set_capacity(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be non-negative, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        while len(self._blocks) > capacity_blocks:
            self._drop(next(iter(self._blocks)))

    def publish(self, kv: SequenceKV, first_block: int, hashes: tuple[int, ...], block_size: int,
                owner: Owner = LOCAL_OWNER) -> None:
        for i, h in enumerate(hashes):
            block = self._blocks.get(h)
            if block is not None:
                block.owner = owner
                self._blocks.move_to_end(h)
                continue
            if not self.capacity_blocks:
                return
            start = (first_block + i) * block_size
            end = start + block_size
            if end > kv.length:
                raise MalformedMessage(f"publishing prefix block [{start}, {end}) of a sequence that holds "
                                       f"{kv.length} tokens")
            while len(self._blocks) >= self.capacity_blocks:
                self._drop(next(iter(self._blocks)))
            block = _Block(kv.k[:, :, start:end].clone(), kv.v[:, :, start:end].clone(), owner)
            self._blocks[h] = block
            self.num_bytes += block.num_bytes

    def evict(self, hashes: Iterable[int], owner: Owner | None = None) -> None:
        """Drop these blocks; with an owner, only those it holds."""
        for h in hashes:
            block = self._blocks.get(h)
            if block is not None and (owner is None or block.owner == owner):
                self._drop(h)

    def drop_owner(self, owner: Owner) -> int:
        """Free every block `owner` holds (its leader is gone); returns how many."""
        mine = [h for h, b in self._blocks.items() if b.owner == owner]
        for h in mine:
            self._drop(h)
        return len(mine)

    def attach(self, kv: SequenceKV, hashes: tuple[int, ...], owner: Owner = LOCAL_OWNER) -> None:
        """Start `kv` from the concatenated blocks `hashes`."""
        missing = [h for h in hashes if h not in self._blocks]
        if missing:
            raise MissingBlock(missing[0])
        blocks = [self._blocks[h] for h in hashes]
        for h, b in zip(hashes, blocks):
            b.owner = owner
            self._blocks.move_to_end(h)
        kv.copy_prefix_from(torch.cat([b.k for b in blocks], dim=2), torch.cat([b.v for b in blocks], dim=2))

    def _drop(self, h: int) -> None:
        self.num_bytes -= self._blocks.pop(h).num_bytes
