"""One Responses request from its chat choice's events to the response object, whole or streamed."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from meshllm.api.choices import ChoiceState, LogprobFormatter, TextCursor
from meshllm.api.generation import Generation
from meshllm.api.responses import new_id
from meshllm.api.responses_api.output import OutputItems, as_chat_message
from meshllm.api.responses_api.requests import ResponsesRequest, input_items
from meshllm.api.responses_api.store import ResponseStore
from meshllm.errors import MeshError
from meshllm.pipeline.events import GenerationEvent


@dataclass
class ResponseRun:
    """A response being made: `messages` are what its input adds to the conversation it continues
    (stored with its output for a later request's previous_response_id)."""

    body: ResponsesRequest
    state: ChoiceState
    messages: list[dict]
    formatter: LogprobFormatter
    model: str
    id: str = field(default_factory=lambda: new_id("resp", "_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: OutputItems = field(default_factory=OutputItems)
    _cursor: TextCursor | None = None

    def feed(self, event: GenerationEvent) -> list[dict]:
        """The stream events `event` makes; raises the sequence's error if it failed."""
        error = self.state.add(event)
        if error is not None:
            raise error
        logprobs = []
        if self.body.wants_logprobs and event.logprobs is not None:
            self._cursor = self._cursor or self.formatter.cursor()
            logprobs = [e.model_dump() for e in self.formatter.chat([event.logprobs], self._cursor).content]
        content, calls = self.state.delta
        events = self.output.feed(content, calls, logprobs, self.state.reasoning_delta)
        if event.finish_reason is not None:
            events += self.output.finish(self.status, frozenset(c.id for c in self.state.tool_calls if c.complete))
        return events

    @property
    def status(self) -> str:
        if self.state.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.state.finish_reason == "length" else "completed"

    def response(self, error: MeshError | None = None) -> dict:
        status = "failed" if error is not None else self.status
        b, s = self.body, self.state
        done = status in ("completed", "incomplete")
        prompt_tokens = len(s.request.prompt_ids)
        output = self.output.items if status != "in_progress" else []
        if error is not None:  # an item the failure cut short is not in progress any more
            output = [{**item, "status": "incomplete"} if item.get("status") == "in_progress" else item
                      for item in output]
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "model": self.model,
            "output": output,
            # OpenAI's codes for a failed response are few; ours goes in the message.
            "error": None if error is None else {"code": "server_error", "message": f"[{error.code}] {error}"},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "parallel_tool_calls": b.parallel_tool_calls, "previous_response_id": b.previous_response_id,
            "store": b.store, "temperature": 1.0 if b.temperature is None else b.temperature,
            "top_p": 1.0 if b.top_p is None else b.top_p, "top_logprobs": b.top_logprobs,
            "text": {**(b.text or {}), "format": b.text_format}, "tool_choice": b.tool_choice or "auto",
            "tools": b.tools or [],
            "truncation": b.truncation, "user": b.user, "background": False, "reasoning": None,
            "completed_at": int(time.time()) if done else None,
            "usage": {"input_tokens": prompt_tokens,
                      "input_tokens_details": {"cached_tokens": s.num_cached_tokens, "cache_write_tokens": 0},
                      "output_tokens": s.num_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + s.num_tokens} if done else None,
        }

    def keep(self, store: ResponseStore, response: dict) -> None:
        """Store the finished response if the request asked for it (the default)."""
        if self.body.store:
            reply = as_chat_message(self.output.items)
            store.put(response, self.body.previous_response_id, self.messages + ([reply] if reply is not None else []),
                      input_items(self.body))


async def whole_response(generation: Generation, run: ResponseRun, store: ResponseStore) -> dict:
    """Wait for the choice to finish; the first failure fails the request (an HTTP error)."""
    async for _, event in generation.events():
        try:
            run.feed(event)
        except MeshError:
            generation.cancel()
            raise
    response = run.response()
    run.keep(store, response)
    return response
