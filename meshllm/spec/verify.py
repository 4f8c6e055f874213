"""The last stage's choice of committed tokens from its logit rows: plain decoding and draft verification.

A scored work without draft tokens commits one token at its `first_new_position`. A work
carrying draft tokens d_1..d_k scored k + 1 rows: row i holds the model's distribution for
position p0 + i given the committed tokens and d_1..d_i. The verifier draws its own token x_i
for each row exactly as plain decoding would at that position (argmax when greedy, else the
draw seeded by (seed, position)), accepts drafts while d_{i+1} == x_i, and commits x_0..x_a
where a is the number accepted: the accepted drafts, then its own next token. Every x_i is
what plain decoding would produce after the same prefix, so the output is identical with or
without drafts, whatever the drafts were: a wrong, late or missing draft costs only speed.

Logit processing composes: row i's penalty counts include d_1..d_i, and a grammar-constrained
sequence carries row i's allowed tokens (the leader cut the draft at the first token its
grammar rejects, so a rejected draft token is simply never proposed).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from meshllm.engine.sampler import position_generator, sample
from meshllm.engine.step import SampledToken, SeqWork


def choose_tokens(logits: Tensor, works: Sequence[SeqWork]) -> list[SampledToken]:
    """Committed tokens of every scored work, in work order then position order.

    logits: fp32 [sum(w.num_scored for w in works), vocab], each work's rows in order.
    """
    assert logits.shape[0] == sum(w.num_scored for w in works), (logits.shape, [w.num_scored for w in works])
    if not works:
        return []
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
        mine = ids[row:row + w.num_scored]
        accepted = 0
        while accepted < len(w.draft) and mine[accepted] == w.draft[accepted]:
            accepted += 1
        for i in range(accepted + 1):
            out.append(SampledToken(w.seq_id, w.first_new_position + i, mine[i], choice.logprobs[row + i]))
        row += w.num_scored
    return out

