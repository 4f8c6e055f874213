"""Strict function tools under tool_choice auto: the reply is free text or calls whose arguments
match the schema (OpenAI's strict mode), enforced by grammar. Walked token by token through
llguidance for each template family's tokenizer (the tiny family models' and SmolLM2's), and
once end to end on SmolLM2 through the Responses API, whose function tools are strict by default."""

from __future__ import annotations

import json

import jsonschema
import pytest

from meshllm.api.prompts import ModelText
from meshllm.engine.grammar import allows
from meshllm.model.source import open_model

from .tool_families import tiny_family_model

pytestmark = [pytest.mark.timeout(600)]

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
# Calls as each family writes them, in the JSON layout the grammars use.
CALL = '{"name": "get_weather", "ARGS": {"city": "Paris"}}'
WRITTEN = {"hermes": "<tool_call>\n" + CALL.replace("ARGS", "arguments") + "\n</tool_call>",
           "mistral": "[TOOL_CALLS][" + CALL.replace("ARGS", "arguments") + "]",
           "llama3": CALL.replace("ARGS", "parameters")}


def _walk(model: ModelText, grammar, text: str) -> str:
    """"accepted" when every token of `text` is allowed in turn and EOS may follow; else where it stopped."""
    tok = model.tokenizer
    matcher = model.grammars.matcher(grammar)
    ids = tok.encode(text, add_special_tokens=False)
    for k, token_id in enumerate(ids):
        if not allows(matcher.allowed(), token_id):
            return f"refused at {tok.decode(ids[:k + 1], skip_special_tokens=False)!r}"
        assert matcher.accept(token_id)
    return "accepted" if any(allows(matcher.allowed(), e) for e in tok.eos_token_ids) else "unfinished"


@pytest.mark.parametrize("family", ["hermes", "mistral", "llama3", "smollm2"])
def test_free_text_or_a_call_that_matches_its_schema(family, tiny_model_dir, smollm2_gguf_path):
    path = smollm2_gguf_path if family == "smollm2" else tiny_family_model(tiny_model_dir, family, seed=31)
    model = ModelText.of(open_model(path).tokenizer, 2048)
    fmt = model.tool_format
    call = WRITTEN[fmt.family]
    grammar = model.grammars.lark(fmt.text_or_call_grammar(TOOLS, parallel=False), "strict tools")
    assert _walk(model, grammar, "It is sunny; no need to look it up.") == "accepted"
    assert _walk(model, grammar, call) == "accepted"
    assert _walk(model, grammar, call.replace('"city"', '"town"')).startswith("refused at")
    assert _walk(model, grammar, call.replace("get_weather", "get_time")).startswith("refused at")
    if fmt.family != "llama3":  # a llama3 call is the whole reply; the others may say something first
        assert _walk(model, grammar, "Let me check.\n" + call) == "accepted"
        assert _walk(model, grammar, "Let me check.\n" + call.replace('"city"', '"town"')).startswith("refused")
    else:
        assert _walk(model, grammar, "{not a call").startswith("refused at")


def test_responses_function_tools_are_strict_by_default(tiny_model_dir):
    """A random model pushed to open a call (logit_bias on its <tool_call> token) writes one whose
    arguments validate, because its tool is strict by default here; told strict false, it writes
    what a random model writes."""
    from meshllm.api.backend import build_local_backend
    from meshllm.pipeline.cluster import ServingOptions

    from .conftest import serve

    path = tiny_family_model(tiny_model_dir, "hermes", seed=31)
    backend = build_local_backend(path, ServingOptions(context_length=1024, max_batch=4))
    opening = backend.tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert len(opening) == 1
    # An enum, so a call ends within a few dozen of this byte-level vocabulary's tokens.
    parameters = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
                  "additionalProperties": False}
    tool = {"type": "function", "name": "get_weather", "parameters": parameters}
    ask = dict(model=backend.model_id, input="What is the weather in Paris?", parallel_tool_calls=False,
               temperature=1.0, max_output_tokens=200)
    with serve(backend) as live:
        client = live.client()
        for seed in range(3):
            r = client.responses.create(tools=[tool], extra_body={"seed": seed, "logit_bias": {str(opening[0]): 100}},
                                        **ask)
            calls = [o for o in r.output if o.type == "function_call"]
            assert r.status == "completed" and len(calls) == 1, r.output
            jsonschema.validate(json.loads(calls[0].arguments), parameters)
        loose = client.responses.create(tools=[{**tool, "strict": False}],
                                        extra_body={"seed": 0, "logit_bias": {str(opening[0]): 100}}, **ask)
    backend.close()
    valid = []
    for item in loose.output:
        try:
            jsonschema.validate(json.loads(item.arguments), parameters)
            valid.append(item)
        except (AttributeError, ValueError, jsonschema.ValidationError):
            pass
    assert not valid, "a random model wrote a valid call unconstrained: the strict check above proves nothing"
