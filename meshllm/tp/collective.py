"""One tensor-parallel group's collectives, on torch.distributed's own backends.

Each loaded group gets its own process-group backend (ProcessGroupGloo on CPU and
macOS, ProcessGroupNCCL on CUDA) built straight from a store: not the process-wide
default group, so a node can be a rank of several groups (several plans) at once and
tear one down without touching the others. The backend objects' own methods are
called (not torch.distributed's module functions, which look groups up in the global
registry). Every call raises TensorParallelFailed when a peer is gone or silent past
the group's timeout, so callers see one named error whatever the backend says.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from meshllm.errors import TensorParallelFailed

log = logging.getLogger(__name__)


@dataclass
class CollectiveStats:
    """Time spent inside collectives (waiting for peers included); read by the benchmark."""

    num_all_reduce: int = 0
    all_reduce_s: float = 0.0
    num_broadcast: int = 0
    broadcast_s: float = 0.0
    num_gather: int = 0
    gather_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.all_reduce_s + self.broadcast_s + self.gather_s


class Collective:
    """Collectives of rank `rank` in a group of `size`. Not thread-safe: one caller at a time
    (the stage's compute lock, or the worker's loop thread)."""

    def __init__(self, backend, rank: int, size: int, store, timeout_s: float, name: str):
        self._backend = backend
        self._store = store  # kept alive with the group: the backend may use it after rendezvous
        self.rank, self.size, self.timeout_s, self.name = rank, size, timeout_s, name
        self.stats = CollectiveStats()
        self.closed = False

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum `t` over the group, in place; returns it."""
        started = time.perf_counter()
        self._wait(self._backend.allreduce([t]), "all-reduce")
        self.stats.num_all_reduce += 1
        self.stats.all_reduce_s += time.perf_counter() - started
        return t

    def broadcast(self, t: Tensor, timeout_s: float | None = None) -> Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        if timeout_s is not None:
            opts.timeout = datetime.timedelta(seconds=timeout_s)
        started = time.perf_counter()
        self._wait(self._backend.broadcast([t], opts), "broadcast")
        self.stats.num_broadcast += 1
        self.stats.broadcast_s += time.perf_counter() - started
        return t

    def gather_to_first(self, t: Tensor) -> list[Tensor] | None:
        """Every rank's `t` (equal shapes) on rank 0, in rank order; None on the other ranks."""
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outputs = [[torch.empty_like(t) for _ in range(self.size)]] if self.rank == 0 else []
        started = time.perf_counter()
        self._wait(self._backend.gather(outputs, [t.contiguous()], opts), "gather")
        self.stats.num_gather += 1
        self.stats.gather_s += time.perf_counter() - started
        return outputs[0] if self.rank == 0 else None

    def barrier(self) -> None:
        self._wait(self._backend.barrier(dist.BarrierOptions()), "barrier")

    def _wait(self, work, what: str) -> None:
        if self.closed:
            raise TensorParallelFailed(f"tensor-parallel group {self.name} is closed")
        try:
            work.wait()
        except RuntimeError as e:  # gloo and NCCL report a dead, closed or silent peer this way
            raise TensorParallelFailed(f"tensor-parallel group {self.name}: {what} failed on rank {self.rank} "
                                       f"of {self.size} ({_first_line(e)}); a rank died or stalled, so the "
                                       f"whole group has failed") from None

    def close(self) -> None:
        """Drop the backend: its sockets close, so peers still waiting on us fail at once."""
        if self.closed:
            return
        self.closed = True
        shutdown = getattr(self._backend, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except RuntimeError as e:  # a peer already gone: nothing left to close politely
                log.debug("group %s: backend shutdown: %s", self.name, e)
        self._backend = None
        self._store = None


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
