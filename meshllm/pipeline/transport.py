"""How the leader reaches the stages of a plan: over a gRPC stream, or in-process.

Both take a Step and return a Future of its StepResult; the leader keeps up to
`num_stages` of them outstanding. Futures resolve on a reader thread.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import SampledToken, StageTiming, Step, StepResult
from meshllm.errors import MeshError
from meshllm.pipeline.stage_relay import failure_named_by
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IdleEnd:
    """A stream to stage 0 that ended with no step pending and not closed by this side: a stage
    failed while the leader was idle, and no step's error will say so."""

    broken: bool  # a gRPC error: stage 0 itself (or the link to it) failed; else stage 0 closed it: a later stage
    why: str


class StepTransport(Protocol):
    num_stages: int
    stage_names: tuple[str, ...]  # how errors name stage i (its node and address), one per stage
    epoch: int  # counts the streams that ended: the stages freed the sequences and blocks each one held

    def submit(self, step: Step) -> Future: ...

    def watch(self, on_idle_end: Callable[[IdleEnd], None]) -> None:
        """Call `on_idle_end` (on a reader thread) whenever a stream ends as IdleEnd describes."""
        ...

    def close(self, timeout_s: float = 10.0, park: bool = False) -> None:
        """End it, waiting up to `timeout_s`; `park`: after a failure, ask the stages to keep what
        they hold for a new plan."""
        ...


class RemotePipeline:
    """One long-lived Forward stream to stage 0 of a plan; stage 0 relays onward."""

    def __init__(self, channel: grpc.Channel, plan_id: str, num_stages: int, stage_names: tuple[str, ...] = (),
                 leader_id: str = ""):
        """`leader_id`: the leader's id as it loaded the plan; every step names it (StepRequest.leader_id)."""
        self.plan_id = plan_id
        self.leader_id = leader_id
        self.num_stages = num_stages
        self.stage_names = stage_names or tuple(f"stage {i}" for i in range(num_stages))
        self._stub = stage_pb2_grpc.StageStub(channel)
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._requests: queue.Queue | None = None
        self._reader: threading.Thread | None = None
        self._on_idle_end: Callable[[IdleEnd], None] | None = None
        self.epoch = 0

    def watch(self, on_idle_end: Callable[[IdleEnd], None]) -> None:
        self._on_idle_end = on_idle_end

    def submit(self, step: Step) -> Future:
        future: Future = Future()
        message = stage_convert.step_to_pb(self.plan_id, step, self.leader_id)
        with self._lock:
            if self._requests is None:
                self._open()
            self._pending[step.step_id] = future
            self._requests.put(message)
        return future

    def _open(self) -> None:
        requests: queue.Queue = queue.Queue()
        call = self._stub.Forward(iter(requests.get, None))
        self._requests = requests
        self._reader = threading.Thread(target=self._read, args=(call, requests), daemon=True, name="leader-stream")
        self._reader.start()

    def _read(self, call, requests: queue.Queue) -> None:
        error, broken, failed = "stream closed", False, 0
        try:
            for reply in call:
                with self._lock:
                    future = self._pending.pop(reply.step_id, None)
                if future is not None:
                    future.set_result(stage_convert.result_from_pb(reply))
            named = failure_named_by(call)  # stage 0 ended it because a later stage failed (stage_relay.py)
            if named is not None and 0 <= named[0] < self.num_stages:
                failed = named[0]
                error = f"stage {failed} is unreachable ({named[1]})"
        except grpc.RpcError as e:
            error, broken = f"{e.code().name}: {e.details()}", True
            log.warning("pipeline %s stream to stage 0 failed: %s", self.plan_id, error)
        with self._lock:
            unasked = self._requests is requests  # close() had not ended it
            if unasked:
                self._requests = None  # the next submit opens a fresh stream
                requests.put(None)  # ends gRPC's thread that waits on it for our next request
            pending, self._pending = self._pending, {}
            self.epoch += 1
            on_idle_end = self._on_idle_end
        for step_id, future in pending.items():
            future.set_result(StepResult(step_id, error_code="stage_unreachable",
                                         error_message=f"stage 0 stream ended: {error}", failed_stage=failed))
        # With steps pending, their errors tell the leader; idle, only this can: a dead later stage
        # ends every stream of the chain (stage_relay.py) but answers no step.
        if unasked and not pending and on_idle_end is not None:
            on_idle_end(IdleEnd(broken, error))

    def close(self, timeout_s: float = 10.0, park: bool = False) -> None:
        """End the stream and wait (up to `timeout_s`) until stage 0 has answered everything sent.
        Each stage ends its stream to the next before its own, after freeing what the stream held:
        when this returns, no stage holds KV of this leader. With `park` (a failover) the stages
        keep it instead, for a while, for the re-planned plan to adopt (pipeline/kv_parking.py)."""
        with self._lock:
            if self._requests is not None:
                self._requests.put(stage_pb2.StepRequest(end=stage_pb2.END_PARK if park else stage_pb2.END_FREE))
                self._requests.put(None)
                self._requests = None
            reader = self._reader
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout_s)


class LocalPipeline:
    """Stages as StageRunners in this process, run one after another on the submitting thread.

    Single-process generation uses this, so it shares every line of arithmetic
    with a distributed run.
    """

    def __init__(self, runners: list[StageRunner]):
        self.runners = runners
        self.num_stages = 1  # one thread computes: nothing to overlap
        self.stage_names = tuple(f"in-process stage {i}" for i in range(len(runners)))
        self.epoch = 0  # the runners never lose what they hold
        self._computing = threading.RLock()  # held while a step runs: close() waits for it

    def watch(self, on_idle_end: Callable[[IdleEnd], None]) -> None:
        """Nothing to watch: no stream, and in-process stages do not die on their own."""

    def submit(self, step: Step) -> Future:
        """Runs `step` now, on the caller's thread (the leader's loop), and returns it done. With
        one step in flight at a time there is nothing to overlap, and handing each step to a
        worker thread and its result back cost ~0.2 ms of a 6 ms SmolLM2 decode step. Requests
        submitted meanwhile wait in the leader's inbox, as they would for the step to end."""
        future: Future = Future()
        with self._computing:
            result = self.run_now(step)
        future.set_result(result)
        return future

    def run_now(self, step: Step) -> StepResult:
        x = step.input
        timings = []
        for index, runner in enumerate(self.runners):
            started, received_at = time.perf_counter(), time.time()
            try:
                x = runner.run(replace(step, input=x))
                timings.append(StageTiming(index, time.perf_counter() - started, received_at, time.time()))
            except MeshError as e:
                self._chores_after_failure(step, index)
                return StepResult(step.step_id, error_code=e.code, error_message=str(e), failed_stage=index)
            except Exception as e:  # noqa: BLE001 - reported to the leader like a remote stage's failure
                log.exception("local stage %d failed", index)
                self._chores_after_failure(step, index)
                return StepResult(step.step_id, error_code="internal", error_message=str(e), failed_stage=index)
        tokens: list[SampledToken] = x if isinstance(x, list) else []
        return StepResult(step.step_id, tuple(tokens), tuple(timings))

    def _chores_after_failure(self, step: Step, failed: int) -> None:
        """As a remote stage does (stage_forward.py): the failed step's releases, publications and
        evictions still reach every stage after the failed one (which applied them first: in process
        no parse comes before them)."""
        chores = step.chores()
        if chores is None:
            return
        for index in range(failed + 1, len(self.runners)):
            try:
                self.runners[index].run(chores)
            except MeshError as e:
                log.warning("local stage %d: a failed step's releases and evictions failed too: %s", index, e.code)

    def close(self, timeout_s: float = 60.0, park: bool = False) -> None:
        """`park` changes nothing here: a re-plan never reuses in-process runners."""
        # Wait for a step still computing on another thread (a leader loop past its join timeout):
        # a daemon thread inside torch or ggml while the interpreter exits aborts the process
        # ("terminate called without an active exception").
        if self._computing.acquire(timeout=timeout_s):
            self._computing.release()


_step_ids = itertools.count(1)


def next_step_id() -> int:
    return next(_step_ids)
