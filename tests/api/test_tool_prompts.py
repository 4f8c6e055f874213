"""Tools and tool turns rendered per template family: through the model's own template when it
knows tools (as transformers passes them), written by us (Hermes protocol) when it does not."""

from __future__ import annotations

import json

import pytest

from meshllm.api.prompts import ModelText, chat_choices
from meshllm.api.schemas import ChatCompletionRequest
from meshllm.api.tool_formats import ToolFormat
from meshllm.model.source import open_model
from meshllm.model.tokenizer import Tokenizer

from .tool_families import tiny_family_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "abcDEF123", "content": "18 C, sunny"},
]


def _prompt(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, "tools": tools})
    choice = chat_choices(ModelText.of(tokenizer, 4096), body)[0]
    return tokenizer.decode(choice.prompt_ids, skip_special_tokens=False)


@pytest.mark.parametrize("family", ["hermes", "llama3", "mistral"])
def test_family_templates_render_tools_calls_and_results(tiny_model_dir, family):
    tokenizer = open_model(tiny_family_model(tiny_model_dir, family, seed=30)).tokenizer
    fmt = ToolFormat.of(tokenizer)
    assert fmt.family == family and fmt.template_renders_tools
    prompt = _prompt(tokenizer, ROUND_TRIP, [WEATHER])
    assert '"name": "get_weather"' in prompt  # the tool's definition, as the template writes it
    assert "18 C, sunny" in prompt
    # the earlier call, with its arguments as an object (not a JSON string inside a string)
    assert '"city": "Paris"' in prompt and '"{\\"city' not in prompt
    expected = {"hermes": ["<tool_call>\n{\"name\": \"get_weather\"", "<tool_response>\n18 C, sunny"],
                "llama3": ["Environment: ipython", "<|start_header_id|>ipython<|end_header_id|>"],
                "mistral": ["[AVAILABLE_TOOLS]", "[TOOL_CALLS] [", "\"call_id\": \"abcDEF123\""]}[family]
    for piece in expected:
        assert piece in prompt, (piece, prompt)
    assert fmt.begin_token == (tokenizer.backend.token_to_id("[TOOL_CALLS]") if family == "mistral" else
                               tokenizer.backend.token_to_id("<|python_tag|>") if family == "llama3" else None)


@pytest.mark.slow
def test_template_without_tools_gets_the_hermes_protocol_written_in(smollm2_gguf_path):
    tokenizer = Tokenizer.from_gguf(smollm2_gguf_path)  # SmolLM2's ChatML template never mentions tools
    fmt = ToolFormat.of(tokenizer)
    assert fmt.family == "hermes" and not fmt.template_renders_tools
    prompt = _prompt(tokenizer, ROUND_TRIP, [WEATHER])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(WEATHER) in prompt
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # without tools in the request nothing about tools is written
    assert "# Tools" not in _prompt(tokenizer, ROUND_TRIP[:2], None)
