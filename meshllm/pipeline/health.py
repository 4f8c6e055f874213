"""Whether a served model can answer right now, and why not: what /health, /v1/cluster,
the dashboard, `meshllm status` and the metrics report.

Written by whoever owns the plan (plan_owner.py: on deploy, on a stage failure, when a
re-plan succeeds or finds nothing that fits); read by the HTTP API from any thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum


class HealthStatus(str, Enum):
    OK = "ok"  # a working plan serves requests
    DEGRADED = "degraded"  # a stage failed: requests wait while the leader re-plans and rebuilds KV
    UNAVAILABLE = "unavailable"  # no plan fits the live fleet: requests fail with shard_unavailable


@dataclass(frozen=True, slots=True)
class StageSummary:
    node_id: str
    address: str
    first_layer: int
    last_layer: int  # exclusive


@dataclass(frozen=True, slots=True)
class HealthReport:
    status: HealthStatus
    reason: str | None = None  # for a person: what failed or what is missing, and what happens next
    failed_node: str | None = None  # the node blamed for the last failure, while not ok
    missing: str | None = None  # what does not fit ("layers 2-3"), when unavailable for lack of memory
    missing_bytes: int | None = None
    stages: tuple[StageSummary, ...] = ()  # the plan serving now (empty: none, or in-process)
    num_failovers: int = 0  # since the leader started
    since: float = field(default_factory=time.time)  # unix seconds of the last change of status

    @property
    def ok(self) -> bool:
        return self.status is HealthStatus.OK


class ServingHealth:
    """Thread-safe holder of the current HealthReport; listeners (metrics) hear every change."""

    def __init__(self, report: HealthReport | None = None):
        self._lock = threading.Lock()
        self._report = report or HealthReport(HealthStatus.OK)
        self._listeners: list[Callable[[HealthReport], None]] = []

    def report(self) -> HealthReport:
        with self._lock:
            return self._report

    def subscribe(self, listener: Callable[[HealthReport], None]) -> None:
        with self._lock:
            self._listeners.append(listener)
            report = self._report
        listener(report)

    def set(self, report: HealthReport) -> None:
        with self._lock:
            if report.status is self._report.status:
                report = replace(report, since=self._report.since)
            self._report = report
            listeners = list(self._listeners)
        for listener in listeners:
            listener(report)

