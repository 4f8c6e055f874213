"""Gossip: symmetric push-pull of capability cards between nodes.

Each round a node sends its whole view to each peer (its --peer seeds, the
nodes mDNS discovered, and one random node from its view); the peer merges it
and answers with its own merged view, which the caller merges in turn. After
one exchange both sides hold the union, so with a connected seed graph every
view holds every live card within graph-diameter rounds.

Only verified cards are merged: a request's cards are covered by its MAC (the
server interceptor checks it before Exchange runs), a reply's by the
responder's signature (the signed channel checks it before Exchange returns),
and both travel over TLS from the cluster key. A host that knows the cluster id
from mDNS but not the key fails the TLS handshake, and even over
--insecure-plaintext its unsigned reply is refused: its cards never reach a
registry, so it is never placed.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc

from meshllm.cluster.card import Card, NodeId
from meshllm.cluster.registry import MergeResult, Registry
from meshllm.errors import AuthError, MalformedMessage, MeshError, PeerUnreachable
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.convert import (MAX_CARDS_PER_EXCHANGE, MAX_EXCHANGE_BYTES, card_to_pb,
                                       cards_from_pb)
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc
from meshllm.transport.tls import Plaintext, TlsMode

log = logging.getLogger(__name__)


def outgoing_cards(cards: Iterable[Card], own: Card) -> list[cluster_pb2.Card]:
    """The cards to send, own card first; past the message limit the freshest win."""
    others = sorted((c for c in cards if c.node_id != own.node_id), key=lambda c: -c.announced_at)
    return [card_to_pb(c) for c in (own, *others[:MAX_CARDS_PER_EXCHANGE - 1])]


def merge_reply(registry: Registry, cards: Iterable[cluster_pb2.Card], source: str, now: float) -> MergeResult:
    """Merge the cards of a verified Exchange message (see the module docstring)."""
    valid, rejected = cards_from_pb(list(cards), now)
    for rejection in rejected:
        log.warning("dropped a card from %s: %s", source, rejection)
    return registry.merge(valid)


class ClusterServicer(cluster_pb2_grpc.ClusterServicer):
    """Answers Exchange on gRPC server threads (the registry is thread-safe)."""

    def __init__(self, registry: Registry, clock: Callable[[], float] = time.time):
        self._registry = registry
        self._clock = clock

    def Exchange(self, request: cluster_pb2.ExchangeRequest, context: grpc.ServicerContext):
        # The server's message limit is sized for activations; the control plane
        # has its own, and an oversized or overfull exchange is refused whole.
        if request.ByteSize() > MAX_EXCHANGE_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"exchange of {request.ByteSize()} bytes exceeds {MAX_EXCHANGE_BYTES}")
        try:
            merge_reply(self._registry, request.cards, f"caller {context.peer()}", self._clock())
        except MalformedMessage as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return cluster_pb2.ExchangeResponse(cards=outgoing_cards(self._registry.snapshot(),
                                                                 self._registry.own_card()))


def node_id_at(channels: ChannelPool, address: str, timeout: float) -> NodeId:
    """Who listens at `address`: its signed answer to Health.Check, the one call that
    may be sent before the receiver is known. Every later call is addressed to it."""
    reply = cluster_pb2_grpc.HealthStub(channels.get(address)).Check(cluster_pb2.HealthRequest(), timeout=timeout)
    return NodeId(reply.node_id)


class HealthServicer(cluster_pb2_grpc.HealthServicer):
    def __init__(self, registry: Registry):
        self._registry = registry

    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id=self._registry.node_id, serving=True)


@dataclass(frozen=True, slots=True)
class PeerError:
    address: str
    kind: str  # gRPC status name, or "invalid_reply"
    message: str
    at: float  # unix seconds of the failed exchange


# Addresses that never answered (discovered over mDNS, or seeds not up yet) get at most one wave
# of the pool per round, and an address that keeps failing is skipped for a growing number of
# rounds: peers that take calls and never answer them (hung members) each hold an exchange for its
# full timeout, 8 at a time, so enough of them held every round past the cards' TTL. (A listener
# that does not speak TLS fails in ~0.3 s, and gRPC's reconnect backoff makes later tries instant.)
MAX_UNANSWERED_PER_ROUND = 8
MAX_BACKOFF_ROUNDS = 4
FAREWELL_TIMEOUT_S = 1.0  # what a stopping node waits, at most, for the others to hear it leave


class GossipLoop:
    """Background thread: refresh own card, exchange with every peer, repeat.

    `peers()` is called each round (seeds plus discovered addresses), so
    discovery can add peers while the loop runs. A failing peer is recorded in
    `errors()` and never stops the round for the others. Peers that answered before
    (or hold a live card) go first; of the others, MAX_UNANSWERED_PER_ROUND per round,
    those tried longest ago first; a peer that failed n times in a row sits out
    min(2^(n-1) - 1, MAX_BACKOFF_ROUNDS) rounds.
    """

    def __init__(self, registry: Registry, channels: ChannelPool, peers: Callable[[], set[str]],
                 refresh_own: Callable[[], Card], interval_s: float, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time, num_random_peers: int = 1):
        self._registry = registry
        self._channels = channels
        self._peers = peers
        self._refresh_own = refresh_own
        self._interval_s = interval_s
        self._timeout_s = min(max(2 * interval_s, 1.0), 10.0)
        self._rng = rng or random.Random()
        self._clock = clock
        self._num_random_peers = num_random_peers
        self._errors: dict[str, PeerError] = {}
        self._receivers: dict[str, NodeId] = {}  # address -> node id it answered with; under _errors_lock
        self._failures: dict[str, int] = {}  # address -> failures in a row; under _errors_lock
        self._due_round: dict[str, int] = {}  # address -> first round it is tried again; under _errors_lock
        self._last_tried: dict[str, int] = {}  # unanswered address -> the round it was last tried
        self._round = 0
        self._errors_lock = threading.Lock()
        self._stopped = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="gossip")
        self._thread = threading.Thread(target=self._run, name="gossip", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._stopped.is_set():
            return  # stopped already: its farewell was said
        self._stopped.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=self._timeout_s + 1)
            self._farewell()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channels.close()

    def _farewell(self) -> None:
        """Tell every node in the view that this one leaves: its card, expired on arrival, which
        drops it from their views at once (Registry.merge) instead of after its TTL, so no plan is
        made on it meanwhile. At most FAREWELL_TIMEOUT_S; a node that misses it lets the TTL run."""
        own = self._registry.own_card()
        card = replace(own, announced_at=max(self._clock(), own.announced_at + 1e-3), ttl_seconds=1e-3)
        request = cluster_pb2.ExchangeRequest(cards=[card_to_pb(card)])
        with self._errors_lock:
            receivers = dict(self._receivers)
        others = [c for c in self._registry.snapshot() if c.node_id != own.node_id]

        def tell(peer: Card) -> None:
            receiver = receivers.get(peer.grpc_address, peer.node_id)
            try:
                cluster_pb2_grpc.ClusterStub(self._channels.get(peer.grpc_address, receiver)).Exchange(
                    request, timeout=FAREWELL_TIMEOUT_S)
            except grpc.RpcError as e:
                log.debug("farewell to %s failed: %s", peer.grpc_address, e.code().name)

        list(self._pool.map(tell, others))

    def errors(self) -> dict[str, PeerError]:
        with self._errors_lock:
            return dict(self._errors)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.run_round()
            except Exception:  # a bug in a card source must not end gossip for good: log it, retry
                log.exception("gossip round failed; retrying in %.1fs", self._interval_s)
            self._stopped.wait(self._interval_s)

    def choose_peers(self) -> set[str]:
        own = self._registry.own_card()
        peers = set(self._peers())
        # A random known node besides the seeds keeps the view connected when
        # seeds leave, and speeds convergence on sparse seed graphs.
        known = sorted({c.grpc_address for c in self._registry.snapshot() if c.node_id != own.node_id} - peers)
        peers.update(self._rng.sample(known, min(self._num_random_peers, len(known))))
        peers.discard(own.grpc_address)
        return peers

    def run_round(self) -> None:
        """One round: refresh own card, exchange with the peers due this round, concurrently."""
        self._round += 1
        self._registry.update_own(self._refresh_own())
        peers = self.choose_peers()
        # Keep channels to live nodes (random picks recur); drop those of nodes gone.
        live = {c.grpc_address for c in self._registry.snapshot()}
        for address in self._channels.addresses() - peers - live:
            self._channels.discard(address)
        list(self._pool.map(self._exchange_with, self._due(peers, live)))

    def _due(self, peers: set[str], live: set[str]) -> list[str]:
        """The peers to exchange with this round, those that answered before first (see the class doc)."""
        with self._errors_lock:
            for book in (self._failures, self._due_round, self._receivers):
                for address in set(book) - peers - live:
                    del book[address]  # forgotten, so a flood of addresses does not grow these for good
            due = [p for p in sorted(peers) if self._due_round.get(p, 0) <= self._round]
            answered = [p for p in due if p in live or p in self._receivers]
        for address in set(self._last_tried) - peers:
            del self._last_tried[address]
        unanswered = sorted(set(due) - set(answered), key=lambda p: (self._last_tried.get(p, 0), p))
        unanswered = unanswered[:MAX_UNANSWERED_PER_ROUND]
        for address in unanswered:
            self._last_tried[address] = self._round
        return answered + unanswered

    def _exchange_with(self, address: str) -> None:
        request = cluster_pb2.ExchangeRequest(cards=outgoing_cards(self._registry.snapshot(),
                                                                   self._registry.own_card()))
        try:
            with self._errors_lock:
                receiver = self._receivers.get(address)
            if receiver is None:
                receiver = node_id_at(self._channels, address, self._timeout_s)
                with self._errors_lock:
                    self._receivers[address] = receiver
            stub = cluster_pb2_grpc.ClusterStub(self._channels.get(address, receiver))
            reply = stub.Exchange(request, timeout=self._timeout_s)
            merge_reply(self._registry, reply.cards, address, self._clock())
        except grpc.RpcError as e:
            self._record_error(address, e.code().name, f"{e.code().name}: {explain_rpc_error(e)}")
        except MalformedMessage as e:
            self._record_error(address, "invalid_reply", str(e))
        else:
            with self._errors_lock:
                recovered = self._errors.pop(address, None)
                self._failures.pop(address, None)
                self._due_round.pop(address, None)
            if recovered is not None:
                log.info("gossip with %s works again", address)

    def _record_error(self, address: str, kind: str, message: str) -> None:
        with self._errors_lock:
            self._receivers.pop(address, None)  # ask who is there again: it may have restarted as another node
            previous = self._errors.get(address)
            self._errors[address] = PeerError(address, kind, message, self._clock())
            failures = self._failures[address] = self._failures.get(address, 0) + 1
            self._due_round[address] = self._round + 1 + min(2 ** (failures - 1) - 1, MAX_BACKOFF_ROUNDS)
        # Once per kind of failure, not every round: a down peer would flood the log.
        if previous is None or previous.kind != kind:
            log.warning("gossip with %s failed (will keep trying): %s", address, message)


def handshake_failed(e: grpc.RpcError) -> bool:
    """The TLS handshake was refused: the peer's certificate is not from this cluster's
    key (or ours not from theirs), or only one side runs with --insecure-plaintext."""
    details = (e.details() or "").lower()
    return e.code() == grpc.StatusCode.UNAVAILABLE and "tls handshake failed" in details


def explain_rpc_error(e: grpc.RpcError) -> str:
    """gRPC's details, plus what to do when the TLS handshake failed."""
    if handshake_failed(e):
        return (f"{e.details()} -- the TLS handshake failed: the peer does not hold this cluster's key (check "
                f"--key-file), or one side runs with --insecure-plaintext and the other not, or the port is "
                f"not a meshllm node's (an HTTP API's port is another)")
    return e.details() or ""


def fetch_view(address: str, key: bytes, timeout: float = 5.0, *, tls: TlsMode = None,
               node_id: str = "meshllm-cli") -> list[Card]:
    """The fleet as the node at `address` sees it: who is there (Health.Check), then one
    authenticated Exchange addressed to it that sends no cards. Used by `meshllm status`,
    `plan` and `generate`."""
    channels = ChannelPool(ChannelConfig(node_id=node_id, key=key, tls=tls))
    try:
        receiver = node_id_at(channels, address, timeout)
        stub = cluster_pb2_grpc.ClusterStub(channels.get(address, receiver))
        reply = stub.Exchange(cluster_pb2.ExchangeRequest(), timeout=timeout)
    except grpc.RpcError as e:
        code, details = e.code(), explain_rpc_error(e)
        if code == grpc.StatusCode.UNAUTHENTICATED or handshake_failed(e):
            raise AuthError(f"{address} refused the call: {details}. Pass the cluster's key file "
                            f"with --key-file.") from None
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            # A TLS node closes a plaintext connection at once: that is not a node that is down.
            plaintext = isinstance(tls, Plaintext) and "socket closed" in details.lower()
            hint = (" It closed the connection: does it run with TLS (the default) while this command runs "
                    "with --insecure-plaintext?" if plaintext else "")
            raise PeerUnreachable(f"no meshllm node answered at {address} within {timeout:.0f}s ({code.name}: "
                                  f"{details}).{hint} Is `meshllm node` running there? Check --peer host:port.") from None
        raise MeshError(f"{address} failed the Exchange call: {code.name}: {details}") from None
    finally:
        channels.close()
    cards, rejected = cards_from_pb(list(reply.cards), time.time())
    for rejection in rejected:
        log.warning("dropped a card from %s: %s", address, rejection)
    return sorted(cards, key=lambda c: c.node_id)
