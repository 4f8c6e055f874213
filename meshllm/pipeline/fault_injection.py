"""Fault injection for failover tests and bench/chaos.py: off unless a node is started with

    MESHLLM_FAULT_INJECTION=KIND@K    (KIND: crash | stall | corrupt | fail_load; K: a count)

in its environment. After the node has computed K micro-batches (empty chore steps do not
count), on the next one it:

- crash:   kills its own process with SIGKILL (as `kill -9` would), before answering;
- stall:   stops its own process with SIGSTOP (a hung machine: nothing answers, not even
           Health.Check) until someone sends SIGCONT;
- corrupt: from then on every step's output is corrupt: NaN hidden states (the next stage
           refuses them as shard_corrupt), or on the last stage a token at the wrong
           position (the leader refuses the reply as invalid_reply).

fail_load counts Loads instead: after K successful Loads, every later one fails once the
node has read its weights (ModelLoadError, as a disk read error would), so a tensor-parallel
group's other ranks are already waiting for it.

Read once, when the stage service starts. Never set it on a node that serves real users.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from dataclasses import dataclass, replace

import torch

from meshllm.engine.step import SampledToken
from meshllm.errors import ModelLoadError

log = logging.getLogger(__name__)

ENV = "MESHLLM_FAULT_INJECTION"
KINDS = ("crash", "stall", "corrupt", "fail_load")
STEP_KINDS = ("crash", "stall", "corrupt")


@dataclass(frozen=True, slots=True)
class FaultSpec:
    kind: str
    after_steps: int

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        kind, sep, count = text.partition("@")
        if kind not in KINDS or not sep or not count.isdigit():
            raise ValueError(f"{ENV}={text!r}: expected KIND@K with KIND one of {', '.join(KINDS)} and K a "
                             f"number of steps, e.g. crash@5")
        return cls(kind, int(count))


class FaultInjector:
    """Called by the Forward pump (any stream's thread) after each computed micro-batch."""

    def __init__(self, spec: FaultSpec | None):
        self.spec = spec
        self._lock = threading.Lock()
        self._num_steps = 0
        self._num_loads = 0

    @classmethod
    def from_env(cls) -> FaultInjector:
        text = os.environ.get(ENV, "").strip()
        spec = FaultSpec.parse(text) if text else None
        if spec is not None:
            log.warning("fault injection is ON: this node will %s after %d steps (%s)", spec.kind,
                        spec.after_steps, ENV)
        return cls(spec)

    def after_compute(self, out: torch.Tensor | list[SampledToken]) -> torch.Tensor | list[SampledToken]:
        """The step's output as this node will pass it on (the real one unless a fault is due)."""
        if self.spec is None or self.spec.kind not in STEP_KINDS:
            return out
        with self._lock:
            self._num_steps += 1
            due = self._num_steps > self.spec.after_steps
        if not due:
            return out
        if self.spec.kind == "crash":
            log.warning("fault injection: crashing (SIGKILL) after %d steps", self.spec.after_steps)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.spec.kind == "stall":
            log.warning("fault injection: stalling (SIGSTOP) after %d steps", self.spec.after_steps)
            self.spec = None  # after SIGCONT the node serves normally
            os.kill(os.getpid(), signal.SIGSTOP)
            return out
        if isinstance(out, list):
            return [replace(t, position=t.position + 1) for t in out]
        return torch.full_like(out, float("nan"))


    def after_load(self) -> None:
        """Called by the stage's control plane once a Load has read its weights; raises when due."""
        if self.spec is None or self.spec.kind != "fail_load":
            return
        with self._lock:
            self._num_loads += 1
            due = self._num_loads > self.spec.after_steps
        if due:
            log.warning("fault injection: failing a Load after %d successful ones", self.spec.after_steps)
            raise ModelLoadError(f"fault injection ({ENV}=fail_load@{self.spec.after_steps}): this Load fails "
                                 f"as a disk read error would")
