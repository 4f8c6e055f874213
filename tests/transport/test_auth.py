"""Cluster-key authentication of calls and replies on a real gRPC server on loopback."""

import contextlib
import os
import stat
import threading
import time

import grpc
import pytest

from meshllm.errors import KeyFileError
from meshllm.transport import auth
from meshllm.transport.channels import ChannelConfig, open_channel
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from meshllm.transport.signed_channel import ReplyRejected
from meshllm.transport.tls import PLAINTEXT, channel_credentials

EXCHANGE = "/meshllm.Cluster/Exchange"
CHAT = "/test.Echo/Chat"
SERVER_ID = "server"


class CountingCluster(cluster_pb2_grpc.ClusterServicer):
    def __init__(self):
        self.requests = []

    def Exchange(self, request, context):
        self.requests.append(request)
        return cluster_pb2.ExchangeResponse()


class Health(cluster_pb2_grpc.HealthServicer):
    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id=SERVER_ID, serving=True)


def start_server(key, tls=None):
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id=SERVER_ID, tls=tls))
    servicer = CountingCluster()
    server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, servicer)
    server.add(cluster_pb2_grpc.add_HealthServicer_to_server, Health())
    chats = []

    def chat(requests, context):
        for r in requests:
            chats.append(r)
            yield r

    handler = grpc.method_handlers_generic_handler("test.Echo", {"Chat": grpc.stream_stream_rpc_method_handler(chat)})
    server.add(lambda _servicer, s: s.add_generic_rpc_handlers((handler,)), None)
    server.start()
    return server, servicer, chats


@pytest.fixture
def served():
    key = auth.generate_key()
    server, servicer, chats = start_server(key)
    try:
        yield key, server, servicer, chats
    finally:
        server.stop(0)


def raw_channel(address, key, tls=None):
    """A channel with the cluster's TLS but no signing: metadata is whatever the test sends."""
    credentials, options = channel_credentials(key, tls, "tester")
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials, options=options)


def raw_exchange(address, key, metadata, body: bytes = b"", tls=None):
    with raw_channel(address, key, tls) as channel:
        return channel.unary_unary(EXCHANGE)(body, metadata=metadata, timeout=5)


def error_of(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


def code_of(fn) -> grpc.StatusCode:
    return error_of(fn).code()


def test_signed_call_passes_and_runs_the_servicer(served):
    key, server, servicer, _ = served
    with open_channel(server.address, ChannelConfig("client", key), receiver=SERVER_ID) as channel:
        cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest())
    assert len(servicer.requests) == 1


def test_missing_or_wrong_key_is_refused_and_does_no_work(served):
    key, server, servicer, _ = served
    assert code_of(lambda: raw_exchange(server.address, key, [])) == grpc.StatusCode.UNAUTHENTICATED
    # Another cluster's key: its certificates are not from our CA, the handshake fails.
    with open_channel(server.address, ChannelConfig("intruder", auth.generate_key()), receiver=SERVER_ID) as channel:
        error = error_of(lambda: cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest()))
        assert error.code() == grpc.StatusCode.UNAVAILABLE and "handshake" in error.details().lower()
    # Our TLS but MACs under another key (what a plaintext or user-PKI cluster relies on).
    metadata = auth.sign(auth.generate_key(), "intruder", EXCHANGE, receiver=SERVER_ID, body=b"")
    error = error_of(lambda: raw_exchange(server.address, key, metadata))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "cluster key mismatch" in error.details()
    assert servicer.requests == []


def test_replayed_call_is_rejected(served):
    key, server, servicer, _ = served
    metadata = auth.sign(key, "client", EXCHANGE, receiver=SERVER_ID, body=b"")
    raw_exchange(server.address, key, metadata)
    error = error_of(lambda: raw_exchange(server.address, key, metadata))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "replayed" in error.details()
    assert len(servicer.requests) == 1


def test_call_is_bound_to_its_receiver_and_body(served):
    key, server, servicer, _ = served
    body = cluster_pb2.ExchangeRequest().SerializeToString()
    other_body = cluster_pb2.ExchangeRequest(cards=[cluster_pb2.Card(node_id="forged")]).SerializeToString()
    for_other_node = auth.sign(key, "client", EXCHANGE, receiver="other-node", body=body)
    error = error_of(lambda: raw_exchange(server.address, key, for_other_node, body))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "addressed to node 'other-node'" in error.details()
    unaddressed = auth.sign(key, "client", EXCHANGE, body=body)
    assert code_of(lambda: raw_exchange(server.address, key, unaddressed, body)) == grpc.StatusCode.UNAUTHENTICATED
    swapped = auth.sign(key, "client", EXCHANGE, receiver=SERVER_ID, body=body)
    assert code_of(lambda: raw_exchange(server.address, key, swapped, other_body)) == grpc.StatusCode.UNAUTHENTICATED
    assert servicer.requests == []
    # Only Health.Check may ask who is there without naming a receiver.
    with open_channel(server.address, ChannelConfig("client", key)) as channel:
        assert cluster_pb2_grpc.HealthStub(channel).Check(cluster_pb2.HealthRequest()).node_id == SERVER_ID
        assert code_of(lambda: cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest())) == \
            grpc.StatusCode.UNAUTHENTICATED


def test_stale_future_and_tampered_calls_are_rejected(served):
    key, server, servicer, _ = served
    sign = lambda **kw: auth.sign(key, "client", EXCHANGE, receiver=SERVER_ID, body=b"", **kw)  # noqa: E731
    stale = sign(now=time.time() - 3 * auth.MAX_CLOCK_SKEW_S)
    future = sign(now=time.time() + 3 * auth.MAX_CLOCK_SKEW_S)
    other_method = auth.sign(key, "client", "/meshllm.Health/Check", receiver=SERVER_ID, body=b"")
    renamed = [(k, "someone-else" if k == auth.HEADER_NODE else v) for k, v in sign()]
    for metadata in (stale, future, other_method, renamed):
        assert code_of(lambda: raw_exchange(server.address, key, metadata)) == grpc.StatusCode.UNAUTHENTICATED
    # The skew has the caller's sign: a stale call is behind this node's clock.
    assert "timestamp is -90." in error_of(lambda: raw_exchange(server.address, key, sign(
        now=time.time() - 3 * auth.MAX_CLOCK_SKEW_S))).details()
    assert "timestamp is +90." in error_of(lambda: raw_exchange(server.address, key, sign(
        now=time.time() + 3 * auth.MAX_CLOCK_SKEW_S))).details()
    assert servicer.requests == []


def test_streams_are_authenticated_too(served):
    key, server, _, chats = served
    with raw_channel(server.address, key) as channel:
        chat = channel.stream_stream(CHAT)
        assert code_of(lambda: list(chat(iter([b"x"]), timeout=5))) == grpc.StatusCode.UNAUTHENTICATED
    assert chats == []
    with open_channel(server.address, ChannelConfig("client", key), receiver=SERVER_ID) as channel:
        assert list(channel.stream_stream(CHAT)(iter([b"a", b"b"]), timeout=5)) == [b"a", b"b"]
    with open_channel(server.address, ChannelConfig("client", key), receiver="other-node") as channel:
        assert code_of(lambda: list(channel.stream_stream(CHAT)(iter([b"c"]), timeout=5))) == \
            grpc.StatusCode.UNAUTHENTICATED
    assert chats == [b"a", b"b"]


def test_replies_are_verified_bound_to_call_body_and_responder():
    key = auth.generate_key()
    body, nonce = b"reply bytes", "n" * 32
    metadata = auth.sign_reply(key, SERVER_ID, "client", EXCHANGE, nonce, body)
    verify = lambda md=metadata, **kw: auth.verify_reply(key, md, **{  # noqa: E731
        **dict(receiver=SERVER_ID, requester="client", method=EXCHANGE, request_nonce=nonce, body=body), **kw})
    assert verify() is None
    assert "another cluster key" in verify(body=b"other bytes")
    assert "another cluster key" in verify(request_nonce="m" * 32)  # a reply to another call
    assert "another cluster key" in verify(requester="someone-else")
    assert "another cluster key" in verify(md=auth.sign_reply(auth.generate_key(), SERVER_ID, "client", EXCHANGE,
                                                              nonce, body))
    assert "comes from node 'server'" in verify(receiver="other-node")
    assert "no meshllm signature" in verify(md=[])


class UnsignedCluster(cluster_pb2_grpc.ClusterServicer):
    """A rogue that answers without the key (plain grpc server, no meshllm interceptor)."""

    def Exchange(self, request, context):
        return cluster_pb2.ExchangeResponse(cards=[cluster_pb2.Card(node_id="forged")])


@contextlib.contextmanager
def rogue_channel():
    """A plaintext channel to an UnsignedCluster on loopback."""
    from concurrent.futures import ThreadPoolExecutor

    rogue = grpc.server(ThreadPoolExecutor(2))
    cluster_pb2_grpc.add_ClusterServicer_to_server(UnsignedCluster(), rogue)
    port = rogue.add_insecure_port("127.0.0.1:0")
    rogue.start()
    try:
        config = ChannelConfig("client", auth.generate_key(), tls=PLAINTEXT)
        with open_channel(f"127.0.0.1:{port}", config, receiver="rogue") as channel:
            yield channel
    finally:
        rogue.stop(0)


def test_unsigned_reply_is_refused_even_in_plaintext():
    with rogue_channel() as channel:
        with pytest.raises(ReplyRejected, match="no meshllm signature") as info:
            cluster_pb2_grpc.ClusterStub(channel).Exchange(cluster_pb2.ExchangeRequest(), timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_signed_future_hands_out_only_verified_replies(served):
    """`.future()` on a signed channel (the leader's chained proposer calls): the reply is checked
    as a blocking call's is, so a rogue's unsigned answer is refused through result()."""
    key, server, servicer, _ = served
    with open_channel(server.address, ChannelConfig("client", key), receiver=SERVER_ID) as channel:
        future = cluster_pb2_grpc.ClusterStub(channel).Exchange.future(cluster_pb2.ExchangeRequest(), timeout=5)
        done = threading.Event()
        future.add_done_callback(lambda f: done.set())
        assert isinstance(future.result(), cluster_pb2.ExchangeResponse) and done.wait(5)
    assert len(servicer.requests) == 1
    with rogue_channel() as channel:
        future = cluster_pb2_grpc.ClusterStub(channel).Exchange.future(cluster_pb2.ExchangeRequest(), timeout=5)
        with pytest.raises(ReplyRejected, match="no meshllm signature"):
            future.result()


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
