"""Check a step's reply against the step before the leader commits anything from it.

The last stage is a peer: a reply must give, for every scored work and no other, 1 to
len(draft) + 1 tokens at consecutive positions from the work's first new position, the
leading ones equal to the draft tokens they accept.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.scheduler import Work
from meshllm.engine.step import SampledToken
from meshllm.errors import InvalidReply


def committed_tokens(works: Sequence[Work], tokens: Sequence[SampledToken]) -> dict[SeqId, tuple[SampledToken, ...]]:
    """The tokens each work commits, by sequence; raises InvalidReply naming what is wrong."""
    by_seq: dict[SeqId, list[SampledToken]] = {}
    for t in tokens:
        by_seq.setdefault(t.seq_id, []).append(t)
    scored = {w.seq.seq_id: w for w in works if w.num_scored}
    stray = set(by_seq) - set(scored)
    if stray:
        raise InvalidReply(f"the last stage returned tokens for {len(stray)} sequence(s) the step did not score")
    out: dict[SeqId, tuple[SampledToken, ...]] = {}
    for seq_id, w in scored.items():
        mine = sorted(by_seq.get(seq_id, ()), key=lambda t: t.position)
        if not 1 <= len(mine) <= len(w.draft) + 1:
            raise InvalidReply(f"sequence {seq_id}: the last stage returned {len(mine)} tokens for a step that "
                               f"commits 1 to {len(w.draft) + 1}")
        first = w.start + w.num_tokens - len(w.draft)
        for i, t in enumerate(mine):
            if t.position != first + i:
                raise InvalidReply(f"sequence {seq_id}: token at position {t.position}, expected {first + i}")
            if i < len(mine) - 1 and t.token_id != w.draft[i]:
                raise InvalidReply(f"sequence {seq_id}: the last stage accepted token {t.token_id} at position "
                                   f"{t.position} but the draft proposed {w.draft[i]}")
        out[seq_id] = tuple(mine)
    return out
