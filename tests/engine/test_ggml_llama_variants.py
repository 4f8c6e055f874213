"""Llama variants on ggml's path, each against the torch path (which tests/model/test_decoder.py
checks against transformers): a partial rotary (Phi-4-mini turns 96 of each head's 128 dims:
ggml's rope over fewer dims than the head turns the first ones and copies the rest, as
transformers does), layers without any (SmolLM3's NoPE layers, every fourth), and Granite's
multipliers (embedding, attention, residual joins, logits), YaRN's frequencies and cos/sin scale
(ggml's rope with freq factors and attn_factor, as LongRoPE's), and GLM-4 (q/k/v biases, fused
gate/up, norms after attention and the MLP, half of each head turned, its q/k rows reordered at
load from interleaved pairs). Dense float32 weights agree to
float32 rounding over chunked prefill and batched decode steps."""

from __future__ import annotations

import math

import pytest
import torch

from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.weights import SafetensorsSource
from tests.engine.test_ggml_sliding_window import _logits, assert_ggml_matches_torch

# 20 tokens: inside phi3-partial's 32-position context (LongRoPE's original one)
SEQS = [[(7 * i + 13 * j) % 90 + 3 for j in range(20)] for i in range(3)]


@pytest.mark.parametrize("variant", ["phi3-partial", "smollm3", "granite", "qwen3-yarn", "glm4"])
@pytest.mark.parametrize("prompt_len, chunk", [(8, 3), (20, 20), (2, 2)],
                         ids=["chunked-prefill", "prefill", "mostly-decode"])
def test_a_llama_variant_on_ggml_matches_the_torch_path(rt, tiny_model_dir, variant, prompt_len, chunk):
    config = SafetensorsSource(tiny_model_dir(variant)).config()
    if variant == "phi3-partial":
        assert config.rotary_dim == 8  # of head_dim 16
    elif variant == "smollm3":
        assert config.rope_layers == (True, True, True, False)
    elif variant == "granite":
        assert (config.embedding_scale, config.residual_scale, config.logit_scale) == pytest.approx((3.0, 0.4, 2.5))
    elif variant == "qwen3-yarn":
        assert config.rope_scaling.factor == 8.0 and config.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(8))
    else:
        assert (config.rotary_dim, config.attention_bias, config.sandwich_norms) == (8, True, True)
    decoder = load_stage_decoder(SafetensorsSource(tiny_model_dir(variant)), config)
    assert isinstance(decoder.fast_path, GGMLStage)
    assert_ggml_matches_torch(decoder, SEQS, prompt_len, chunk, atol=1e-4)  # 4e-6 measured


def test_a_stage_of_nope_layers_only_gives_the_whole_models_logits(rt, tiny_model_dir):
    # SmolLM3's last layer alone as a stage: it holds no rotary at all, and a pipeline of it
    # after layers [0, 3) computes what one stage of all four does, bit for bit.
    source = SafetensorsSource(tiny_model_dir("smollm3"))
    config = source.config()
    whole = load_stage_decoder(source, config)
    first, last = load_stage_decoder(source, config, 0, 3), load_stage_decoder(source, config, 3, 4)
    assert [layer.rope for layer in last.layers] == [None]
    for fast in (True, False):
        want = _logits(whole, SEQS, 8, 3, fast, torch.float32)
        got = _logits([first, last], SEQS, 8, 3, fast, torch.float32)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_q_k_v_biases_over_parts_of_two_types(rt, tiny_model_dir, tmp_path):
    # llama.cpp's K-quant mixes keep some attn_v in another type than attn_q/attn_k (Q4_K_M:
    # Q6_K for half the layers): q/k/v are then two matrices under one bias, each adding its rows'
    # share (a GLM-4.5 Q4_K_M file failed to load; Qwen2.5's are the common case)
    from gguf.constants import GGMLQuantizationType as GGML

    from meshllm.model.gguf import GGUFSource
    from tests.model.test_gguf import write_model_gguf

    source = GGUFSource(write_model_gguf(tiny_model_dir("qwen2"), tmp_path / "qwen2.gguf", "qwen2",
                                         types={"attn_q": GGML.Q4_0, "attn_k": GGML.Q4_0, "attn_v": GGML.Q8_0}))
    decoder = load_stage_decoder(source, source.config())
    qkv = decoder.layers[0].self_attn.qkv_proj
    assert set(qkv.weight_types) == {"Q4_0", "Q8_0"} and qkv.bias is not None
    assert_ggml_matches_torch(decoder, SEQS, 8, 3, atol=5e-2)  # ggml's products take Q8_0 activations
