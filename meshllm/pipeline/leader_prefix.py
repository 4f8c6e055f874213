"""The leader's side of the prefix cache: which prompt blocks the stages hold.

Hash blocks at the leader so all stages agree on reuse without sending KV. On
admission a sequence starts after its longest cached prefix (the blocks are pinned
until the step that attaches them is sent); when its prompt is computed, the stages
are told to keep the new blocks, and the index's evictions are passed on. Called
on the leader's loop thread only.
"""

from __future__ import annotations

from meshllm.engine.prefix_index import PrefixIndex, block_hashes
from meshllm.engine.scheduler import Work
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import Publish
from meshllm.pipeline.chores import StageChores
from meshllm.pipeline.events import LeaderObserver


class LeaderPrefixCache:
    def __init__(self, block_size: int, capacity_blocks: int, salt: int, chores: StageChores,
                 observer: LeaderObserver):
        self.index = PrefixIndex(block_size, capacity_blocks)
        self._salt = salt  # per leader: two leaders sharing stages never evict each other's blocks
        self._chores = chores
        self._observer = observer

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def match(self, seq: Sequence) -> None:
        """On admission: start the sequence after the longest cached prefix of its prompt."""
        if not self.index.capacity_blocks:
            return
        seq.block_hashes = block_hashes(seq.prompt_ids, self.index.block_size, self._salt)
        hits, misses = self.index.num_hit_tokens, self.index.num_miss_tokens
        num_blocks = self.index.match(seq.block_hashes, seq.num_prompt_tokens)
        self._observer.on_prefix(self.index.num_hit_tokens - hits, self.index.num_miss_tokens - misses)
        if num_blocks:
            seq.attach = seq.block_hashes[:num_blocks]
            self.index.pin(seq.attach)
            seq.num_cached = seq.num_computed = num_blocks * self.index.block_size

    def sent(self, work: Work) -> None:
        """`work` is on its way: later steps (and so any eviction) reach each stage after it."""
        if work.attach:
            self.index.unpin(work.seq.attach)
            work.seq.attach = []

    def computed(self, work: Work) -> None:
        """The stages committed `work`: once it completes the prompt, have them keep its blocks."""
        seq = work.seq
        if not seq.block_hashes or not work.start < seq.num_prompt_tokens <= work.start + work.num_tokens:
            return
        new, evicted = self.index.insert(seq.block_hashes)
        self._chores.drop(evicted)
        position = {h: i for i, h in enumerate(seq.block_hashes)}
        gone = set(evicted)
        for h in new:
            # A prompt of more new blocks than there is room for evicts its own first ones: the
            # stages must not keep those either, or their LRU (as large as the index) drops
            # blocks the index still holds, pinned ones included (an attach then gets kv_missing).
            if h not in gone:
                self._chores.keep(Publish(seq.seq_id, position[h], (h,)))

    def drop_attached(self, works) -> None:
        """A stage answered kv_missing: it lost blocks these works attached (dropped by its LRU when
        leaders share it, or a stream that ended). Stop offering them, so the next request re-prefills."""
        self.index.remove([h for w in works for h in w.attach])

    def reset(self) -> None:
        """The stages hold no cached block (the stream that published them ended, or a new plan):
        start empty, and drop publish/evict chores about blocks no stage has."""
        self.index = PrefixIndex(self.index.block_size, self.index.capacity_blocks)
        self._chores.publish.clear()
        self._chores.evict.clear()

    def forget(self, seq: Sequence) -> None:
        """The sequence ends: unpin blocks it was admitted with but never sent."""
        if seq.attach:
            self.index.unpin(seq.attach)
            seq.attach = []
