"""Cluster authentication: a shared key, an HMAC on every call, optional mTLS.

Every gRPC call carries metadata (node id, unix time, random nonce, method) and
an HMAC-SHA256 of them under the cluster key. The server interceptor checks the
MAC, the time window and that the nonce is new before any servicer runs, so a
caller without the key, a stale call or a replayed one gets UNAUTHENTICATED and
does no work. Message bodies are not covered by the MAC: use mTLS
(--tls-cert/--tls-key/--tls-ca) where the network itself is not trusted.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc

from meshllm.errors import KeyFileError

log = logging.getLogger(__name__)

KEY_BYTES = 32
MIN_KEY_BYTES = 16
MAX_CLOCK_SKEW_S = 30.0  # calls stamped further from the server's clock are refused
NONCE_HEX_CHARS = 32
MAX_REMEMBERED_NONCES = 200_000  # ~ calls per 2 * MAX_CLOCK_SKEW_S; beyond, calls wait

HEADER_NODE = "x-meshllm-node"
HEADER_TIME = "x-meshllm-time"
HEADER_NONCE = "x-meshllm-nonce"
HEADER_MAC = "x-meshllm-mac"


# ---------------------------------------------------------------- key files

def generate_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: Path, key: bytes) -> None:
    """Write `key` as hex, readable only by the owner."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")


def load_key(path: Path) -> bytes:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise KeyFileError(
            f"cluster key file {path} does not exist. Copy the key file from a running node "
            f"(it prints its path at first start) and pass it with --key-file.") from None
    except OSError as e:
        raise KeyFileError(f"cannot read cluster key file {path}: {e}. Check its permissions.") from e
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise KeyFileError(
            f"cluster key file {path} is not a hex key. Copy the key file from a running node "
            f"unchanged, or delete it to have a new cluster key generated.") from None
    if len(key) < MIN_KEY_BYTES:
        raise KeyFileError(f"cluster key in {path} has {len(key)} bytes; at least {MIN_KEY_BYTES} are needed")
    return key


def load_or_create_key(path: Path) -> tuple[bytes, bool]:
    """The key in `path`, generating and writing one first if the file is absent.

    Returns (key, created). Two nodes racing to create the same file both end
    up with the one that was written first.
    """
    if path.exists():
        return load_key(path), False
    try:
        write_key(path, generate_key())
    except FileExistsError:
        return load_key(path), False
    return load_key(path), True


def cluster_id(key: bytes) -> str:
    """A short public tag of the key, so nodes can skip other clusters on the LAN
    without revealing the key (it is an HMAC of a constant under the key)."""
    return hmac.new(key, b"meshllm cluster id", hashlib.sha256).hexdigest()[:16]


# ---------------------------------------------------------------- signing

def _mac(key: bytes, node_id: str, timestamp: str, nonce: str, method: str) -> str:
    message = "\n".join((node_id, timestamp, nonce, method)).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(key: bytes, node_id: str, method: str, *, now: float | None = None,
         nonce: str | None = None) -> list[tuple[str, str]]:
    """The auth metadata for one call of `method` ("/meshllm.Cluster/Exchange")."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(NONCE_HEX_CHARS // 2) if nonce is None else nonce
    return [
        (HEADER_NODE, node_id),
        (HEADER_TIME, timestamp),
        (HEADER_NONCE, nonce),
        (HEADER_MAC, _mac(key, node_id, timestamp, nonce, method)),
    ]


class ReplayGuard:
    """Nonces seen within the acceptance window. Thread-safe.

    A nonce must be remembered while its timestamp can still pass the skew
    check, i.e. at most 2 * max_skew after it arrived; older ones are pruned in
    arrival order.
    """

    def __init__(self, max_skew_s: float = MAX_CLOCK_SKEW_S, capacity: int = MAX_REMEMBERED_NONCES,
                 clock: Callable[[], float] = time.monotonic):
        self._keep_s = 2 * max_skew_s
        self._capacity = capacity
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: set[str] = set()
        self._by_arrival: collections.deque[tuple[float, str]] = collections.deque()

    def first_use(self, nonce: str) -> bool | None:
        """True if new (and now remembered), False if replayed, None if full."""
        now = self._clock()
        with self._lock:
            while self._by_arrival and self._by_arrival[0][0] <= now:
                self._seen.discard(self._by_arrival.popleft()[1])
            if nonce in self._seen:
                return False
            if len(self._seen) >= self._capacity:
                return None
            self._seen.add(nonce)
            self._by_arrival.append((now + self._keep_s, nonce))
            return True


@dataclass(frozen=True, slots=True)
class Rejection:
    code: grpc.StatusCode
    reason: str


def check(key: bytes, method: str, metadata: dict[str, str], guard: ReplayGuard, now: float,
          max_skew_s: float = MAX_CLOCK_SKEW_S) -> Rejection | None:
    """None when the call's metadata authenticates it; else why not."""
    fields = [metadata.get(h) for h in (HEADER_NODE, HEADER_TIME, HEADER_NONCE, HEADER_MAC)]
    if any(f is None for f in fields):
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         "call carries no meshllm cluster signature; pass the cluster --key-file")
    node_id, timestamp, nonce, mac = fields
    if not hmac.compare_digest(mac, _mac(key, node_id, timestamp, nonce, method)):
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         "cluster key mismatch: the caller signed with a different --key-file")
    try:
        sent_at = float(timestamp)
    except ValueError:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, f"bad timestamp {timestamp!r}")
    if not abs(now - sent_at) <= max_skew_s:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         f"call timestamp is {now - sent_at:+.1f}s off this node's clock (limit "
                         f"{max_skew_s:.0f}s): a stale or replayed call, or clocks out of sync (run NTP)")
    if len(nonce) != NONCE_HEX_CHARS:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, "bad nonce")
    first = guard.first_use(nonce)
    if first is None:
        return Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls in the replay window; retry later")
    if not first:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, "replayed call (nonce already used)")
    return None


# ---------------------------------------------------------------- interceptors

class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression


class ClientAuthInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Signs every outgoing call with the cluster key."""

    def __init__(self, key: bytes, node_id: str):
        self._key = key
        self._node_id = node_id

    def _signed(self, details: grpc.ClientCallDetails) -> _CallDetails:
        metadata = list(details.metadata or []) + sign(self._key, self._node_id, details.method)
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._signed(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._signed(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._signed(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._signed(details), request_iterator)


def _rejecting_handler(handler: grpc.RpcMethodHandler, rejection: Rejection) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that only aborts."""

    def abort(_request, context):
        context.abort(rejection.code, rejection.reason)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class ServerAuthInterceptor(grpc.ServerInterceptor):
    """Rejects unauthenticated calls before the servicer sees them.

    Runs on gRPC's server threads; the replay guard is shared and thread-safe.
    """

    def __init__(self, key: bytes, max_skew_s: float = MAX_CLOCK_SKEW_S,
                 clock: Callable[[], float] = time.time):
        self._key = key
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._guard = ReplayGuard(max_skew_s)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)  # a lookup only; runs no servicer code
        if handler is None:
            return None
        metadata = {k: v for k, v in (handler_call_details.invocation_metadata or ()) if isinstance(v, str)}
        rejection = check(self._key, handler_call_details.method, metadata, self._guard,
                          self._clock(), self._max_skew_s)
        if rejection is None:
            return handler
        log.warning("rejected %s from node %r: %s", handler_call_details.method,
                    metadata.get(HEADER_NODE), rejection.reason)
        return _rejecting_handler(handler, rejection)


# ---------------------------------------------------------------- mTLS

@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for mutual TLS: this node's certificate and key, and the CA that
    signed every node's certificate."""

    cert: Path
    key: Path
    ca: Path

    def _read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()
        except OSError as e:
            raise KeyFileError(f"cannot read TLS file: {e}. Check --tls-cert/--tls-key/--tls-ca.") from e

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
