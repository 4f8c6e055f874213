"""A partial rotary (Phi-4-mini turns 96 of each head's 128 dims) on ggml's path: ggml's rope
with fewer dims than the head turns the first ones and copies the rest, as transformers does
(tests/model/test_decoder.py checks the torch path against transformers). Dense float32 weights
agree with the torch path to float32 rounding over chunked prefill and batched decode steps."""

from __future__ import annotations

import pytest

from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.weights import SafetensorsSource
from tests.engine.test_ggml_sliding_window import assert_ggml_matches_torch

# 20 tokens: inside phi3-partial's 32-position context (LongRoPE's original one)
SEQS = [[(7 * i + 13 * j) % 90 + 3 for j in range(20)] for i in range(3)]


@pytest.mark.parametrize("prompt_len, chunk", [(8, 3), (20, 20), (2, 2)],
                         ids=["chunked-prefill", "prefill", "mostly-decode"])
def test_a_partial_rotary_on_ggml_matches_the_torch_path(rt, tiny_model_dir, prompt_len, chunk):
    source = SafetensorsSource(tiny_model_dir("phi3-partial"))
    assert source.config().rotary_dim == 8  # of head_dim 16
    decoder = load_stage_decoder(source, source.config())
    assert isinstance(decoder.fast_path, GGMLStage)
    assert_ggml_matches_torch(decoder, SEQS, prompt_len, chunk, atol=1e-4)  # 4e-6 measured
