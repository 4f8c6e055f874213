"""Gossip over real gRPC on loopback, in one process: exchange, convergence,
per-peer errors, and hostile messages that must not harm the registry."""

import random
import threading
import time

import grpc
import pytest

from meshllm.cluster.gossip import ClusterServicer, GossipLoop, HealthServicer, fetch_view
from meshllm.cluster.registry import Registry
from meshllm.errors import AuthError, PeerUnreachable
from meshllm.transport import auth, convert
from meshllm.transport.channels import ChannelConfig, ChannelPool, open_channel
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from tests.cluster.cards import make_card

EXCHANGE = "/meshllm.Cluster/Exchange"


class LocalNode:
    """A node's control plane without a process: server, registry, gossip loop."""

    def __init__(self, name: str, key: bytes, peers: set[str] = frozenset()):
        self.server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id=name))
        self.name = name
        self.registry = Registry(make_card(name, grpc_address=self.server.address))
        self.server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, ClusterServicer(self.registry))
        self.server.add(cluster_pb2_grpc.add_HealthServicer_to_server, HealthServicer(self.registry))
        self.peers = set(peers)
        self.gossip = GossipLoop(self.registry, ChannelPool(ChannelConfig(name, key)), peers=lambda: self.peers,
                                 refresh_own=lambda: make_card(name, grpc_address=self.server.address),
                                 interval_s=0.2, rng=random.Random(0))
        self.server.start()

    def ids(self) -> set[str]:
        return {c.node_id for c in self.registry.snapshot()}

    def close(self):
        self.gossip.stop()
        self.server.stop(0)


@pytest.fixture
def key():
    return auth.generate_key()


@pytest.fixture
def nodes(key):
    made = []

    def make(name, peers=()):
        node = LocalNode(name, key, set(peers))
        made.append(node)
        return node

    try:
        yield make
    finally:
        for node in made:
            node.close()


def test_one_exchange_gives_both_sides_the_union(nodes):
    a = nodes("a")
    b = nodes("b", peers=[a.server.address])
    b.gossip.run_round()
    assert a.ids() == b.ids() == {"a", "b"}


def test_line_converges_round_by_round(nodes):
    line = [nodes("n0")]
    for i in range(1, 5):
        line.append(nodes(f"n{i}", peers=[line[-1].server.address]))
    everyone = {f"n{i}" for i in range(5)}
    for _ in range(4):  # diameter of a line of five
        for node in line:
            node.gossip.run_round()
    assert all(node.ids() == everyone for node in line)


def test_unreachable_peer_is_recorded_and_others_still_exchange(nodes):
    a = nodes("a")
    dead = f"127.0.0.1:{NodeServer(ServerConfig('127.0.0.1', 0, b'k' * 16)).port}"  # bound, never started
    b = nodes("b", peers=[dead, a.server.address])
    b.gossip.run_round()
    assert b.ids() == {"a", "b"}
    errors = b.gossip.errors()
    assert set(errors) == {dead} and errors[dead].kind == "UNAVAILABLE"
    b.peers.discard(dead)
    a.server.stop(0)
    b.gossip.run_round()
    assert a.server.address in b.gossip.errors()  # and the loop keeps going


def test_gossip_loop_thread_runs_and_stops(nodes):
    a = nodes("a")
    b = nodes("b", peers=[a.server.address])
    b.gossip.start()
    deadline = time.monotonic() + 5
    while a.ids() != {"a", "b"} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.ids() == {"a", "b"}
    started = time.monotonic()
    b.gossip.stop()
    assert time.monotonic() - started < 3


def test_a_node_that_stops_leaves_every_view_at_once(nodes):
    """Its farewell, not its card's 30 s TTL: no plan is made on it meanwhile."""
    a = nodes("a")
    b = nodes("b", peers=[a.server.address])
    c = nodes("c", peers=[a.server.address])
    b.gossip.start()
    c.gossip.run_round()  # c hears of b through a

    def until(condition):
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert condition()

    until(lambda: a.ids() == b.ids() == c.ids() == {"a", "b", "c"})
    b.gossip.stop()
    assert "b" not in a.ids() and "b" not in c.ids()
    c.gossip.run_round()  # nobody brings b's older card back
    a.gossip.run_round()
    assert a.ids() == c.ids() == {"a", "c"}


def raw_call(address, key, payload: bytes, receiver: str = "a"):
    with open_channel(address, ChannelConfig("tester", key), receiver=receiver) as channel:
        return channel.unary_unary(EXCHANGE)(payload, timeout=5)


@pytest.mark.parametrize("payload,code", [
    (b"\xff\xfe garbage that is not protobuf", grpc.StatusCode.INVALID_ARGUMENT),
    (cluster_pb2.ExchangeRequest(cards=[cluster_pb2.Card(node_id="x" * (convert.MAX_EXCHANGE_BYTES + 1))])
     .SerializeToString(), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (cluster_pb2.ExchangeRequest(cards=[convert.card_to_pb(make_card(f"n{i}")) for i in range(513)])
     .SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT),
], ids=["malformed", "oversized", "too-many-cards"])
def test_hostile_messages_are_refused_without_touching_the_registry(nodes, key, payload, code):
    a = nodes("a")
    a.registry.merge([make_card("b")])
    before = a.registry.snapshot()
    with pytest.raises(grpc.RpcError) as info:
        raw_call(a.server.address, key, payload)
    assert info.value.code() == code
    assert a.registry.snapshot() == before


def test_absurd_cards_are_dropped_while_good_ones_merge(nodes, key):
    a = nodes("a")
    now = time.time()
    bad = [make_card("neg", memory_total_bytes=-1), make_card("years", ttl=5 * 365 * 86400.0),
           make_card("future", announced_at=now + 3600), make_card("a", announced_at=now + 10)]  # claims a's id
    good = make_card("good")
    request = cluster_pb2.ExchangeRequest(cards=[convert.card_to_pb(c) for c in [*bad, good]])
    reply = cluster_pb2.ExchangeResponse.FromString(raw_call(a.server.address, key, request.SerializeToString()))
    assert {c.node_id for c in reply.cards} == {"a", "good"}
    assert a.ids() == {"a", "good"}
    assert a.registry.own_card().grpc_address == a.server.address


def test_fetch_view_reads_without_writing(nodes, key):
    a = nodes("a")
    a.registry.merge([make_card("b")])
    assert [c.node_id for c in fetch_view(a.server.address, key)] == ["a", "b"]
    assert a.ids() == {"a", "b"}  # the reader's id is not a card


def test_fetch_view_errors_say_what_to_do(nodes):
    a = nodes("a")
    with pytest.raises(AuthError, match="--key-file"):
        fetch_view(a.server.address, auth.generate_key())
    port = NodeServer(ServerConfig("127.0.0.1", 0, b"k" * 16)).port
    with pytest.raises(PeerUnreachable, match="meshllm node"):
        fetch_view(f"127.0.0.1:{port}", auth.generate_key(), timeout=1)


def test_wrong_key_node_can_neither_read_nor_write(nodes, key):
    a = nodes("a")
    intruder = LocalNode("intruder", auth.generate_key(), {a.server.address})
    try:
        intruder.gossip.run_round()
        assert intruder.ids() == {"intruder"} and a.ids() == {"a"}
        error = intruder.gossip.errors()[a.server.address]
        assert error.kind == "UNAVAILABLE" and "TLS handshake failed" in error.message and "--key-file" in error.message
    finally:
        intruder.close()


class HungHealth(cluster_pb2_grpc.HealthServicer):
    """A member that takes calls and never answers them (stuck handlers), until `release`."""

    def __init__(self, release):
        self.release = release

    def Check(self, request, context):
        self.release.wait(30)
        context.abort(grpc.StatusCode.UNAVAILABLE, "hung")


def test_peers_that_never_answer_neither_hold_up_rounds_nor_crowd_out_live_ones(nodes, key):
    # Peers that take a call and never answer it: each exchange waits its whole timeout, 8 at a time,
    # so many of them held every round for that many waves of timeouts (60: minutes, past the cards'
    # TTL, and every view emptied). Now the peers that answered go first, at most one wave of the
    # others is tried per round, and the failing ones sit rounds out.
    from meshllm.cluster.gossip import MAX_UNANSWERED_PER_ROUND

    release = threading.Event()
    hung = []
    for i in range(2 * MAX_UNANSWERED_PER_ROUND):
        server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id=f"hung-{i}"))
        server.add(cluster_pb2_grpc.add_HealthServicer_to_server, HungHealth(release))
        server.start()
        hung.append(server)
    a = nodes("a")
    fakes = {server.address for server in hung}
    b = nodes("b", peers=[a.server.address, *fakes])
    timeout_s = b.gossip._timeout_s
    try:
        durations = []
        for _ in range(3):  # every one tried once by then
            started = time.monotonic()
            b.gossip.run_round()
            durations.append(time.monotonic() - started)
        assert b.ids() == {"a", "b"}
        assert set(b.gossip.errors()) == fakes  # every one was tried
        # One wave of timeouts per round at most, where 17 peers on 8 workers took 3 every round.
        assert max(durations) < 2 * timeout_s, durations
        # a answered: from then on every round reaches it, whatever the others do.
        a.registry.update_own(make_card("a", grpc_address=a.server.address, announced_at=time.time() + 5))
        b.gossip.run_round()
        (seen,) = [c for c in b.registry.snapshot() if c.node_id == "a"]
        assert seen.announced_at > time.time()
    finally:
        release.set()
        for server in hung:
            server.stop(0)
