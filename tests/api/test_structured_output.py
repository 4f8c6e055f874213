"""response_format json_schema (strict) and json_object, enforced by grammar-constrained decoding:
every sampled completion parses and validates, on the real SmolLM2 and through the 2-stage
pipeline of node processes (masks on the wire). A truncated reply fails the test explicitly."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshllm.api.backend import build_local_backend
from meshllm.pipeline.cluster import ServingOptions

from .conftest import serve

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Every string and array is bounded, so a valid document always fits max_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "tags", "active"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "profile", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Invent a user profile for a web app, as JSON."}]
MAX_TOKENS = 400  # above the longest valid document: 80 free characters of up to 4 byte tokens each, plus structure


def _validated(choice) -> dict:
    assert choice.finish_reason == "stop", f"truncated or failed ({choice.finish_reason}): {choice.message.content!r}"
    document = json.loads(choice.message.content)
    jsonschema.validate(document, SCHEMA)
    return document


@pytest.fixture(scope="module")
def wide_smollm2(smollm2_gguf_path):
    """All 50 choices in one batch, default (fast) kernels: this test needs validity, not bit-identity."""
    backend = build_local_backend(smollm2_gguf_path, ServingOptions(context_length=512, max_batch=50))
    with serve(backend) as live:
        yield live
    backend.close()


def test_fifty_sampled_completions_validate_against_a_strict_schema(wide_smollm2):
    reply = wide_smollm2.client(timeout=600).chat.completions.create(
        model=wide_smollm2.backend.model_id, messages=ASK, response_format=FORMAT, temperature=1.0, seed=11,
        n=50, max_tokens=MAX_TOKENS)
    documents = [_validated(c) for c in reply.choices]
    assert len(documents) == 50
    assert len({json.dumps(d, sort_keys=True) for d in documents}) > 25  # sampled, not one answer repeated


def test_json_object_always_parses_whole_and_streamed(smollm2_fast_server):
    client, model = smollm2_fast_server.client(), smollm2_fast_server.backend.model_id
    ask = [{"role": "user", "content": "Give the capital of France as JSON with one key."}]
    reply = client.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"},
                                           temperature=0, max_tokens=120)
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    chunks = list(client.chat.completions.create(model=model, messages=ask, response_format={"type": "json_object"},
                                                 temperature=0, max_tokens=120, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content


def test_json_schema_through_the_pipeline(long_server):
    """A random-weight model still writes valid documents: only the grammar speaks."""
    reply = long_server.client().chat.completions.create(
        model=long_server.backend.model_id, messages=ASK, response_format=FORMAT, temperature=1.0, seed=2, n=4,
        max_tokens=MAX_TOKENS)
    for choice in reply.choices:
        _validated(choice)
