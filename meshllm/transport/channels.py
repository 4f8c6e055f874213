"""Client channels to other nodes: signed, size-limited, with default deadlines."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from meshllm.transport.auth import ClientAuthInterceptor, TlsFiles

# Big enough for a micro-batch of activations between pipeline stages; the
# control-plane services enforce their own, much smaller limits on top.
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_DEADLINE_S = 10.0


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    node_id: str  # who we are, sent (signed) with every call
    key: bytes
    tls: TlsFiles | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    default_deadline_s: float = DEFAULT_DEADLINE_S  # for calls that set no timeout

    def __post_init__(self):
        if self.max_message_bytes <= 0 or self.default_deadline_s <= 0:
            raise ValueError("max_message_bytes and default_deadline_s must be positive")


class _DefaultDeadline(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Gives unary-response calls a deadline when the caller set none, so a hung
    peer cannot block a thread forever. Streams keep theirs open-ended: a
    pipeline stream lives as long as its plan."""

    def __init__(self, deadline_s: float):
        self._deadline_s = deadline_s

    def _with_deadline(self, details):
        if details.timeout is not None:
            return details
        return _Details(details, self._deadline_s)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_deadline(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._with_deadline(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, details: grpc.ClientCallDetails, timeout: float):
        self.method = details.method
        self.timeout = timeout
        self.metadata = details.metadata
        self.credentials = details.credentials
        self.wait_for_ready = details.wait_for_ready
        self.compression = details.compression


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Notice a dead peer on a long-lived stream within seconds, not minutes.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # A peer that restarts is reachable again within seconds (gRPC's default
        # backoff grows to two minutes, longer than a card's ttl).
        ("grpc.initial_reconnect_backoff_ms", 250),
        ("grpc.min_reconnect_backoff_ms", 250),
        ("grpc.max_reconnect_backoff_ms", 2_000),
    ]


def open_channel(address: str, config: ChannelConfig) -> grpc.Channel:
    """A channel to `address` ("host:port") whose every call is signed."""
    options = channel_options(config.max_message_bytes)
    if config.tls is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        channel = grpc.secure_channel(address, config.tls.channel_credentials(), options=options)
    return grpc.intercept_channel(channel, _DefaultDeadline(config.default_deadline_s),
                                  ClientAuthInterceptor(config.key, config.node_id))


class ChannelPool:
    """One reusable channel per peer address. Thread-safe.

    gRPC channels reconnect by themselves, so a channel is kept across failures
    and only dropped by `discard` (a peer that left) or `close`.
    """

    def __init__(self, config: ChannelConfig):
        self.config = config
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self.config)
            return channel

    def addresses(self) -> set[str]:
        with self._lock:
            return set(self._channels)

    def discard(self, address: str) -> None:
        with self._lock:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()
