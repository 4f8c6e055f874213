"""A non-zero rank of a tensor-parallel group: mirrors rank 0's commands on its own slices.

One thread per loaded group receives commands and applies them to the rank's
StageRunner (which computes but never samples). The loop ends on Shutdown, or when
rank 0 is gone: its sockets closed (a crash or a failed group, seen at once) or no
command, not even a heartbeat, within the group's timeout (a hung or cut-off rank 0).
Either way the worker closes its side of the group and `on_exit` drops the stage, so
no rank outlives its group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from meshllm.engine.stage_runner import StageRunner
from meshllm.errors import MalformedMessage, MeshError, TensorParallelFailed
from meshllm.tp.channel import CommandChannel
from meshllm.tp.command import Heartbeat, Release, ReleaseOwner, RunStep, Shutdown

log = logging.getLogger(__name__)


class TensorParallelWorker:
    def __init__(self, runner: StageRunner, channel: CommandChannel,
                 on_exit: Callable[[str], None] = lambda reason: None, lock: threading.Lock | None = None):
        assert channel.collective.rank != 0 and not runner.samples
        self.runner = runner
        # Held while a command changes the runner's state, so the node can read it (Info) meanwhile.
        self.lock = lock or threading.Lock()
        self.channel = channel
        self.collective = channel.collective
        self._on_exit = on_exit
        self.exit_reason: str | None = None
        self.num_steps = 0
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name=f"tp-worker-{self.collective.name}-{self.collective.rank}")

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        reason = "shutdown"
        try:
            while True:
                command = self.channel.receive(self.collective.timeout_s)
                match command:
                    case RunStep(step=step, owner=owner, max_held=max_held):
                        self._apply(lambda: self.runner.run(step, owner, max_held))
                        self.num_steps += 1
                    case Release(seq_ids=seq_ids, owner=owner):
                        self._apply(lambda: self.runner.release(seq_ids, owner))
                    case ReleaseOwner(owner=owner):
                        self._apply(lambda: self.runner.release_owner(owner))
                    case Heartbeat():
                        pass
                    case Shutdown():
                        break
        except Exception as e:  # noqa: BLE001 - the rank must leave its group, never hang in it
            reason = self._reason_to_leave(e)
        finally:
            self.collective.close()
            self.exit_reason = reason
            self._on_exit(reason)

    def _reason_to_leave(self, e: Exception) -> str:
        rank, group = self.collective.rank, self.collective.name
        if self.collective.closed:
            # Closed under this loop, which waited on it: the node is stopping. Not an error (it
            # logged a traceback for every group at each clean shutdown of a rank-1 node).
            log.debug("tensor-parallel rank %d leaves group %s as its node stops (%s)", rank, group, e)
            return "shutdown"
        if isinstance(e, TensorParallelFailed):
            log.warning("tensor-parallel rank %d leaves group %s: %s", rank, group, e)
            return f"rank 0 is gone: {e}"
        if isinstance(e, MalformedMessage):
            log.error("tensor-parallel rank %d leaves group %s: %s", rank, group, e)
            return f"command stream out of step: {e}"
        log.error("tensor-parallel rank %d failed in group %s", rank, group, exc_info=e)
        return f"{type(e).__name__}: {e}"

    def _apply(self, call) -> None:
        try:
            with self.lock:
                call()
        except TensorParallelFailed:
            raise
        except MeshError as e:
            # Rank 0 runs the same checks on the same state and reports this error to the leader.
            log.debug("rank %d: step refused like on rank 0: %s", self.collective.rank, e)
