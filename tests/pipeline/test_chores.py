"""The leader's chores never ask the stages to drop and keep the same block in one step, so
the order a stage applies them in cannot lose a block the leader's index still lists."""

from __future__ import annotations

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import Publish
from meshllm.pipeline.chores import StageChores


def test_a_block_evicted_then_published_again_is_only_published():
    chores = StageChores()
    chores.drop([5, 6])
    chores.keep(Publish(SeqId(1), 0, (5,)))
    release, publish, evict = chores.take()
    assert publish == (Publish(SeqId(1), 0, (5,)),) and evict == (6,)
    assert not chores


def test_a_block_published_then_evicted_is_only_evicted():
    chores = StageChores()
    chores.keep(Publish(SeqId(1), 0, (5,)))
    chores.keep(Publish(SeqId(1), 1, (7,)))
    chores.drop([5])
    _, publish, evict = chores.take()
    assert publish == (Publish(SeqId(1), 1, (7,)),) and evict == (5,)
