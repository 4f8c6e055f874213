"""One meshllm node: a gRPC server plus the services that run beside it.

Composition only. The server carries every gRPC service on one port; the
services (model scan, mDNS discovery, gossip loop, and later the stage
service and the HTTP API) start in order after the server and stop in
reverse order before it. Later features hook in with `node.server.add(...)`,
`node.add_service(...)` and `node.card.set_shards_source(...)` before
`start()`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from meshllm.cluster.card import Card, LinkProbe, NodeId
from meshllm.cluster.discovery import Discovery, is_wildcard, lan_ipv4_addresses
from meshllm.cluster.gossip import ClusterServicer, GossipLoop, HealthServicer
from meshllm.cluster.models_on_disk import ModelScan
from meshllm.cluster.own_card import CardIdentity, OwnCard
from meshllm.cluster.profile import load_or_probe, memory_of, platform_name
from meshllm.cluster.registry import Registry
from meshllm.cluster.stage_budget import StageMemory
from meshllm.transport.auth import cluster_id
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.convert import MAX_TTL_S
from meshllm.transport.protos import cluster_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig, join_host_port
from meshllm.transport.tls import PLAINTEXT, TlsMode

if TYPE_CHECKING:  # torch.distributed comes with it: imported where a node starts its collective
    from meshllm.tp.node_collective import NodeCollective

log = logging.getLogger(__name__)

KEY_FILE_NAME = "cluster.key"


def default_state_dir() -> Path:
    """Where a node keeps its cluster key and probe cache: $XDG_STATE_HOME/meshllm."""
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "meshllm"


@dataclass(frozen=True, slots=True)
class NodeConfig:
    host: str = "127.0.0.1"
    port: int = 7650  # 0 picks a free port
    advertise_host: str | None = None  # address peers dial; default: host, or a LAN address for 0.0.0.0
    peers: tuple[str, ...] = ()  # seed peers, host:port
    model_paths: tuple[Path, ...] = ()
    node_id: str | None = None  # default: <hostname>-<port>
    gossip_interval_s: float = 2.0
    ttl_s: float = 30.0
    discovery: bool = True
    state_dir: Path = field(default_factory=default_state_dir)
    tls: TlsMode = None  # None: TLS with certificates derived from the cluster key
    device: str = "cpu"
    max_memory_bytes: int | None = None  # the most memory this node offers to plans (None: what is free)
    # Port of the tensor-parallel rendezvous store this node hosts (0: a free one); None: the node
    # takes no part in tensor parallelism (no collective endpoint in its card, no link probes).
    collective_port: int | None = None
    # A plan (and a proposer's sequence) no leader used this long is dropped: a leader that is gone
    # for good leaves nothing loaded. Far above the leaders' idle renewals (every 2 s).
    plan_lease_s: float = 300.0

    def __post_init__(self):
        if self.plan_lease_s <= 0:
            raise ValueError(f"--plan-lease must be positive, got {self.plan_lease_s}")
        if self.max_memory_bytes is not None and self.max_memory_bytes < 1:
            raise ValueError(f"--max-memory must be positive, got {self.max_memory_bytes} bytes")
        if self.gossip_interval_s <= 0:
            raise ValueError(f"--gossip-interval must be positive, got {self.gossip_interval_s}")
        if not self.gossip_interval_s < self.ttl_s <= MAX_TTL_S:
            raise ValueError(f"--ttl must be above --gossip-interval ({self.gossip_interval_s}s) and at most "
                             f"{MAX_TTL_S:.0f}s, got {self.ttl_s}; a few intervals is typical")
        for peer in self.peers:
            host, sep, port = peer.rpartition(":")
            if not (sep and host and port.isdigit()):
                raise ValueError(f"--peer {peer!r} is not host:port")


def capped_memory(memory: tuple[int, int], cap: int | None, plans: StageMemory = StageMemory()) -> tuple[int, int]:
    """(total, free) as the card advertises them. Free leaves out the KV this node's plans may still
    grow into (`plans.reserved`), which the OS counts as free until they do. With --max-memory, never
    more than the cap less what the plans hold (weights and KV) and reserve, so the cap bounds what
    they take together, not each reading of free memory (which already counts what they took)."""
    total, free = memory
    free -= plans.reserved
    if cap is not None:
        total, free = min(total, cap), min(free, cap - plans.held - plans.reserved)
    return total, max(0, min(free, total))


class Service(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


class Node:
    """Built in the constructor (the port is bound then), run by `start`/`stop`."""

    def __init__(self, config: NodeConfig, key: bytes):
        self.config = config
        if config.tls is PLAINTEXT:
            log.warning("--insecure-plaintext: prompts, activations and tokens cross the network unencrypted "
                        "and streamed messages can be altered on the way; use it on a trusted link only")
        self.server = NodeServer(ServerConfig(host=config.host, port=config.port, key=key, node_id=config.node_id,
                                              tls=config.tls))
        self.node_id = NodeId(self.server.node_id)
        self.address = join_host_port(self._advertised_host(), self.server.port)

        self.models = ModelScan(config.model_paths)
        profile = load_or_probe(config.device, config.state_dir)
        self.plan_memory: Callable[[], StageMemory] = StageMemory  # the stage service's (node_stage.py)
        self.card = OwnCard(CardIdentity(self.node_id, self.address, platform_name(), config.ttl_s), profile,
                            memory=lambda: capped_memory(memory_of(config.device), config.max_memory_bytes,
                                                         self.plan_memory()),
                            models=lambda: self.models.models)
        self.collective: NodeCollective | None = None
        if config.collective_port is not None:
            from meshllm.tp import node_collective

            self.collective = node_collective.NodeCollective(
                self.node_id, self._advertised_host(), config.collective_port, self._fleet,
                ChannelPool(ChannelConfig(self.node_id, key, config.tls)), self._publish_links)
            self.card.set_collective_endpoint(self.collective.endpoint)
            self.server.add(cluster_pb2_grpc.add_CollectiveServicer_to_server, self.collective.servicer)
        self.registry = Registry(self.card.build())
        self.server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, ClusterServicer(self.registry))
        self.server.add(cluster_pb2_grpc.add_HealthServicer_to_server, HealthServicer(self.registry))

        self.discovery = (Discovery(self.node_id, config.host, self.server.port, cluster_id(key))
                          if config.discovery else None)
        self.gossip = GossipLoop(self.registry, ChannelPool(ChannelConfig(self.node_id, key, config.tls)),
                                 peers=self._peers, refresh_own=self.card.build,
                                 interval_s=config.gossip_interval_s)
        self.services: list[Service] = [self.models, *([self.discovery] if self.discovery else []), self.gossip,
                                        *([self.collective] if self.collective else [])]
        self._started: list[Service] = []

    def _advertised_host(self) -> str:
        if self.config.advertise_host:
            return self.config.advertise_host
        if not is_wildcard(self.config.host):
            return self.config.host
        lan = lan_ipv4_addresses()
        return lan[0] if lan else socket.gethostname()

    def _fleet(self) -> list[Card]:
        return self.registry.snapshot()

    def _publish_links(self, links: tuple[LinkProbe, ...]) -> None:
        self.card.set_links(links)
        self.registry.update_own(self.card.build())  # in the card at once, not at the next gossip round

    def _peers(self) -> set[str]:
        discovered = self.discovery.peers() if self.discovery else set()
        return set(self.config.peers) | discovered

    def add_service(self, service: Service) -> None:
        """Run `service` after the built-in ones (stopped before them)."""
        if self._started:
            raise RuntimeError("add services before Node.start()")
        self.services.append(service)

    def start(self) -> None:
        self.server.start()
        for service in self.services:
            service.start()
            self._started.append(service)

    def stop(self) -> None:
        """Services last started first, then the gRPC server; one that fails to stop is logged and
        the rest still stop (a node that is told to stop must not keep its port and threads)."""
        try:
            while self._started:
                service = self._started.pop()
                try:
                    service.stop()
                except Exception:  # noqa: BLE001 - logged; the other services and the server still stop
                    log.exception("stopping %s failed", type(service).__name__)
        finally:
            self.server.stop()


def run_until_signalled(node: Node, on_ready: Callable[[Node], None] = lambda node: None,
                        on_stopping: Callable[[], None] = lambda: None, parent_pid: int | None = None) -> None:
    """Start `node`, call `on_ready`, and stop cleanly on SIGINT or SIGTERM: `on_stopping` first
    (what was built on the node, such as an API and its leader, goes before the stages it uses),
    then the node. With `parent_pid`, also once that process is no longer this one's parent (it
    died: SIGKILL gives it no chance to stop its children). Call from the main thread (Python
    delivers signals there)."""
    stop, ready = threading.Event(), threading.Event()

    def on_signal(signum, frame) -> None:
        stop.set()
        if not ready.is_set():
            # Still starting (waiting for the fleet, loading weights: minutes): stop now, not after.
            raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        node.start()
        on_ready(node)
        ready.set()
        while not stop.wait(0.5):  # a timed wait keeps the main thread responsive to signals
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("the process that started this node (pid %d) is gone: stopping", parent_pid)
                break
        log.info("node %s stopping", node.node_id)
    finally:
        try:
            on_stopping()
        finally:
            node.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
