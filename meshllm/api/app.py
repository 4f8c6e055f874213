"""The OpenAI-compatible HTTP API of one served model: routes only.

Prompt building lives in prompts.py, the bridge to the leader in generation.py,
replies in replies.py and streaming.py, errors in errors.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from meshllm.api import replies
from meshllm.api.auth import APIKeyMiddleware
from meshllm.api.backend import Backend
from meshllm.api.choices import ChoiceState, LogprobFormatter
from meshllm.api.cluster_view import ClusterView, cluster_view, health_view
from meshllm.api.config import APIConfig
from meshllm.api.errors import document_errors, error_responses, install_error_handlers
from meshllm.api.generation import ClientDisconnected, Generation
from meshllm.api.harmony import HarmonyReader
from meshllm.api.limits import BodyLimitMiddleware
from meshllm.api.metrics import CONTENT_TYPE_LATEST
from meshllm.api.prompts import ChoiceRequest, ModelText, chat_choices, completion_choices
from meshllm.api.replies import ReplyContext
from meshllm.api.responses import ChatCompletion, Completion, ModelEntry, ModelList, now
from meshllm.api.responses_api.reply import ResponseRun, whole_response
from meshllm.api.responses_api.requests import ResponsesRequest, chat_messages, chat_request, in_responses_terms
from meshllm.api.responses_api.store import ResponseStore, input_items_page
from meshllm.api.responses_api.stream import open_response_stream
from meshllm.api.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from meshllm.api.streaming import open_stream
from meshllm.api.think import ThinkReader
from meshllm.errors import MeshError, ShardUnavailable, UnknownModel
from meshllm.pipeline.leader import Leader

_DASHBOARD = Path(__file__).with_name("dashboard.html")
_CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it


def create_app(backend: Backend, config: APIConfig) -> FastAPI:
    app = FastAPI(title="meshllm", summary="OpenAI-compatible API of a meshllm node", docs_url=None,
                  redoc_url=None)
    metrics = backend.metrics
    install_error_handlers(app, metrics)
    document_errors(app)
    # The last added runs first: the key is checked before the body's size, both before it is read.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=config.max_body_bytes, metrics=metrics)
    if config.api_key is not None:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, metrics=metrics)
    keyed = (401,) if config.api_key is not None else ()
    generating = error_responses(400, *keyed, 404, 413, 429, 503, 504)
    formatter = LogprobFormatter(backend.tokenizer)
    backend.tokenizer.max_token_chars  # noqa: B018 - computed once here rather than in the first request
    model_text = ModelText.of(backend.tokenizer, backend.max_context)
    stored_responses = ResponseStore()
    started = now()

    def leader_for(model: str) -> Leader:
        if model != backend.model_id:
            raise UnknownModel(f"model {model!r} is not served here; GET /v1/models lists {backend.model_id!r}")
        if backend.leader is None:
            report = backend.health.report()
            raise ShardUnavailable(f"{model} cannot run: {report.reason}", missing_bytes=report.missing_bytes,
                                   part=report.missing)
        # Without a working plan right now the leader tries to get one for this request (it
        # waits through a failover; when nothing fits it fails with shard_unavailable).
        return backend.leader

    def states_of(choices: list[ChoiceRequest], body: SamplingFields) -> list[ChoiceState]:
        """One per choice, each reading its text for tool calls when the request has tools to call
        (and, for a harmony model's chat, always: its reply is messages on channels)."""
        chat = isinstance(body, ChatCompletionRequest)
        fmt = model_text.tool_format
        if chat and fmt.harmony is not None:
            return [ChoiceState(c, HarmonyReader(fmt.harmony, fmt.new_call_id, body.parallel_calls, body.calls_tools,
                                                 in_final=body.continue_final_message)) for c in choices]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if chat and body.calls_tools else None

        def reader(c: ChoiceRequest):
            calls = None if tools is None else fmt.call_reader(tools, body.parallel_calls,
                                                               forced=body.forced_tools is not None)
            if not chat or not model_text.thinks or body.continue_final_message:
                return calls
            # a <think> block first (Qwen3, DeepSeek-R1): reasoning_content; the prompt may have opened it
            return ThinkReader(calls, in_reasoning=c.in_reasoning)

        return [ChoiceState(c, reader(c)) for c in choices]

    async def respond(request: Request, leader: Leader, choices: list[ChoiceRequest],
                      stream: Callable[[Generation], Awaitable[Response]] | None,
                      whole: Callable[[Generation], Awaitable[object]]):
        """Queue `choices` at the leader, then answer by `stream` (when asked) or `whole`. The
        sequences are cancelled on every way out, except once a stream has opened: it owns them then,
        and cancels them when it ends."""
        generation = Generation(leader, choices, config.request_timeout_s, request.is_disconnected,
                                model_text.grammars)
        streaming = False
        try:
            await run_in_threadpool(generation.submit)
            if stream is not None:
                response = await stream(generation)
                streaming = True
                return response
            return await whole(generation)
        except ClientDisconnected:
            return Response(status_code=_CLIENT_CLOSED)
        finally:
            if not streaming:
                generation.cancel()  # no-op for finished choices; frees the rest on any failure

    async def answer(request: Request, leader: Leader, choices: list[ChoiceRequest], body: SamplingFields,
                     ctx: ReplyContext, chat: bool) -> Response | ChatCompletion | Completion:
        states = states_of(choices, body)

        async def whole(generation: Generation) -> ChatCompletion | Completion:
            await replies.collect(generation, states)
            return replies.chat_completion(states, ctx) if chat else replies.completion(states, ctx)

        stream = (lambda g: open_stream(g, states, ctx, body.include_usage, metrics, chat)) if body.stream else None
        return await respond(request, leader, choices, stream, whole)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_DASHBOARD.read_text())

    @app.get("/health", responses={503: {"description": "No plan fits the fleet: the model cannot run now"}})
    async def health() -> JSONResponse:
        """For load balancers: 200 only while a working plan serves and the leader's loop runs; else 503 and why."""
        view = health_view(backend.health_report())
        return JSONResponse(view.model_dump(), status_code=200 if view.status == "ok" else 503)

    app.head("/health", include_in_schema=False)(health)  # monitoring probes use HEAD (a 405 read as "down")

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cluster", responses=error_responses(*keyed))
    async def cluster() -> ClusterView:
        # Off the event loop: the fleet view may ask a node over gRPC (the demo's), which takes
        # seconds when that node is down, and every open stream would wait with it.
        return await run_in_threadpool(cluster_view, backend, metrics)

    @app.get("/v1/models", responses=error_responses(*keyed))
    async def list_models() -> ModelList:
        return ModelList(data=[ModelEntry(id=backend.model_id, created=started, max_model_len=backend.max_context)])

    @app.get("/v1/models/{model:path}", responses=error_responses(*keyed, 404))
    async def get_model(model: str) -> ModelEntry:
        if model != backend.model_id:
            raise UnknownModel(f"model {model!r} is not served here; GET /v1/models lists {backend.model_id!r}")
        return ModelEntry(id=backend.model_id, created=started, max_model_len=backend.max_context)

    def with_template_defaults(body: ChatCompletionRequest) -> ChatCompletionRequest:
        """The server's chat_template_kwargs (--chat-template-kwargs) under the request's own."""
        if not config.chat_template_kwargs:
            return body
        merged = {**config.chat_template_kwargs, **(body.chat_template_kwargs or {})}
        return body.model_copy(update={"chat_template_kwargs": merged})

    @app.post("/v1/chat/completions", response_model=None, responses=generating)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | ChatCompletion:
        leader = leader_for(body.model)
        choices = await run_in_threadpool(chat_choices, model_text, with_template_defaults(body))
        ctx = ReplyContext.new("chatcmpl", backend.model_id, formatter, body.logprobs)
        return await answer(request, leader, choices, body, ctx, chat=True)

    @app.post("/v1/completions", response_model=None, responses=generating)
    async def completions(body: CompletionRequest, request: Request) -> Response | Completion:
        leader = leader_for(body.model)
        choices = await run_in_threadpool(completion_choices, model_text, body)
        ctx = ReplyContext.new("cmpl", backend.model_id, formatter, body.logprobs is not None)
        return await answer(request, leader, choices, body, ctx, chat=False)

    @app.post("/v1/responses", response_model=None, responses=generating)
    async def create_response(body: ResponsesRequest, request: Request) -> Response | dict:
        """OpenAI's Responses API: one chat choice underneath (responses_api/)."""
        leader = leader_for(body.model)
        history = stored_responses.conversation(body.previous_response_id) if body.previous_response_id else []
        messages = chat_messages(body, history)
        try:  # the chat machinery's errors, in this API's terms
            chat = with_template_defaults(chat_request(body, history, messages))
            choices = await run_in_threadpool(chat_choices, model_text, chat)
            run = ResponseRun(body, states_of(choices, chat)[0], messages, formatter, backend.model_id)
            stream = (lambda g: open_response_stream(g, run, stored_responses, metrics)) if body.stream else None
            return await respond(request, leader, choices, stream, lambda g: whole_response(g, run, stored_responses))
        except MeshError as e:
            raise in_responses_terms(e) from None

    @app.get("/v1/responses/{response_id}", response_model=None, responses=error_responses(*keyed, 404))
    async def get_response(response_id: str) -> dict:
        return stored_responses.get(response_id).response

    @app.get("/v1/responses/{response_id}/input_items", response_model=None,
             responses=error_responses(400, *keyed, 404))
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None,
                               before: str | None = None) -> dict:
        return input_items_page(stored_responses.get(response_id).input_items, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}", response_model=None, responses=error_responses(*keyed, 404))
    async def delete_response(response_id: str) -> dict:
        stored_responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return app
