"""The leader refuses replies that do not answer the step it sent."""

from __future__ import annotations

import pytest

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import Work
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import SampledToken
from meshllm.errors import InvalidReply
from meshllm.pipeline.replies import committed_tokens

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
