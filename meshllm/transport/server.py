"""One gRPC server per node: every service (Cluster, Health, later Stage and
Proposer) shares one port, one thread pool, one TLS identity and one auth interceptor.

    server = NodeServer(ServerConfig(host="0.0.0.0", port=7650, key=key, node_id="mac-mini"))
    server.add(cluster_pb2_grpc.add_ClusterServicer_to_server, ClusterServicer(...))
    server.add(stage_pb2_grpc.add_StageServicer_to_server, stage_servicer)
    server.start()
"""

from __future__ import annotations

import logging
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc

from meshllm.errors import BindFailed
from meshllm.transport.channels import DEFAULT_MAX_MESSAGE_BYTES, KeepalivePolicy
from meshllm.transport.server_auth import ServerAuthInterceptor
from meshllm.transport.tls import TlsMode, server_credentials

log = logging.getLogger(__name__)


UNARY_WORKERS = 8  # server threads kept free of streams: gossip, health, Load/Info/Release
DEFAULT_MAX_WORKERS = 32
DEFAULT_MAX_STREAMS = DEFAULT_MAX_WORKERS - UNARY_WORKERS


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str
    port: int  # 0 picks a free port; NodeServer.port tells which
    key: bytes
    node_id: str | None = None  # calls must be addressed to it; default <hostname>-<port>
    tls: TlsMode = None  # None: certificates derived from `key` (the default)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Each open stream (a pipeline Forward stream) holds one thread for its life; `max_streams`
    # leaves the rest to short calls, so open streams never starve gossip, health or Load.
    max_workers: int = DEFAULT_MAX_WORKERS
    keepalive: KeepalivePolicy = field(default_factory=KeepalivePolicy)  # the same as the clients'

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0..65535")
        if self.max_workers <= UNARY_WORKERS:
            raise ValueError(f"max_workers must exceed the {UNARY_WORKERS} threads kept for short calls")

    @property
    def max_streams(self) -> int:
        """Long-lived streams accepted at once (the Stage service refuses more; cards advertise it)."""
        return self.max_workers - UNARY_WORKERS


class NodeServer:
    """The node's gRPC server. Binds in the constructor (so `port` is known before
    the card is built), takes servicers with `add` until `start`."""

    def __init__(self, config: ServerConfig):
        self.config = config
        options = [
            ("grpc.max_send_message_length", config.max_message_bytes),
            ("grpc.max_receive_message_length", config.max_message_bytes),
            *config.keepalive.server_options(),
            ("grpc.so_reuseport", 0),  # a second node on the same port must fail, not share it
        ]
        # The id is known only once the port is (its default names the port): set after binding.
        self._auth = ServerAuthInterceptor(config.key, node_id="")
        self._server = grpc.server(ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="grpc"),
                                   interceptors=[self._auth], options=options)
        bind = join_host_port(config.host, config.port)
        credentials = server_credentials(config.key, config.tls, config.node_id or socket.gethostname())
        try:
            if credentials is None:
                self.port = self._server.add_insecure_port(bind)
            else:
                self.port = self._server.add_secure_port(bind, credentials)
        except RuntimeError as e:  # grpc raises RuntimeError("Failed to bind to address ...")
            raise BindFailed(f"cannot listen on {bind}: {str(e).rstrip('.')}. Is another node using the port? "
                             f"Pick another --port (0 picks a free one).") from e
        if self.port == 0:
            raise BindFailed(f"cannot listen on {bind}. Is another node using the port? "
                             f"Pick another --port (0 picks a free one).")
        self.node_id = config.node_id or f"{socket.gethostname()}-{self.port}"
        self._auth.node_id = self.node_id
        self._started = False

    @property
    def address(self) -> str:
        return join_host_port(self.config.host, self.port)

    def add(self, adder: Callable[[Any, grpc.Server], None], servicer: Any) -> None:
        """Register a servicer through its generated `add_XServicer_to_server`."""
        if self._started:
            raise RuntimeError("add servicers before NodeServer.start()")
        adder(servicer, self._server)

    def start(self) -> None:
        self._server.start()
        self._started = True
        log.info("gRPC server listening on %s", self.address)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting calls and wait up to `grace_s` for running ones."""
        self._server.stop(grace_s).wait()
