"""chat_template_kwargs (vLLM's and llama.cpp server's extra-body field): more variables for the
model's chat template. Qwen3's and SmolLM3's templates read `enable_thinking`; false writes an
empty reasoning block after the generation prompt, so the model answers without one.

A tiny random Qwen2 model with a Hermes template ending as Qwen3's does, served over HTTP and
asked through the official openai client."""

from __future__ import annotations

import openai
import pytest

from meshllm.api.backend import build_local_backend
from meshllm.api.config import APIConfig
from meshllm.pipeline.cluster import ServingOptions
from tests.api.conftest import serve
from tests.api.tool_families import HERMES_TEMPLATE, tiny_family_model, with_template

# Qwen3's generation prompt (its template's last lines)
THINKING_TEMPLATE = HERMES_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")
ASK = [{"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def thinking_model(tiny_model_dir, tmp_path_factory):
    assert THINKING_TEMPLATE != HERMES_TEMPLATE
    folder = with_template(tiny_family_model(tiny_model_dir, "hermes", seed=31), tmp_path_factory.mktemp("thinking"),
                           THINKING_TEMPLATE)
    backend = build_local_backend(folder, ServingOptions(context_length=512, max_batch=2))
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def live(thinking_model):
    with serve(thinking_model) as server:
        yield server


def _prompt_tokens(live, **extra) -> int:
    reply = live.client().chat.completions.create(model=live.backend.model_id, messages=ASK, max_tokens=1,
                                                  temperature=0, **extra)
    return reply.usage.prompt_tokens


def test_enable_thinking_reaches_the_template(live):
    tokenizer = live.backend.tokenizer
    block = len(tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
    plain = _prompt_tokens(live)
    assert _prompt_tokens(live, extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == plain + block
    assert _prompt_tokens(live, extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == plain
    assert _prompt_tokens(live, extra_body={"chat_template_kwargs": {}}) == plain


@pytest.mark.parametrize("kwargs, words", [
    ({"messages": []}, ["'messages'", "may not set"]),
    ({"add_generation_prompt": False}, ["'add_generation_prompt'"]),
    ({"eos_token": "x"}, ["'eos_token'"]),
    ({"raise_exception": 1}, ["'raise_exception'"]),  # a function templates call
    ({"namespace": 0}, ["'namespace'"]),  # jinja's own (Qwen3's template calls it)
    ({"not a name": 1}, ["'not a name'", "template variable name"]),
])
def test_variables_the_request_sets_itself_are_refused_by_name(live, kwargs, words):
    with pytest.raises(openai.BadRequestError) as info:
        _prompt_tokens(live, extra_body={"chat_template_kwargs": kwargs})
    for word in words:
        assert word in str(info.value)


def test_chat_template_kwargs_must_be_an_object(live):
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        _prompt_tokens(live, extra_body={"chat_template_kwargs": ["enable_thinking"]})


def test_the_servers_defaults_sit_under_the_requests_own(thinking_model, live):
    # serve --chat-template-kwargs '{"enable_thinking": false}': every chat request renders with
    # it unless the request says otherwise; the Responses API's prompts too
    plain = _prompt_tokens(live)
    no_thinking = _prompt_tokens(live, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    with serve(thinking_model, APIConfig(port=0, chat_template_kwargs={"enable_thinking": False})) as server:
        assert _prompt_tokens(server) == no_thinking
        assert _prompt_tokens(server, extra_body={"chat_template_kwargs": {"enable_thinking": True}}) == plain
        response = server.client().responses.create(model=server.backend.model_id, input="Is the sky blue?",
                                                    max_output_tokens=1, temperature=0)
        assert response.usage.input_tokens == no_thinking
    with pytest.raises(ValueError, match="may not set 'messages'"):
        APIConfig(chat_template_kwargs={"messages": []})
