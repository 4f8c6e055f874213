"""Request bodies of the OpenAI-compatible API, validated by pydantic at the HTTP edge.

Types are strict (a string where a number belongs is a 422, as OpenAI rejects it
too); unknown fields are ignored so newer clients keep working, and an explicit
null means "the default", as it does for OpenAI. Values out of OpenAI's ranges are
400s from SamplingParams, which states the range. Fields we accept but cannot honour
(echo, suffix) are refused with a message rather than silently ignored, since they
would change what the client gets.
"""

from __future__ import annotations

from typing import Any, Literal

import jinja2.defaults
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from meshllm.engine.sampler import MAX_LOGPROBS

MAX_CHOICES = 128  # OpenAI's limit on n
MAX_STOP_STRINGS = 16


class RequestBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(RequestBody):
    include_usage: bool = False


class TextPart(RequestBody):
    type: Literal["text"]
    text: str


class FunctionCall(RequestBody):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(RequestBody):
    """A call an assistant message made earlier in the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this result answers
    # assistant messages: a reasoning model's reasoning, as replies carry it (vLLM's and llama.cpp's
    # name); templates read it as reasoning_content (Qwen3) or thinking (GPT-OSS, before a call)
    reasoning_content: str | None = None

    def as_template_input(self) -> dict:
        """The message as OpenAI-shaped plain data: role, plain-text content, tool calls."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        # OpenAI's newer name for the system role; chat templates know only "system" (Qwen's and
        # Hermes' skip any other role they do not know, so the instructions were silently lost).
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.reasoning_content:
            message["reasoning_content"] = message["thinking"] = self.reasoning_content
        return message


class FunctionDefinition(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
    description: str | None = None
    parameters: dict | None = None  # JSON Schema of the arguments object
    strict: bool | None = None


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(RequestBody):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict = Field(default_factory=dict, alias="schema")  # {} allows any JSON value
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema object')
        return self


class GenerationFields(RequestBody):
    """What every generating request takes (chat, legacy completions, responses)."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)  # 0: the likeliest token only, as OpenAI takes it
    top_k: int | None = Field(None, ge=-1)  # extension (vLLM): keep the k likeliest tokens; -1 or 0 keeps all
    seed: int | None = None
    stream: bool = False
    ignore_eos: bool = False  # extension (vLLM): generate exactly max_tokens, for benchmarks
    frequency_penalty: float | None = None  # [-2, 2], checked by SamplingParams (400 with the range)
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM): (0, 10], 1 disables
    min_p: float | None = None  # extension (vLLM): [0, 1]
    logit_bias: dict[str, float] | None = None  # token id (as text) -> [-100, 100]
    user: str | None = None
    speculative: bool | None = None  # extension: false decodes this request without drafts (default: server's)


class SamplingFields(GenerationFields):
    """What chat and legacy completions share."""

    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream_options: StreamOptions | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        for text in [stop] if isinstance(stop, str) else stop or ():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # no text a model writes holds one: refused, as in prompts
                raise ValueError("a stop string is not valid Unicode: it holds a lone UTF-16 surrogate") from None
        return stop

    @property
    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


# What meshllm passes every chat template itself (model/tokenizer.py apply_chat_template), besides
# the model's special tokens (bos_token, eos_token, ...), and the functions it gives templates
# (a variable of the same name would hide them)
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "raise_exception",
                                "strftime_now", "self", *jinja2.defaults.DEFAULT_NAMESPACE})  # namespace, range, ...


def checked_template_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Variables for a chat template (a request's chat_template_kwargs, serve's default ones):
    names a template can read, none of those every render sets (ValueError says which)."""
    for name in kwargs:
        if not name.isidentifier():
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in TEMPLATE_VARIABLES or name.endswith("_token"):
            raise ValueError(f"chat_template_kwargs may not set {name!r}: the request and the model set it")
    return kwargs


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # Extensions (vLLM's names): the reply continues the last message, an assistant's opening
    # words ("prefill"), instead of starting a new turn; and whether the template opens one.
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # vLLM's and llama.cpp server's: more variables for the model's chat template (Qwen3's and
    # SmolLM3's read enable_thinking: false turns their reasoning off)
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if kwargs is None else checked_template_kwargs(kwargs)

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.continue_final_message:
            last = self.messages[-1]
            if last.role != "assistant" or last.tool_calls or not last.as_template_input()["content"].strip():
                raise ValueError("continue_final_message needs the last message to be an assistant's text (the "
                                 "words the reply goes on from)")
            if self.add_generation_prompt:
                raise ValueError("continue_final_message continues the last turn, add_generation_prompt opens a "
                                 "new one: set at most one of them")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions share a name")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice needs tools: there is nothing to call")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                             f"among tools ({', '.join(names)})")
        return self

    @property
    def opens_turn(self) -> bool:
        """Whether the rendered prompt ends by opening the assistant's turn (the template's generation prompt)."""
        return not self.continue_final_message if self.add_generation_prompt is None else self.add_generation_prompt

    @property
    def calls_tools(self) -> bool:
        """Whether the reply is read for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def parallel_calls(self) -> bool:
        """Whether the reply may make more than one call: a named tool_choice asks for that call,
        once (as OpenAI answers it), whatever parallel_tool_calls says."""
        return self.parallel_tool_calls and not isinstance(self.tool_choice, NamedToolChoice)

    @property
    def forced_tools(self) -> list[ToolDefinition] | None:
        """The tools one of which must be called (tool_choice required or named), else None."""
        if self.tool_choice == "required":
            return self.tools
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return None

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token, or None when the client wants no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for legacy completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self):
        if self.echo:
            raise ValueError("echo is not supported; the prompt is not repeated in the completion")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) or be left out: this server returns every choice")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)
