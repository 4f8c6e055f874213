"""A stage skips the rows whose KV it carried over from a failed plan.

After a failover the leader re-prefills every running sequence from its first token, because
the new plan has at least one stage (the replaced one) that holds nothing. A stage downstream
of every replaced stage adopted the sequence's KV (SequenceKV.carried positions, see
pipeline/kv_parking.py), so it only needs the rows it lacks: it computes rows [carried, end) of
the work and passes only those on; the stages after it adopted the same positions. Stages
upstream of a replaced stage still compute every row: the replaced stage needs their output
(boundary activations are not cached anywhere).

Scored rows are never skipped (their logits sample), and a work attaching prefix blocks is
left alone. Identity holds because a row's arithmetic does not depend on the chunk it is in
(batch-invariant mode: engine/batch_invariant.py); the carried KV is the very KV an
undisturbed run would hold.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from meshllm.engine.kv_cache import KVCache, Owner
from meshllm.engine.step import Step


@dataclass(frozen=True, slots=True)
class Kept:
    """A work left after skipping: its index in the incoming step and the rows still computed."""

    index: int
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class Skipped:
    step: Step  # what this stage computes and passes on
    kept: tuple[Kept, ...] | None  # None: nothing skipped, the step goes on as it came
    num_rows: int  # rows skipped


def skip_carried(step: Step, cache: KVCache, owner: Owner) -> Skipped:
    """Drop the rows of `step` whose KV this stage carried over; consumes a sequence's carried
    mark once a work reaches it. Call under the stage's lock, before running the step.

    `owner`, the stream the step came on, takes the carried sequences it names, even when none
    of their rows is left to compute: it then holds (and frees) them, and may publish their blocks."""
    if not any(w.seq_id in cache and cache.sequences[w.seq_id].carried > w.start for w in step.seqs):
        return Skipped(step, None, 0)
    kept, works, rows, row = [], [], [], 0
    for index, w in enumerate(step.seqs):
        kv = cache.get_or_allocate(w.seq_id, owner) if w.seq_id in cache else None
        end = w.start + w.num_tokens
        start = w.start
        if kv is not None and kv.carried > w.start and not w.attach:
            start = min(kv.carried, end - w.num_scored, kv.length)
        if kv is not None and end >= kv.carried:
            kv.carried = 0  # reached: later steps (rollbacks included) are ordinary
        if start < end:
            kept.append(Kept(index, start, end - start))
            works.append(replace(w, start=start, num_tokens=end - start))
            rows.append(torch.arange(row + start - w.start, row + w.num_tokens))
        row += w.num_tokens
    x = step.input[torch.cat(rows)] if rows else step.input[:0]
    skipped = step.num_tokens - sum(k.num_tokens for k in kept)
    return Skipped(replace(step, seqs=tuple(works), input=x), tuple(kept), skipped)
