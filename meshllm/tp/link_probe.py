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
from concurrent.futures import ThreadPoolExecutor

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
PROBE_TIMEOUT_S = 30.0
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
    """Measure our link to `peer` (gRPC at `peer_address`); raises TensorParallelFailed if it fails."""
    group_id = f"probe/{uuid.uuid4().hex}"
    request = cluster_pb2.LinkProbeRequest(store_address=store.endpoint, group_id=group_id, sizes=SCHEDULE,
                                           timeout_s=timeout_s)
    stub = cluster_pb2_grpc.CollectiveStub(channels.get(peer_address, peer))
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(stub.ProbeLink, request, timeout=timeout_s)
        spec = GroupSpec(group_id, 0, 2, store.endpoint, bind_host, timeout_s=timeout_s,
                         rendezvous_timeout_s=timeout_s)
        try:
            collective = join_group(spec, store)
        except TensorParallelFailed:
            _wait_quietly(call)
            raise
        try:
            times = run_schedule(collective, SCHEDULE, SMALL_INDICES)
        finally:
            collective.close()
        try:
            call.result()
        except grpc.RpcError as e:
            raise TensorParallelFailed(f"link probe of {peer}: {e.code().name} {e.details()}") from None
    return summarize(peer, SCHEDULE, times)


def _wait_quietly(call) -> None:
    try:
        call.result()
    except grpc.RpcError:
        pass


class CollectiveServicer(cluster_pb2_grpc.CollectiveServicer):
    """Joins a prober's 2-rank group as rank 1 and mirrors its all-reduces (one probe at a time)."""

    def __init__(self, bind_host: str):
        self.bind_host = bind_host
        self._lock = threading.Lock()

    def ProbeLink(self, request: cluster_pb2.LinkProbeRequest, context):
        try:
            sizes, timeout_s = _checked(request)
            with self._lock:
                collective = join_group(GroupSpec(request.group_id, 1, 2, request.store_address, self.bind_host,
                                                  timeout_s=timeout_s, rendezvous_timeout_s=timeout_s))
                try:
                    run_schedule(collective, sizes)
                finally:
                    collective.close()
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
