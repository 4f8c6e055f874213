"""Cluster-key authentication on a real gRPC server on loopback."""

import os
import stat
import time

import grpc
import pytest

from meshllm.errors import KeyFileError
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, open_channel
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig

EXCHANGE = "/meshllm.Cluster/Exchange"
CHAT = "/test.Echo/Chat"


class CountingCluster(cluster_pb2_grpc.ClusterServicer):
    def __init__(self):
        self.calls = 0

    def Exchange(self, request, context):
        self.calls += 1
        return cluster_pb2.ExchangeResponse()


@pytest.fixture
def served():
    key = auth.generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key))
    servicer = CountingCluster()
    server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, servicer)
    chats = []

    def chat(requests, context):
        for r in requests:
            chats.append(r)
            yield r

    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(chat)})
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None)
    server.start()
    try:
        yield key, server, servicer, chats
    finally:
        server.stop(0)


def raw_exchange(address, metadata):
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(EXCHANGE, request_serializer=cluster_pb2.ExchangeRequest.SerializeToString,
                                   response_deserializer=cluster_pb2.ExchangeResponse.FromString)
        return call(cluster_pb2.ExchangeRequest(), metadata=metadata, timeout=5)


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value.code()


def test_signed_call_passes_and_runs_the_servicer(served):
    key, server, servicer, _ = served
    with open_channel(server.address, ChannelConfig("client", key)) as channel:
        cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest())
    assert servicer.calls == 1


def test_missing_or_wrong_key_is_unauthenticated_and_does_no_work(served):
    key, server, servicer, _ = served
    assert code_of(lambda: raw_exchange(server.address, [])) == grpc.StatusCode.UNAUTHENTICATED
    with open_channel(server.address, ChannelConfig("intruder", auth.generate_key())) as channel:
        stub = cluster_pb2_grpc.ClusterStub(channel)
        assert code_of(lambda: stub.Exchange(cluster_pb2.ExchangeRequest())) == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == 0


def test_replayed_call_is_rejected(served):
    key, server, servicer, _ = served
    metadata = auth.sign(key, "client", EXCHANGE)
    raw_exchange(server.address, metadata)
    assert code_of(lambda: raw_exchange(server.address, metadata)) == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == 1


def test_stale_future_and_tampered_calls_are_rejected(served):
    key, server, servicer, _ = served
    stale = auth.sign(key, "client", EXCHANGE, now=time.time() - 3 * auth.MAX_CLOCK_SKEW_S)
    future = auth.sign(key, "client", EXCHANGE, now=time.time() + 3 * auth.MAX_CLOCK_SKEW_S)
    other_method = auth.sign(key, "client", "/meshllm.Health/Check")
    renamed = [(k, "someone-else" if k == auth.HEADER_NODE else v) for k, v in auth.sign(key, "client", EXCHANGE)]
    for metadata in (stale, future, other_method, renamed):
        assert code_of(lambda: raw_exchange(server.address, metadata)) == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.calls == 0


def test_streams_are_authenticated_too(served):
    key, server, _, chats = served
    with grpc.insecure_channel(server.address) as channel:
        chat = channel.stream_stream(CHAT)
        assert code_of(lambda: list(chat(iter([b"x"]), timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
    assert chats == []
    with open_channel(server.address, ChannelConfig("client", key)) as channel:
        assert list(channel.stream_stream(CHAT)(iter([b"a", b"b"]), timeout=5)) == [b"a", b"b"]


def test_replay_guard_forgets_after_the_window_and_has_a_capacity():
    clock = [0.0]
    guard = auth.ReplayGuard(max_skew_s=1.0, capacity=2, clock=lambda: clock[0])
    assert guard.first_use("a") is True and guard.first_use("a") is False
    assert guard.first_use("b") is True and guard.first_use("c") is None  # full: refuse, never forget early
    clock[0] = 2.5
    assert guard.first_use("a") is True


def test_key_file_is_created_private_and_reloaded(tmp_path):
    path = tmp_path / "state" / "cluster.key"
    key, created = auth.load_or_create_key(path)
    assert created and len(key) == auth.KEY_BYTES
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert auth.load_or_create_key(path) == (key, False)
    assert auth.cluster_id(key) == auth.cluster_id(auth.load_key(path)) != auth.cluster_id(auth.generate_key())


@pytest.mark.parametrize("content,match", [(None, "does not exist"), ("not hex", "not a hex key"),
                                           ("abcd", "at least 16")])
def test_bad_key_files_say_how_to_fix(tmp_path, content, match):
    path = tmp_path / "k"
    if content is not None:
        path.write_text(content)
    with pytest.raises(KeyFileError, match=match):
        auth.load_key(path)
