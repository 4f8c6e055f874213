"""A micro-batch as it travels through the stages of a pipeline, and what comes back.

Frozen dataclasses inside the process; transport/stage_convert.py turns them
into protobuf and back, checking every field a peer could get wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.logit_processors import PenaltyCounts, RowInputs
from meshllm.engine.sampler import SamplingParams, TokenLogprobs


MAX_DRAFT_SUPPORT = 64  # entries of one sparse draft distribution


@dataclass(frozen=True, slots=True)
class DraftDist:
    """A sparse draft distribution q: the draft token was drawn from exactly these ids with
    these probabilities (summing to 1). The last stage then accepts it with min(1, p/q)."""

    ids: tuple[int, ...]
    probs: tuple[float, ...]

    def prob(self, token_id: int) -> float:
        for i, p in zip(self.ids, self.probs):
            if i == token_id:
                return p
        return 0.0


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's rows in a micro-batch: tokens at positions [start, start + num_tokens).

    The last stage scores the last `num_scored` rows: none for a prefill chunk that does not
    reach the end of the known tokens, one for a chunk that does or a plain decode step, and
    len(draft) + 1 when the step verifies draft tokens. The draft is the last len(draft) input
    rows (proposed, not yet committed): row i's logits decide whether draft[i] is accepted.

    `penalties` are the sequence's penalty counts up to its last committed token (empty unless
    its sampling penalises repeats); `allowed` holds, for a grammar-constrained sequence, one
    allowed-token bitmask per scored row (row i: after the committed tokens and draft[:i]).
    """

    seq_id: SeqId
    start: int
    num_tokens: int
    num_scored: int = 0
    sampling: SamplingParams | None = None  # with a concrete seed; set when num_scored > 0
    attach: tuple[int, ...] = ()  # prefix-cache blocks to copy in first; start == len(attach) * block size
    draft: tuple[int, ...] = ()
    penalties: PenaltyCounts = PenaltyCounts()
    allowed: tuple[Tensor, ...] = ()  # int32 bitmask words per scored row; () without a grammar
    # q of each draft token when the proposer sampled it (speculative sampling); None: point masses,
    # verified by exact match against the verifier's own draw.
    draft_dists: tuple[DraftDist, ...] | None = None

    def __post_init__(self):
        if self.start < 0 or self.num_tokens < 1:
            raise ValueError(f"sequence {self.seq_id}: start {self.start} / num_tokens {self.num_tokens} invalid")
        if self.num_scored not in ((len(self.draft) + 1,) if self.draft else (0, 1)) \
                or self.num_scored > self.num_tokens:
            raise ValueError(f"sequence {self.seq_id}: {self.num_scored} scored rows for {len(self.draft)} draft "
                             f"tokens in {self.num_tokens} rows; expected 0 or len(draft) + 1")
        if self.draft_dists is not None and len(self.draft_dists) != len(self.draft):
            raise ValueError(f"sequence {self.seq_id}: {len(self.draft_dists)} draft distributions for "
                             f"{len(self.draft)} draft tokens")
        if self.num_scored and (self.sampling is None or self.sampling.seed is None):
            raise ValueError(f"sequence {self.seq_id} is scored but carries no seeded SamplingParams")
        if self.allowed and len(self.allowed) != self.num_scored:
            raise ValueError(f"sequence {self.seq_id}: {len(self.allowed)} allowed-token masks for "
                             f"{self.num_scored} scored rows")

    def row_inputs(self) -> list[RowInputs]:
        """Penalty counts and mask of each scored row: row i also counts draft[:i] as generated."""
        penalise = self.sampling is not None and self.sampling.penalises
        return [RowInputs(self.penalties.extended(self.draft[:i]) if penalise else PenaltyCounts(),
                          self.allowed[i] if self.allowed else None) for i in range(self.num_scored)]

    @property
    def first_new_position(self) -> int:
        """Position of the first token this work can commit (the draft's first, else the next one)."""
        return self.start + self.num_tokens - len(self.draft)


@dataclass(frozen=True, slots=True)
class Publish:
    """Keep the KV of a sequence's prompt blocks [first_block, first_block + len(hashes))."""

    seq_id: SeqId
    first_block: int
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StageTiming:
    stage_index: int
    compute_s: float
    received_at: float
    sent_at: float


@dataclass(frozen=True, slots=True)
class Step:
    step_id: int
    seqs: tuple[SeqWork, ...]
    input: Tensor  # token ids [tokens] into the first stage; hidden states [tokens, hidden] after
    release: tuple[SeqId, ...] = ()
    timings: tuple[StageTiming, ...] = ()
    publish: tuple[Publish, ...] = ()  # applied after evict, before release (stage_runner.py)
    evict: tuple[int, ...] = ()
    block_size: int = 0  # tokens per prefix-cache block (0: no prefix cache in this step)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def chores(self) -> Step | None:
        """This step's releases, publications and evictions without its work, or None without any:
        what the stages after one that failed the step still owe the leader, which counts them done."""
        if not (self.release or self.publish or self.evict):
            return None
        return Step(self.step_id, (), self.input[:0], self.release, (), self.publish, self.evict, self.block_size)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """A token the last stage committed for `seq_id` at `position` (its index in the sequence).

    A scored work yields 1 + the number of accepted draft tokens, at consecutive positions from
    its `first_new_position`: the accepted drafts, then the verifier's own next token.
    """

    seq_id: SeqId
    position: int
    token_id: int
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True, slots=True)
class StepResult:
    step_id: int
    tokens: tuple[SampledToken, ...] = ()
    timings: tuple[StageTiming, ...] = ()
    error_code: str | None = None  # None when the step succeeded
    error_message: str = ""
    failed_stage: int | None = None

    @property
    def ok(self) -> bool:
        return self.error_code is None
