"""Chat through a model with its own chat template: SmolLM2-135M-Instruct (Q4_1 GGUF)."""

from __future__ import annotations

import pytest

from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.pipeline.local_generate import generate_many
from meshllm.engine.sampler import SamplingParams
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MESSAGES = [{"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_uses_the_models_template_and_matches_single_process(smollm2_server, smollm2_gguf_path):
    backend = smollm2_server.backend
    tokenizer = backend.tokenizer
    prompt = tokenizer.apply_chat_template(MESSAGES)
    assert prompt.startswith("<|im_start|>system\nYou are a concise assistant.<|im_end|>")
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)  # the template wrote its own special tokens

    files = open_model(smollm2_gguf_path)
    decoder = make_batch_invariant(load_decoder(files.source, files.config))
    expected = generate_many(decoder, files.tokenizer, [ids], SamplingParams(temperature=0, max_tokens=12))[0]
    assert "Paris" in expected.text

    client = smollm2_server.client()
    reply = client.chat.completions.create(model=backend.model_id, messages=MESSAGES, temperature=0, max_tokens=12)
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == expected.finish_reason
    streamed = client.chat.completions.create(model=backend.model_id, messages=MESSAGES, temperature=0,
                                              max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected.text



def test_a_developer_message_is_the_system_prompt(smollm2_server):
    """OpenAI's newer clients send the system prompt as role "developer"; templates know only
    "system" (Qwen's and Hermes' drop roles they do not know): it must render as the system prompt."""
    from meshllm.api.prompts import ModelText, chat_choices
    from meshllm.api.schemas import ChatCompletionRequest
    from meshllm.model.tokenizer import Tokenizer
    from tests.api.tool_families import HERMES_TEMPLATE

    model = ModelText.of(smollm2_server.backend.tokenizer, 4096)
    as_developer = [{**MESSAGES[0], "role": "developer"}, MESSAGES[1]]

    def prompt(messages) -> list[int]:
        body = ChatCompletionRequest(model="m", messages=messages, max_tokens=4)
        return chat_choices(model, body)[0].prompt_ids

    assert prompt(as_developer) == prompt(MESSAGES)
    tokenizer = smollm2_server.backend.tokenizer  # the same, under a Hermes-style template
    hermes = Tokenizer(tokenizer.backend, special_tokens=tokenizer.special_tokens,
                       eos_token_ids=tokenizer._eos_token_ids, chat_template=HERMES_TEMPLATE)
    rendered = hermes.apply_chat_template([m.as_template_input() for m in ChatCompletionRequest(
        model="m", messages=as_developer).messages])
    assert rendered.startswith("<|im_start|>system\nYou are a concise assistant.<|im_end|>")
