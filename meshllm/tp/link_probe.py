"""Measure the link between two nodes the way tensor parallelism uses it: all-reduces.

The prober hosts the rendezvous (its StoreHost) and is rank 0 of a 2-rank group; it asks
the peer over gRPC (Collective.ProbeLink) to join as rank 1, and both run the same list of
all-reduces: warm-ups, then small ones (latency) and large ones (bandwidth). The result
goes in the prober's card (LinkProbe), where the planner's cost model reads it.

The latency is that of small all-reduces the prober starts after idling a while (IDLE_GAP_S,
about a layer's compute), not back-to-back ones: in a decode step each all-reduce follows a
layer's compute, so the peer waits idle in it and pays its wake-up (scheduler latency,
sockets gone cold) on every call. Back-to-back calls stay hot and measured a third of what
decode paid on loopback (bench/tensor_parallel.py). Only the prober idles, so the peer runs
the same list of all-reduces unchanged.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import uuid
from concurrent.futures import Future

import grpc
import torch

from meshllm.cluster.card import LinkProbe, NodeId
from meshllm.errors import MalformedMessage, TensorParallelFailed
from meshllm.tp.collective import Collective
from meshllm.tp.group import GroupSpec, StoreHost, join_group
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc

log = logging.getLogger(__name__)

SMALL_BYTES, LARGE_BYTES = 1024, 1 << 20
NUM_WARMUP, NUM_SMALL, NUM_LARGE = 5, 25, 8
SCHEDULE = [SMALL_BYTES] * (NUM_WARMUP + NUM_SMALL) + [LARGE_BYTES] * (2 + NUM_LARGE)
IDLE_GAP_S = 2e-3  # the prober idles this long before each small all-reduce it times
SMALL_INDICES = range(NUM_WARMUP, NUM_WARMUP + NUM_SMALL)
# A probe is worth something only if the peer answers at once: a stopped, dead or busy peer must
# cost the prober's thread a few seconds, not a group's minutes. It bounds both sides' rendezvous
# and each all-reduce (the largest, 1 MiB, takes well under a second on any LAN).
PROBE_TIMEOUT_S = 5.0
PROBE_CALL_FACTOR = 3  # the peer's whole part (rendezvous, then the schedule) within this many timeouts
MAX_SIZES, MAX_SIZE_BYTES = 256, 16 << 20  # what a callee accepts


def run_schedule(collective: Collective, sizes: list[int], idle_before: range = range(0)) -> list[float]:
    """All-reduce a float32 tensor of each size in turn; seconds of each. Calls at `idle_before`
    start after IDLE_GAP_S of idling (the prober's side only)."""
    times = []
    for i, num_bytes in enumerate(sizes):
        t = torch.ones(max(1, num_bytes // 4))
        if i in idle_before:
            time.sleep(IDLE_GAP_S)
        started = time.perf_counter()
        collective.all_reduce(t)
        times.append(time.perf_counter() - started)
    return times


def summarize(peer: NodeId, sizes: list[int], times: list[float]) -> LinkProbe:
    """Latency: median small all-reduce after idling; bandwidth: payload per second the large ones add."""
    small = statistics.median(times[i] for i in SMALL_INDICES if sizes[i] == SMALL_BYTES)
    large = statistics.median(times[-NUM_LARGE:])
    extra_s = large - small
    bandwidth = (LARGE_BYTES - SMALL_BYTES) / extra_s if extra_s > 0 else LARGE_BYTES / large
    return LinkProbe(peer, latency_s=small, bandwidth_gbps=bandwidth / 1e9)


def probe_peer(store: StoreHost, bind_host: str, peer: NodeId, peer_address: str, channels: ChannelPool,
               timeout_s: float = PROBE_TIMEOUT_S) -> LinkProbe:
    """Measure our link to `peer` (gRPC at `peer_address`); raises TensorParallelFailed if it fails.
    Returns or raises within about `timeout_s` when the peer does not take part (stopped, dead, busy)."""
    group_id = f"probe/{uuid.uuid4().hex}"
    request = cluster_pb2.LinkProbeRequest(store_address=store.endpoint, group_id=group_id, sizes=SCHEDULE,
                                           timeout_s=timeout_s)
    stub = cluster_pb2_grpc.CollectiveStub(channels.get(peer_address, peer))
    # The call runs on a thread of its own that nobody waits for when the group cannot form: a
    # stopped peer never answers it, and the prober must not wait out the call's deadline too.
    # (Signed calls have no cancellable .future(); the thread ends at the deadline at most.)
    call: Future = Future()

    def ask() -> None:
        try:
            call.set_result(stub.ProbeLink(request, timeout=PROBE_CALL_FACTOR * timeout_s))
        except BaseException as e:  # noqa: BLE001 - handed to the prober through the future
            call.set_exception(e)

    threading.Thread(target=ask, daemon=True, name="link-probe-call").start()
    spec = GroupSpec(group_id, 0, 2, store.endpoint, bind_host, timeout_s=timeout_s, rendezvous_timeout_s=timeout_s)
    collective = join_group(spec, store)
    try:
        times = run_schedule(collective, SCHEDULE, SMALL_INDICES)
    finally:
        collective.close()
    try:
        call.result()
    except grpc.RpcError as e:
        raise TensorParallelFailed(f"link probe of {peer}: {e.code().name} {e.details()}") from None
    return summarize(peer, SCHEDULE, times)


class CollectiveServicer(cluster_pb2_grpc.CollectiveServicer):
    """Joins a prober's 2-rank group as rank 1 and mirrors its all-reduces, one probe at a time.

    A probe runs on one of the node's gRPC threads kept for short calls (Load, Info, gossip):
    a probe that arrives while another runs is refused at once (the prober tries again at its
    next round), never queued, so probes from many peers never hold more than one such thread."""

    def __init__(self, bind_host: str):
        self.bind_host = bind_host
        self._lock = threading.Lock()

    def ProbeLink(self, request: cluster_pb2.LinkProbeRequest, context):
        try:
            sizes, timeout_s = _checked(request)
            if not self._lock.acquire(blocking=False):
                context.abort(grpc.StatusCode.UNAVAILABLE, "[tp_group_failed] this node is answering another "
                                                           "link probe; probe it again later")
            try:
                collective = join_group(GroupSpec(request.group_id, 1, 2, request.store_address, self.bind_host,
                                                  timeout_s=timeout_s, rendezvous_timeout_s=timeout_s))
                try:
                    run_schedule(collective, sizes)
                finally:
                    collective.close()
            finally:
                self._lock.release()
        except (MalformedMessage, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[malformed_message] {e}")
        except TensorParallelFailed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"[{e.code}] {e}")
        return cluster_pb2.LinkProbeReply(ok=True)


def _checked(request: cluster_pb2.LinkProbeRequest) -> tuple[list[int], float]:
    sizes = list(request.sizes)
    if not 0 < len(sizes) <= MAX_SIZES or not all(0 < s <= MAX_SIZE_BYTES for s in sizes):
        raise MalformedMessage(f"a link probe runs 1..{MAX_SIZES} all-reduces of 1..{MAX_SIZE_BYTES} bytes")
    if not 0 < request.timeout_s <= 120 or not request.group_id.startswith("probe/") or len(request.group_id) > 64:
        raise MalformedMessage("a link probe needs a timeout of at most 120 s and a probe/ group id")
    return sizes, request.timeout_s
