"""Cluster authentication: one shared key, and a MAC on every call and every reply.

The key file is all a node needs: TLS certificates derive from it (tls.py), and
so does the MAC key used here. TLS keeps outsiders out of the connection; the
MACs bind each call to who sent it, who it is for, the method and the exact
body, so that even a captured call (where --insecure-plaintext lets one be
captured) cannot be redirected to another node, given another body or replayed.

A request carries (sender, receiver, unix time, random nonce) and
HMAC(sender, receiver, method, time, nonce, SHA-256 of the body). Streaming
requests sign their opening only: the messages that follow ride the same TLS
connection. The server (server_auth.py) checks the MAC, that it is the receiver,
the time window and that the nonce is new, before any servicer runs. Its reply
carries HMAC(responder, requester, method, the request's nonce, SHA-256 of the
reply body) in trailing metadata (initial metadata for a streamed reply), which
the client (signed_channel.py) checks before it believes a byte.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from meshllm.errors import KeyFileError

KEY_BYTES = 32
MIN_KEY_BYTES = 16
MAX_CLOCK_SKEW_S = 30.0  # calls stamped further from the server's clock are refused
NONCE_HEX_CHARS = 32
MAX_REMEMBERED_NONCES = 200_000  # ~ calls per 2 * MAX_CLOCK_SKEW_S; beyond, calls wait

HEADER_NODE = "x-meshllm-node"  # sender
HEADER_TO = "x-meshllm-to"  # receiver's node id; empty for HEALTH_CHECK, which asks who is there
HEADER_TIME = "x-meshllm-time"
HEADER_NONCE = "x-meshllm-nonce"
HEADER_MAC = "x-meshllm-mac"
HEADER_FROM = "x-meshllm-from"  # in a reply: the responder's node id
HEADER_REPLY_MAC = "x-meshllm-reply-mac"

STREAM = "stream"  # the body digest of a streamed request or reply: TLS protects its messages
HEALTH_CHECK = "/meshllm.Health/Check"


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

@functools.lru_cache(maxsize=8)
def mac_key(key: bytes) -> bytes:
    """The key of call MACs, apart from the TLS CA's: one secret, two purposes, no overlap."""
    return HKDF(hashes.SHA256(), length=32, salt=None, info=b"meshllm call mac v1").derive(key)


def body_digest(body: bytes | None) -> str:
    """SHA-256 of a unary message's bytes; STREAM for a stream."""
    return STREAM if body is None else hashlib.sha256(body).hexdigest()


def _mac(key: bytes, kind: str, *fields: str) -> str:
    return hmac.new(mac_key(key), "\n".join((kind, *fields)).encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, node_id: str, method: str, *, receiver: str = "", body: bytes | None = None,
         now: float | None = None, nonce: str | None = None) -> list[tuple[str, str]]:
    """The auth metadata for one call of `method` ("/meshllm.Cluster/Exchange") from
    `node_id` to `receiver` carrying `body` (None: a streaming request)."""
    timestamp = f"{time.time() if now is None else now:.3f}"
    nonce = secrets.token_hex(NONCE_HEX_CHARS // 2) if nonce is None else nonce
    return [
        (HEADER_NODE, node_id),
        (HEADER_TO, receiver),
        (HEADER_TIME, timestamp),
        (HEADER_NONCE, nonce),
        (HEADER_MAC, _mac(key, "call", node_id, receiver, method, timestamp, nonce, body_digest(body))),
    ]


def sign_reply(key: bytes, responder: str, requester: str, method: str, request_nonce: str,
               body: bytes | None) -> list[tuple[str, str]]:
    """The metadata that proves `responder` (holding the key) sent `body` in answer to
    the call with `request_nonce`: it cannot be moved to another call or body."""
    return [(HEADER_FROM, responder),
            (HEADER_REPLY_MAC, _mac(key, "reply", responder, requester, method, request_nonce, body_digest(body)))]


def verify_reply(key: bytes, metadata, *, receiver: str, requester: str, method: str, request_nonce: str,
                 body: bytes | None) -> str | None:
    """None when `metadata` signs `body` as the reply to our call (from `receiver`, when
    the call named one); else why not."""
    fields = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    responder, mac = fields.get(HEADER_FROM), fields.get(HEADER_REPLY_MAC)
    if responder is None or mac is None:
        return "the reply carries no meshllm signature: the peer is not a node of this cluster"
    expected = _mac(key, "reply", responder, requester, method, request_nonce, body_digest(body))
    if not hmac.compare_digest(mac, expected):
        return "the reply's signature does not match: another cluster key, or the reply was altered"
    if receiver and responder != receiver:
        return f"the reply comes from node {responder!r}, the call was for node {receiver!r}"
    return None


class ReplayGuard:
    """Nonces seen within the acceptance window. Thread-safe.

    A nonce must be remembered while its timestamp can still pass the skew
    check, i.e. at most 2 * max_skew after it arrived; older ones are pruned in
    arrival order. Each node keeps its own; calls name their receiver, so a nonce
    used at one node cannot be spent at another.
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


@dataclass(frozen=True, slots=True)
class Caller:
    """Who an admitted call came from, and its nonce (the reply is bound to it)."""

    node_id: str
    nonce: str


def check(key: bytes, own_id: str, method: str, metadata: dict[str, str], digest: str, guard: ReplayGuard,
          now: float, max_skew_s: float = MAX_CLOCK_SKEW_S) -> Caller | Rejection:
    """The caller when the call's metadata authenticates it for this node (`own_id`)
    and body (`digest`, from body_digest); else why not."""
    fields = [metadata.get(h) for h in (HEADER_NODE, HEADER_TO, HEADER_TIME, HEADER_NONCE, HEADER_MAC)]
    if any(f is None for f in fields):
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         "call carries no meshllm cluster signature; pass the cluster --key-file")
    node_id, receiver, timestamp, nonce, mac = fields
    if not hmac.compare_digest(mac, _mac(key, "call", node_id, receiver, method, timestamp, nonce, digest)):
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         "cluster key mismatch: the caller signed with a different --key-file (or the call "
                         "was altered on the way)")
    if receiver != own_id and not (receiver == "" and method == HEALTH_CHECK):
        meant = f"addressed to node {receiver!r}" if receiver else "addressed to no node"
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         f"call is {meant}, this is node {own_id!r}: a call replayed or misrouted from "
                         f"another node, or the node at this address restarted under another id")
    try:
        sent_at = float(timestamp)
    except ValueError:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, f"bad timestamp {timestamp!r}")
    if not abs(now - sent_at) <= max_skew_s:
        # Positive: the caller's clock is ahead of ours; negative: behind (or the call is stale).
        return Rejection(grpc.StatusCode.UNAUTHENTICATED,
                         f"call timestamp is {sent_at - now:+.1f}s off this node's clock (limit "
                         f"{max_skew_s:.0f}s): a stale or replayed call, or clocks out of sync (run NTP)")
    if len(nonce) != NONCE_HEX_CHARS:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, "bad nonce")
    first = guard.first_use(nonce)
    if first is None:
        return Rejection(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many calls in the replay window; retry later")
    if not first:
        return Rejection(grpc.StatusCode.UNAUTHENTICATED, "replayed call (nonce already used)")
    return Caller(node_id, nonce)
