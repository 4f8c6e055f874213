"""One server per node: services share a port; channels carry deadlines and size limits."""

import time

import grpc
import pytest

from meshllm.errors import BindFailed
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, ChannelPool, open_channel
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig, join_host_port


class SlowCluster(cluster_pb2_grpc.ClusterServicer):
    def Exchange(self, request, context):
        time.sleep(2)
        return cluster_pb2.ExchangeResponse()


class Health(cluster_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id="n1", serving=True)


@pytest.fixture
def server():
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="n1", max_message_bytes=64 * 1024))
    server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, SlowCluster())
    server.add(cluster_pb2_grpc.add_HealthServicer_to_server, Health())
    server.start()
    try:
        yield key, server
    finally:
        server.stop(0)


def test_services_share_one_port_and_calls_get_a_default_deadline(server):
    key, srv = server
    with open_channel(srv.address, ChannelConfig("c", key, default_deadline_s=0.3), receiver="n1") as channel:
        assert cluster_pb2_grpc.HealthStub(channel).Check(cluster_pb2.HealthRequest()).node_id == "n1"
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest())
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 1.5


def test_messages_over_the_size_limit_are_refused(server):
    key, srv = server
    huge = cluster_pb2.ExchangeRequest(cards=[cluster_pb2.Card(node_id="x" * 100_000)])
    with open_channel(srv.address, ChannelConfig("c", key), receiver="n1") as channel:
        with pytest.raises(grpc.RpcError) as info:
            cluster_pb2_grpc.ClusterStub(channel).Exchange(huge, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_taken_port_fails_with_a_named_error(server):
    key, srv = server
    with pytest.raises(BindFailed, match="--port"):
        NodeServer(ServerConfig("127.0.0.1", srv.port, key))


def test_servicers_cannot_be_added_after_start(server):
    with pytest.raises(RuntimeError):
        server[1].add(cluster_pb2_grpc.add_HealthServicer_to_server, Health())


def test_channel_pool_reuses_and_discards(server):
    key, srv = server
    pool = ChannelPool(ChannelConfig("c", key))
    assert pool.get(srv.address) is pool.get(srv.address)
    assert pool.addresses() == {srv.address}
    pool.discard(srv.address)
    assert pool.addresses() == set()
    pool.close()


def test_ipv6_addresses_are_bracketed():
    assert join_host_port("::1", 7650) == "[::1]:7650"
    assert join_host_port("10.0.0.1", 7650) == "10.0.0.1:7650"
