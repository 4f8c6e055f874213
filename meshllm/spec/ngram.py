"""Prompt-lookup proposer: the longest suffix of the sequence seen earlier in it, and what followed.

Zero weights, so every node can serve it. Per sequence it indexes every n-gram (n up to
`max_ngram`) by the positions that follow it; proposing finds the longest n whose latest
earlier occurrence exists, measures how far back that match really extends, and copies
the continuation. As in SuffixDecoding the draft grows with the match: a 1-token match
proposes 1 token, a 10-token match up to 10 (capped by k), so free text (short chance
matches) costs few rejected rows and repeated text (code edits, quotes) drafts long blocks.
Updates are incremental: appending a token adds `max_ngram` index entries, rolling back
a speculative tail removes them, so a step costs O(k * max_ngram), not O(context).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshllm.engine.kv_cache import SeqId
from meshllm.spec.proposer import Draft, ProposeRequest

MAX_MATCH_LENGTH = 64  # how far back a match is measured


@dataclass(frozen=True, slots=True)
class NgramConfig:
    max_ngram: int = 8  # longest n-gram indexed
    min_ngram: int = 1  # shortest suffix that may start a draft
    draft_per_matched_token: float = 1.0  # draft length = this x match length (capped by k)
    max_sequences: int = 4096

    def __post_init__(self):
        if not 1 <= self.min_ngram <= self.max_ngram <= 32 or self.draft_per_matched_token <= 0:
            raise ValueError(f"n-gram proposer needs 1 <= min_ngram <= max_ngram <= 32 and a positive "
                             f"draft_per_matched_token: {self}")


class _Index:
    """One sequence's tokens and, per n-gram, the positions that follow its occurrences (ascending)."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.follows: dict[tuple[int, ...], list[int]] = {}

    def truncate(self, length: int) -> None:
        while len(self.tokens) > length:
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                key = tuple(self.tokens[end - n:end])
                positions = self.follows[key]
                positions.pop()  # appended last, so it is last
                if not positions:
                    del self.follows[key]
            self.tokens.pop()

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.follows.setdefault(tuple(self.tokens[end - n:end]), []).append(end)

    def longest_match(self, min_ngram: int, enough: int = MAX_MATCH_LENGTH) -> tuple[int, int] | None:
        """(start of the continuation, match length) of the longest suffix that occurred earlier;
        the length is measured back to `enough` at most (what the caller can use)."""
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end - 1), min_ngram - 1, -1):
            positions = self.follows.get(tuple(self.tokens[end - n:end]))
            if not positions or len(positions) < 2:
                continue  # the suffix itself is the only occurrence
            start = positions[-2]  # the latest occurrence before the suffix itself
            length = n
            while length < enough and start - length - 1 >= 0 \
                    and self.tokens[start - length - 1] == self.tokens[end - length - 1]:
                length += 1
            return start, length
        return None


class NgramProposer:
    """Proposer over each sequence's own tokens (meshllm.spec.proposer.Proposer)."""

    name = "ngram"
    inline = True  # a dict lookup and a copy per request: cheaper than a thread hop
    sizes_drafts = True  # as long as the match: the leader weighs each offer by its length

    def __init__(self, config: NgramConfig | None = None):
        self.config = config or NgramConfig()
        self._indexes: dict[SeqId, _Index] = {}

    def propose(self, requests: Sequence[ProposeRequest], cancelled: Callable[[], bool] = lambda: False
                ) -> list[Draft]:
        return [self._propose_one(r) for r in requests]  # microseconds: `cancelled` is never worth asking

    def _propose_one(self, request: ProposeRequest) -> Draft:
        index = self._indexes.get(request.seq_id)
        if index is None:
            if request.position != 0:
                return Draft(request.seq_id, resync_from=0)
            if len(self._indexes) >= self.config.max_sequences:
                del self._indexes[next(iter(self._indexes))]
            index = self._indexes[request.seq_id] = _Index(self.config.max_ngram)
        if request.position > len(index.tokens):
            return Draft(request.seq_id, resync_from=len(index.tokens))
        index.truncate(request.position)
        index.extend(request.tokens)
        if request.k == 0:
            return Draft(request.seq_id)
        # A match longer than the draft it allows is not measured further: on a model's loops of
        # repeated text that walk back 64 tokens was most of a batch-8 step's drafting time.
        enough = min(MAX_MATCH_LENGTH, math.ceil(request.k / self.config.draft_per_matched_token))
        match = index.longest_match(self.config.min_ngram, enough)
        if match is None:
            return Draft(request.seq_id)
        start, length = match
        limit = min(request.k, math.ceil(self.config.draft_per_matched_token * length))
        # The continuation may run into the tokens being drafted (a repeating pattern): copy one at a time.
        draft: list[int] = []
        while len(draft) < limit:
            draft.append(index.tokens[start + len(draft)] if start + len(draft) < len(index.tokens)
                         else draft[start + len(draft) - len(index.tokens)])
        index.extend(draft)  # assumed context for the next request (rolled back if it was wrong)
        return Draft(request.seq_id, tuple(draft))

    def release(self, seq_ids: Sequence[SeqId]) -> None:
        for s in seq_ids:
            self._indexes.pop(s, None)
