"""The leader's prefix index and what it has the stages keep stay the same set of blocks: the
stages' LRU is as large as the index, so a block published beyond the index's room makes a stage
drop one the index still offers (a pinned one included), and that attach gets kv_missing."""

from __future__ import annotations

from collections import OrderedDict

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import Work
from meshllm.engine.sequence import Sequence
from meshllm.pipeline.chores import StageChores
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.leader_prefix import LeaderPrefixCache

BLOCK, CAPACITY = 2, 4


def test_a_prompt_longer_than_the_room_left_publishes_only_what_the_index_keeps():
    chores = StageChores()
    cache = LeaderPrefixCache(BLOCK, CAPACITY, salt=7, chores=chores, observer=LeaderObserver())
    stage: OrderedDict[int, None] = OrderedDict()  # the blocks a stage's PrefixStore keeps, as it keeps them

    def apply() -> None:  # a step's chores as a stage applies them: evict, then publish (LRU beyond capacity)
        _, publish, evict = chores.take()
        for h in evict:
            stage.pop(h, None)
        for p in publish:
            stage[p.hashes[0]] = None
            while len(stage) > CAPACITY:
                stage.popitem(last=False)

    def prompt(seq_id: int, first: int, blocks: int) -> Sequence:
        seq = Sequence(SeqId(seq_id), list(range(first, first + blocks * BLOCK)) + [99],
                       SamplingParams(temperature=0.0))
        cache.match(seq)
        return seq

    a = prompt(1, 0, 2)
    cache.computed(Work(a, 0, a.num_prompt_tokens, 1))
    apply()
    c = prompt(2, 0, 2)  # admitted with a's two blocks pinned, not sent yet
    assert len(c.attach) == 2
    b = prompt(3, 100, 4)  # four new blocks, room for two
    cache.computed(Work(b, 0, b.num_prompt_tokens, 1))
    apply()
    held = set(cache.index._blocks)
    assert set(c.attach) <= held and set(stage) == held
