"""The client side of call authentication: a channel that signs every call and
believes no reply it cannot verify.

A SignedChannel wraps one plain grpc.Channel (TLS or not) for one receiver, the
node id it expects at that address. Unary requests are serialized here so the
MAC covers the exact bytes sent; unary replies are received as bytes, checked
against the signature in their trailing metadata, then parsed. A streamed
reply's opening must carry the receiver's signature bound to our call before
its first message is handed out. A reply that fails raises ReplyRejected, a
grpc.RpcError with code UNAUTHENTICATED, so callers handle it like any failed call.
"""

from __future__ import annotations

from typing import Callable

import grpc
from google.protobuf.message import DecodeError

from meshllm.transport.auth import HEADER_NONCE, sign, verify_reply


class ReplyRejected(grpc.RpcError):
    """A reply that does not prove it came from the node we called, in answer to this call."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class CallSigner:
    """Our identity and key: signs requests, verifies replies. Immutable, thread-safe."""

    def __init__(self, key: bytes, node_id: str):
        self._key = key
        self.node_id = node_id

    def sign(self, method: str, receiver: str, body: bytes | None) -> list[tuple[str, str]]:
        return sign(self._key, self.node_id, method, receiver=receiver, body=body)

    def check_reply(self, method: str, receiver: str, request_metadata: list[tuple[str, str]], metadata,
                    body: bytes | None) -> None:
        nonce = next(v for k, v in request_metadata if k == HEADER_NONCE)
        problem = verify_reply(self._key, metadata, receiver=receiver, requester=self.node_id, method=method,
                               request_nonce=nonce, body=body)
        if problem is not None:
            raise ReplyRejected(grpc.StatusCode.UNAUTHENTICATED, f"{method}: {problem}")


def _identity(x):
    return x


class SignedChannel(grpc.Channel):
    """Calls through `channel` to node `receiver` ("" only to ask who is there:
    HEALTH_CHECK). Unary-response calls get `default_deadline_s` when the caller
    sets no timeout, so a hung peer cannot block a thread forever; streams stay
    open-ended (a pipeline stream lives as long as its plan)."""

    def __init__(self, channel: grpc.Channel, signer: CallSigner, receiver: str, default_deadline_s: float,
                 owns_channel: bool = False):
        self._channel = channel
        self.signer = signer
        self.receiver = receiver
        self.default_deadline_s = default_deadline_s
        self._owns_channel = owns_channel

    def unary_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        return _UnaryUnary(self, self._channel.unary_unary(method), method, request_serializer, response_deserializer)

    def unary_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        inner = self._channel.unary_stream(method, response_deserializer=response_deserializer)
        return _UnaryStream(self, inner, method, request_serializer)

    def stream_unary(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        inner = self._channel.stream_unary(method, request_serializer=request_serializer)
        return _StreamUnary(self, inner, method, response_deserializer)

    def stream_stream(self, method, request_serializer=None, response_deserializer=None, _registered_method=False):
        inner = self._channel.stream_stream(method, request_serializer=request_serializer,
                                            response_deserializer=response_deserializer)
        return _StreamStream(self, inner, method)

    def subscribe(self, callback, try_to_connect=False):
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):
        self._channel.unsubscribe(callback)

    def close(self):
        """Closes the underlying channel only when this wrapper owns it (open_channel);
        a ChannelPool's wrappers share theirs, and the pool closes it."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc_val, exc_tb):
        self.close()
        return False

    def deadline(self, timeout: float | None) -> float:
        return self.default_deadline_s if timeout is None else timeout


def _parse(deserialize: Callable | None, raw: bytes, method: str):
    try:
        return (deserialize or _identity)(raw)
    except DecodeError as e:
        raise ReplyRejected(grpc.StatusCode.INTERNAL, f"{method}: the signed reply does not parse: {e}") from None


class _UnaryUnary(grpc.UnaryUnaryMultiCallable):
    def __init__(self, channel: SignedChannel, inner, method: str, serialize, deserialize):
        self._channel, self._inner, self._method = channel, inner, method
        self._serialize, self._deserialize = serialize or _identity, deserialize

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        return self.with_call(request, timeout, metadata, credentials, wait_for_ready, compression)[0]

    def with_call(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        body, signed = self._signed(request)
        raw, call = self._inner.with_call(body, timeout=self._channel.deadline(timeout),
                                          metadata=[*(metadata or ()), *signed], credentials=credentials,
                                          wait_for_ready=wait_for_ready, compression=compression)
        return self._verified(signed, call.trailing_metadata(), raw), call

    def future(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None, compression=None):
        body, signed = self._signed(request)
        inner = self._inner.future(body, timeout=self._channel.deadline(timeout), metadata=[*(metadata or ()), *signed],
                                   credentials=credentials, wait_for_ready=wait_for_ready, compression=compression)
        return SignedFuture(inner, lambda raw: self._verified(signed, inner.trailing_metadata(), raw))

    def _signed(self, request) -> tuple[bytes, list[tuple[str, str]]]:
        """The request's bytes and the signature over exactly them."""
        body = self._serialize(request)
        return body, self._channel.signer.sign(self._method, self._channel.receiver, body)

    def _verified(self, signed: list[tuple[str, str]], trailing_metadata, raw: bytes):
        """The reply parsed, once its signature proves it answers this call (ReplyRejected if not)."""
        c = self._channel
        c.signer.check_reply(self._method, c.receiver, signed, trailing_metadata, raw)
        return _parse(self._deserialize, raw, self._method)


class SignedFuture:
    """A unary call in flight (`.future()`): `result()` verifies the reply as a blocking call does
    (ReplyRejected when it fails), so an unverified reply is never handed out."""

    def __init__(self, inner, verified: Callable):
        self._inner = inner
        self._verified = verified

    def result(self, timeout: float | None = None):
        return self._verified(self._inner.result(timeout))

    def done(self) -> bool:
        return self._inner.done()

    def cancel(self) -> bool:
        return self._inner.cancel()

    def add_done_callback(self, fn: Callable[["SignedFuture"], None]) -> None:
        """`fn(this future)` once the call is over (at once when it already is)."""
        self._inner.add_done_callback(lambda _: fn(self))


class _StreamUnary(grpc.StreamUnaryMultiCallable):
    def __init__(self, channel: SignedChannel, inner, method: str, deserialize):
        self._channel, self._inner, self._method, self._deserialize = channel, inner, method, deserialize

    def __call__(self, request_iterator, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        return self.with_call(request_iterator, timeout, metadata, credentials, wait_for_ready, compression)[0]

    def with_call(self, request_iterator, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                  compression=None):
        c = self._channel
        signed = c.signer.sign(self._method, c.receiver, None)
        raw, call = self._inner.with_call(request_iterator, timeout=c.deadline(timeout),
                                          metadata=[*(metadata or ()), *signed], credentials=credentials,
                                          wait_for_ready=wait_for_ready, compression=compression)
        c.signer.check_reply(self._method, c.receiver, signed, call.trailing_metadata(), raw)
        return _parse(self._deserialize, raw, self._method), call

    def future(self, request_iterator, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
               compression=None):
        raise NotImplementedError("signed calls verify their reply before returning: call them from a thread "
                                  "instead of using .future()")


class _UnaryStream(grpc.UnaryStreamMultiCallable):
    def __init__(self, channel: SignedChannel, inner, method: str, serialize):
        self._channel, self._inner, self._method, self._serialize = channel, inner, method, serialize or _identity

    def __call__(self, request, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        c = self._channel
        body = self._serialize(request)
        signed = c.signer.sign(self._method, c.receiver, body)
        # The inner call serializes nothing more: `body` is already bytes.
        call = self._inner(body, timeout=timeout, metadata=[*(metadata or ()), *signed], credentials=credentials,
                           wait_for_ready=wait_for_ready, compression=compression)
        return VerifiedStream(call, lambda md: c.signer.check_reply(self._method, c.receiver, signed, md, None))


class _StreamStream(grpc.StreamStreamMultiCallable):
    def __init__(self, channel: SignedChannel, inner, method: str):
        self._channel, self._inner, self._method = channel, inner, method

    def __call__(self, request_iterator, timeout=None, metadata=None, credentials=None, wait_for_ready=None,
                 compression=None):
        c = self._channel
        signed = c.signer.sign(self._method, c.receiver, None)
        call = self._inner(request_iterator, timeout=timeout, metadata=[*(metadata or ()), *signed],
                           credentials=credentials, wait_for_ready=wait_for_ready, compression=compression)
        return VerifiedStream(call, lambda md: c.signer.check_reply(self._method, c.receiver, signed, md, None))


class VerifiedStream:
    """A streaming call whose messages are handed out only once the stream's opening
    (initial metadata) proves it is the receiver's answer to our call. Everything else
    (cancel, code, details, ...) is the underlying call's."""

    def __init__(self, call, verify: Callable[[object], None]):
        self._call = call
        self._verify = verify
        self._verified = False

    def __iter__(self):
        return self

    def __next__(self):
        if not self._verified:
            metadata = self._call.initial_metadata()  # blocks until the server answers or the call ends
            try:
                self._verify(metadata)
            except ReplyRejected:
                if self._call.done() and self._call.code() != grpc.StatusCode.OK:
                    return next(self._call)  # the call failed before any signed opening: raise its own error
                self._call.cancel()
                raise
            self._verified = True
        return next(self._call)

    def __getattr__(self, name):
        return getattr(self._call, name)
