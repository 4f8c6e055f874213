"""Tool calling through real HTTP with the official `openai` client: SmolLM2 (its ChatML template
knows no tools, so the Hermes protocol is written in) and tiny random models whose templates
speak each family (hermes, llama3, mistral, mistral_args, glm, qwen3_coder, minimax). Forced calls (tool_choice required or named) are
grammar-constrained, so even a random model's arguments validate against the schema. Also one
agent loop of the `openai-agents` framework with this server as its model, over chat completions
and over the Responses API (test_responses_api.py tests that API itself)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer

from meshllm.api.backend import build_local_backend
from meshllm.pipeline.cluster import ServingOptions

from .conftest import serve
from .tool_families import tiny_family_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": PARAMETERS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a time zone",
                                         "parameters": {"type": "object", "properties": {
                                             "zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                                         "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
RESPONSES_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat form


def _check_calls(calls, names=("get_weather",)) -> None:
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        arguments = json.loads(call.function.arguments)
        schema = WEATHER if call.function.name == "get_weather" else TIME
        jsonschema.validate(arguments, schema["function"]["parameters"])


def _streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    """Reassemble tool calls from stream deltas as OpenAI's SDK users do; also checks the shape."""
    calls: dict[int, dict] = {}
    finish, content = None, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        indices = [d.index for d in choice.delta.tool_calls or ()]
        assert len(indices) == len(set(indices)), "one delta per call in a chunk, as OpenAI sends them"
        for d in choice.delta.tool_calls or ():
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, "a call's first delta names it"
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def _round_trip(client, model: str, tools: list[dict], extra: dict) -> None:
    """required -> tool_calls; named + streamed -> tool_calls; tool results -> a final answer."""
    first = client.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=300, **extra)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", (message.content, first.usage)
    _check_calls(message.tool_calls, names=[t["function"]["name"] for t in tools])

    chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=tools, tool_choice=NAMED,
                                                 temperature=0, max_tokens=300, stream=True, **extra))
    streamed, finish, _ = _streamed_calls(chunks)
    assert finish == "tool_calls" and len(streamed) >= 1
    for call in streamed:
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS)

    history = ASK + [message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 degrees and sunny"} for c in message.tool_calls]
    final = client.chat.completions.create(model=model, messages=history, tools=tools, temperature=0,
                                           max_tokens=24, **extra)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    answer = final.choices[0].message
    assert answer.content or answer.tool_calls


def test_smollm2_tool_round_trip(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    _round_trip(client, model, [WEATHER, TIME], {})
    # one call only when parallel calls are off
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert len(reply.choices[0].message.tool_calls) == 1
    # with the result in hand, SmolLM2 answers in words
    call = reply.choices[0].message.tool_calls[0]
    history = ASK + [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason in ("stop", "length")


def test_a_named_tool_choice_makes_that_call_once(smollm2_fast_server):
    """As OpenAI answers it, whatever parallel_tool_calls says (SmolLM2 repeats the call when it may)."""
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
                                           temperature=0, max_tokens=120)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_weather"]
    assert reply.choices[0].finish_reason == "tool_calls"
    response = client.responses.create(model=model, input=ASK[0]["content"], tools=[RESPONSES_WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                       max_output_tokens=120)
    assert [(item.type, item.name) for item in response.output] == [("function_call", "get_weather")]


def test_a_forced_call_cut_by_max_tokens_leaves_no_markup_in_the_content(smollm2_fast_server):
    """Cut anywhere (inside the opening marker, the call's head, its arguments): finish_reason
    length, no content, and once the name is written, the call with the arguments it got; the
    same streamed, and through the Responses API (an incomplete response, no message item)."""
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    for limit in (1, 3, 5, 8, 12, 18):
        reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="required",
                                               temperature=0, max_tokens=limit)
        choice = reply.choices[0]
        assert choice.finish_reason == "length" and not choice.message.content, (limit, choice.message)
        assert all(c.function.name == "get_weather" for c in choice.message.tool_calls or ()), limit
        chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                                     temperature=0, max_tokens=limit, stream=True))
        calls, finish, content = _streamed_calls(chunks)
        assert finish == "length" and content == "", (limit, content)
        assert [c["name"] for c in calls] == [c.function.name for c in choice.message.tool_calls or ()], limit
        response = client.responses.create(model=model, input=ASK[0]["content"], tools=[RESPONSES_WEATHER],
                                           tool_choice="required", temperature=0, max_output_tokens=limit)
        assert response.status == "incomplete", limit
        assert [item.type for item in response.output] == ["function_call"] * len(calls), (limit, response.output)


def test_tool_choice_none_and_auto_without_a_call_return_content(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    reply = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice="none",
                                           temperature=0, max_tokens=16)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral", "mistral_args", "glm", "qwen3_coder", "minimax"])
def test_family_tool_round_trip_on_a_tiny_random_model(tiny_model_dir, family):
    folder = tiny_family_model(tiny_model_dir, family, seed=31)
    backend = build_local_backend(folder, ServingOptions(context_length=2048, max_batch=4))
    # a random model would chain calls until max_tokens: one call per turn
    extra: dict = {"parallel_tool_calls": False}
    if family == "minimax":  # its prompt opens a <think> block: the random model is biased to close it
        close = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("</think>")
        extra["logit_bias"] = {str(close): 100}
    try:
        with serve(backend) as live:
            tools = [WEATHER] if family == "llama3" else [WEATHER, TIME]
            _round_trip(live.client(), backend.model_id, tools, extra)
            reply = live.client().chat.completions.create(
                model=backend.model_id, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                temperature=1.0, seed=5, max_tokens=300, **extra)
            assert len(reply.choices[0].message.tool_calls) == 1
            if family == "mistral":  # Mistral's template accepts only 9-character ids back
                assert len(reply.choices[0].message.tool_calls[0].id) == 9
    finally:
        backend.close()


def test_forced_calls_through_a_two_stage_pipeline(long_server):
    """Masks travel to the last stage of the pipeline of node processes (and in process)."""
    model = long_server.backend.model_id
    reply = long_server.client().chat.completions.create(model=model, messages=ASK, tools=[WEATHER], tool_choice=NAMED,
                                                    parallel_tool_calls=False, temperature=1.0, seed=3, n=3,
                                                    max_tokens=100)
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        _check_calls(choice.message.tool_calls)


@pytest.mark.parametrize("api", ["chat", "responses", "responses-streamed"])
def test_openai_agents_loop_with_this_server_as_its_model(smollm2_fast_server, api):
    """The framework on chat completions, and on its default model class, which speaks the Responses API."""
    import asyncio

    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # never export traces anywhere
    asked: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        asked.append(city)
        return f"It is 18 degrees and sunny in {city}."

    client = AsyncOpenAI(base_url=f"{smollm2_fast_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    model_class = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(name="weather", instructions="You answer questions about the weather. Use the tools.",
                  tools=[get_weather],
                  model=model_class(model=smollm2_fast_server.backend.model_id, openai_client=client),
                  # required for the first turn; the SDK resets it to auto once a tool ran
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=60))
    if api == "responses-streamed":
        async def run():
            result = Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=4)
            kinds = {e.data.type async for e in result.stream_events() if e.type == "raw_response_event"}
            assert {"response.function_call_arguments.delta", "response.output_text.delta"} <= kinds
            return result
        result = asyncio.run(run())
    else:
        result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert asked == ["Paris"]
    assert isinstance(result.final_output, str) and "18" in result.final_output


def test_harmony_calls_and_answers_on_a_tiny_random_gpt_oss(tiny_model_dir):
    """GPT-OSS's harmony format (api/harmony.py): a forced call is a message to functions.NAME
    whose body the grammar makes valid arguments; a JSON answer is a final-channel message; the
    markers never reach the content. The grammar lets a reply reason first (free text on the
    analysis channel), as GPT-OSS answers better so; a random model could reason until
    max_tokens, so a logit bias on "a" (the first letter of "analysis") steers it past."""
    backend = build_local_backend(tiny_family_model(tiny_model_dir, "harmony", seed=31),
                                  ServingOptions(context_length=2048, max_batch=4))
    try:
        with serve(backend) as live:
            client, model = live.client(), backend.model_id
            steer = {"logit_bias": {str(backend.tokenizer.backend.token_to_id("a")): -100}, "temperature": 0,
                     "max_tokens": 300}
            first = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                                   tool_choice="required", **steer)
            message = first.choices[0].message
            assert first.choices[0].finish_reason == "tool_calls" and message.content is None
            _check_calls(message.tool_calls, names=["get_weather", "get_time"])
            assert len(message.tool_calls) == 1  # a call ends its turn

            chunks = list(client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER, TIME],
                                                         tool_choice=NAMED, stream=True, **steer))
            streamed, finish, _ = _streamed_calls(chunks)
            assert finish == "tool_calls" and [c["name"] for c in streamed] == ["get_weather"]
            jsonschema.validate(json.loads(streamed[0]["arguments"]), PARAMETERS)

            schema = {"type": "object", "properties": {"celsius": {"type": "integer"}}, "required": ["celsius"],
                      "additionalProperties": False}
            answer = client.chat.completions.create(
                model=model, messages=ASK, response_format={"type": "json_schema", "json_schema": {
                    "name": "reading", "schema": schema}}, **steer)
            assert answer.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(answer.choices[0].message.content), schema)

            history = ASK + [message.model_dump(exclude_none=True)] + [
                {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "18 degrees"}]
            # the call and its result go back through the template (a message to and one from
            # functions.get_weather): the prompt grows by them
            final = client.chat.completions.create(model=model, messages=history, tools=[WEATHER, TIME],
                                                   temperature=0, max_tokens=24)
            assert final.usage.prompt_tokens > first.usage.prompt_tokens + len("18 degrees")
    finally:
        backend.close()
