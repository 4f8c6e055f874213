"""Property-based fuzzing of what the leader accepts from the stages: any StepReply a peer can
send, parsed as the wire parses it, is either committed (when it is exactly what the step
asked) or refused with InvalidReply / a named stage error; inside a real leader it ends the
request with a clear error or delivers valid tokens, never stops the loop, and the next request
is served exactly as before. Bounded: few examples, no deadline."""

from __future__ import annotations

import queue

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import Work
from meshllm.engine.sequence import Sequence
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import Step, StepResult
from meshllm.errors import InvalidReply, MeshError, PipelineStalled
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, new_leader
from meshllm.pipeline.replies import ReplyCheck
from meshllm.pipeline.transport import LocalPipeline
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, -0.5, -1e-9]))
int64 = st.integers(-(1 << 63), (1 << 63) - 1)
int32 = st.integers(-(1 << 31), (1 << 31) - 1)


@st.composite
def replies(draw, seq_ids: list[int], first_position: int) -> stage_pb2.StepReply:
    """Replies close to valid (the step's sequences and positions, small ids) and far from it."""
    reply = stage_pb2.StepReply(step_id=draw(st.integers(0, (1 << 64) - 1)))
    for _ in range(draw(st.integers(0, 4))):
        token = reply.tokens.add(
            seq_id=draw(st.one_of(st.sampled_from(seq_ids), st.integers(0, (1 << 64) - 1))),
            token_id=draw(st.one_of(st.integers(-2, 600), int64)),
            position=draw(st.one_of(st.integers(first_position - 1, first_position + 2), int32)))
        if draw(st.booleans()):
            token.logprob = draw(floats)
            for _ in range(draw(st.integers(0, 3))):
                token.top.add(token_id=draw(st.one_of(st.integers(0, 600), int64)), logprob=draw(floats))
    for _ in range(draw(st.integers(0, 3))):
        reply.timings.add(stage_index=draw(st.one_of(st.integers(-1, 2), int32)), compute_s=draw(floats),
                          received_at=draw(floats), sent_at=draw(floats))
    if draw(st.booleans()):
        reply.error_code = draw(st.text(max_size=20))
        reply.error_message = draw(st.text(max_size=200))
        reply.failed_stage = draw(st.one_of(st.integers(-1, 2), int32))
    return stage_pb2.StepReply.FromString(reply.SerializeToString())


CHECK = ReplyCheck(vocab_size=512, stage_names=("node-a (127.0.0.1:1)", "node-b (127.0.0.1:2)"))
WORK = Work(Sequence(SeqId(7), [1, 2, 3, 4], SamplingParams(temperature=0, seed=1, logprobs=2)), 3, 1, 1)


@FUZZ
@given(replies([7], 4))
def test_any_reply_is_committed_only_when_valid_and_otherwise_refused_by_name(reply):
    result = stage_convert.result_from_pb(reply)
    if not result.ok:
        error = CHECK.failure(result)
        assert isinstance(error, (PipelineStalled, InvalidReply)) and "node-" in str(error)
        return
    try:
        committed = CHECK.committed([WORK], result)
    except InvalidReply as e:
        assert "node-" in str(e) or "sequence" in str(e)
        return
    [token] = committed[SeqId(7)]  # accepted: then it is exactly one well-formed token at position 4
    assert token.position == 4 and 0 <= token.token_id < 512 and token.logprobs.token_id == token.token_id


class FuzzedReplies(LocalPipeline):
    """The real in-process stage; the reply to the next step is replaced by a fuzzed one, drawn
    with placeholder sequence 0 at position 0 and moved onto the step's first sequence here.
    Mocks only the peer: a remote stage could send any such message."""

    def __init__(self, runners):
        super().__init__(runners)
        self.pending: queue.Queue = queue.Queue()  # fuzzed StepReplies

    def run_now(self, step: Step) -> StepResult:
        real = super().run_now(step)
        if not step.seqs or self.pending.empty():
            return real
        reply = self.pending.get()
        reply.step_id = step.step_id
        first = step.seqs[0]
        for t in reply.tokens:
            if t.seq_id == 0:
                t.seq_id = first.seq_id
            if -1 <= t.position <= 2:
                t.position += first.first_new_position
        return stage_convert.result_from_pb(reply)


@pytest.fixture(scope="module")
def fuzzed_leader(aidreams_path):
    files = open_model(aidreams_path)
    pipeline = FuzzedReplies([StageRunner(load_decoder(files.source, files.config))])
    leader = new_leader(files, pipeline, ServingOptions(context_length=128, max_batch=4))
    prompt = files.tokenizer.encode("Once upon a time")
    expected = [e.token_id for e in leader.generate(prompt, PARAMS) if e.token_id is not None]
    yield leader, pipeline, prompt, expected
    leader.close()


PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_leader_fed_any_reply_fails_that_request_clearly_and_serves_the_next(fuzzed_leader, data):
    leader, pipeline, prompt, expected = fuzzed_leader
    pipeline.pending.put(data.draw(replies([0], 0)))
    events = list(leader.generate(prompt, PARAMS))  # ends: no hang
    last = events[-1]
    if last.finish_reason == "error":
        assert isinstance(last.error, MeshError) and str(last.error)
    else:
        assert all(e.token_id is None or 0 <= e.token_id < 512 for e in events)
    assert leader.failure is None
    again = [e.token_id for e in leader.generate(prompt, PARAMS) if e.token_id is not None]
    assert again == expected
