"""A Phi-3 GGUF served over the OpenAI API: llama.cpp's Phi-3 vocabulary and chat template (from
its models/ folder, kept by install.sh) on a tiny random Phi-3 of fused, Q4_K-quantized tensors
with a sliding window, held quantized on ggml's path.

Random weights say nothing by their text; what is checked is what Phi-3 needs of the product: the
template's turns become the prompt llama.cpp would tokenize, and `<|end|>` (not the file's EOS,
<|endoftext|>) ends a reply.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.api.backend import build_local_backend
from meshllm.engine.ggml_lib import runtime
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions
from tests.api.conftest import serve
from tests.quantized_gguf import write_quantized_llama

PHI3_VOCAB = Path(sys.prefix) / "share" / "llama-cpp-vocabs" / "ggml-vocab-phi-3.gguf"
END = 32007  # <|end|>


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    rt = runtime()
    if rt is None or not PHI3_VOCAB.is_file():
        pytest.skip("needs ggml and llama.cpp's vocabulary files (install.sh builds and keeps both)")
    path = write_quantized_llama(rt, PHI3_VOCAB, tmp_path_factory.mktemp("phi3") / "phi3.gguf", GGML.Q4_K,
                                 arch="phi3", sliding_window=8)
    backend = build_local_backend(path, ServingOptions(context_length=256, max_batch=4))
    with serve(backend) as live:
        yield live, open_model(path).tokenizer
    backend.close()


def test_the_chat_template_makes_the_prompt(phi3):
    live, tokenizer = phi3
    reply = live.client().chat.completions.create(
        model="phi3", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=12, temperature=0)
    rendered = "<s><|user|>\nName three colours.<|end|>\n<|assistant|>\n"
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False)) == 14
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].finish_reason in ("stop", "length")


def test_end_of_turn_ends_the_reply(phi3):
    live, _ = phi3
    client = live.client()
    messages = [{"role": "user", "content": "Hello"}]
    # This random model puts "\n" (13) ~170 above every other token: both biases to reach <|end|>
    reply = client.chat.completions.create(model="phi3", messages=messages, max_tokens=12, temperature=0,
                                           logit_bias={"13": -100, str(END): 100})
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == "" and reply.usage.completion_tokens == 1
    # Without the bias the random model runs to its limit: the stop above was <|end|>'s doing.
    plain = client.chat.completions.create(model="phi3", messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 12
