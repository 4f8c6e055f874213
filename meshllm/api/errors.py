"""Errors as OpenAI clients expect them: {"error": {message, type, param, code}} with the right status.

Every failure of a request (our MeshErrors, pydantic validation, unknown routes)
leaves through here, so clients always get the same shape. Validation errors are
400, as OpenAI, vLLM and llama-server answer, not FastAPI's 422; the OpenAPI
document lists exactly the statuses each route can answer (`document_errors`).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from meshllm.api.metrics import MetricsObserver
from meshllm.engine.scheduler import QueueFull
from meshllm.errors import (AuthError, BadRequest, ContextOverflow, LeaderDown, MalformedMessage, MeshError, NotFound,
                            PipelineStalled, RequestTimeout, RequestTooLarge, ShardUnavailable, UnknownModel)

log = logging.getLogger(__name__)

# (status, OpenAI error type) by exception class; the first match in order wins.
_STATUS: tuple[tuple[type[MeshError], int, str], ...] = (
    (RequestTooLarge, 413, "invalid_request_error"),
    (ContextOverflow, 400, "invalid_request_error"),
    (BadRequest, 400, "invalid_request_error"),
    (MalformedMessage, 400, "invalid_request_error"),
    (AuthError, 401, "invalid_request_error"),
    (UnknownModel, 404, "invalid_request_error"),
    (NotFound, 404, "invalid_request_error"),
    (QueueFull, 429, "rate_limit_error"),
    (ShardUnavailable, 503, "server_error"),
    (PipelineStalled, 503, "server_error"),
    (LeaderDown, 503, "server_error"),
    (RequestTimeout, 504, "server_error"),
)


def status_of(error: MeshError) -> tuple[int, str]:
    for cls, status, kind in _STATUS:
        if isinstance(error, cls):
            return status, kind
    return 500, "server_error"


def _encodable(text: str | None) -> str | None:
    # A message may quote the client's input, which can hold lone surrogates: escape them, or
    # the JSON response itself could not be encoded (a 500 instead of the client's 400).
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, kind: str, code: str | None, param: str | None = None) -> dict:
    return {"error": {"message": _encodable(message), "type": kind, "param": _encodable(param), "code": code}}


def mesh_error_body(error: MeshError) -> dict:
    """The body for `error` (also what a stream sends as its last event)."""
    _, kind = status_of(error)
    return error_body(str(error), kind, error.code)


def install_error_handlers(app: FastAPI, metrics: MetricsObserver) -> None:
    async def on_mesh_error(request: Request, error: MeshError) -> JSONResponse:
        status, _ = status_of(error)
        metrics.api_errors.labels(code=error.code).inc()
        if status >= 500:
            log.warning("%s %s failed: [%s] %s", request.method, request.url.path, error.code, error)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return JSONResponse(mesh_error_body(error), status_code=status, headers=headers)

    async def on_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {"loc": (), "msg": "invalid request", "type": "invalid"}
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        if first.get("type") == "json_invalid":
            # The body is not JSON at all: OpenAI answers 400, and so do we.
            metrics.api_errors.labels(code="invalid_json").inc()
            message = f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})"
            return JSONResponse(error_body(message, "invalid_request_error", "invalid_json"), status_code=400)
        metrics.api_errors.labels(code="invalid_value").inc()
        details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e['msg']}"
                            for e in problems[:5])
        return JSONResponse(error_body(f"invalid request: {details}", "invalid_request_error", "invalid_value",
                                       param), status_code=400)

    async def on_http_error(request: Request, error: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "http_error")
        message = (f"no route {request.method} {request.url.path}; this server offers /v1/models, "
                   f"/v1/chat/completions, /v1/completions, /v1/responses, /v1/cluster and /metrics"
                   if error.status_code in (404, 405) else str(error.detail))
        return JSONResponse(error_body(message, "invalid_request_error", code), status_code=error.status_code,
                            headers=error.headers)

    async def on_unexpected(request: Request, error: Exception) -> JSONResponse:
        # A bug, not the client's doing: an OpenAI-shaped 500 (clients parse it, and say what
        # failed) instead of Starlette's plain text; the traceback goes to the log.
        log.error("%s %s failed: %s", request.method, request.url.path, type(error).__name__,
                  exc_info=(type(error), error, error.__traceback__))
        return JSONResponse(error_body(f"internal error: {type(error).__name__}", "server_error", "internal_error"),
                            status_code=500)

    app.add_exception_handler(MeshError, on_mesh_error)
    app.add_exception_handler(Exception, on_unexpected)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every error answer carries (OpenAI's shape)."""

    error: ErrorDetail


_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a field out of range, text that is not valid Unicode, or a prompt "
         "longer than the context",
    401: "Missing or wrong API key (only when the server runs with --api-key)",
    404: "The model is not served here, or (responses) the response is not stored here",
    413: "The request body is over the server's --max-body-mib",
    429: "The queue is full; retry later",
    500: "Internal error",
    503: "The model cannot run on the fleet right now, or a stage stalled",
    504: "The request ran past the server's --request-timeout",
}


def error_responses(*statuses: int) -> dict[int | str, dict]:
    """The `responses=` entry of a route that can answer `statuses` (and 500)."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]} for status in (*statuses, 500)}


def document_errors(app: FastAPI) -> None:
    """Make the OpenAPI document list what the API really answers: FastAPI adds a 422
    to every route with a body or parameters, which this API never sends."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
