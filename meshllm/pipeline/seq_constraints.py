"""What the leader keeps per sequence so the last stage can process its logits: the grammar
matcher (allowed tokens) and the counts of generated tokens (penalties).

Only the leader has a sequence's token history, so it ships, with every scored step, the
penalty counts up to the last committed token and one allowed-token mask per scored row.
For a verified draft it walks the matcher along the draft and rolls it back: the matcher only
ever holds committed tokens, so a replayed step (failover) or any number of rejected drafts
never desynchronise it. The draft ends at the first token the grammar rejects: dropped from a
draft without probabilities (exact-match verification then samples that row as usual), kept in
one with them (speculative sampling must reject it at its row, where the mask makes p zero, and
draw from the residual: drawing from p there instead, because of what was drafted, biases the
output). It ends after a stop token too, which is not walked: llguidance's rollback over a
stop token takes back the token before it instead.
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

    def inputs(self, draft: tuple[int, ...], keep_rejected: bool = False
               ) -> tuple[tuple[int, ...], PenaltyCounts, tuple[Tensor, ...]]:
        """(the draft as the step carries it, penalty counts, one mask per scored row);
        `keep_rejected`: the draft has probabilities (see the module doc)."""
        penalties = PenaltyCounts.of(self.params, self.prompt_ids, self.output_counts)
        if self.matcher is None:
            return draft, penalties, ()
        masks = [self.matcher.allowed()]
        walked = 0
        for token_id in draft:
            allowed = allows(masks[-1], token_id)
            if allowed and token_id in self.matcher.stop_ids:
                masks.append(self.matcher.stopped_mask())  # what may follow it (with ignore_eos)
                break
            if not allowed:
                if keep_rejected:
                    masks.append(masks[-1])  # its row rejects it: the row after it is never used
                break
            if not self.matcher.accept(token_id):  # never expected: the mask allowed it
                break
            walked += 1
            masks.append(self.matcher.allowed())
        self.matcher.rollback(walked)
        return draft[:len(masks) - 1], penalties, tuple(torch.from_numpy(m) for m in masks)

    def commit(self, token_id: int) -> str | None:
        """Account for a committed token; returns why the grammar refuses it (never expected: the
        last stage only picks allowed tokens), else None."""
        if self.params.penalises:
            self.output_counts[token_id] += 1
        if self.matcher is not None and not self.matcher.accept(token_id):
            return f"the {self.matcher.description} grammar refused token {token_id}: {self.matcher.error}"
        return None
