"""Steps and replies survive the wire unchanged, and malformed ones are refused with clear errors."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.step import SampledToken, SeqWork, Step
from meshllm.errors import MalformedMessage
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2

PARAMS = SamplingParams(temperature=0.75, top_p=0.875, top_k=40, seed=5, logprobs=2)  # exact in float32


def test_a_verification_step_round_trips():
    step = Step(9, (SeqWork(SeqId(3), 10, 4, 4, PARAMS, draft=(7, 8, 9)), SeqWork(SeqId(4), 0, 6)),
                torch.arange(10))
    back = stage_convert.step_from_pb(stage_convert.step_to_pb("plan", step))
    assert back.seqs == step.seqs and torch.equal(back.input, step.input)


def test_committed_tokens_round_trip_with_positions():
    tokens = [SampledToken(SeqId(3), 11, 7, TokenLogprobs(7, -0.5, (7, 2), (-0.5, -1.5))),
              SampledToken(SeqId(3), 12, 4)]
    reply = stage_pb2.StepReply(step_id=9, tokens=stage_convert.tokens_to_pb(tokens))
    assert stage_convert.result_from_pb(reply).tokens == tuple(tokens)


@pytest.mark.parametrize("num_tokens, num_scored, draft", [
    (4, 2, (7, 8, 9)),  # scored rows must be 0 or drafts + 1
    (2, 4, (7, 8, 9)),  # more scored rows than rows
    (4, 0, (7,)),  # a draft nobody scores
    (80, 71, tuple(range(70))),  # beyond the draft limit
])
def test_inconsistent_draft_entries_are_refused(num_tokens, num_scored, draft):
    msg = stage_pb2.StepRequest(plan_id="p", step_id=1, input=stage_convert.codec.to_pb(torch.zeros(num_tokens,
                                                                                                     dtype=torch.int64)))
    msg.seqs.add(seq_id=1, start=0, num_tokens=num_tokens, num_scored=num_scored, draft=draft,
                 sampling=stage_convert.sampling_to_pb(PARAMS))
    with pytest.raises(MalformedMessage, match="scored rows"):
        stage_convert.step_from_pb(msg)
