"""Speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for drafts that carry q.

A draft token d was drawn from the proposer's distribution q. The verifier accepts it
with probability min(1, p(d) / q(d)), p being exactly what plain sampling draws from at
that position (sampler.target_distribution: temperature, top-k, top-p); on rejection it
draws from the residual max(0, p - q), normalised, and stops. The committed token is then
distributed exactly as p whatever q was, and the acceptance probability is sum(min(p, q)),
more than the sum(p * q) of accepting only an exact match with the verifier's own draw.

Both uniform numbers come from the position's generator (seed, position), so a step
replayed with the same draft commits the same token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from meshllm.engine.sampler import SamplingParams, inverse_cdf, target_distribution
from meshllm.engine.step import DraftDist


def accept_or_resample(row: Tensor, params: SamplingParams, generator: torch.Generator, draft_token: int,
                       q: DraftDist) -> tuple[int, bool]:
    """(committed token, whether it is the accepted draft) for one scored row (fp32 [vocab])."""
    probs, ids = target_distribution(row, params)
    p = probs.double() if ids is None else torch.zeros(row.shape[-1], dtype=torch.float64).index_put_(
        (ids,), probs.double())
    p = p / p.sum()
    u = float(torch.rand((), generator=generator, dtype=torch.float64))
    q_of_draft = q.prob(draft_token)
    if q_of_draft > 0.0 and u * q_of_draft < float(p[draft_token]):
        return draft_token, True
    residual = p.clone()
    residual[torch.tensor(q.ids, dtype=torch.long)] -= torch.tensor(q.probs, dtype=torch.float64)
    residual.clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q up to rounding: the draft was rejected by rounding alone
        residual = p
    return inverse_cdf(residual, float(torch.rand((), generator=generator, dtype=torch.float64))), False
