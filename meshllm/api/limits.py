"""Request size limit in front of the routes, before FastAPI reads a body.

A body whose Content-Length is over the limit is refused at once, unread (413);
one without a length (chunked) is counted as it arrives and refused the moment
it passes the limit. A body within the limit is handed to the app unchanged.
A plain ASGI middleware: FastAPI would read the whole body before any
dependency or handler could look at its size.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from meshllm.api.errors import mesh_error_body
from meshllm.api.metrics import MetricsObserver
from meshllm.errors import RequestTooLarge


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: MetricsObserver):
        self.app = app
        self._limit = max_body_bytes
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._limit:
            await self._refuse(scope, receive, send, f"the request body has {declared} bytes")
            return
        if declared is not None:
            await self.app(scope, receive, send)  # uvicorn delivers no more than the declared length
            return
        # Chunked: gather up to the limit, then replay it; FastAPI holds the whole body anyway.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away mid-body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._limit:
                await self._refuse(scope, receive, send, f"the request body passed {self._limit} bytes")
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        error = RequestTooLarge(f"{what}; this server accepts at most {self._limit} bytes (its --max-body-mib). "
                                f"Send a shorter prompt, or token ids instead of text.")
        self._metrics.api_errors.labels(code=error.code).inc()
        await JSONResponse(mesh_error_body(error), status_code=413)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed length before the app runs
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """The whole body as one message, then the client's own messages (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
