"""What a leader reports: per-sequence generation events, and hooks for metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import TokenLogprobs
from meshllm.engine.scheduler import MicroBatch
from meshllm.engine.step import StepResult
from meshllm.errors import MeshError

if TYPE_CHECKING:
    from meshllm.pipeline.failover import RecoveryTiming, StageFailure


@dataclass(frozen=True, slots=True)
class GenerationEvent:
    seq_id: SeqId
    text: str = ""
    token_id: int | None = None
    logprobs: TokenLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: MeshError | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


class LeaderObserver:
    """Hooks for metrics; the default does nothing. Called on the leader's loop thread."""

    def on_step(self, batch: MicroBatch, result: StepResult, seconds: float) -> None: ...

    def on_token(self, first: bool, seconds: float) -> None: ...

    def on_finish(self, reason: str, num_tokens: int) -> None: ...

    def on_queue(self, num_waiting: int, num_running: int) -> None: ...

    def on_prefix(self, hit_tokens: int, miss_tokens: int) -> None: ...

    def on_verified(self, num_drafted: int, num_accepted: int) -> None:
        """One verifier pass of a sequence: `num_drafted` draft tokens (0: plain decode), `num_accepted` kept."""

    def on_proposer_failed(self, error: MeshError) -> None:
        """A proposer call failed (an error, its deadline, a refusal): its drafts are dropped, and the
        leader decodes plainly for SpecConfig.retry_after_s. Output never changes, so only this shows it."""

    def on_failure(self, failure: StageFailure) -> None:
        """A node failed (or the pipeline stalled): the leader starts a failover."""

    def on_stall(self) -> None:
        """A stage stopped answering (declared by the deadline and a health probe)."""

    def on_recovered(self, timing: RecoveryTiming) -> None:
        """The first token after a failover: how long each part of the recovery took."""

    def on_fallback_local(self) -> None:
        """No plan fit the fleet: the model now runs on the leader alone (called by the plan owner)."""
