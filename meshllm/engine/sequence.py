"""A sequence as the leader's scheduler sees it: token ids and counts, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: SeqId
    prompt_ids: list[int]
    params: SamplingParams  # seed is concrete: the last stage derives each draw from it
    output_ids: list[int] = field(default_factory=list)  # committed: sampled, or accepted drafts
    num_computed: int = 0  # committed tokens whose KV every stage holds
    # After its stream ended (num_computed went back to 0): the positions every stage held then. They
    # may still hold them, parked, and a failover's new plan may adopt them (pipeline/carry_over.py).
    num_held_before: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache
    attach: list[int] = field(default_factory=list)  # cached blocks to attach on the first step
    block_hashes: list[int] = field(default_factory=list)  # of the prompt's full blocks
    status: SeqStatus = SeqStatus.WAITING
    in_flight: bool = False
    cancelled: bool = False
    # Proposed continuation (speculative decoding), valid while draft_position == num_tokens:
    # draft[0] would be the token at draft_position. The scheduler sends it for verification.
    draft: tuple[int, ...] = ()
    draft_position: int = 0
    draft_dists: tuple | None = None  # DraftDist per draft token when the proposer sampled them

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        """More than the last committed token lacks KV: the prompt on admission, or prompt and
        output after a failover emptied a stage. Such a sequence catches up in chunks and samples
        only when a chunk reaches its last committed token, so no committed token is re-sampled."""
        return self.num_computed + 1 < self.num_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_tokens - len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """KV this sequence may need by the time it finishes."""
        return self.num_prompt_tokens + self.params.max_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        # Slices only: a decode step must not copy the whole context.
        n = self.num_prompt_tokens
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]
