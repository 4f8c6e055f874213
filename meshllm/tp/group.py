"""Forming one tensor-parallel group: rendezvous through the store rank 0 hosts.

Rank 0's node hosts a torch.distributed TCPStore (StoreHost, on the address its card
advertises as `collective_endpoint`); every rank of a group, rank 0 included, joins by
building its backend over `PrefixStore(group_id, store)`. The group id is fresh for each
load, so a re-formed group never reads a previous group's rendezvous keys, and groups of
different plans share the one store without meeting. Each group (each load gate, each link
probe) talks to the store over a connection of its own (StoreHost.client): a TCPStore client
runs one operation at a time, so a rendezvous waiting for a stopped rank would otherwise hold
up every other use of the store, such as the Load of the group that replaces it.
"""

from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from meshllm.errors import BadRequest, BindFailed, TensorParallelFailed
from meshllm.tp.collective import Collective

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0  # a rank silent this long (no step, no heartbeat) has failed
DEFAULT_RENDEZVOUS_TIMEOUT_S = 300.0  # ranks load their weights first, at their disks' speed


@dataclass(frozen=True, slots=True)
class GroupSpec:
    group_id: str  # fresh per load; the store key prefix of this group's rendezvous
    rank: int
    size: int
    store_address: str  # host:port of the TCPStore rank 0 hosts
    bind_host: str  # this rank's own address peers connect to (its collective endpoint's host)
    timeout_s: float = DEFAULT_TIMEOUT_S
    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    device: str = "cpu"

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} is outside a group of {self.size}")
        if self.timeout_s <= 0 or self.rendezvous_timeout_s <= 0:
            raise ValueError("tensor-parallel timeouts must be positive")
        host, sep, port = self.store_address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ValueError(f"store address {self.store_address!r} is not host:port")

    @property
    def store_host(self) -> str:
        return self.store_address.rpartition(":")[0].strip("[]")

    @property
    def store_port(self) -> int:
        return int(self.store_address.rpartition(":")[2])


@dataclass(frozen=True, slots=True)
class RankRole:
    """This node's part in a group, from the LoadRequest (transport/stage_convert.py)."""

    rank: int
    size: int
    store_address: str  # host:port of rank 0's store (its collective endpoint)
    group_id: str  # fresh per deploy
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self):
        if not (0 <= self.rank < self.size and self.size >= 2 and self.group_id and self.timeout_s > 0):
            raise BadRequest(f"tensor-parallel role rank {self.rank} of {self.size} (group {self.group_id!r}, "
                             f"timeout {self.timeout_s}s) is not valid")


class StoreHost:
    """The TCPStore this node hosts for the groups it leads and the link probes it runs.

    Started with the node when it offers a collective endpoint, stopped with it. Users connect
    with `client()`, one connection each; `store` (the hosting object) is not for them."""

    def __init__(self, host: str, port: int = 0):
        self.host, self._port = host, port
        self.store: TCPStore | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self.store is not None:
                return
            try:
                self.store = TCPStore(self.host, self._port, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=DEFAULT_RENDEZVOUS_TIMEOUT_S))
            except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
                raise BindFailed(f"cannot host the tensor-parallel store on {self.host}:{self._port} ({e}); "
                                 f"pick another --collective-port") from None
            self._port = self.store.port

    def client(self, timeout_s: float) -> TCPStore:
        """A connection of its own to the hosted store; `timeout_s` bounds its blocking operations.

        Never share one between threads that may block: a TCPStore client serialises its operations
        (one socket, one lock), so a `get` waiting out its timeout for a key a stopped rank never
        writes stalls every other operation on that client just as long. The server answers each
        connection on its own. Raises RuntimeError when the store cannot be reached."""
        with self._lock:
            if self.store is None:
                raise RuntimeError("the tensor-parallel store is not running (StoreHost not started or stopped)")
            host, port = self.host, self._port
        return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self._port}"

    def stop(self) -> None:
        with self._lock:
            self.store = None  # the last reference closes the listening socket


def join_group(spec: GroupSpec, hosted: StoreHost | None = None) -> Collective:
    """Join the group as `spec.rank`; blocks until every rank has joined (or the rendezvous timeout).

    Rank 0 passes the StoreHost its node runs (started); the others connect to `spec.store_address`.
    Either way the group gets a client connection of its own (see StoreHost.client).
    """
    rendezvous = datetime.timedelta(seconds=spec.rendezvous_timeout_s)
    try:
        if hosted is not None:
            assert hosted.store is not None, "start the StoreHost first"
            store = hosted.client(spec.rendezvous_timeout_s)
        else:
            store = TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=rendezvous)
        prefixed = PrefixStore(f"meshllm/tp/{spec.group_id}", store)
        backend = _backend(spec, prefixed, rendezvous)
    except RuntimeError as e:
        raise TensorParallelFailed(f"rank {spec.rank} of {spec.size} could not join tensor-parallel group "
                                   f"{spec.group_id} through {spec.store_address}: {str(e).splitlines()[0][:300]}. "
                                   f"Are all ranks up and the collective ports reachable?") from None
    # Rendezvous may wait minutes for a slow rank; once formed, a silent rank fails in seconds.
    backend._set_default_timeout(datetime.timedelta(seconds=spec.timeout_s))
    log.info("joined tensor-parallel group %s as rank %d of %d", spec.group_id, spec.rank, spec.size)
    return Collective(backend, spec.rank, spec.size, store, spec.timeout_s, spec.group_id)


def _backend(spec: GroupSpec, store, timeout: datetime.timedelta):
    if spec.device.startswith("cuda"):
        # NCCL for CUDA ranks (untested here: no GPU in CI).
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(torch.device(spec.device))
        return dist.ProcessGroupNCCL(store, spec.rank, spec.size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=spec.bind_host)]
    return dist.ProcessGroupGloo(store, spec.rank, spec.size, options)
