"""Speculative sampling keeps the target distribution: over many seeded draws, the token the
last stage commits for a drafted position is distributed as plain sampling's p, whatever q the
draft came from, and drafts are accepted with probability sum(min(p, q)).

Fixed seeds make the test deterministic; the tolerance is statistical: with N draws the
total-variation distance between the empirical and the exact distribution of a 6-token
vocabulary stays below 0.02 (its expected value is about 0.008 at N = 20000)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams, inverse_cdf, position_generator, target_distribution
from meshllm.engine.step import DraftDist, SeqWork
from meshllm.spec.verify import choose_tokens

N = 20_000
TV_TOLERANCE = 0.02
CHUNK = 500
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],  # row 0: scores the draft token
                       [0.0, 0.3, 0.1, 1.5, -0.5, 0.2]])  # row 1: the bonus row
Q = DraftDist((0, 1, 2, 4), (0.1, 0.5, 0.3, 0.1))  # deliberately far from p


def run(params: SamplingParams, dists: bool) -> tuple[torch.Tensor, float]:
    """N independent trials, CHUNK at a time through one choose_tokens call (each trial its own
    sequence, seed and generators, exactly as alone: the batch only amortises the call)."""
    counts = torch.zeros(6)
    accepted = 0
    for first in range(0, N, CHUNK):
        works = []
        for trial in range(first, min(first + CHUNK, N)):
            seed = 1000 + trial
            # The proposer draws its token from q with its own generator, independent of the verifier's.
            draft = Q.ids[inverse_cdf(torch.tensor(Q.probs), float(torch.rand((), generator=position_generator(
                seed ^ 0x5555, 10), dtype=torch.float64)))]
            works.append(SeqWork(SeqId(trial), 9, 2, 2, replace(params, seed=seed), draft=(draft,),
                                 draft_dists=(Q,) if dists else None))
        committed: dict[SeqId, list[int]] = {}
        for token in choose_tokens(LOGITS.repeat(len(works), 1), works):
            committed.setdefault(token.seq_id, []).append(token.token_id)
        for tokens in committed.values():
            counts[tokens[0]] += 1
            accepted += len(tokens) == 2
    return counts / N, accepted / N


def exact_p(params: SamplingParams) -> torch.Tensor:
    probs, ids = target_distribution(LOGITS[0], params)
    p = probs if ids is None else torch.zeros(6).index_put_((ids,), probs)
    return p / p.sum()


def test_min_p_over_q_acceptance_keeps_plain_sampling_distribution():
    started = time.perf_counter()
    q = torch.zeros(6).index_put_((torch.tensor(Q.ids),), torch.tensor(Q.probs, dtype=torch.float32))
    for params in (SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=0.7, top_k=4, seed=0)):
        p = exact_p(params)
        empirical, acceptance = run(params, dists=True)
        tv = 0.5 * float((empirical - p).abs().sum())
        assert tv < TV_TOLERANCE, (params, empirical, p)
        expected_acceptance = float(torch.minimum(p, q).sum())  # sum(min(p, q))
        assert abs(acceptance - expected_acceptance) < 0.02, (acceptance, expected_acceptance)
        # Exact match with the verifier's own draw (no q) accepts less: sum(p * q).
        empirical_exact, acceptance_exact = run(params, dists=False)
        assert 0.5 * float((empirical_exact - p).abs().sum()) < TV_TOLERANCE
        assert abs(acceptance_exact - float((p * q).sum())) < 0.02
        assert acceptance > acceptance_exact
    assert time.perf_counter() - started < 120  # bounded: 80k verifications of one row pair


def test_seeded_exact_match_commits_the_plain_draw_whatever_the_draft():
    params = SamplingParams(temperature=1.0, seed=42)
    plain = choose_tokens(LOGITS[:1], [SeqWork(SeqId(1), 10, 1, 1, params)])[0].token_id
    for draft in range(6):
        tokens = choose_tokens(LOGITS, [SeqWork(SeqId(1), 9, 2, 2, params, draft=(draft,))])
        assert tokens[0].token_id == plain  # the draft itself when it equals the plain draw, else the draw
        assert len(tokens) == (2 if draft == plain else 1)
