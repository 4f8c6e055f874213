"""Prefix cache index at the leader: which prompt blocks the stages hold KV for.

Hash blocks at the leader so all stages agree on reuse without sending KV: a
block's hash chains the hash of the block before it, so equal hashes mean equal
prefixes. The stages keep one KV copy per published hash; this index decides
what they keep (LRU within a token budget) and tells them what to drop.
No torch here.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict


def block_hashes(token_ids: list[int], block_size: int, salt: int) -> list[int]:
    """Chained 63-bit hashes of every full block of `token_ids`."""
    hashes, previous = [], salt.to_bytes(8, "little")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        digest = hashlib.blake2b(previous + struct.pack(f"<{len(block)}q", *block), digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little") >> 1)
        previous = digest
    return hashes


class PrefixIndex:
    def __init__(self, block_size: int, capacity_blocks: int):
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError("block_size must be positive and capacity_blocks non-negative")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._pins: dict[int, int] = {}  # hash -> number of sequences about to attach it
        self.num_hit_tokens = 0
        self.num_miss_tokens = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: list[int], num_prompt_tokens: int) -> int:
        """Number of leading blocks the stages hold, leaving at least one prompt token to
        compute (its logits give the first new token). Counts hits and misses."""
        usable = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)
        n = 0
        while n < usable and hashes[n] in self._blocks:
            self._blocks.move_to_end(hashes[n])
            n += 1
        self.num_hit_tokens += n * self.block_size
        self.num_miss_tokens += num_prompt_tokens - n * self.block_size
        return n

    def hashes(self) -> list[int]:
        """Every block held, least recently used first."""
        return list(self._blocks)

    def remove(self, hashes) -> None:
        """Forget blocks the stages turned out not to hold (pinned ones stay: a sequence will attach them
        and learn the same)."""
        for h in hashes:
            if h not in self._pins:
                self._blocks.pop(h, None)

    def pin(self, hashes: list[int]) -> None:
        for h in hashes:
            self._pins[h] = self._pins.get(h, 0) + 1

    def unpin(self, hashes: list[int]) -> None:
        for h in hashes:
            left = self._pins[h] - 1
            if left:
                self._pins[h] = left
            else:
                del self._pins[h]

    def insert(self, hashes: list[int]) -> tuple[list[int], list[int]]:
        """Record that the stages can publish these blocks; returns (new, evicted) hashes.

        Blocks beyond the capacity are evicted least recently used first, never a
        pinned one. A new block that cannot get room is not inserted.
        """
        new: list[int] = []
        evicted: list[int] = []
        for h in hashes:
            if h in self._blocks:
                self._blocks.move_to_end(h)
                continue
            if len(self._blocks) >= self.capacity_blocks and not self._evict_one(evicted):
                break
            self._blocks[h] = None
            new.append(h)
        return new, evicted

    def _evict_one(self, evicted: list[int]) -> bool:
        for h in self._blocks:
            if h not in self._pins:
                del self._blocks[h]
                evicted.append(h)
                return True
        return False
