"""The scheduler alone: pure bookkeeping, no tensors."""

from __future__ import annotations

import pytest

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from meshllm.engine.sequence import Sequence, SeqStatus
from meshllm.errors import ContextOverflow


def seq(i: int, prompt_len: int, max_tokens: int = 8) -> Sequence:
    return Sequence(SeqId(i), list(range(prompt_len)), SamplingParams(temperature=0, max_tokens=max_tokens, seed=1))


def complete(scheduler: Scheduler, batch, sampled: int = 42) -> None:
    """What the leader does with a successful result: commit, append sampled tokens."""
    for w in batch.works:
        scheduler.on_computed(w)
        if w.num_scored:
            w.seq.output_ids.append(sampled)


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    s = Scheduler(SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))
    short = seq(1, 4)
    s.add(short)
    complete(s, s.next_microbatch())  # short's prompt done: it decodes from now on
    long = seq(2, 150)
    s.add(long)
    chunks = []
    while long.is_prefilling:
        batch = s.next_microbatch()
        kinds = {w.seq.seq_id: w for w in batch.works}
        assert kinds[1].num_tokens == 1 and kinds[1].num_scored == 1  # the decode rides along every step
        chunks.append((kinds[2].start, kinds[2].num_tokens))
        assert batch.num_tokens <= 64
        complete(s, batch)
    # Chunks end at multiples of prefill_chunk: the same boundaries whatever shares the batch.
    assert chunks == [(0, 32), (32, 32), (64, 32), (96, 32), (128, 22)]


def test_chunk_boundaries_do_not_depend_on_the_batch():
    def chunks_of(prompt_len: int, others: int) -> list[tuple[int, int]]:
        s = Scheduler(SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))
        target = seq(0, prompt_len)
        s.add(target)
        for i in range(others):
            s.add(seq(i + 1, 10 + 7 * i))
        out = []
        while target.is_prefilling:
            batch = s.next_microbatch()
            out += [(w.start, w.num_tokens) for w in batch.works if w.seq is target]
            complete(s, batch)
        return out

    assert chunks_of(100, 0) == chunks_of(100, 3) == chunks_of(100, 7)


def test_the_queue_bound_counts_what_waits_beyond_the_free_running_room():
    """A burst submitted before any step admits it: as many as may run, plus max_waiting, fit."""
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_waiting=1, max_batched_tokens=256, prefill_chunk=256,
                                  prefix_block_size=16))
    for i in range(3):
        s.add(seq(i + 1, 10, 5))
    with pytest.raises(QueueFull):
        s.add(seq(4, 10, 5))
    s.next_microbatch()  # two run now: the room left is the queue's
    assert len(s.running) == 2 and len(s.waiting) == 1
    with pytest.raises(QueueFull):
        s.add(seq(5, 10, 5))


def test_admission_by_kv_budget_and_bounded_queue():
    s = Scheduler(SchedulerConfig(kv_budget_tokens=100, max_num_seqs=2, max_waiting=0, max_batched_tokens=256,
                                  prefill_chunk=256, prefix_block_size=16))
    a, b, c = seq(1, 40, 20), seq(2, 30, 20), seq(3, 10, 5)  # a needs 60, b 50: not both at once
    for x in (a, b):  # room for two to run, none to wait
        s.add(x)
    with pytest.raises(QueueFull):
        s.add(c)
    batch = s.next_microbatch()
    assert [w.seq for w in batch.works] == [a] and b.status is SeqStatus.WAITING
    s.finish(a)
    assert s.num_reserved_tokens == 0
    assert [w.seq for w in s.next_microbatch().works] == [b]
    with pytest.raises(ContextOverflow, match="needs 130 tokens"):
        s.add(seq(4, 120, 10))


def test_micro_batches_split_running_sequences_across_stages():
    s = Scheduler(SchedulerConfig(num_stages=2, max_batched_tokens=256, prefill_chunk=256, prefix_block_size=16))
    seqs = [seq(i, 5) for i in range(6)]
    for x in seqs:
        s.add(x)
    first, second = s.next_microbatch(), s.next_microbatch()
    assert len(first.works) == len(second.works) == 3  # half each, so two micro-batches can be in flight
    assert s.next_microbatch() is None  # every sequence is in flight
    complete(s, first)
    again = s.next_microbatch()
    assert {w.seq.seq_id for w in again.works} == {w.seq.seq_id for w in first.works}


def test_prefix_hit_starts_after_the_cached_blocks_and_attaches_them():
    def on_admit(x: Sequence) -> None:
        x.attach = [11, 12]
        x.num_cached = x.num_computed = 32

    s = Scheduler(SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16), on_admit)
    x = seq(1, 70)
    s.add(x)
    batch = s.next_microbatch()
    [work] = batch.works
    assert (work.start, work.num_tokens, work.attach) == (32, 32, (11, 12))
    complete(s, batch)
    [work] = s.next_microbatch().works
    assert (work.start, work.num_tokens, work.attach) == (64, 6, ())


def test_token_ids_slice_prompt_output_and_both():
    s = seq(1, 5)
    s.output_ids += [50, 51, 52]
    everything = s.prompt_ids + s.output_ids
    for start, end in ((0, 3), (5, 6), (6, 8), (3, 7), (0, 8)):
        assert s.token_ids(start, end) == everything[start:end]


def test_a_draft_rides_as_extra_scored_rows_capped_by_budget_and_remaining_tokens():
    s = Scheduler(SchedulerConfig(max_batched_tokens=4, prefill_chunk=4, prefix_block_size=2))
    x = seq(1, 3, max_tokens=5)
    s.add(x)
    complete(s, s.next_microbatch())  # prompt computed, first token sampled: 4 known, 3 computed
    x.draft, x.draft_position = (9, 9, 9, 9, 9), x.num_tokens
    [work] = s.next_microbatch().works
    # 1 + 3 draft rows fill the budget of 4.
    assert (work.start, work.num_tokens, work.num_scored, work.draft) == (3, 4, 4, (9, 9, 9))
    s.on_computed(work, num_accepted=1)
    assert x.num_computed == 5  # the last committed token and one accepted draft
    x.output_ids += [9, 3]
    x.draft_position = x.num_tokens
    [work] = s.next_microbatch().works
    # 3 outputs of 5: this step may commit 2 tokens, so at most 1 draft row.
    assert (work.num_tokens, work.draft) == (2, (9,))


def test_drafts_of_many_sequences_together_stay_within_the_verify_rows():
    # Each sequence sizes its draft on its own; together they may not push a decode step past
    # max_verify_rows (where a CPU step leaves its few-row kernels): later drafts are cut.
    s = Scheduler(SchedulerConfig(max_batched_tokens=512, prefill_chunk=8, prefix_block_size=2, max_verify_rows=16))
    xs = [seq(i, 3, max_tokens=64) for i in range(8)]
    for x in xs:
        s.add(x)
    complete(s, s.next_microbatch())  # all prompts computed in one micro-batch
    for x in xs:
        x.draft, x.draft_position = (9, 9, 9, 9), x.num_tokens
    works = s.next_microbatch().works
    assert sum(w.num_tokens for w in works) == 16  # 8 rows + 8 of the 32 draft tokens offered
    assert [len(w.draft) for w in works] == [4, 4, 0, 0, 0, 0, 0, 0]
    for w in works:
        s.on_computed(w, num_accepted=0)
        w.seq.output_ids.append(42)
        w.seq.draft, w.seq.draft_position = (9, 9, 9, 9), w.seq.num_tokens
    # The next step hands the room out from the next sequence on: not the same two cut again.
    assert [len(w.draft) for w in s.next_microbatch().works] == [0, 4, 4, 0, 0, 0, 0, 0]
    # 16 or more sequences decoding: no room for any draft.
    s = Scheduler(SchedulerConfig(max_batched_tokens=512, prefill_chunk=8, prefix_block_size=2, max_verify_rows=16))
    xs = [seq(i, 3, max_tokens=64) for i in range(20)]
    for x in xs:
        s.add(x)
    complete(s, s.next_microbatch())
    for x in xs:
        x.draft, x.draft_position = (9,), x.num_tokens
    works = s.next_microbatch().works
    assert len(works) == 20 and all(not w.draft for w in works)


def test_a_stale_draft_is_not_sent():
    s = Scheduler(SchedulerConfig(max_batched_tokens=8, prefill_chunk=8, prefix_block_size=2))
    x = seq(1, 3)
    s.add(x)
    complete(s, s.next_microbatch())
    x.draft, x.draft_position = (5, 6), x.num_tokens - 1  # proposed for an older position
    [work] = s.next_microbatch().works
    assert (work.num_tokens, work.draft) == (1, ())


def test_catching_up_after_losing_kv_never_samples_a_committed_token_again():
    # What failover does: a stage lost the KV, so every committed token is computed again.
    s = Scheduler(SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))
    x = seq(1, 40, max_tokens=30)
    s.add(x)
    while x.is_prefilling:
        complete(s, s.next_microbatch())
    for _ in range(19):
        complete(s, s.next_microbatch())
    assert len(x.output_ids) == 20 and x.num_computed == 59
    x.num_computed = 0
    works = []
    while x.is_prefilling:
        batch = s.next_microbatch()
        works += [(w.start, w.num_tokens, w.num_scored) for w in batch.works]
        for w in batch.works:
            s.on_computed(w)
    # The prompt in its own chunks again (ending at 32 and at its end, 40), then the generated
    # tokens in decode-sized pieces of at most max_verify_rows (the few-row kernels' bits); only
    # the piece reaching the last committed token (position 59) is scored, and what it scores is
    # position 60: the next token, never sampled yet.
    assert works == [(0, 32, 0), (32, 8, 0), (40, 16, 0), (56, 4, 1)]
    assert x.num_computed == 60 and len(x.output_ids) == 20
