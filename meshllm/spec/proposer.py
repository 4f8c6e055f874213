"""What every proposer (n-gram, draft model, a remote node) answers, and the per-sequence
token history it keeps so a request carries only what changed.

The interface is `propose(committed_token_ids, k) -> draft`, made incremental and batched:
a ProposeRequest gives one sequence's tokens from `position` on, and the proposer keeps
the tokens before it from earlier requests (plus the tokens it drafted, as assumed
context). A proposer that does not hold `position` tokens of the sequence (it restarted,
or released the sequence) answers `resync_from` instead of a draft, and the caller
resends from there. So a decode step costs a few token ids on the wire, not the context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import MAX_DRAFT_SUPPORT, DraftDist
from meshllm.errors import MeshError

MAX_DRAFT_TOKENS = 64  # per request; the Step wire format caps a verified draft at the same
# A request carrying more context tokens than this is a catch-up (a prompt, or a long stretch
# decoded plainly): the proposer prefills them first, so its time is not a block's drafting time.
CATCH_UP_TOKENS = 32


class ProposerError(MeshError):
    """A proposer could not answer (unreachable, too slow, refused). Costs speed only: the
    leader decodes without its drafts."""

    code = "proposer_unavailable"


class IncompatibleDraftModel(MeshError):
    """A draft model does not share the target's tokenizer, so its token ids mean other text."""

    code = "incompatible_draft_model"


@dataclass(frozen=True, slots=True)
class DraftSampling:
    """How a proposer with a distribution draws its tokens: from q = the draft model's
    softmax(logits / temperature) restricted to its `support` likeliest tokens and renormalised
    (the sparse q it reports), each draw seeded by (seed, position). Greedy proposers ignore it."""

    temperature: float
    seed: int
    support: int = 16

    def __post_init__(self):
        if not 0.0 < self.temperature <= 100.0 or not 1 <= self.support <= MAX_DRAFT_SUPPORT:
            raise ValueError(f"draft sampling needs temperature in (0, 100] and support in [1, "
                             f"{MAX_DRAFT_SUPPORT}], got {self.temperature} and {self.support}")


@dataclass(frozen=True, slots=True)
class ProposeRequest:
    """Propose up to `k` tokens for `seq_id` after its tokens[:position] + `tokens`."""

    seq_id: SeqId
    position: int  # tokens[0] sits at this position of the sequence
    tokens: tuple[int, ...]
    k: int
    sampling: DraftSampling | None = None  # None: propose the likeliest tokens (a point mass)

    def __post_init__(self):
        if self.position < 0 or not 0 <= self.k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"sequence {self.seq_id}: position {self.position} / k {self.k} out of range")

    @property
    def end(self) -> int:
        return self.position + len(self.tokens)


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens proposed after the request's context. `dists[i]` is the q that tokens[i] was
    drawn from (None for point-mass proposers: n-gram, greedy drafting). A proposer missing
    context answers `resync_from` (how many tokens it holds) and no tokens."""

    seq_id: SeqId
    tokens: tuple[int, ...] = ()
    dists: tuple[DraftDist, ...] | None = None
    resync_from: int | None = None


class Proposer(Protocol):
    """Drafts for many sequences. Called from one thread at a time (the leader's drafting
    thread, or the Proposer gRPC service under its lock); may block for the draft's compute."""

    name: str  # "ngram", a draft model's id, "remote:<node>"
    # True: answers in microseconds in this process (no I/O, no model), so the leader calls it on
    # its loop thread instead of its drafting thread (spec/drafter.py). Absent means False.
    inline: bool
    # True: the draft's length says how sure the proposer is (n-gram: its suffix match), so the
    # leader asks for the most it may send and judges each offer by its length. Absent means False.
    sizes_drafts: bool

    # `cancelled` (optional to honour): asked while drafting; once true nobody wants the answer.
    def propose(self, requests: Sequence[ProposeRequest], cancelled: Callable[[], bool] = ...) -> list[Draft]: ...

    def release(self, seq_ids: Sequence[SeqId]) -> None: ...


def catch_up_tokens(requests: Sequence[ProposeRequest]) -> int:
    """Context tokens the proposer must prefill before drafting, over the requests that are catch-ups."""
    return sum(len(r.tokens) for r in requests if len(r.tokens) > CATCH_UP_TOKENS)


def checked_draft(draft: Draft, request: ProposeRequest, vocab_size: int) -> Draft:
    """A peer's (or a buggy proposer's) draft cut to what can be verified: at most k tokens,
    ids inside the vocabulary; distributions dropped unless each is well formed and contains
    its token. Never raises: a bad draft only costs acceptance."""
    tokens = list(draft.tokens[:request.k])
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            del tokens[i:]
            break
    dists = draft.dists
    if dists is not None:
        if len(dists) < len(tokens) or not all(_well_formed(d, t, vocab_size) for d, t in zip(dists, tokens)):
            dists = None
        else:
            dists = tuple(dists[:len(tokens)])
    return Draft(draft.seq_id, tuple(tokens), dists if tokens else None, draft.resync_from)


def _well_formed(d: DraftDist, token: int, vocab_size: int) -> bool:
    if not 0 < len(d.ids) == len(d.probs) <= MAX_DRAFT_SUPPORT or len(set(d.ids)) != len(d.ids):
        return False
    if any(not 0 <= i < vocab_size for i in d.ids) or any(not p >= 0.0 for p in d.probs):
        return False
    if abs(sum(d.probs) - 1.0) > 1e-3:
        return False
    return any(i == token and p > 0.0 for i, p in zip(d.ids, d.probs))
