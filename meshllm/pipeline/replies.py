"""Check a step's reply against the step before the leader commits anything from it.

The stages are peers: a reply must give, for every scored work and no other, 1 to
len(draft) + 1 tokens at consecutive positions from the work's first new position, the
leading ones equal to the draft tokens they accept, every id inside the vocabulary, and
logprobs (exactly when asked) at most 0, the chosen token's finite. Its timings name each stage of the
plan at most once with finite, non-negative numbers (they feed metrics labelled by
stage). An error reply names a stage of the plan. Whatever is wrong raises InvalidReply
naming the node that answered, so an operator knows which machine to look at.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import TokenLogprobs
from meshllm.engine.scheduler import Work
from meshllm.engine.step import SampledToken, StepResult
from meshllm.errors import InvalidReply, PipelineStalled

MAX_ERROR_MESSAGE = 500  # characters of a stage's error message passed on to clients and logs
_LOGPROB_SLACK = 1e-3  # log-softmax is <= 0 up to rounding


@dataclass(frozen=True, slots=True)
class ReplyCheck:
    """What a valid reply looks like for one plan. `stage_names[i]` names stage i's node."""

    vocab_size: int | None
    stage_names: tuple[str, ...]

    @property
    def last_stage(self) -> str:
        return self.stage_names[-1] if self.stage_names else "the last stage"

    def committed(self, works: Sequence[Work], result: StepResult) -> dict[SeqId, tuple[SampledToken, ...]]:
        """The tokens each work of a successful step commits, by sequence; raises InvalidReply."""
        self._check_timings(result)
        return committed_tokens(works, result.tokens, self.vocab_size, self.last_stage)

    def failure(self, result: StepResult) -> PipelineStalled | InvalidReply:
        """The error to fail a failed step's sequences with, naming the stage's node."""
        stage = result.failed_stage
        if stage is not None and not 0 <= stage < len(self.stage_names):
            return InvalidReply(f"{self.stage_names[0] if self.stage_names else 'stage 0'} relayed an error "
                                f"[{_printable(result.error_code, 40)}] from stage {stage}, which is not in "
                                f"the plan")
        where = "the pipeline" if stage is None else f"stage {stage} on {self.stage_names[stage]}"
        return PipelineStalled(f"{where} failed: [{_printable(result.error_code, 40)}] "
                               f"{_printable(result.error_message, MAX_ERROR_MESSAGE)}")

    def _check_timings(self, result: StepResult) -> None:
        seen: set[int] = set()
        for t in result.timings:
            if not 0 <= t.stage_index < len(self.stage_names) or t.stage_index in seen:
                raise InvalidReply(f"{self.last_stage} answered with a timing for stage {t.stage_index}, which is "
                                   f"not in the plan or appears twice")
            seen.add(t.stage_index)
            if not all(math.isfinite(x) and x >= 0 for x in (t.compute_s, t.received_at, t.sent_at)):
                raise InvalidReply(f"{self.stage_names[t.stage_index]} reported a timing that is not a finite, "
                                   f"non-negative number")


def committed_tokens(works: Sequence[Work], tokens: Sequence[SampledToken], vocab_size: int | None = None,
                     answered_by: str = "the last stage") -> dict[SeqId, tuple[SampledToken, ...]]:
    """The tokens each work commits, by sequence; raises InvalidReply naming what is wrong."""
    by_seq: dict[SeqId, list[SampledToken]] = {}
    for t in tokens:
        by_seq.setdefault(t.seq_id, []).append(t)
    scored = {w.seq.seq_id: w for w in works if w.num_scored}
    stray = set(by_seq) - set(scored)
    if stray:
        raise InvalidReply(f"{answered_by} returned tokens for {len(stray)} sequence(s) the step did not score")
    out: dict[SeqId, tuple[SampledToken, ...]] = {}
    for seq_id, w in scored.items():
        mine = sorted(by_seq.get(seq_id, ()), key=lambda t: t.position)
        if not 1 <= len(mine) <= len(w.draft) + 1:
            raise InvalidReply(f"sequence {seq_id}: {answered_by} returned {len(mine)} tokens for a step that "
                               f"commits 1 to {len(w.draft) + 1}")
        first = w.start + w.num_tokens - len(w.draft)
        for i, t in enumerate(mine):
            if t.position != first + i:
                raise InvalidReply(f"sequence {seq_id}: {answered_by} returned a token at position {t.position}, "
                                   f"expected {first + i}")
            if i < len(mine) - 1 and t.token_id != w.draft[i]:
                raise InvalidReply(f"sequence {seq_id}: {answered_by} accepted token {t.token_id} at position "
                                   f"{t.position} but the draft proposed {w.draft[i]}")
            if vocab_size is not None and not 0 <= t.token_id < vocab_size:
                raise InvalidReply(f"sequence {seq_id}: {answered_by} returned token id {t.token_id}, outside the "
                                   f"vocabulary [0, {vocab_size})")
            _check_logprobs(seq_id, t, w.seq.params.logprobs, vocab_size, answered_by)
        out[seq_id] = tuple(mine)
    return out


def _check_logprobs(seq_id: SeqId, t: SampledToken, num_top: int | None, vocab_size: int | None,
                    answered_by: str) -> None:
    lp: TokenLogprobs | None = t.logprobs
    if (lp is None) != (num_top is None):
        raise InvalidReply(f"sequence {seq_id}: {answered_by} returned {'no ' if lp is None else ''}logprobs "
                           f"for a sequence that asked for {'none' if num_top is None else num_top}")
    if lp is None:
        return
    expected_top = num_top if vocab_size is None else min(num_top, vocab_size)
    # The chosen token was possible, so its logprob is finite; an alternative may be -inf (a
    # token a constraint rules out), never NaN or positive.
    if (lp.token_id != t.token_id or len(lp.top_ids) != expected_top or len(lp.top_logprobs) != expected_top
            or not (math.isfinite(lp.logprob) and lp.logprob <= _LOGPROB_SLACK)
            or not all(v <= _LOGPROB_SLACK for v in lp.top_logprobs)  # False for NaN
            or (vocab_size is not None and not all(0 <= i < vocab_size for i in lp.top_ids))):
        raise InvalidReply(f"sequence {seq_id}: {answered_by} returned malformed logprobs at position "
                           f"{t.position} (expected {expected_top} alternatives, logprobs <= 0 and the chosen one's "
                           f"finite, ids inside the vocabulary)")


def _printable(text: str, limit: int) -> str:
    """A peer's string, cut to `limit` characters, control characters replaced (it reaches logs)."""
    cut = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else "?" for c in cut)
