"""The leader's prefix index and what it has the stages keep stay the same set of blocks: the
stages' LRU is as large as the index, so a block published beyond the index's room makes a stage
drop one the index still offers (a pinned one included), and that attach gets kv_missing."""

from __future__ import annotations

from collections import OrderedDict

import pytest

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


@pytest.mark.parametrize("dropped_on", [0, 1])
def test_a_prefix_block_a_stage_dropped_is_prefilled_again_not_a_failure(aidreams_path, dropped_on):
    """Leaders sharing a plan share its stages' prefix room, so a stage's LRU may drop a block
    one leader still offers. The request that attaches it prefills its prompt instead and gets
    the same answer; before, it ended in an error (or, with a re-planner, every running request
    was re-prefilled on a new plan). Two stages in this process; the blocks dropped on the first
    or on the second (the first then attached and computed the step, and rolls back)."""
    import torch

    from meshllm.engine.stage_runner import StageRunner
    from meshllm.engine.stage_weights import load_stage_decoder
    from meshllm.model.source import open_model
    from meshllm.pipeline.cluster import new_leader
    from meshllm.pipeline.transport import LocalPipeline
    from tests.spec.conftest import EXACT

    files = open_model(aidreams_path)
    prompt = files.tokenizer.encode("Once upon a time, there was a little robot. The robot liked to play in the "
                                    "garden with its friends every day")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    runners = [StageRunner(load_stage_decoder(files.source, files.config, a, b, torch.float32, batch_invariant=True),
                           prefix_capacity_blocks=EXACT.scheduler.prefix_cache_blocks) for a, b in ((0, 2), (2, 4))]
    leader = new_leader(files, LocalPipeline(runners), EXACT)

    def answer() -> tuple[list[int], int]:
        events = list(leader.generate(prompt, params))
        assert events[-1].error is None, events[-1].error
        return [e.token_id for e in events if e.token_id is not None], events[-1].num_cached_tokens

    try:
        first, cached = answer()
        assert cached == 0 and len(prompt) >= 2 * EXACT.scheduler.prefix_block_size
        store = runners[dropped_on].prefix  # the leader is idle: nothing else touches it
        capacity = store.capacity_blocks
        store.set_capacity(0)  # the stage's LRU dropped the blocks; the leader's index still offers them
        store.set_capacity(capacity)
        assert answer() == (first, 0)  # prefilled again, nothing taken from the cache
        again, cached = answer()  # and published again
        assert again == first and cached >= EXACT.scheduler.prefix_block_size
    finally:
        leader.close()
