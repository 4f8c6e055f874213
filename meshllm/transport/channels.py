"""Client channels to other nodes: TLS from the cluster key, every call signed for its
receiver, replies verified, size limits, default deadlines, one keepalive policy."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import grpc

from meshllm.transport.signed_channel import CallSigner, SignedChannel
from meshllm.transport.tls import TlsMode, channel_credentials

# Big enough for a micro-batch of activations between pipeline stages; the
# control-plane services enforce their own, much smaller limits on top.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True)
class KeepalivePolicy:
    """How often an idle connection is probed, shared by clients and servers so they agree.

    Clients ping every `interval_ms` even while a stream is idle (an idle pipeline stream
    is when a dead peer must be noticed); servers accept pings that often. A gRPC server
    left at its defaults accepts one ping per 5 minutes without data and answers more
    with GOAWAY too_many_pings, tearing down the connection and every stream on it.
    """

    interval_ms: int = 10_000
    timeout_ms: int = 5_000  # no ack within this: the peer is dead

    def __post_init__(self):
        if self.interval_ms < 10 or self.timeout_ms < 10:
            raise ValueError(f"keepalive interval and timeout must be at least 10 ms, got {self}")

    def client_options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", self.interval_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # no cap: keep probing a quiet stream
        ]

    def server_options(self) -> list[tuple[str, int]]:
        return [
            # The server probes its callers too, so the streams of a leader that vanished end.
            ("grpc.keepalive_time_ms", self.interval_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            # The least time between pings the server accepts without data (what gRPC's
            # headers call GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS): half the
            # clients' interval, so timer jitter never counts as abuse.
            ("grpc.http2.min_ping_interval_without_data_ms", self.interval_ms // 2),
        ]


def channel_options(max_message_bytes: int, keepalive: KeepalivePolicy = KeepalivePolicy()) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        *keepalive.client_options(),
        # A peer that restarts is reachable again within seconds (gRPC's default
        # backoff grows to two minutes, longer than a card's ttl).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    node_id: str  # who we are, sent (signed) with every call
    key: bytes
    tls: TlsMode = None  # None: certificates derived from `key` (the default)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    default_deadline_s: float = DEFAULT_DEADLINE_S  # for calls that set no timeout
    keepalive: KeepalivePolicy = field(default_factory=KeepalivePolicy)

    def __post_init__(self):
        if self.max_message_bytes <= 0 or self.default_deadline_s <= 0:
            raise ValueError("max_message_bytes and default_deadline_s must be positive")


def _plain_channel(address: str, config: ChannelConfig) -> grpc.Channel:
    credentials, tls_options = channel_credentials(config.key, config.tls, config.node_id)
    options = channel_options(config.max_message_bytes, config.keepalive) + tls_options
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=options)


def open_channel(address: str, config: ChannelConfig, receiver: str | None = None) -> SignedChannel:
    """A channel to node `receiver` at `address` ("host:port"). `receiver` None only asks
    who is there (Health.Check); every other call must name its receiver. Close it
    (or use it as a context manager) when done."""
    return SignedChannel(_plain_channel(address, config), CallSigner(config.key, config.node_id), receiver or "",
                         config.default_deadline_s, owns_channel=True)


class ChannelPool:
    """One reusable connection per peer address. Thread-safe.

    gRPC channels reconnect by themselves, so a channel is kept across failures
    and only dropped by `discard` (a peer that left) or `close`.
    """

    def __init__(self, config: ChannelConfig):
        self.config = config
        self._signer = CallSigner(config.key, config.node_id)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._signed: dict[tuple[str, str], SignedChannel] = {}

    def get(self, address: str, receiver: str | None = None) -> SignedChannel:
        """Calls to node `receiver` at `address` (None: only to ask who is there)."""
        with self._lock:
            signed = self._signed.get((address, receiver or ""))
            if signed is None:
                channel = self._channels.get(address)
                if channel is None:
                    channel = self._channels[address] = _plain_channel(address, self.config)
                signed = self._signed[(address, receiver or "")] = SignedChannel(
                    channel, self._signer, receiver or "", self.config.default_deadline_s)
            return signed

    def addresses(self) -> set[str]:
        with self._lock:
            return set(self._channels)

    def discard(self, address: str) -> None:
        with self._lock:
            channel = self._channels.pop(address, None)
            for key in [k for k in self._signed if k[0] == address]:
                del self._signed[key]
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels, self._signed = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()
