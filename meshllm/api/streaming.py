"""Streamed replies as server-sent events (`data: {chunk}\\n\\n` ... `data: [DONE]\\n\\n`).

The stream opens only once the first event has arrived: an error before any
output (deadline, a failed stage, a client that left while queued) still gets
its proper HTTP status. After that, an error ends the stream with an
`{"error": ...}` event, which the openai client raises as APIError.

Cancellation: when the client disconnects, Starlette cancels the body iterator
(and `Generation.events` polls for it too); `finally` then cancels every choice
still running, so the leader frees their sequences on every stage.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from meshllm.api.choices import ChoiceState, TextCursor, failure_of, usage
from meshllm.api.errors import mesh_error_body
from meshllm.api.generation import ClientDisconnected, Generation
from meshllm.api.metrics import MetricsObserver
from meshllm.api.replies import ReplyContext
from meshllm.api.tool_parser import CallDelta
from meshllm.api.responses import (ChatChunkChoice, ChatCompletionChunk, ChatDelta, Completion, CompletionChoice,
                                   DeltaFunction, DeltaToolCall, Usage)
from meshllm.errors import MeshError
from meshllm.pipeline.events import GenerationEvent

log = logging.getLogger(__name__)

Item = tuple[int, GenerationEvent]
_DONE = "data: [DONE]\n\n"


def _sse(chunk: BaseModel | dict) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {data}\n\n"


async def open_stream(generation: Generation, states: list[ChoiceState], ctx: ReplyContext, include_usage: bool,
                      metrics: MetricsObserver, chat: bool) -> StreamingResponse:
    """Wait for the first event (raising its error as an HTTP error), then stream the rest."""
    events = await started(generation)
    body = _stream(generation, events, states, ctx, include_usage, metrics, chat)
    return StreamingResponse(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def started(generation: Generation) -> AsyncIterator[Item]:
    """The generation's events once the first has arrived; raises that one's error (cancelling the
    rest) if it failed, while the HTTP status can still say so."""
    events = generation.events()
    first = await anext(events)
    error = failure_of(first[1])
    if error is not None:
        generation.cancel()
        raise error
    return _prepend(first, events)


async def _prepend(first: Item, rest: AsyncIterator[Item]) -> AsyncIterator[Item]:
    yield first
    async for item in rest:
        yield item


async def _stream(generation: Generation, events: AsyncIterator[Item], states: list[ChoiceState],
                  ctx: ReplyContext, include_usage: bool, metrics: MetricsObserver, chat: bool) -> AsyncIterator[str]:
    chunks = _ChatChunks(ctx) if chat else _CompletionChunks(ctx)
    try:
        for state in states:
            opening = chunks.opening(state)
            if opening is not None:
                yield _sse(opening)
        async for index, event in events:
            state = states[index]
            error = state.add(event)
            if error is not None:
                raise error
            content, calls = state.delta
            if content or calls or state.reasoning_delta or event.logprobs is not None:
                yield _sse(chunks.delta(state, event))
            if event.finish_reason is not None:
                yield _sse(chunks.finish(state))
        if include_usage:
            yield _sse(chunks.usage(usage(states)))
        yield _DONE
    except MeshError as e:
        metrics.api_errors.labels(code=e.code).inc()
        log.warning("stream %s ended with an error: [%s] %s", ctx.id, e.code, e)
        yield _sse(mesh_error_body(e))
    except ClientDisconnected:
        log.debug("stream %s: client disconnected", ctx.id)
    finally:
        generation.cancel()


class _ChatChunks:
    def __init__(self, ctx: ReplyContext):
        self.ctx = ctx
        self._cursors: dict[int, TextCursor] = {}  # per choice

    def _chunk(self, choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.ctx.id, created=self.ctx.created, model=self.ctx.model, choices=choices,
                                   **extra)

    def opening(self, state: ChoiceState) -> ChatCompletionChunk:
        # OpenAI opens each choice with the role and empty content.
        return self._chunk([ChatChunkChoice(index=state.request.index, delta=ChatDelta(role="assistant", content=""))])

    def delta(self, state: ChoiceState, event: GenerationEvent) -> ChatCompletionChunk:
        logprobs = None
        if self.ctx.wants_logprobs and event.logprobs is not None:
            cursor = self._cursors.setdefault(state.request.index,
                                              self.ctx.formatter.cursor(state.request.continues_prompt))
            logprobs = self.ctx.formatter.chat([event.logprobs], cursor)
        content, calls = state.delta
        tool_calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                                    function=DeltaFunction(name=d.name, arguments=d.arguments))
                      for d in _one_per_call(calls)]
        return self._chunk([ChatChunkChoice(index=state.request.index,
                                            delta=ChatDelta(content=content or None if calls or state.reasoning_delta
                                                            else content, tool_calls=tool_calls or None,
                                                            reasoning_content=state.reasoning_delta or None),
                                            logprobs=logprobs)])

    def finish(self, state: ChoiceState) -> ChatCompletionChunk:
        return self._chunk([ChatChunkChoice(index=state.request.index, delta=ChatDelta(),
                                            finish_reason=state.finish_reason)])

    def usage(self, total: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage=total)


class _CompletionChunks:
    def __init__(self, ctx: ReplyContext):
        self.ctx = ctx
        self._cursors: dict[int, TextCursor] = {}  # per choice

    def _chunk(self, choices: list[CompletionChoice], **extra) -> Completion:
        return Completion(id=self.ctx.id, created=self.ctx.created, model=self.ctx.model, choices=choices, **extra)

    def opening(self, state: ChoiceState) -> None:
        return None  # legacy completions have no role to announce

    def delta(self, state: ChoiceState, event: GenerationEvent) -> Completion:
        logprobs = None
        if self.ctx.wants_logprobs and event.logprobs is not None:
            cursor = self._cursors.setdefault(state.request.index,
                                              self.ctx.formatter.cursor(state.request.continues_prompt))
            logprobs = self.ctx.formatter.completion([event.logprobs], cursor)
        return self._chunk([CompletionChoice(index=state.request.index, text=state.delta[0], logprobs=logprobs)])

    def finish(self, state: ChoiceState) -> Completion:
        return self._chunk([CompletionChoice(index=state.request.index, text="", finish_reason=state.finish_reason)])

    def usage(self, total: Usage) -> Completion:
        return self._chunk([], usage=total)


def _one_per_call(calls: list[CallDelta]) -> list[CallDelta]:
    """One delta per call in a chunk, as OpenAI sends them: a call's opening (id and name) and its
    first arguments often come in one token's text, and clients that store a call's first delta
    as is (some openai-python stream helpers) lose what a second entry of the same index adds."""
    merged: dict[int, CallDelta] = {}
    for d in calls:
        first = merged.get(d.index)
        merged[d.index] = d if first is None else CallDelta(d.index, first.id or d.id, first.name or d.name,
                                                            first.arguments + d.arguments)
    return list(merged.values())
