"""The last stage's choice of committed tokens from its logit rows: plain decoding and draft verification.

A scored work without draft tokens commits one token at its `first_new_position`. A work
carrying draft tokens d_1..d_k scored k + 1 rows: row i holds the model's distribution for
position p0 + i given the committed tokens and d_1..d_i.

Point-mass drafts (n-gram, greedy drafting, or any draft sent without q): the verifier
draws its own token x_i for each row exactly as plain decoding would at that position
(argmax when greedy, else the draw seeded by (seed, position)), accepts drafts while
d_{i+1} == x_i, and commits x_0..x_a where a is the number accepted: the accepted drafts,
then its own next token. Every x_i is what plain decoding would produce after the same
prefix, so the output is identical with or without drafts, whatever the drafts were: a
wrong, late or missing draft costs only speed. For a point mass this exact-match rule
accepts d with probability p(d), the same as min(1, p/q) with q(d) = 1.

Drafts with q (a sampling draft model) at temperature > 0: each row accepts with
min(1, p/q) and resamples the residual on rejection (speculative_sampling.py); the bonus
row after a fully accepted draft is the plain draw. Output is distributed exactly as
plain sampling, and depends on the draft (so the leader sends q only for requests that
did not ask for a seed: seeded ones stay bit-reproducible with exact match).

Logit processing composes: row i's penalty counts include d_1..d_i, and a grammar-constrained
sequence carries row i's allowed tokens (the leader cut the draft at the first token its
grammar rejects, so a rejected draft token is simply never proposed).

Structure: the rows' logits are processed first (the plain choice x_i of every row, and
logprobs), then each work's acceptance walks its rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from meshllm.engine.sampler import argmax_ids, position_generator, sample, token_logprobs
from meshllm.engine.step import SampledToken, SeqWork
from meshllm.spec.speculative_sampling import accept_or_resample


def choose_tokens(logits: Tensor, works: Sequence[SeqWork]) -> list[SampledToken]:
    """Committed tokens of every scored work, in work order then position order.

    logits: fp32 [sum(w.num_scored for w in works), vocab], each work's rows in order.
    """
    assert logits.shape[0] == sum(w.num_scored for w in works), (logits.shape, [w.num_scored for w in works])
    if not works:
        return []
    if all(_argmax_only(w) for w in works):
        # Plain greedy rows (most decode steps): each row's token is its argmax, with none of the
        # per-row inputs, processing and logprobs sample() builds (0.20 -> 0.15 ms of a 6 ms step).
        return _accepted(works, argmax_ids(logits).tolist(), None)
    params, generators, rows = [], [], []
    for w in works:
        rows.extend(w.row_inputs())
        for i in range(w.num_scored):
            params.append(w.sampling)
            generators.append(None if w.sampling.greedy else
                              position_generator(w.sampling.seed, w.first_new_position + i))
    choice = sample(logits, params, generators, rows)
    ids = choice.token_ids.tolist()
    out: list[SampledToken] = []
    row = 0
    for w in works:
        if w.draft_dists is not None and not w.sampling.greedy:
            # p is what plain sampling draws from: the processed rows (penalties, bias, grammar mask),
            # so a residual draw can never pick a token the grammar forbids.
            out.extend(_accept_by_ratio(choice.processed[row:row + w.num_scored], logits[row:row + w.num_scored],
                                        w, ids[row + w.num_scored - 1], choice.logprobs[row + w.num_scored - 1]))
        else:
            out.extend(_accepted((w,), ids[row:row + w.num_scored], choice.logprobs[row:row + w.num_scored]))
        row += w.num_scored
    return out


def _argmax_only(w: SeqWork) -> bool:
    """Whether w's rows pick their argmax and report nothing else (sample() would do no more)."""
    p = w.sampling
    return p.greedy and p.logprobs is None and not p.adjusts_logits and not w.allowed


def _accepted(works: Sequence[SeqWork], ids: list[int], logprobs) -> list[SampledToken]:
    """Exact-match verification of each work's draft against the verifier's own tokens `ids` (each
    work's rows in order): the accepted draft tokens and the verifier's next one."""
    out: list[SampledToken] = []
    row = 0
    for w in works:
        mine = ids[row:row + w.num_scored]
        accepted = 0
        while accepted < len(w.draft) and mine[accepted] == w.draft[accepted]:
            accepted += 1
        for i in range(accepted + 1):
            out.append(SampledToken(w.seq_id, w.first_new_position + i, mine[i],
                                    None if logprobs is None else logprobs[row + i]))
        row += w.num_scored
    return out


def _accept_by_ratio(rows: Tensor, raw_rows: Tensor, w: SeqWork, bonus: int, bonus_logprobs) -> list[SampledToken]:
    """min(1, p/q) acceptance along one work's processed rows; the bonus token (plain draw of the
    last row, already made) is committed when every draft token is accepted. Logprobs report the
    model's own distribution (`raw_rows`), as plain sampling does."""
    out = []
    for i, (draft_token, q) in enumerate(zip(w.draft, w.draft_dists)):
        position = w.first_new_position + i
        # A fresh generator for the position: the plain draw above used its own copy.
        token, accepted = accept_or_resample(rows[i], w.sampling, position_generator(w.sampling.seed, position),
                                             draft_token, q)
        logprobs = None if w.sampling.logprobs is None else token_logprobs(raw_rows[i], token, w.sampling.logprobs)
        out.append(SampledToken(w.seq_id, position, token, logprobs))
        if not accepted:
            return out
    out.append(SampledToken(w.seq_id, w.first_new_position + len(w.draft), bonus, bonus_logprobs))
    return out
