"""The command codec rank 0 broadcasts to its workers: encode/decode round trips (property
tests) to what a worker computes from, frames for commands larger than one buffer, and
refusal of garbage."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import DraftDist, Publish, SeqWork, Step
from meshllm.errors import MalformedMessage
from meshllm.cluster.tp_cost import COMMAND_FRAME_BYTES
from meshllm.tp.channel import DEFAULT_FRAME_WORDS, from_frames, num_frames, to_frames
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.tp.command import Heartbeat, Release, ReleaseOwner, RunStep, Shutdown, decode, encode, worker_view

u64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 10_000)
sampling = st.builds(SamplingParams, temperature=st.floats(0.0, 2.0), top_p=st.floats(0.01, 1.0),
                     top_k=st.none() | st.integers(1, 1000), seed=u64.map(lambda s: s >> 1),
                     logprobs=st.none() | st.integers(0, 20), frequency_penalty=st.floats(0.0, 1.0))


@st.composite
def seq_works(draw) -> SeqWork:
    num_tokens = draw(st.integers(1, 40))
    draft = tuple(draw(st.lists(st.integers(0, 50_000), max_size=min(num_tokens - 1, 8))))
    num_scored = len(draft) + 1 if draft else draw(st.sampled_from((0, 1)))
    block = draw(st.integers(0, 4))
    penalties = PenaltyCounts(*zip(*draw(st.lists(st.tuples(small, small), max_size=3)))) if draw(
        st.booleans()) else PenaltyCounts()
    allowed = tuple(torch.tensor([draw(st.integers(-2**31, 2**31 - 1))], dtype=torch.int32)
                    for _ in range(num_scored)) if draw(st.booleans()) else ()
    dists = tuple(DraftDist((t,), (1.0,)) for t in draft) if draft and draw(st.booleans()) else None
    return SeqWork(SeqId(draw(u64)), draw(small) if not block else block * 16, num_tokens, num_scored,
                   draw(sampling) if num_scored else draw(st.none() | sampling),
                   tuple(draw(st.lists(u64, min_size=block, max_size=block))), draft, penalties, allowed, dists)


@st.composite
def steps(draw) -> Step:
    seqs = tuple(draw(st.lists(seq_works(), max_size=6)))
    rows = sum(w.num_tokens for w in seqs)
    dtype = draw(st.sampled_from((torch.int64, torch.float32, torch.bfloat16, torch.float16)))
    if dtype == torch.int64:
        x = torch.randint(0, 50_000, (rows,), generator=torch.Generator().manual_seed(draw(small)))
    else:  # hidden states; odd widths leave a partial last word in the payload
        x = torch.randn(rows, draw(st.integers(1, 33)), generator=torch.Generator().manual_seed(draw(small))).to(dtype)
    publish = tuple(Publish(SeqId(draw(u64)), draw(small), tuple(draw(st.lists(u64, max_size=5))))
                    for _ in range(draw(st.integers(0, 3))))
    return Step(draw(st.integers(0, 2**62)), seqs, x, tuple(SeqId(s) for s in draw(st.lists(u64, max_size=5))),
                (), publish, tuple(draw(st.lists(u64, max_size=5))), draw(st.sampled_from((0, 16))))


def _same_step(got: Step, sent: Step) -> None:
    """`got` is what a worker must see of `sent`: everything it computes from."""
    want = worker_view(sent)
    assert replace(got, input=None) == replace(want, input=None)
    assert got.input.dtype == sent.input.dtype and torch.equal(got.input, sent.input)


OWNERS = st.integers(0, 2**62)


@settings(max_examples=200, deadline=None)
@given(steps(), OWNERS, st.none() | st.integers(0, 4096))
def test_step_round_trip(step, owner, max_held):
    decoded = decode(encode(RunStep(step, owner, max_held)))
    assert isinstance(decoded, RunStep)
    assert (decoded.owner, decoded.max_held) == (owner, max_held)
    _same_step(decoded.step, step)
    # What the view leaves out is only what sampling reads: rank 0 keeps it.
    for got, sent in zip(decoded.step.seqs, step.seqs):
        assert (got.seq_id, got.start, got.num_tokens, got.num_scored, got.attach, got.draft) == (
            sent.seq_id, sent.start, sent.num_tokens, sent.num_scored, sent.attach, sent.draft)


@settings(max_examples=200, deadline=None)
@given(steps(), st.integers(2, 300))
def test_frames_carry_any_command_in_order(step, frame_words):
    words = encode(RunStep(step))
    frames = to_frames(words, frame_words)
    assert len(frames) == num_frames(words.numel(), frame_words)
    assert all(f.shape == (frame_words,) for f in frames)
    _same_step(decode(from_frames(frames)).step, step)


def test_a_prefill_of_hidden_states_spans_many_frames():
    # 512 rows of 576-wide fp32 hidden states: 1.2 MB, just over 18 frames of the default 64 KiB.
    x = torch.randn(512, 576)
    step = Step(7, (SeqWork(SeqId(2**64 - 1), 0, 512, 1, SamplingParams(temperature=0.0, seed=2**63 + 5)),), x)
    words = encode(RunStep(step))
    frames = to_frames(words, 8192)
    assert len(frames) == 19
    _same_step(decode(from_frames(frames)).step, step)


@given(st.lists(u64, max_size=50), st.none() | OWNERS)
def test_release_round_trip(ids, owner):
    assert decode(encode(Release(tuple(SeqId(i) for i in ids), owner))) == Release(tuple(ids), owner)


@given(OWNERS)
def test_release_owner_round_trip(owner):
    assert decode(encode(ReleaseOwner(owner))) == ReleaseOwner(owner)


def test_the_planner_counts_the_frame_the_channel_sends():
    assert COMMAND_FRAME_BYTES == DEFAULT_FRAME_WORDS * 8


def test_heartbeat_and_shutdown_round_trip():
    assert decode(encode(Heartbeat())) == Heartbeat()
    assert decode(encode(Shutdown())) == Shutdown()


@settings(max_examples=100, deadline=None)
@given(steps(), st.data())
def test_a_damaged_command_is_refused_or_decodes_to_a_command(step, data):
    words = encode(RunStep(step)).clone()
    cut = data.draw(st.integers(0, words.numel()))
    damaged = words[:cut]
    try:
        decode(damaged)
    except MalformedMessage:
        return
    assert cut == words.numel()  # only the whole command decodes


@pytest.mark.parametrize("words", [torch.zeros(3, dtype=torch.int64), torch.ones(8, dtype=torch.int32),
                                   torch.tensor([1, 2], dtype=torch.int64)])
def test_garbage_is_a_malformed_message(words):
    with pytest.raises(MalformedMessage):
        decode(words)
