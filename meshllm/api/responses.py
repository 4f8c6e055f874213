"""Response bodies of the OpenAI-compatible API (the shapes the `openai` client parses)."""

from __future__ import annotations

import secrets
import time
from typing import Literal

from pydantic import BaseModel, Field, model_serializer


def new_id(prefix: str, separator: str = "-") -> str:
    """chatcmpl-..., as OpenAI writes chat ids; the Responses API's are resp_..., msg_..., fc_..."""
    return f"{prefix}{separator}{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


# --- chat ------------------------------------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ResponseFunction(BaseModel):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunction


class _WithReasoning(BaseModel):
    """`reasoning_content` (a reasoning model's thinking, as vLLM and llama.cpp's server send it)
    appears only where there is some, so other models' replies keep OpenAI's exact shape."""

    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _without_empty_reasoning(self, handler):
        data = handler(self)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class AssistantMessage(_WithReasoning):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's first delta has id, type and name (arguments ""); later ones add arguments text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction


class ChatDelta(_WithReasoning):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# --- legacy completions ----------------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class Completion(BaseModel):
    """A whole completion, and (object unchanged, as OpenAI does) each streamed chunk of one."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# --- models ----------------------------------------------------------------------------------------
class ModelEntry(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "meshllm"
    max_model_len: int | None = None  # extension (vLLM): tokens of prompt + completion one request may use


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEntry]
