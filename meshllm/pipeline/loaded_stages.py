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
from meshllm.engine.step_limits import StepLimits
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2


@dataclass
class LoadedStage:
    """A layer range loaded for one plan. Its limits come with the plan (LoadRequest): every
    step is checked against them, and the prefix store keeps at most the plan's blocks."""

    request: stage_pb2.LoadRequest
    runner: StageRunner
    lock: threading.Lock = field(default_factory=threading.Lock)
    limits: StepLimits = field(init=False)

    def __post_init__(self):
        self.limits = stage_convert.limits_from_pb(self.request)
        self.runner.prefix.set_capacity(self.limits.max_prefix_blocks)

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

    def put(self, plan_id: str, stage: LoadedStage) -> None:
        with self._lock:
            self._stages[plan_id] = stage

    def pop(self, plan_id: str) -> LoadedStage | None:
        with self._lock:
            return self._stages.pop(plan_id, None)

    def items(self) -> list[tuple[str, LoadedStage]]:
        """A snapshot, sorted by plan id."""
        with self._lock:
            return sorted(self._stages.items())
