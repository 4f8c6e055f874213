"""What a stage holds is owned and bounded: each sequence and prefix block belongs to the
stream that last computed it and is freed with it; the prefix store keeps at most its
capacity, least recently used dropped first; a stream holds no more sequences than the plan's
batch. Real aidreams weights on one stage (the whole model), so publish/attach move real KV."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kv_cache import KVLayout, Owner, SequenceKV
from meshllm.engine.prefix_store import MissingBlock, PrefixStore
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import Publish, SeqWork, Step
from meshllm.errors import MalformedMessage, PlanLimitExceeded
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource

A, B = Owner(1), Owner(2)
GREEDY = SamplingParams(temperature=0.0, seed=1)
BLOCK = 4


@pytest.fixture(scope="module")
def runner_factory(aidreams_path):
    source = SafetensorsSource(aidreams_path)
    decoder = load_decoder(source, source.config())

    def make(capacity: int = 8) -> StageRunner:
        return StageRunner(decoder, prefix_capacity_blocks=capacity)

    return make


def prefill(seq_id: int, n: int, **kw) -> Step:
    return Step(seq_id * 100, (SeqWork(seq_id, 0, n, 1, GREEDY),), torch.arange(1, n + 1), **kw)


def kv_with_blocks(num_blocks: int) -> SequenceKV:
    kv = SequenceKV(KVLayout(1, 1, 2, torch.float32))
    kv.reserve(num_blocks * BLOCK)
    kv.k[:, :, :num_blocks * BLOCK] = torch.arange(num_blocks * BLOCK, dtype=torch.float32).view(1, 1, -1, 1)
    kv.length = num_blocks * BLOCK
    return kv


def test_store_keeps_its_capacity_dropping_the_least_recently_used():
    store = PrefixStore(capacity_blocks=3)
    kv = kv_with_blocks(5)
    store.publish(kv, 0, (10, 11, 12), BLOCK)
    store.attach(SequenceKV(kv.layout), (10,))  # 10 is now the most recently used
    store.publish(kv, 3, (13, 14), BLOCK)  # needs two slots: 11 and 12 go
    assert len(store) == 3
    with pytest.raises(MissingBlock):
        store.attach(SequenceKV(kv.layout), (11,))
    fresh = SequenceKV(kv.layout)
    store.attach(fresh, (10,))
    assert torch.equal(fresh.k[:, :, :BLOCK], kv.k[:, :, :BLOCK])
    assert store.num_bytes == 3 * 2 * BLOCK * 2 * 4  # 3 blocks of k and v, fp32


def test_store_frees_an_owners_blocks_and_evicts_only_its_own():
    store = PrefixStore(capacity_blocks=8)
    kv = kv_with_blocks(4)
    store.publish(kv, 0, (1, 2), BLOCK, owner=A)
    store.publish(kv, 2, (3, 4), BLOCK, owner=B)
    store.evict((1, 3), owner=A)  # 3 is B's: untouched
    assert len(store) == 3
    store.attach(SequenceKV(kv.layout), (2, 3), owner=A)  # attaching takes the blocks over
    assert store.drop_owner(A) == 2 and len(store) == 1
    assert store.drop_owner(B) == 1 and len(store) == 0 and store.num_bytes == 0


def test_publishing_a_block_the_sequence_does_not_hold_is_refused_and_capacity_zero_keeps_nothing():
    store = PrefixStore(capacity_blocks=4)
    with pytest.raises(MalformedMessage, match="holds 4 tokens"):
        store.publish(kv_with_blocks(1), 0, (1, 2), BLOCK)
    store.set_capacity(0)
    store.publish(kv_with_blocks(2), 0, (1, 2), BLOCK)
    assert len(store) == 0


def test_a_stream_releases_only_its_own_sequences_and_frees_all_of_them_when_it_ends(runner_factory):
    runner = runner_factory()
    runner.run(prefill(1, 8), owner=A)
    runner.run(prefill(2, 8), owner=B)
    runner.run(Step(3, (), torch.zeros(0, dtype=torch.int64), release=(2,)), owner=A)  # not A's: kept
    assert runner.held_sequences() == [1, 2]
    runner.run(prefill(3, 8, publish=(Publish(1, 0, (77,)),), block_size=BLOCK), owner=A)
    assert len(runner.prefix) == 1
    assert runner.release_owner(A) == (2, 1)
    assert runner.held_sequences() == [2] and len(runner.prefix) == 0
    assert runner.release([2]) == 1  # the control plane's Release frees anyone's
    assert runner.held_sequences() == [] and runner.cache.num_bytes == 0


def test_a_stream_may_hold_no_more_sequences_than_the_plans_batch(runner_factory):
    runner = runner_factory()
    runner.run(prefill(1, 4), owner=A, max_held=2)
    runner.run(prefill(2, 4), owner=A, max_held=2)
    with pytest.raises(PlanLimitExceeded, match="would hold 3 sequences"):
        runner.run(prefill(3, 4), owner=A, max_held=2)
    assert runner.held_sequences() == [1, 2]  # refused before anything was allocated
    runner.run(prefill(3, 4, release=(1,)), owner=A, max_held=2)  # releasing first makes room
    runner.run(prefill(4, 4), owner=B, max_held=2)  # another stream has its own budget
    assert runner.held_sequences() == [2, 3, 4]


def test_continuing_a_sequence_on_a_new_stream_moves_it_there(runner_factory):
    runner = runner_factory()
    runner.run(prefill(1, 4), owner=A)
    runner.run(Step(9, (SeqWork(1, 4, 1, 1, GREEDY),), torch.tensor([5])), owner=B)  # the leader reconnected
    assert runner.release_owner(A) == (0, 0)
    assert runner.release_owner(B) == (1, 0)
