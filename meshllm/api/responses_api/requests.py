"""A Responses request, validated, and turned into the chat completion request it amounts to.

Items are converted by hand rather than declared as a pydantic union: clients send back the
output items they received (with ids, statuses, annotations) and many item kinds this server
has no use for, and an error should name the item and say what to send instead, not list
every tag a union expected.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from meshllm.api.schemas import ChatCompletionRequest, RequestBody
from meshllm.engine.sampler import MAX_LOGPROBS
from meshllm.errors import BadRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEYS = 16  # OpenAI's limit
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")
# Extensions this server takes on chat completions too (vLLM's names), passed through as they are.
_PASSED_THROUGH = ("top_k", "min_p", "seed", "frequency_penalty", "presence_penalty", "repetition_penalty",
                   "speculative", "ignore_eos", "user")


class ResponsesRequest(RequestBody):
    model: str
    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None  # {"format": {...}, "verbosity": ...}
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    background: bool = False
    conversation: str | dict | None = None
    # Extensions, as on chat completions.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    speculative: bool | None = None
    ignore_eos: bool = False
    user: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.background:
            raise ValueError("background responses are not supported; leave background out and keep the "
                             "connection open (or stream)")
        if self.conversation is not None:
            raise ValueError("conversation objects are not supported; continue a conversation with "
                             "previous_response_id or send the whole input")
        if self.truncation == "auto":
            raise ValueError('truncation "auto" is not supported: nothing is dropped from a conversation here; '
                             'leave truncation out and keep the input within the context')
        if not isinstance((self.text or {}).get("format") or {}, dict):
            raise ValueError('text.format must be an object such as {"type": "json_object"}')
        if self.metadata is not None and len(self.metadata) > MAX_METADATA_KEYS:
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys, got {len(self.metadata)}")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def text_format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}


def chat_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input as chat messages (without its instructions)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(f"{where}: role {role!r} is not one of {', '.join(_ROLES)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # a reply's text and calls are one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            continue  # a model's reasoning, sent back by clients that keep every item: none is produced here
        elif kind == "item_reference":
            raise BadRequest(f"{where}: item references are not supported; send the item itself, or continue "
                             f"a stored response with previous_response_id")
        else:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported; this server takes messages, "
                             f"function_call and function_call_output items")
    return messages


def chat_request(body: ResponsesRequest, history: list[dict], messages: list[dict]) -> ChatCompletionRequest:
    """The chat completion `body` amounts to: `history` (a stored conversation it continues) and
    `messages` after its instructions, which, as OpenAI has it, do not carry over from a previous
    response."""
    head = [{"role": "system", "content": body.instructions}] if body.instructions else []
    fields = {"model": body.model, "messages": head + history + messages, "parallel_tool_calls": body.parallel_tool_calls,
              "temperature": body.temperature, "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens,
              "logprobs": body.wants_logprobs, "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
              "tools": [_chat_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None,
              "tool_choice": _chat_tool_choice(body.tool_choice), "response_format": _response_format(body.text_format)}
    fields.update({name: getattr(body, name) for name in _PASSED_THROUGH})
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(str(p) for p in problem.get("loc", ()))
        raise BadRequest(f"invalid request: {where}: {problem['msg']}") from None


def _text_of(content, where: str) -> str:
    """A message's or output's content: a string, or text parts (whose texts are joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise BadRequest(f"{where}.content[{j}]: parts of type {kind!r} are not supported; the models served "
                             f"here read text only (input_text)")
    return "".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{where}: {key} must be a string")
    return value


def _chat_tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise BadRequest(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported; only function tools "
                         f"(this server runs no hosted tools)")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice) -> str | dict | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadRequest(f"tool_choice {choice!r} is not supported; use none, auto, required or "
                     f"{{\"type\": \"function\", \"name\": ...}}")


def _response_format(fmt: dict) -> dict | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "description", "schema", "strict") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise BadRequest(f"text.format type {kind!r} is not supported; use text, json_object or json_schema")
