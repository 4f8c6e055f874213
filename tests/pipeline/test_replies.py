"""The leader refuses replies that do not answer the step it sent."""

from __future__ import annotations

import pytest

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.scheduler import Work
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import SampledToken, StageTiming, StepResult
from meshllm.errors import InvalidReply, PipelineStalled
from meshllm.pipeline.replies import ReplyCheck, committed_tokens

PARAMS = SamplingParams(temperature=0, seed=1)


def work(seq_id: int, start: int, n: int, draft: tuple[int, ...] = (), scored: bool = True) -> Work:
    seq = Sequence(SeqId(seq_id), list(range(start + 1)), PARAMS)
    return Work(seq, start, n, (1 + len(draft)) if scored else 0, draft=draft)


def tok(seq_id: int, position: int, token_id: int) -> SampledToken:
    return SampledToken(SeqId(seq_id), position, token_id)


def test_accepted_drafts_and_bonus_are_committed_in_position_order():
    w = work(1, 10, 4, draft=(7, 8, 9))
    got = committed_tokens([w], [tok(1, 12, 5), tok(1, 11, 7)])
    assert [(t.position, t.token_id) for t in got[SeqId(1)]] == [(11, 7), (12, 5)]


@pytest.mark.parametrize("tokens, match", [
    ([], "returned 0 tokens"),
    ([tok(1, 11, 7), tok(1, 12, 8), tok(1, 13, 9), tok(1, 14, 1), tok(1, 15, 1)], "returned 5 tokens"),
    ([tok(1, 12, 7)], "position 12, expected 11"),
    ([tok(1, 11, 6), tok(1, 12, 1)], "accepted token 6 at position 11 but the draft proposed 7"),
    ([tok(1, 11, 7), tok(2, 3, 1)], "did not score"),
])
def test_malformed_replies_are_refused(tokens, match):
    with pytest.raises(InvalidReply, match=match):
        committed_tokens([work(1, 10, 4, draft=(7, 8, 9)), work(2, 2, 1, scored=False)], tokens)


CHECK = ReplyCheck(vocab_size=100, stage_names=("node-a (10.0.0.1:7650)", "node-b (10.0.0.2:7650)"))
LOGPROBS = SamplingParams(temperature=0, seed=1, logprobs=2)


def logprob_work() -> Work:
    return Work(Sequence(SeqId(5), [1, 2, 3], LOGPROBS), 2, 1, 1)


def lp(token_id: int, logprob: float = -0.5, top=((3, -0.5), (4, -1.0))) -> TokenLogprobs:
    return TokenLogprobs(token_id, logprob, tuple(i for i, _ in top), tuple(v for _, v in top))


@pytest.mark.parametrize("token, match", [
    (SampledToken(SeqId(1), 12, 100), "token id 100, outside the vocabulary"),
    (SampledToken(SeqId(1), 12, -1), "token id -1"),
    (SampledToken(SeqId(1), 12, 7, lp(7)), "returned logprobs for a sequence that asked for none"),
])
def test_token_ids_outside_the_vocabulary_or_unasked_logprobs_name_the_last_stage(token, match):
    result = StepResult(1, (token,))
    with pytest.raises(InvalidReply, match=match) as caught:
        CHECK.committed([work(1, 11, 1)], result)
    assert "node-b (10.0.0.2:7650)" in str(caught.value)


@pytest.mark.parametrize("logprobs", [
    None,  # asked for, missing
    lp(3, float("nan")), lp(3, float("-inf")), lp(3, 0.5),  # the chosen token's must be finite and <= 0
    lp(3, top=((3, -0.5),)),  # one alternative where two were asked
    lp(3, top=((3, -0.5), (4, float("nan")))), lp(3, top=((3, -0.5), (400, -1.0))),
    lp(9),  # logprobs of another token
])
def test_malformed_logprobs_are_refused(logprobs):
    with pytest.raises(InvalidReply):
        CHECK.committed([logprob_work()], StepResult(1, (SampledToken(SeqId(5), 3, 3, logprobs),)))


def test_well_formed_logprobs_pass_and_an_impossible_alternative_may_be_minus_infinity():
    token = SampledToken(SeqId(5), 3, 3, lp(3, top=((3, -0.5), (4, float("-inf")))))
    assert CHECK.committed([logprob_work()], StepResult(1, (token,)))[SeqId(5)] == (token,)


@pytest.mark.parametrize("timings", [
    (StageTiming(2, 0.1, 1.0, 1.0),),  # no stage 2 in the plan (and metrics label by stage)
    (StageTiming(0, 0.1, 1.0, 1.0), StageTiming(0, 0.1, 1.0, 1.0)),
    (StageTiming(1, float("nan"), 1.0, 1.0),), (StageTiming(1, -1.0, 1.0, 1.0),),
])
def test_timings_must_name_each_stage_of_the_plan_once_with_finite_numbers(timings):
    with pytest.raises(InvalidReply):
        CHECK.committed([work(1, 11, 1)], StepResult(1, (tok(1, 12, 7),), timings))


def test_an_error_reply_names_the_failed_stages_node_and_is_cut_to_a_printable_length():
    error = CHECK.failure(StepResult(1, error_code="shard_corrupt", error_message="bad\x1b[31m" + "x" * 5000,
                                     failed_stage=1))
    assert isinstance(error, PipelineStalled) and "stage 1 on node-b (10.0.0.2:7650)" in str(error)
    assert "\x1b" not in str(error) and len(str(error)) < 700
    assert isinstance(CHECK.failure(StepResult(1, error_code="x", failed_stage=7)), InvalidReply)


def test_a_reply_with_one_timing_per_stage_passes():
    timings = (StageTiming(0, 0.1, 1.0, 1.1), StageTiming(1, 0.2, 1.1, 1.3))
    assert CHECK.committed([work(1, 11, 1)], StepResult(1, (tok(1, 12, 7),), timings))[SeqId(1)][0].token_id == 7
