"""What the leader keeps per sequence so the last stage can process its logits: the grammar
matcher (allowed tokens) and the counts of generated tokens (penalties).

Only the leader has a sequence's token history, so it ships, with every scored step, the
penalty counts up to the last committed token and one allowed-token mask per scored row.
For a verified draft it walks the matcher along the draft, cutting the draft at the first
token the grammar rejects (a rejected draft token is never proposed), and rolls the matcher
back: the matcher only ever holds committed tokens, so a replayed step (failover) or any
number of rejected drafts never desynchronise it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from meshllm.engine.grammar import Matcher, allows
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.engine.sampler import SamplingParams


@dataclass
class SeqConstraints:
    """Owned by the leader's loop thread."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    matcher: Matcher | None = None
    output_counts: Counter = field(default_factory=Counter)

    @property
    def active(self) -> bool:
        return self.matcher is not None or self.params.penalises

    def inputs(self, draft: tuple[int, ...]) -> tuple[tuple[int, ...], PenaltyCounts, tuple[Tensor, ...]]:
        """(draft as far as the grammar allows it, penalty counts, one mask per scored row)."""
        penalties = PenaltyCounts.of(self.params, self.prompt_ids, self.output_counts)
        if self.matcher is None:
            return draft, penalties, ()
        masks = [self.matcher.allowed()]
        for token_id in draft:
            if not allows(masks[-1], token_id) or not self.matcher.accept(token_id):
                break
            masks.append(self.matcher.allowed())
        self.matcher.rollback(len(masks) - 1)
        return draft[:len(masks) - 1], penalties, tuple(torch.from_numpy(m) for m in masks)

    def commit(self, token_id: int) -> str | None:
        """Account for a committed token; returns why the grammar refuses it (never expected: the
        last stage only picks allowed tokens), else None."""
        if self.params.penalises:
            self.output_counts[token_id] += 1
        if self.matcher is not None and not self.matcher.accept(token_id):
            return f"the {self.matcher.description} grammar refused token {token_id}: {self.matcher.error}"
        return None
