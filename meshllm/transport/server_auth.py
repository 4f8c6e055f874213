"""The server side of call authentication: a gRPC interceptor in front of every servicer.

For each call it wraps the servicer's handler so that, before the servicer sees
anything, the request's MAC is checked over the exact bytes received (unary
requests) or over the call's opening (streams), and so that every reply goes
out signed: a unary reply's MAC covers its exact bytes (trailing metadata), a
streamed reply's opening is signed in the initial metadata.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from meshllm.transport.auth import (HEADER_NODE, MAX_CLOCK_SKEW_S, Caller, ReplayGuard, body_digest, check,
                                    sign_reply)

log = logging.getLogger(__name__)


def _identity(x):
    return x


class ServerAuthInterceptor(grpc.ServerInterceptor):
    """Admits only calls signed with the cluster key and addressed to `node_id`.

    Runs on gRPC's server threads; the replay guard is shared and thread-safe.
    """

    def __init__(self, key: bytes, node_id: str, max_skew_s: float = MAX_CLOCK_SKEW_S,
                 clock: Callable[[], float] = time.time):
        self._key = key
        self.node_id = node_id
        self._max_skew_s = max_skew_s
        self._clock = clock
        self._guard = ReplayGuard(max_skew_s)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)  # a lookup only; runs no servicer code
        if handler is None:
            return None
        metadata = {k: v for k, v in (handler_call_details.invocation_metadata or ()) if isinstance(v, str)}
        return _GuardedCall(self, handler, handler_call_details.method, metadata).handler()

    def admit(self, method: str, metadata: dict[str, str], digest: str, context: grpc.ServicerContext) -> Caller:
        verdict = check(self._key, self.node_id, method, metadata, digest, self._guard, self._clock(),
                        self._max_skew_s)
        if isinstance(verdict, Caller):
            return verdict
        log.warning("rejected %s from node %r: %s", method, metadata.get(HEADER_NODE), verdict.reason)
        context.abort(verdict.code, verdict.reason)
        raise AssertionError("context.abort returns only by raising")

    def reply_metadata(self, caller: Caller, method: str, body: bytes | None) -> list[tuple[str, str]]:
        return sign_reply(self._key, self.node_id, caller.node_id, method, caller.nonce, body)


class _GuardedCall:
    """One call's handler, rebuilt so authentication and reply signing surround the servicer."""

    def __init__(self, guard: ServerAuthInterceptor, handler: grpc.RpcMethodHandler, method: str,
                 metadata: dict[str, str]):
        self._guard = guard
        self._inner = handler
        self._method = method
        self._metadata = metadata
        self._deserialize = handler.request_deserializer or _identity
        self._serialize = handler.response_serializer or _identity

    def handler(self) -> grpc.RpcMethodHandler:
        h = self._inner
        # Unary requests and replies travel as raw bytes through the wrapper: the MACs cover
        # exactly the bytes on the wire, never a re-encoding of a parsed message.
        if not h.request_streaming and not h.response_streaming:
            return grpc.unary_unary_rpc_method_handler(self._unary_unary)
        if not h.request_streaming:
            return grpc.unary_stream_rpc_method_handler(self._unary_stream, response_serializer=self._serialize)
        if not h.response_streaming:
            return grpc.stream_unary_rpc_method_handler(self._stream_unary, request_deserializer=self._deserialize)
        return grpc.stream_stream_rpc_method_handler(self._stream_stream, request_deserializer=self._deserialize,
                                                     response_serializer=self._serialize)

    def _request(self, raw: bytes, context: grpc.ServicerContext):
        caller = self._guard.admit(self._method, self._metadata, body_digest(raw), context)
        try:
            return caller, self._deserialize(raw)
        except DecodeError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {self._method} request: {e}")

    def _signed_reply(self, caller: Caller, response, context: grpc.ServicerContext) -> bytes:
        body = self._serialize(response)
        context.set_trailing_metadata(self._guard.reply_metadata(caller, self._method, body))
        return body

    def _accept_stream(self, caller: Caller, context: grpc.ServicerContext) -> None:
        context.send_initial_metadata(self._guard.reply_metadata(caller, self._method, None))

    def _unary_unary(self, raw: bytes, context):
        caller, request = self._request(raw, context)
        return self._signed_reply(caller, self._inner.unary_unary(request, context), context)

    def _unary_stream(self, raw: bytes, context):
        caller, request = self._request(raw, context)
        self._accept_stream(caller, context)
        yield from self._inner.unary_stream(request, context)

    def _stream_unary(self, request_iterator, context):
        caller = self._guard.admit(self._method, self._metadata, body_digest(None), context)
        return self._signed_reply(caller, self._inner.stream_unary(request_iterator, context), context)

    def _stream_stream(self, request_iterator, context):
        caller = self._guard.admit(self._method, self._metadata, body_digest(None), context)
        self._accept_stream(caller, context)
        yield from self._inner.stream_stream(request_iterator, context)
