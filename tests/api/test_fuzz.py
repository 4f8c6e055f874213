"""Property-based fuzzing of the HTTP request bodies against the app serving the real
SmolLM2-135M-Instruct: whatever arrives, the answer is a 2xx or a clear 4xx JSON error
(never a 5xx, never a hang), and the next good request still succeeds.

Bounded for CI: a few dozen examples, short contexts and max_tokens, a timeout on
every request. Bodies are drawn near the real schema (every field name the API
knows, plausible and absurd values, lone surrogates, NaN, huge numbers) and far
from it (any JSON, truncated JSON, raw bytes).
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.api.backend import build_local_backend
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.pipeline.cluster import ServingOptions

from .conftest import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
# Short contexts keep every accepted request quick, whatever max_tokens the fuzzer picks.
OPTIONS = ServingOptions(context_length=96, max_batch=4, scheduler=SchedulerConfig(max_waiting=8))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    backend = build_local_backend(smollm2_gguf_path, OPTIONS)
    with serve(backend) as live:
        yield live
    backend.close()


SURROGATES = st.sampled_from(["\ud800", "\udfff", "\ud83d", "\ude00"])
# Built from a list: st.text() leaves lone surrogates out, and they are what JS clients send.
text = st.lists(st.one_of(st.characters(), SURROGATES), max_size=24).map("".join)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), text)
any_json = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                         st.dictionaries(text, inner, max_size=4)), max_leaves=12)
small_int = st.integers(-3, 130)
PLAUSIBLE = {
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "top_k": small_int, "seed": st.integers(-5, 2**64),
    "stop": st.one_of(text, st.lists(text, max_size=20)), "n": small_int, "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "max_tokens": st.integers(-1, 8),
    "max_completion_tokens": st.integers(-1, 8), "logprobs": st.one_of(st.booleans(), small_int),
    "top_logprobs": small_int, "logit_bias": st.dictionaries(text, st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2), "user": text,
    "tools": st.lists(any_json, max_size=2), "response_format": any_json, "ignore_eos": st.booleans(),
    "echo": st.booleans(), "suffix": text, "best_of": small_int,
}
field_value = st.sampled_from(sorted(PLAUSIBLE)).flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(PLAUSIBLE[name], any_json)))
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"]),
                           "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=3), any_json)},
                          optional={"name": text}),
    any_json)
MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
model = st.one_of(st.just(MODEL_ID), text, any_json)
prompt = st.one_of(text, st.lists(text, max_size=3), st.lists(st.integers(-5, 60_000), max_size=12),
                   st.lists(st.lists(st.integers(-5, 60_000), max_size=6), max_size=3), any_json)


valid_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text})
near_prompt = st.one_of(text, st.lists(st.integers(-5, 60_000), min_size=1, max_size=12))

# The Responses API: its own fields, and input items of every kind (converted by hand, so fuzzed hard).
RESPONSE_FIELDS = {
    "instructions": text, "max_output_tokens": st.integers(-1, 8), "temperature": st.floats(-1, 3),
    "top_p": st.floats(-0.5, 1.5), "top_logprobs": small_int, "store": st.booleans(), "stream": st.booleans(),
    "previous_response_id": text, "parallel_tool_calls": st.booleans(), "background": st.booleans(),
    "truncation": st.sampled_from(["auto", "disabled", "middle"]), "metadata": st.dictionaries(text, text, max_size=20),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content"]), max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "file_search"]), "name": text})),
    "tools": st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "web_search"]), "name": text},
                                            optional={"parameters": any_json, "strict": st.booleans()}), max_size=2),
    "text": st.fixed_dictionaries({"format": st.one_of(any_json, st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar"]), "name": text,
         "schema": any_json}))}),
}
input_item = st.one_of(
    valid_message,
    st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning",
                                                    "item_reference", "web_search_call"])},
                          optional={"role": st.sampled_from(["user", "assistant", "tool", "wizard"]),
                                    "content": st.one_of(text, st.lists(st.fixed_dictionaries(
                                        {"type": st.sampled_from(["input_text", "output_text", "refusal",
                                                                  "input_image"]), "text": text}), max_size=2),
                                                         any_json),
                                    "call_id": st.one_of(text, any_json), "name": text, "arguments": any_json,
                                    "output": any_json, "id": text}),
    any_json)


def _responses_body(draw, near: bool) -> dict:
    body: dict = {"model": MODEL_ID, "max_output_tokens": draw(st.integers(1, 6))}
    if near:
        body["input"] = draw(st.one_of(text, st.lists(input_item, min_size=1, max_size=3)))
        body.update(draw(st.lists(st.sampled_from(sorted(RESPONSE_FIELDS)).flatmap(
            lambda name: st.tuples(st.just(name), RESPONSE_FIELDS[name])), max_size=3)))
    else:
        body["model"] = draw(model)
        body["input"] = draw(st.one_of(st.lists(input_item, max_size=3), any_json))
        body.update(draw(st.lists(st.sampled_from(sorted(RESPONSE_FIELDS)).flatmap(
            lambda name: st.tuples(st.just(name), st.one_of(RESPONSE_FIELDS[name], any_json))), max_size=6)))
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(body))), None)
    return body


@st.composite
def bodies(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from([CHAT, COMPLETIONS, RESPONSES]))
    body: dict = {"model": MODEL_ID, "max_tokens": draw(st.integers(1, 6))}
    if path == RESPONSES:
        body = _responses_body(draw, draw(st.booleans()))
    elif draw(st.booleans()):
        # Near the schema: a valid request with odd text and a few plausible, maybe invalid, fields.
        if path == CHAT:
            body["messages"] = draw(st.lists(valid_message, min_size=1, max_size=3))
        else:
            body["prompt"] = draw(near_prompt)
        body.update(draw(st.lists(st.sampled_from(sorted(PLAUSIBLE)).flatmap(
            lambda name: st.tuples(st.just(name), PLAUSIBLE[name])), max_size=2)))
    else:
        # Anywhere: every field may be any JSON, and one may be missing.
        body["model"] = draw(model)
        if path == CHAT:
            body["messages"] = draw(st.one_of(st.lists(message, min_size=1, max_size=3), any_json))
        else:
            body["prompt"] = draw(prompt)
        body.update(draw(st.lists(field_value, max_size=6)))
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(body))), None)
    raw = json.dumps(body).encode()  # NaN and Infinity as Python writes them, lone surrogates as \\u escapes
    shape = draw(st.sampled_from(["json"] * 6 + ["truncated", "any_json", "bytes"]))
    if shape == "truncated":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    elif shape == "any_json":
        raw = json.dumps(draw(any_json)).encode()
    elif shape == "bytes":
        raw = draw(st.binary(max_size=64))
    return path, raw


GOOD = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
        "temperature": 0}


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
def test_any_body_gets_a_clear_answer_and_the_server_keeps_serving(smollm2, case):
    path, raw = case
    with httpx.Client(timeout=60) as http:
        reply = http.post(f"{smollm2.url}{path}", content=raw, headers={"content-type": "application/json"})
        assert reply.status_code < 500, f"{reply.status_code} for {raw[:300]!r}: {reply.text[:300]}"
        if reply.status_code >= 400:
            assert reply.headers["content-type"].startswith("application/json"), reply.text[:200]
            error = reply.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"]
        else:
            assert reply.status_code == 200 and reply.content  # a completion, or a finished SSE stream
        good = http.post(f"{smollm2.url}{CHAT}", json=GOOD)
        assert good.status_code == 200, good.text
        assert good.json()["usage"]["completion_tokens"] == 1
