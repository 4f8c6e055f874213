"""KV carried over from a failed plan: a stage parks what a failed stream held, a new plan over
the same weights adopts it (truncated to the positions the leader knows every stage held), and
the re-prefill then skips those rows there, with the very bits of a stage that computed every
row. Real aidreams weights split in two stages, batch-invariant fp32 as the identity tests run."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch

from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.engine.kv_cache import PARKED, Owner, SeqId, SequenceKV
from meshllm.engine.kv_carry import Kept, skip_carried
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import Publish, SeqWork, Step
from meshllm.engine.step_limits import StepLimits
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource
from meshllm.pipeline.kv_parking import PARK_S, adopt, park_stream
from meshllm.pipeline.loaded_stages import LoadedStage, SharedWeights, WeightKey
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2

GREEDY = SamplingParams(temperature=0.0, seed=1)
STREAM = Owner(7)
SEQ = SeqId(5)
N, HELD = 20, 12  # tokens re-prefilled after the failover; positions the adopting stage kept


@pytest.fixture(scope="module")
def decoders(aidreams_path):
    source = SafetensorsSource(aidreams_path)
    config = source.config()
    return [make_batch_invariant(load_decoder(source, config, a, b)) for a, b in ((0, 2), (2, 4))]


def step(start: int, n: int, x: torch.Tensor, scored: int = 0, seq: SeqId = SEQ) -> Step:
    return Step(start + 1000 * n, (SeqWork(seq, start, n, scored, GREEDY if scored else None),), x)


def test_an_adopting_stage_computes_only_the_rows_it_lacks_with_identical_bits(decoders):
    first, last = StageRunner(decoders[0]), StageRunner(decoders[1])
    ids = torch.arange(3, 3 + N)
    hidden = first.run(step(0, N, ids))
    reference = last.run(step(0, N, hidden, scored=1))  # a stage that computes every row

    adopter = StageRunner(decoders[1])  # held HELD positions (and a few more it must forget)
    adopter.run(step(0, HELD + 3, hidden[:HELD + 3]), STREAM)
    kv = adopter.cache.sequences[SEQ]
    kv.truncate(HELD)
    kv.carried = HELD
    adopter.cache.park(STREAM, time.monotonic() + PARK_S)  # as an Adopt leaves it: no stream holds it

    chunk = skip_carried(step(0, 8, hidden[:8]), adopter.cache, STREAM)  # a chunk it holds entirely: dropped
    assert chunk.step.seqs == () and chunk.num_rows == 8 and chunk.kept == () and kv.carried == HELD
    assert adopter.cache.owner_of(SEQ) == STREAM  # the stream holds it now: it may publish, and frees it
    rest = skip_carried(step(8, N - 8, hidden[8:], scored=1), adopter.cache, STREAM)
    assert rest.kept == (Kept(0, HELD, N - HELD),) and rest.num_rows == HELD - 8 and kv.carried == 0
    assert torch.equal(rest.step.input, hidden[HELD:])
    assert adopter.run(rest.step, STREAM) == reference
    assert torch.equal(kv.k[:, :, :N], last.cache.sequences[SEQ].k[:, :, :N])
    assert torch.equal(kv.v[:, :, :N], last.cache.sequences[SEQ].v[:, :, :N])
    # The mark is spent: a later step starting below it is an ordinary rollback.
    assert skip_carried(step(4, 2, hidden[4:6]), adopter.cache, STREAM).kept is None


def test_scored_rows_and_prefix_attachments_are_never_skipped(decoders):
    runner = StageRunner(decoders[1])
    runner.run(step(0, N, torch.zeros(N, decoders[1].config.hidden_size)), STREAM)
    runner.cache.sequences[SEQ].carried = N
    x = torch.zeros(N + 1, decoders[1].config.hidden_size)
    assert skip_carried(step(0, N + 1, x, scored=1), runner.cache, STREAM).kept == (Kept(0, N, 1),)
    runner.cache.sequences[SEQ].carried = N
    attached = Step(1, (SeqWork(SEQ, 16, 4, 0, attach=(1,)),), x[:4])
    assert skip_carried(attached, runner.cache, STREAM).kept == (Kept(0, 16, 4),)  # computed as sent


def loaded(plan_id: str, decoder, key: WeightKey) -> LoadedStage:
    request = stage_pb2.LoadRequest(plan_id=plan_id, first_layer=2, last_layer=4, stage_index=1)
    stage_convert.limits_to_pb(StepLimits(128, 4, 64, 16, 8), request)
    return LoadedStage(request, StageRunner(decoder), SharedWeights(key, decoder, 0))


def test_a_failed_stream_is_parked_adopted_truncated_and_freed_at_its_deadline(decoders):
    key = WeightKey("f", 2, 4, "float32", "", True)
    old, new = loaded("old", decoders[1], key), loaded("new", decoders[1], key)
    hidden = torch.zeros(N, decoders[1].config.hidden_size)
    for seq, n in ((SeqId(1), N), (SeqId(2), 4)):
        old.runner.run(step(0, n, hidden[:n], seq=seq), STREAM)
    assert old.runner.cache.park(STREAM, time.monotonic() + PARK_S) == 2
    assert old.runner.cache.owner_of(SeqId(1)) == PARKED and old.runner.cache.owned_by(STREAM) == []

    # Sequence 2 holds fewer positions than asked: not adopted (and gone from the failed plan).
    assert adopt(new, old, [(SeqId(1), HELD), (SeqId(2), 9), (SeqId(3), 5)]) == [(SeqId(1), HELD)]
    assert old.runner.held_sequences() == []
    kv = new.runner.cache.sequences[SeqId(1)]
    assert (kv.length, kv.carried, new.runner.cache.owner_of(SeqId(1))) == (HELD, HELD, PARKED)
    other = loaded("other-weights", decoders[1], WeightKey("f", 2, 4, "bfloat16", "", True))
    assert adopt(other, new, [(SeqId(1), HELD)]) == []  # other weights: nothing moves

    # A stream that computes it owns it; parked ones go at their deadline.
    new.runner.cache.get_or_allocate(SeqId(1), STREAM)
    new.runner.cache.put_parked(SeqId(9), SequenceKV(kv.layout), time.monotonic())
    assert new.runner.cache.drop_expired(time.monotonic() + 1) == 1
    assert new.runner.held_sequences() == [SeqId(1)]


def test_parked_kv_waiting_for_its_sweep_does_not_keep_an_unloaded_plan_resident(decoders):
    """The sweep of what nobody adopted runs PARK_S after the park; an Unload before then frees
    the plan's runner (and, when no other plan shares them, its weights) at once."""
    stage = loaded("gone", decoders[1], WeightKey("f", 2, 4, "float32", "", True))
    stage.runner.run(step(0, 4, torch.zeros(4, decoders[1].config.hidden_size)), STREAM)
    assert park_stream(stage, STREAM) == (1, 0)
    runner = weakref.ref(stage.runner)
    del stage  # what an Unload leaves: no registry entry, no stream
    gc.collect()
    assert runner() is None


def test_an_adopted_sequence_named_only_to_publish_or_release_is_the_streams(decoders):
    """A stage before this one that had every row of a re-prefill chunk carried drops that work,
    so this stage (which adopted the same positions) sees the sequence named only by the step's
    publish or release. The stream must take it then: its blocks published (or a later request
    attaching them gets kv_missing and a full redeploy) and the sequence freed on release (not
    left parked until the sweep)."""
    runner = StageRunner(decoders[1])
    runner.prefix.set_capacity(8)
    hidden = torch.zeros(N, decoders[1].config.hidden_size)
    runner.run(step(0, N, hidden), Owner(3))  # the failed plan's stream
    runner.cache.sequences[SEQ].carried = N
    runner.cache.park(Owner(3), time.monotonic() + PARK_S)  # as an Adopt leaves it
    published = Step(1, (), hidden[:0], publish=(Publish(SEQ, 0, (11, 12)),), block_size=8)
    runner.run(published, STREAM)
    assert len(runner.prefix) == 2 and runner.cache.owner_of(SEQ) == STREAM
    runner.run(Step(2, (), hidden[:0], release=(SEQ,)), STREAM)
    assert SEQ not in runner.cache
    # A sequence another stream holds is not taken by naming it.
    runner.run(step(0, 4, hidden[:4]), Owner(9))
    runner.run(Step(3, (), hidden[:0], release=(SEQ,)), STREAM)
    assert runner.cache.owner_of(SEQ) == Owner(9)
