"""What a stage accepts from the leaders of one plan: the plan's limits, not the wire's.

The leader derives them from the plan and its scheduler (`ServingOptions.step_limits`),
sends them in every stage's LoadRequest, and each stage refuses a step that exceeds
them (transport/stage_convert.py) or a stream that would hold more sequences than the
plan's batch (engine/stage_runner.py). So one leader's KV on a stage stays within what
the planner budgeted: `max_seqs` sequences of at most `max_context` positions, plus
`max_prefix_blocks` cached prompt blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

# Sanity limits for a message whose plan says nothing (a LoadRequest without limits, or a
# step checked before its plan is known); a plan's own limits are always far smaller.
WIRE_MAX_SEQS = 4096
WIRE_MAX_STEP_TOKENS = 1 << 20
WIRE_MAX_CONTEXT = 1 << 24
WIRE_MAX_BLOCK_SIZE = 1 << 16
WIRE_MAX_LIST = 1 << 16  # release and evict entries in one step
DEFAULT_PREFIX_BLOCKS = 512  # a stage loaded without limits keeps at most this many prefix blocks


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_context: int  # positions per sequence: start + num_tokens never exceeds it
    max_seqs: int  # sequences in one step, and held at once by one leader's stream
    max_step_tokens: int  # rows of one step (prefill chunks, decode tokens and drafts together)
    prefix_block_size: int | None = None  # tokens per prefix-cache block; None: whatever a step says
    max_prefix_blocks: int = 0  # prefix-cache blocks the stage keeps for this plan, LRU beyond (0: none)

    def __post_init__(self):
        if not (1 <= self.max_context <= WIRE_MAX_CONTEXT and 1 <= self.max_seqs <= WIRE_MAX_SEQS
                and 1 <= self.max_step_tokens <= WIRE_MAX_STEP_TOKENS):
            raise ValueError(f"step limits out of range: {self}")
        if self.prefix_block_size is not None and not 1 <= self.prefix_block_size <= WIRE_MAX_BLOCK_SIZE:
            raise ValueError(f"prefix_block_size {self.prefix_block_size} out of range")
        if not 0 <= self.max_prefix_blocks < 1 << 31:
            raise ValueError(f"max_prefix_blocks {self.max_prefix_blocks} out of range")

    def kv_tokens(self, streams: int = 1) -> int:
        """Positions of KV a stage may hold for the plan: `streams` leaders' sequences at full
        context, plus its prefix-cache blocks (what the planner budgets: Footprint.layer_kv)."""
        return self.max_context * self.max_seqs * streams + self.max_prefix_blocks * (self.prefix_block_size or 0)


# What a stage loaded without limits (an older leader) accepts: only the wire's sanity limits.
WIRE_LIMITS = StepLimits(WIRE_MAX_CONTEXT, WIRE_MAX_SEQS, WIRE_MAX_STEP_TOKENS, None, DEFAULT_PREFIX_BLOCKS)
