"""Link probes: a real gRPC Collective service and a real 2-rank gloo group on loopback (both
ranks in this process), the prober's once-per-pair rule, refusal of malformed probes, and what a
stopped or busy peer costs (seconds for the prober, no queued threads on the peer)."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from meshllm.cluster.card import Card, NodeId
from meshllm.errors import TensorParallelFailed
from meshllm.tp.group import StoreHost
from meshllm.tp.link_probe import SCHEDULE, CollectiveServicer, probe_peer, summarize
from meshllm.tp.node_collective import LinkProber
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig


@pytest.fixture
def peer():
    """A node's gRPC server carrying only the Collective service, and a channel pool to it."""
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="peer"))
    server.add(cluster_pb2_grpc.add_CollectiveServicer_to_server, CollectiveServicer("127.0.0.1"))
    server.start()
    store = StoreHost("127.0.0.1")
    store.start()
    try:
        yield server.address, ChannelPool(ChannelConfig("prober", key)), store
    finally:
        server.stop(0)
        store.stop()


def test_a_probe_measures_latency_and_bandwidth_of_real_all_reduces(peer):
    address, channels, store = peer
    link = probe_peer(store, "127.0.0.1", NodeId("peer"), address, channels)
    assert link.peer == "peer"
    # Loopback on a shared 2-core machine: tens of microseconds to a few ms; >10 MB/s surely.
    assert 1e-6 < link.latency_s < 0.05 and link.bandwidth_gbps > 0.01
    assert link.all_reduce_s(1 << 20) > link.all_reduce_s(1024) > link.latency_s


def test_summary_takes_medians_and_the_bandwidth_the_large_ones_add():
    times = [1.0] * 5 + [0.001] * 25 + [9.0] * 2 + [0.001 + (1 << 20) / 1e9] * 8
    link = summarize(NodeId("p"), SCHEDULE, times)
    assert link.latency_s == pytest.approx(0.001)
    assert link.bandwidth_gbps == pytest.approx(1.0 * ((1 << 20) - 1024) / (1 << 20), rel=1e-6)


def _card(node_id: str, address: str, endpoint: str | None) -> Card:
    return Card(node_id=NodeId(node_id), grpc_address=address, platform="linux", device="cpu",
                memory_total_bytes=1, memory_free_bytes=1, memory_bandwidth_gbps=1.0, matmul_gflops=1.0,
                collective_endpoint=endpoint)


def test_each_pair_is_probed_once_by_its_lower_node_and_again_only_when_due(peer):
    address, channels, store = peer
    # The one server answers as "peer": every card here points at it, under that id.
    fleet = [_card("b", "127.0.0.1:1", store.endpoint), _card("a", address, "127.0.0.1:9"),
             _card("peer", address, "127.0.0.1:9"), _card("d", address, None)]
    published = []
    prober = LinkProber(NodeId("b"), lambda: fleet, store, "127.0.0.1", channels, published.append)
    measured = prober.probe_due()
    # "a" sorts before "b" and probes us; "d" offers no collective endpoint; "peer" is ours to probe.
    assert [k.peer for k in measured] == ["peer"] and [k.peer for k in published[-1]] == ["peer"]
    assert prober.probe_due() == [] and [k.peer for k in published[-1]] == ["peer"]  # not due again yet
    fleet.pop(2)
    prober.probe_due()
    assert published[-1] == ()  # "peer" left the view: its link is dropped


@pytest.mark.parametrize("fields", [dict(sizes=[]), dict(sizes=[1 << 30]), dict(timeout_s=0.0),
                                    dict(group_id="plan/x")])
def test_malformed_probes_are_refused(peer, fields):
    address, channels, store = peer
    request = dict(store_address=store.endpoint, group_id="probe/x", sizes=[1024], timeout_s=5.0) | fields
    with pytest.raises(grpc.RpcError) as e:
        cluster_pb2_grpc.CollectiveStub(channels.get(address, "peer")).ProbeLink(
            cluster_pb2.LinkProbeRequest(**request), timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


PROMPT_S = 10.0  # a probe of a peer that does not take part ends within this (it waited 30 s, then the call's 30 s)


def test_a_probe_of_a_stopped_peer_ties_up_the_prober_for_seconds_only(peer):
    # A SIGSTOPped node: its kernel still accepts connections, nothing answers on them.
    _, channels, store = peer
    stopped = socket.create_server(("127.0.0.1", 0))
    try:
        started = time.monotonic()
        with pytest.raises(TensorParallelFailed):
            probe_peer(store, "127.0.0.1", NodeId("stopped"), f"127.0.0.1:{stopped.getsockname()[1]}", channels)
        failed_s = time.monotonic() - started
    finally:
        stopped.close()
    assert failed_s < PROMPT_S, f"the probe of a stopped peer took {failed_s:.1f}s"


def test_a_peer_answering_a_probe_refuses_another_at_once_instead_of_queueing_it(peer):
    # Each probe holds one of the peer's gRPC threads kept for short calls (Load, Info, gossip):
    # probes from several nodes at once must not queue there, holding one thread each.
    address, channels, store = peer
    stub = cluster_pb2_grpc.CollectiveStub(channels.get(address, "peer"))

    def probe(group_id: str):
        # Rank 0 (this prober) never joins: the peer waits in the rendezvous for the whole timeout.
        return cluster_pb2.LinkProbeRequest(store_address=store.endpoint, group_id=group_id, sizes=[1024],
                                            timeout_s=5.0)

    with ThreadPoolExecutor(1) as pool:  # (signed calls have no .future())
        first = pool.submit(stub.ProbeLink, probe("probe/first"), timeout=15)
        time.sleep(0.5)  # the peer is in the first probe's rendezvous
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            stub.ProbeLink(probe("probe/second"), timeout=4)
        refused_s = time.monotonic() - started
        with pytest.raises(grpc.RpcError):
            first.result()  # its rank 0 never came
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "another link probe" in refused.value.details()
    assert refused_s < 2.0
