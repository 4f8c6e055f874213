"""What the HTTP API serves: one model's leader, its tokenizer, and a view of the fleet.

The app only reads a Backend; how the leader reaches its stages (in-process here,
over gRPC to stage nodes in cluster mode) is decided by whoever builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import Card
from meshllm.model.source import open_model
from meshllm.model.tokenizer import Tokenizer
from meshllm.pipeline.cluster import ServingOptions, context_of, local_leader
from meshllm.pipeline.health import HealthReport, HealthStatus, ServingHealth
from meshllm.pipeline.leader import Leader


def _no_fleet() -> list[Card]:
    return []


@dataclass(frozen=True)
class Backend:
    """One served model.

    `leader` is None only for a backend that can never serve (its `health` says why: HTTP 503);
    in cluster mode the leader lives on through failures and re-plans, and `health` (written by
    the plan's owner, pipeline/plan_owner.py) says whether a working plan exists right now.
    `max_context` is the most tokens (prompt + completion) one sequence may hold.
    `metrics` must be the observer the leader was built with: /metrics reads it.
    `fleet_view` returns the cards /v1/cluster shows ([] for a process without a node).
    """

    model_id: str
    tokenizer: Tokenizer
    max_context: int
    leader: Leader | None
    metrics: MetricsObserver = field(default_factory=MetricsObserver, repr=False)
    fleet_view: Callable[[], list[Card]] = _no_fleet
    health: ServingHealth = field(default_factory=ServingHealth)  # ok: the in-process model always serves

    def __post_init__(self):
        if self.leader is None and self.health.report().ok:
            raise ValueError("a Backend without a leader must say why in an unavailable health")
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2 tokens, got {self.max_context}")
        self.health.subscribe(self.metrics.on_health)

    def health_report(self) -> HealthReport:
        """The plan's health, unless the leader's loop has stopped (pipeline/supervision.py): then
        nothing serves whatever the plan, and the report says why."""
        report = self.health.report()
        failure = self.leader.failure if self.leader is not None else None
        if failure is None:
            return report
        return replace(report, status=HealthStatus.UNAVAILABLE, reason=f"[{failure.code}] {failure}")

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()


def build_local_backend(path: str | Path | None, options: ServingOptions | None = None,
                        fleet_view: Callable[[], list[Card]] = _no_fleet) -> Backend:
    """Serve the whole model in this process (one StageRunner behind a LocalPipeline).

    `path` None opens the demo model. `options` sets dtype, context, batch, queue and
    batch invariance (same output for a sequence whatever shares its batch; slower).
    """
    options = options or ServingOptions()
    files = open_model(path)
    metrics = MetricsObserver()
    leader = local_leader(files, options, observer=metrics)
    return Backend(files.model_id, files.tokenizer, context_of(files, options), leader, metrics, fleet_view)
