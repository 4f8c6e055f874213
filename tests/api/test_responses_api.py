"""POST /v1/responses through real HTTP with the official `openai` client (and its strict stream
accumulator, `responses.stream`): the same answers as chat completions, on one process and on
the 2-stage pipeline of node processes; stored responses continued by previous_response_id;
tool calls, JSON schemas and logprob bytes on the real SmolLM2. (The `openai-agents` framework on
its default model class, which speaks this API: test_tool_calling.py.)"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from .test_logprob_bytes import REPEAT, _assert_rebuilds, _utf8
from .test_structured_output import MAX_TOKENS, SCHEMA

pytestmark = [pytest.mark.timeout(600)]

TERSE = "Answer in a few words."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris?"


def _chat_text(client, model, messages, max_tokens) -> tuple[str, str]:
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content, reply.choices[0].finish_reason


def _streamed(client, **request) -> tuple[list, str]:
    """The raw events of a streamed response, checked for order; and its text rebuilt from the deltas."""
    events = list(client.responses.create(stream=True, **request))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    added = {e.item.id for e in events if e.type == "response.output_item.added"}
    assert all(e.item_id in added for e in events if e.type == "response.output_text.delta")
    return events, "".join(e.delta for e in events if e.type == "response.output_text.delta")


def test_a_response_says_what_the_same_chat_completion_says(server):
    client, model = server.client(), server.backend.model_id
    r = client.responses.create(model=model, instructions=TERSE, input="Hello", max_output_tokens=12, temperature=0)
    text, finish = _chat_text(client, model, [{"role": "system", "content": TERSE}, {"role": "user", "content": "Hello"}],
                              12)
    assert r.object == "response" and r.model == model and r.output_text == text and text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and r.output[-1].status == "incomplete"
    assert r.usage.output_tokens == 12 or r.status == "completed"
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events, streamed = _streamed(client, model=model, instructions=TERSE, input="Hello", max_output_tokens=12,
                                 temperature=0)
    assert streamed == text
    final = events[-1].response
    assert final.output_text == text and final.status == r.status and final.usage.output_tokens == r.usage.output_tokens


def test_previous_response_id_continues_the_stored_conversation(server):
    client, model = server.client(), server.backend.model_id
    first = client.responses.create(model=model, instructions=TERSE, input="Hello", max_output_tokens=8,
                                    temperature=0)
    second = client.responses.create(model=model, instructions=TERSE, previous_response_id=first.id,
                                     input=[{"role": "user", "content": "And then?"}], max_output_tokens=8,
                                     temperature=0)
    text, _ = _chat_text(client, model, [{"role": "system", "content": TERSE}, {"role": "user", "content": "Hello"},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "And then?"}], 8)
    assert second.output_text == text and second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [(i.type, i.role, i.content[0].text) for i in listed.data] == [("message", "user", "And then?")]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match="not stored here"):
        client.responses.create(model=model, previous_response_id=first.id, input="x", max_output_tokens=2)
    unstored = client.responses.create(model=model, input="Hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize("request_fields, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "read text only"),
    ({"tools": [{"type": "web_search"}]}, "only function tools"),
    ({"background": True}, "background responses are not supported"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id must be a string"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    # The chat machinery underneath says max_tokens; the client sent max_output_tokens.
    ({"max_output_tokens": 500}, r"\+ max_output_tokens 500 = \d+ exceeds"),
])
def test_what_cannot_be_served_is_a_400_that_says_why(server, request_fields, says):
    client, model = server.client(), server.backend.model_id
    with pytest.raises(openai.BadRequestError, match=says):
        client.responses.create(**{"model": model, "input": "Hello", **request_fields})
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.responses.create(model="no-such-model", input="Hello")


@pytest.mark.slow
def test_a_tool_call_round_trip(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    asked = client.responses.create(model=model, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [o for o in asked.output if o.type == "function_call"]
    assert asked.status == "completed" and len(calls) == 1, asked.output
    assert calls[0].name == "get_weather" and calls[0].call_id and calls[0].status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 degrees and sunny"}
    answered = client.responses.create(model=model, previous_response_id=asked.id, input=[result], tools=[WEATHER],
                                       max_output_tokens=60, temperature=0)
    assert answered.status in ("completed", "incomplete") and answered.output
    # The same turn without the store: the whole conversation sent back as items, as agent loops do.
    items = [{"role": "user", "content": ASK_WEATHER}, *[o.model_dump(exclude_none=True) for o in asked.output], result]
    resent = client.responses.create(model=model, input=items, tools=[WEATHER], max_output_tokens=60, temperature=0)
    assert resent.usage.input_tokens == answered.usage.input_tokens


@pytest.mark.slow
def test_a_streamed_tool_call_passes_the_sdks_own_accumulator(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    with client.responses.stream(model=model, input=ASK_WEATHER, tools=[WEATHER], parallel_tool_calls=False,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=80,
                                 temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    call = [o for o in final.output if o.type == "function_call"]
    assert len(call) == 1 and call[0].arguments == "".join(deltas)
    jsonschema.validate(json.loads(call[0].arguments), WEATHER["parameters"])


@pytest.mark.slow
def test_a_json_schema_text_format_validates(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    fmt = {"type": "json_schema", "name": "profile", "schema": SCHEMA, "strict": True}
    for seed in range(4):
        r = client.responses.create(model=model, input="Invent a user profile for a web app, as JSON.",
                                    text={"format": fmt}, temperature=1.0, extra_body={"seed": seed},
                                    max_output_tokens=MAX_TOKENS)
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    events, text = _streamed(client, model=model, input="Give the capital of France as JSON with one key.",
                             text={"format": {"type": "json_object"}}, temperature=0, max_output_tokens=120)
    assert events[-1].type == "response.completed", text
    assert isinstance(json.loads(text), dict)


@pytest.mark.slow
def test_logprob_bytes_join_to_the_text(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    ask = dict(model=model, input=REPEAT, include=["message.output_text.logprobs"], top_logprobs=2,
               max_output_tokens=24, temperature=0)
    r = client.responses.create(**ask)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in entries)
    assert any(e.bytes and not _utf8(bytes(e.bytes)) for e in entries), "no token split a character: test nothing"
    _assert_rebuilds(r.output_text, b"".join(bytes(e.bytes) for e in entries), _finish(r.status))
    # Streamed, each delta carries its tokens' entries. (Not compared with the whole reply: a repeated
    # prompt hits the prefix cache, and the default kernels then may pick another greedy token.)
    events, text = _streamed(client, **ask)
    streamed = [e for ev in events if ev.type == "response.output_text.delta" for e in ev.logprobs]
    _assert_rebuilds(text, b"".join(bytes(e.bytes) for e in streamed), _finish(events[-1].response.status))


def _finish(status: str) -> str:
    return "length" if status == "incomplete" else "stop"
