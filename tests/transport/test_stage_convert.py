"""Steps and replies survive the wire unchanged, and malformed ones are refused with clear errors."""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams, TokenLogprobs
from meshllm.engine.step import SampledToken, SeqWork, Step
from meshllm.engine.step_limits import WIRE_LIMITS, StepLimits
from meshllm.errors import BadRequest, MalformedMessage, PlanLimitExceeded
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


LIMITS = StepLimits(max_context=64, max_seqs=2, max_step_tokens=16, prefix_block_size=4, max_prefix_blocks=8)


def request(*entries: tuple[int, int, int], block_size: int = 4, attach: tuple[int, ...] = ()) -> stage_pb2.StepRequest:
    """A step of (seq_id, start, num_tokens) entries with matching token-id input."""
    total = sum(n for _, _, n in entries)
    msg = stage_pb2.StepRequest(plan_id="p", step_id=1, block_size=block_size,
                                input=stage_convert.codec.to_pb(torch.zeros(total, dtype=torch.int64)))
    for seq_id, start, n in entries:
        msg.seqs.add(seq_id=seq_id, start=start, num_tokens=n, attach=attach)
    return msg


@pytest.mark.parametrize("msg, match", [
    (request((1, 0, 1), (2, 0, 1), (3, 0, 1)), "3 sequences; the plan's batch is 2"),
    (request((1, 0, 10), (2, 0, 7)), "more than 16 tokens"),
    (request((1, 60, 5)), "position 65, beyond the plan's context of 64"),
])
def test_steps_beyond_the_plans_limits_are_refused(msg, match):
    stage_convert.step_from_pb(msg)  # within the wire's own limits
    with pytest.raises(PlanLimitExceeded, match=match):
        stage_convert.step_from_pb(msg, LIMITS)


def verification(start: int, draft: tuple[int, ...], others: int = 0) -> stage_pb2.StepRequest:
    """A speculative step: one sequence's last committed token plus `draft` (with its q), and
    `others` decode rows of other sequences."""
    n = 1 + len(draft)
    msg = request((1, start, n), *((2 + i, 0, 1) for i in range(others)))
    entry = msg.seqs[0]
    entry.sampling.CopyFrom(stage_convert.sampling_to_pb(PARAMS))
    entry.num_scored = n
    entry.draft.extend(draft)
    entry.draft_dists.extend(stage_pb2.DraftDist(ids=[t], probs=[1.0]) for t in draft)
    return msg


def test_draft_rows_count_against_the_plans_step_tokens_and_context():
    assert stage_convert.step_from_pb(verification(40, tuple(range(15))), LIMITS).num_tokens == 16
    with pytest.raises(PlanLimitExceeded, match="more than 16 tokens"):  # 1 + 15 drafts + another sequence
        stage_convert.step_from_pb(verification(40, tuple(range(15)), others=1), LIMITS)
    assert stage_convert.step_from_pb(verification(56, tuple(range(7))), LIMITS).num_tokens == 8
    with pytest.raises(PlanLimitExceeded, match="position 65, beyond the plan's context of 64"):
        stage_convert.step_from_pb(verification(56, tuple(range(8))), LIMITS)


def test_another_block_size_or_more_blocks_than_the_plan_keeps_are_refused():
    with pytest.raises(MalformedMessage, match="block size 4"):
        stage_convert.step_from_pb(request((1, 0, 1), block_size=8), LIMITS)
    with pytest.raises(MalformedMessage, match="keeps 8 blocks"):
        stage_convert.step_from_pb(request((1, 36, 1), attach=tuple(range(9))), LIMITS)
    assert stage_convert.step_from_pb(request((1, 0, 16)), LIMITS).num_tokens == 16  # the limit itself is fine


def test_limits_travel_in_the_load_request_and_a_request_without_them_gets_the_wires():
    load = stage_pb2.LoadRequest(plan_id="p")
    assert stage_convert.limits_from_pb(load) == WIRE_LIMITS
    stage_convert.limits_to_pb(LIMITS, load)
    assert stage_convert.limits_from_pb(stage_pb2.LoadRequest.FromString(load.SerializeToString())) == LIMITS
    load.max_seqs = -3
    with pytest.raises(BadRequest, match="step limits"):
        stage_convert.limits_from_pb(load)


def test_allowed_token_masks_inflate_to_at_most_the_steps_budget(monkeypatch):
    """A mask compresses ~1000:1 (a run of ones), so the bytes a step's masks inflate to are
    bounded in all, not only per mask: under the wire's limits a step may carry 4096 x 65 masks."""
    import numpy as np

    from meshllm.transport.token_mask import MAX_MASK_WORDS, mask_to_bytes

    monkeypatch.setattr(stage_convert, "MAX_STEP_MASK_BYTES", 8 * 4 * MAX_MASK_WORDS)  # eight whole masks
    mask = mask_to_bytes(np.full(MAX_MASK_WORDS, -1, dtype=np.int32))
    assert len(mask) < 1024  # 128 KiB of ones

    def step(num_seqs: int) -> stage_pb2.StepRequest:
        works = tuple(SeqWork(SeqId(s), 0, 3, 3, PARAMS, draft=(5, 6)) for s in range(num_seqs))
        msg = stage_convert.step_to_pb("plan", Step(1, works, torch.zeros(3 * num_seqs, dtype=torch.int64)))
        for e in msg.seqs:
            e.allowed.extend([mask] * 3)
        return msg

    assert len(stage_convert.step_from_pb(step(2)).seqs[1].allowed) == 3  # six masks: within
    with pytest.raises(PlanLimitExceeded, match="allowed-token masks exceed"):
        stage_convert.step_from_pb(step(3))  # nine
    # A stage that does not sample never inflates them (it passes the request's bytes on).
    assert all(not s.allowed for s in stage_convert.step_from_pb(step(3), samples=False).seqs)


def test_only_the_sampling_stage_inflates_masks_so_only_it_refuses_a_bad_one():
    from meshllm.errors import MalformedMessage

    works = (SeqWork(SeqId(1), 0, 1, 1, PARAMS),)
    msg = stage_convert.step_to_pb("plan", Step(1, works, torch.zeros(1, dtype=torch.int64)))
    msg.seqs[0].allowed.append(b"not zlib")
    assert stage_convert.step_from_pb(msg, samples=False).seqs[0].allowed == ()
    with pytest.raises(MalformedMessage, match="does not decompress"):
        stage_convert.step_from_pb(msg)
    msg.seqs[0].allowed.append(b"x")  # two masks for one scored row: refused by every stage
    with pytest.raises(MalformedMessage, match="2 allowed-token masks for 1"):
        stage_convert.step_from_pb(msg, samples=False)
