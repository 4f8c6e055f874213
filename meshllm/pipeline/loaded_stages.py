"""The layer ranges a node holds, by plan id: shared by the stage's control and data planes.

Thread-safe: gRPC runs every call on its own pool thread, and the gossip thread reads
the list for the node's card. Each stage has its own compute lock, so micro-batches of
all streams run one at a time on it (one compute stream per node keeps the CPU threads
from fighting); the registry's lock only guards the dict.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from meshllm.engine.stage_runner import StageRunner
from meshllm.transport.protos import stage_pb2


@dataclass
class LoadedStage:
    request: stage_pb2.LoadRequest
    # A StageRunner, or for a tensor-parallel rank one of tp/'s (same interface, plus close()).
    runner: StageRunner
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def index(self) -> int:
        return self.request.stage_index


class LoadedStages:
    def __init__(self):
        self._lock = threading.Lock()
        self._stages: dict[str, LoadedStage] = {}

    def get(self, plan_id: str) -> LoadedStage | None:
        with self._lock:
            return self._stages.get(plan_id)

    def put(self, plan_id: str, stage: LoadedStage) -> LoadedStage | None:
        """Hold `stage` for `plan_id`; returns the stage it replaces, if any (the caller closes it)."""
        with self._lock:
            previous = self._stages.get(plan_id)
            self._stages[plan_id] = stage
            return previous

    def pop(self, plan_id: str) -> LoadedStage | None:
        with self._lock:
            return self._stages.pop(plan_id, None)

    def pop_runner(self, plan_id: str, runner) -> LoadedStage | None:
        """Drop `plan_id` only while `runner` still serves it (not a stage loaded since)."""
        with self._lock:
            stage = self._stages.get(plan_id)
            if stage is None or stage.runner is not runner:
                return None
            return self._stages.pop(plan_id)

    def items(self) -> list[tuple[str, LoadedStage]]:
        """A snapshot, sorted by plan id."""
        with self._lock:
            return sorted(self._stages.items())
