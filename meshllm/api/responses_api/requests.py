"""A Responses request, validated, and turned into the chat completion request it amounts to.

Items are converted by hand rather than declared as a pydantic union: clients send back the
output items they received (with ids, statuses, annotations) and many item kinds this server
has no use for, and an error should name the item and say what to send instead, not list
every tag a union expected.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from meshllm.api.responses import new_id
from meshllm.api.responses_api.output import reasoning_text
from meshllm.api.schemas import ChatCompletionRequest, GenerationFields
from meshllm.engine.sampler import MAX_LOGPROBS
from meshllm.errors import BadRequest, MeshError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
# Fields of chat completions (or of OpenAI features not served here) that would change what the
# client gets if they were ignored as unknown fields are: refused, saying what to send instead.
_MISPLACED = {"messages": "send them as input", "max_tokens": "use max_output_tokens",
              "max_completion_tokens": "use max_output_tokens", "response_format": "use text.format",
              "stop": "this API has no stop strings", "n": "this API makes one output; send n requests",
              "prompt": "stored prompt templates are not supported; send the instructions and input"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "assistant", "system", "developer")


class ResponsesRequest(GenerationFields):
    """The fields every generating request takes (sampling, and the extensions chat completions take
    too, vLLM's names), and this API's own."""

    input: str | list[dict]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict | None = None
    parallel_tool_calls: bool = True
    text: dict | None = None  # {"format": {...}, "verbosity": ...}
    max_output_tokens: int | None = Field(None, ge=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"  # either way nothing is dropped (see _check)
    background: bool = False
    conversation: str | dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_misplaced_and_unencodable(cls, data):
        if isinstance(data, dict):
            for name, instead in _MISPLACED.items():
                if data.get(name) is not None:
                    raise ValueError(f"{name} is not a field of the Responses API: {instead}")
            where = _lone_surrogate(data)
            if where is not None:
                # Echoed fields (metadata, user, tools) would make the response itself unencodable.
                raise ValueError(f"{where} is not valid Unicode: it holds a lone UTF-16 surrogate, as a client "
                                 f"that splits an emoji or other character in two sends; send whole characters")
        return data

    @model_validator(mode="after")
    def _check(self):
        if not self.input:  # else chat's "messages should have at least 1 item" would name a field not sent
            raise ValueError("input is empty: give a text, or at least one item")
        if self.background:
            raise ValueError("background responses are not supported; leave background out and keep the "
                             "connection open (or stream)")
        if self.conversation is not None:
            raise ValueError("conversation objects are not supported; continue a conversation with "
                             "previous_response_id or send the whole input")
        if not isinstance((self.text or {}).get("format") or {}, dict):
            raise ValueError('text.format must be an object such as {"type": "json_object"}')
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS or any(len(k) > MAX_METADATA_KEY_CHARS or len(v) > MAX_METADATA_VALUE_CHARS
                                                    for k, v in metadata.items()):
            raise ValueError(f"metadata holds at most {MAX_METADATA_KEYS} keys of up to {MAX_METADATA_KEY_CHARS} "
                             f"characters, with values of up to {MAX_METADATA_VALUE_CHARS}")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def text_format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}


def _lone_surrogate(value, where: str = "body") -> str | None:
    """Where in `value` (JSON data) a string holds a lone surrogate, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return where
    elif isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate(key, where) or _lone_surrogate(item, f"{where}.{key}")
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate(item, f"{where}[{i}]")
            if found:
                return found
    return None


_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def input_items(body: ResponsesRequest) -> list[dict]:
    """The request's input as the items GET /v1/responses/{id}/input_items lists: text as a user
    message, every item with an id (its own, or a new one) and a message's text as parts."""
    raw = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    items = []
    for item in raw:
        item = {"type": "message", **item}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
            item.setdefault("status", "completed")
        item.setdefault("id", new_id(_ITEM_ID_PREFIX.get(item["type"], "item"), "_"))
        items.append(item)
    return items


def chat_messages(body: ResponsesRequest, history: list[dict] = ()) -> list[dict]:
    """The request's input as chat messages (without its instructions); `history`: the stored
    conversation it continues, whose calls its function_call_output items may answer."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    called = {c["id"] for m in history for c in m.get("tool_calls") or ()}
    messages: list[dict] = []
    reasoning = ""  # a reasoning item's text, for the assistant message that follows it
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise BadRequest(f"{where}: role {role!r} is not one of {', '.join(_ROLES)}")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            called.add(call["id"])
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # a reply's text and calls are one message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning:
                messages[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in called:
                raise BadRequest(f"{where}: no function call with call_id {call_id!r} comes before this output; "
                                 f"send the function_call item first (or continue its response with "
                                 f"previous_response_id)")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":  # a reasoning model's, sent back: to its template with the turn it led to
            reasoning += reasoning_text([item])
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
    # "auto" and "none" without tools say nothing (agent frameworks send auto with no tools).
    choice = body.tool_choice if body.tools or body.tool_choice not in ("auto", "none") else None
    fields = body.model_dump(include=set(GenerationFields.model_fields))  # sampling and the extensions, as sent
    fields.update({"messages": head + history + messages, "parallel_tool_calls": body.parallel_tool_calls,
                   "max_completion_tokens": body.max_output_tokens, "logprobs": body.wants_logprobs,
                   "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
                   "tools": [_chat_tool(t, i) for i, t in enumerate(body.tools)] if body.tools else None,
                   "tool_choice": _chat_tool_choice(choice), "response_format": _response_format(body.text_format)})
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        problem = e.errors()[0]
        where = ".".join(str(p) for p in problem.get("loc", ()))
        message = problem["msg"].removeprefix("Value error, ")
        raise BadRequest(f"invalid request: {where}: {message}" if where else f"invalid request: {message}") from None


def _text_of(content, where: str) -> str:
    """A message's or output's content: a string, or text parts (whose texts are joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind in (*_TEXT_PARTS, "refusal"):
            if not isinstance(part.get(key), str):
                raise BadRequest(f"{where}.content[{j}]: a {kind} part needs its {key} as a string")
            texts.append(part[key])
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
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    # Strict unless the client says otherwise, as OpenAI has it on this API (not on chat completions):
    # a call's arguments then always match the parameters' schema (prompts._strict_calls_grammar).
    function["strict"] = tool.get("strict") is not False
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


# What the chat machinery underneath names, in this API's terms (its errors reach this API's clients).
_CHAT_TERMS = ((re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
               (re.compile(r"\bresponse_format\b"), "text.format"),
               (re.compile(r"\bmessages(?:\[(\d+)\]|\.(\d+))(?:\.content)?"),
                "message \\1\\2 of the conversation (from 0: instructions, stored turns, then input)"),
               (re.compile(r"\btools\.(\d+)\.function\."), "tools.\\1."))


def in_responses_terms(error: MeshError) -> MeshError:
    """`error` as this API's client should read it: chat field names put in this API's terms."""
    text = str(error)
    for pattern, term in _CHAT_TERMS:
        text = pattern.sub(term, text)
    if text == str(error) or type(error).__init__ is not MeshError.__init__:
        return error  # unchanged, or an error carrying more than its message
    renamed = type(error)(text)
    renamed.__cause__ = error
    return renamed
