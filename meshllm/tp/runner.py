"""Rank 0 of a tensor-parallel group, behind the same interface as a StageRunner.

The stage service (and the in-process pipeline) call `run(step)` and `release(ids)` on it
as on any stage; it first broadcasts the call to the other ranks as a command
(tp/command.py), then runs its own slice. The collectives inside the layers keep the
ranks in lockstep; only rank 0's output leaves the group (hidden states for the next
stage, or the tokens it sampled from the gathered logits).

A heartbeat thread broadcasts a no-op when the group has been idle for a quarter of
its timeout, so idle workers know rank 0 is alive. Any collective failure fails the
whole group: it closes, `on_failed` runs (the node drops the stage), and every later
step raises TensorParallelFailed, which the leader treats as this stage failing; a release
after that frees rank 0's own state only (a stream ending, an Unload), without raising.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from torch import Tensor

from meshllm.engine.kv_cache import LOCAL_OWNER, KVCache, Owner, SeqId
from meshllm.engine.prefix_store import PrefixStore
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import SampledToken, Step
from meshllm.errors import MeshError, TensorParallelFailed
from meshllm.tp.channel import CommandChannel
from meshllm.tp.command import Command, Heartbeat, Release, ReleaseOwner, RunStep, Shutdown

log = logging.getLogger(__name__)


class RankStage:
    """What the stage service reads of a rank's StageRunner (`self.runner`), as it reads a stage's."""

    runner: StageRunner

    @property
    def is_first(self) -> bool:
        return self.runner.is_first

    @property
    def is_last(self) -> bool:
        return self.runner.is_last

    @property
    def decoder(self):
        return self.runner.decoder

    @property
    def cache(self) -> KVCache:
        return self.runner.cache

    @property
    def prefix(self) -> PrefixStore:
        return self.runner.prefix


class TensorParallelRunner(RankStage):
    """Rank 0, run by the stage service like a StageRunner. Thread-safe: calls and heartbeats
    are serialised by one lock (commands are collective)."""

    def __init__(self, runner: StageRunner, channel: CommandChannel,
                 on_failed: Callable[[TensorParallelFailed], None] = lambda e: None):
        assert channel.collective.rank == 0
        self.runner = runner
        self.channel = channel
        self.collective = channel.collective
        self._on_failed = on_failed
        self._lock = threading.RLock()  # re-entered when on_failed closes the stage
        self._failure: TensorParallelFailed | None = None
        self._closed = threading.Event()
        self._last_sent = time.monotonic()
        self._heartbeat = threading.Thread(target=self._beat, daemon=True, name="tp-heartbeat")
        self._heartbeat.start()

    @property
    def group_size(self) -> int:
        return self.collective.size

    # --- the StageRunner interface the stage service uses ------------------------------------------
    def held_sequences(self) -> list[SeqId]:
        return self.runner.held_sequences()

    def run(self, step: Step, owner: Owner = LOCAL_OWNER, max_held: int | None = None) -> Tensor | list[SampledToken]:
        with self._lock:
            self._send(RunStep(step, owner, max_held))
            return self._guarded(lambda: self.runner.run(step, owner, max_held))

    def release(self, seq_ids, owner: Owner | None = None) -> int:
        with self._lock:
            seq_ids = tuple(SeqId(s) for s in seq_ids)
            if self._ended:
                return self.runner.release(seq_ids, owner)  # the workers' state went with the group
            self._send(Release(seq_ids, owner))
            return self._guarded(lambda: self.runner.release(seq_ids, owner))

    def release_owner(self, owner: Owner) -> tuple[int, int]:
        with self._lock:
            if self._ended:
                return self.runner.release_owner(owner)
            self._send(ReleaseOwner(owner))
            return self._guarded(lambda: self.runner.release_owner(owner))

    def close(self) -> None:
        """Tell the workers to stop (best effort) and drop the group; idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            if self._failure is None:
                try:
                    self.channel.send(Shutdown())
                except TensorParallelFailed as e:
                    log.debug("shutdown of a broken group: %s", e)
            self.collective.close()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    @property
    def _ended(self) -> bool:
        """Failed or closed: no worker listens any more, so freeing state is rank 0's own business.
        (A stream ending, or an Unload, after its group failed frees rank 0's KV without raising.)"""
        return self._failure is not None or self._closed.is_set()

    # --- inside the lock ---------------------------------------------------------------------------
    def _send(self, command: Command) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed.is_set():
            raise TensorParallelFailed(f"tensor-parallel group {self.collective.name} was unloaded")
        self._guarded(lambda: self.channel.send(command))
        self._last_sent = time.monotonic()

    def _guarded(self, call):
        try:
            return call()
        except TensorParallelFailed as e:
            self._fail(e)
            raise
        except MeshError:
            raise  # a bad step: every rank refuses it the same way (same checks, same state)
        except Exception as e:
            # Anything else may have left the workers inside a collective: the group cannot continue.
            failure = TensorParallelFailed(f"rank 0 of tensor-parallel group {self.collective.name} failed: "
                                           f"{type(e).__name__}: {e}")
            self._fail(failure)
            raise failure from e

    def _fail(self, failure: TensorParallelFailed) -> None:
        if self._failure is not None:
            return
        self._failure = failure
        log.warning("%s", failure)
        self.collective.close()  # closes our sockets: workers blocked on us fail at once
        self._on_failed(failure)

    def _beat(self) -> None:
        interval = self.collective.timeout_s / 4
        while not self._closed.wait(interval / 2):
            if self._failure is not None:
                return
            if time.monotonic() - self._last_sent < interval:
                continue
            with self._lock:
                if self._closed.is_set() or self._failure is not None:
                    return
                try:
                    self._send(Heartbeat())
                except TensorParallelFailed:
                    return
