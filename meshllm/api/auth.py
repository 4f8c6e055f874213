"""API key check (`--api-key`) in front of the routes, before the body is even read.

A plain ASGI middleware rather than a FastAPI dependency: FastAPI parses the
body before dependencies run, so a dependency would answer an unauthenticated
client's malformed JSON with 400 instead of 401 and do work for it.
"""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from meshllm.api.errors import mesh_error_body
from meshllm.api.metrics import MetricsObserver
from meshllm.errors import InvalidAPIKey

# Probes and Prometheus cannot send a key, and these show no prompts, addresses or
# topology. The dashboard page is static (no data in it); its script asks for the key
# and sends it to /v1/cluster, which needs one like every other route.
OPEN_PATHS = frozenset({"/health", "/metrics", "/"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, metrics: MetricsObserver):
        self.app = app
        self._key = api_key.encode()
        self._metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        error = InvalidAPIKey("missing or incorrect API key: send the server's --api-key as "
                              "'Authorization: Bearer <key>'")
        self._metrics.api_errors.labels(code=error.code).inc()
        response = JSONResponse(mesh_error_body(error), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, given = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self._key)
