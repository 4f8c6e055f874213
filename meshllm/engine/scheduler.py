"""Continuous batching at the leader: which tokens of which sequences run next.

No torch here: the scheduler moves sequences and counts; the leader turns a
MicroBatch into tensors. Called from the leader's loop thread only.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sequence import Sequence, SeqStatus
from meshllm.errors import ContextOverflow, MeshError


class QueueFull(MeshError):
    code = "queue_full"


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # running at once
    max_batched_tokens: int = 512  # tokens in one micro-batch
    prefill_chunk: int = 256  # prompts are prefilled in chunks ending at multiples of this
    kv_budget_tokens: int = 32768  # KV the plan reserved, summed over running sequences
    max_waiting: int = 256  # bounded queue; beyond it requests are refused (429)
    num_stages: int = 1  # micro-batches in flight
    prefix_block_size: int = 32  # tokens per prefix-cache block; divides prefill_chunk
    prefix_cache_blocks: int = 512  # blocks of prompt KV the stages keep for reuse (0: no prefix cache)
    # Drafts ride a micro-batch's decode rows (one per sequence, plus the drafts) only up to this
    # many in all. Each sequence sizes its draft beside a plain step of the others, so when many
    # drafted at once a step outgrew the few-row kernels (16 rows on CPUs: SmolLM2 Q4_1 at one
    # thread 16 rows 46 ms, 17 rows 68 ms) and cost more than its drafts returned (free text,
    # 8 sequences: 20-28-row steps at 3x an 8-row one).
    max_verify_rows: int = 16

    def __post_init__(self):
        if min(self.max_num_seqs, self.max_batched_tokens, self.prefill_chunk, self.kv_budget_tokens,
               self.num_stages) < 1 or self.max_waiting < 0:
            raise ValueError(f"scheduler limits must be positive: {self}")
        if self.prefix_block_size < 1 or self.prefill_chunk % self.prefix_block_size:
            raise ValueError(f"prefix_block_size {self.prefix_block_size} must divide prefill_chunk "
                             f"{self.prefill_chunk}: chunks and cached prefixes must share boundaries")
        if self.prefill_chunk > self.max_batched_tokens:
            raise ValueError(f"prefill_chunk {self.prefill_chunk} exceeds max_batched_tokens "
                             f"{self.max_batched_tokens}: a chunk would never fit a micro-batch")


@dataclass(frozen=True, slots=True)
class Work:
    """Rows [start, start + num_tokens) of `seq`; the last `num_scored` are scored (see SeqWork)."""

    seq: Sequence
    start: int
    num_tokens: int
    num_scored: int  # 0: a chunk short of the last committed token; else 1 + len(draft)
    attach: tuple[int, ...] = ()  # prefix-cache blocks the stages copy in before computing
    draft: tuple[int, ...] = ()  # proposed tokens riding as the last rows, verified by the last stage
    draft_dists: tuple | None = None  # q of each draft token (speculative sampling), else None


@dataclass(frozen=True, slots=True)
class MicroBatch:
    works: tuple[Work, ...]

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)


class Scheduler:
    def __init__(self, config: SchedulerConfig, on_admit: Callable[[Sequence], None] = lambda seq: None):
        self.config = config
        self.on_admit = on_admit  # the leader matches the prefix cache here
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_reserved_tokens = 0  # KV reserved by running sequences
        self._draft_turn = 0  # who is first to the draft rows of the next decode step (_draft_rows)

    def add(self, seq: Sequence) -> None:
        if seq.max_total_tokens > self.config.kv_budget_tokens:
            raise ContextOverflow(
                f"prompt of {seq.num_prompt_tokens} tokens + max_tokens {seq.params.max_tokens} needs "
                f"{seq.max_total_tokens} tokens of KV cache; the plan holds {self.config.kv_budget_tokens}. "
                f"Shorten the prompt or lower max_tokens.")
        # The queue bound counts what waits beyond the running room: a burst of submissions
        # handled before the next step admits any (the leader drains its inbox first) must not
        # fill the queue with sequences that are about to start.
        if len(self.waiting) >= self.config.max_waiting + max(0, self.config.max_num_seqs - len(self.running)):
            raise QueueFull(f"{len(self.waiting)} requests are already waiting; retry later")
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (done, cancelled or failed); its KV may be released."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.num_reserved_tokens -= seq.max_total_tokens
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED

    def next_microbatch(self) -> MicroBatch | None:
        # Admit waiting sequences first-come first-served while the KV budget and the
        # running limit allow. Then take sequences that are not in flight: decode steps
        # first (one token each plus any draft to verify, so running decodes never starve
        # behind a long prompt), then prefill chunks, until the token budget is spent. With
        # S stages, each micro-batch takes about 1/S of the running sequences so S
        # micro-batches can be in flight at once and every stage stays busy.
        self._admit()
        ready = [s for s in self.running if not s.in_flight]
        if not ready:
            return None
        share = math.ceil(len(self.running) / self.config.num_stages)
        budget = self.config.max_batched_tokens
        ordered = sorted(ready, key=lambda s: s.is_prefilling)
        drafts = self._draft_rows(ordered[:share])
        works: list[Work] = []
        for seq in ordered:
            if len(works) >= share or budget <= 0:
                break
            work = self._work_for(seq, min(budget, 1 + drafts.get(seq.seq_id, 0)) if not seq.is_prefilling else budget)
            if work is None:
                continue
            works.append(work)
            budget -= work.num_tokens
        if not works:
            return None
        for w in works:
            w.seq.in_flight = True
        return MicroBatch(tuple(works))

    def _draft_rows(self, candidates: list[Sequence]) -> dict[SeqId, int]:
        """Draft rows each decoding candidate may send: together at most max_verify_rows less one
        row per candidate, handed out from a starting point that turns each step, so the same
        sequences are not the ones cut every time."""
        decoding = [s for s in candidates if not s.is_prefilling]
        room = max(0, self.config.max_verify_rows - len(decoding))
        rows: dict[SeqId, int] = {}
        if decoding:
            turn = self._draft_turn % len(decoding)
            self._draft_turn += 1
            for seq in decoding[turn:] + decoding[:turn]:
                rows[seq.seq_id] = n = min(len(self._draft_for(seq, room + 1)), room)
                room -= n
        return rows

    def _work_for(self, seq: Sequence, budget: int) -> Work | None:
        start = seq.num_computed
        attach = tuple(seq.attach) if seq.attach and start == seq.num_cached else ()
        if not seq.is_prefilling:
            draft = self._draft_for(seq, budget)
            n = 1 + len(draft)
            dists = seq.draft_dists[:len(draft)] if draft and seq.draft_dists is not None else None
            return Work(seq, start, n, num_scored=n, attach=attach, draft=draft, draft_dists=dists)
        # A chunk always ends at the next multiple of prefill_chunk (or the last committed
        # token), whatever else is in the batch: batch-invariant arithmetic needs the same chunks.
        chunk = self.config.prefill_chunk
        end = min(seq.num_tokens, (start // chunk + 1) * chunk)
        if start < seq.num_prompt_tokens:
            end = min(end, seq.num_prompt_tokens)  # a prompt computed again ends where it first ended
        else:
            # Tokens it generated, computed again (a failover's re-prefill): in as few rows as the
            # decode steps and verify passes that first computed them, so the few-row kernels give
            # the KV the same bits as then, and greedy output goes on as it would have (in the
            # default kernels too; a prefill chunk's GEMM rounds otherwise, README says by how much).
            end = min(end, start + self.config.max_verify_rows)
        if end - start > budget:
            return None  # waits for a micro-batch with room (prefill_chunk <= max_batched_tokens)
        return Work(seq, start, end - start, num_scored=1 if end == seq.num_tokens else 0, attach=attach)

    @staticmethod
    def _draft_for(seq: Sequence, budget: int) -> tuple[int, ...]:
        # A draft proposed for another position is stale. It may not exceed the token budget
        # (its rows share the micro-batch) nor the tokens the sequence may still generate, so
        # KV never grows past prompt + max_tokens: the reservation already covers draft rows.
        if not seq.draft or seq.draft_position != seq.num_tokens:
            return ()
        return seq.draft[:max(0, min(budget - 1, seq.num_remaining - 1))]

    def on_computed(self, work: Work, num_accepted: int = 0) -> None:
        """The stages committed `work`'s rows except its rejected draft tokens (the leader then
        appends the committed tokens the last stage returned)."""
        assert 0 <= num_accepted <= len(work.draft), (num_accepted, work.draft)
        seq = work.seq
        seq.in_flight = False
        seq.num_computed = work.start + work.num_tokens - len(work.draft) + num_accepted

    def recompute(self, seqs) -> None:
        """The stages lost these sequences' KV (the stream that held it ended): each running one
        catches up from its first token again, sampling nothing it already committed."""
        for seq in seqs:
            if seq.status is SeqStatus.RUNNING:
                seq.num_held_before = max(seq.num_held_before, seq.num_computed)
                seq.num_computed = 0
                seq.attach = []

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.num_reserved_tokens + seq.max_total_tokens > self.config.kv_budget_tokens:
                break
            self.waiting.popleft()
            self.on_admit(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            self.num_reserved_tokens += seq.max_total_tokens
