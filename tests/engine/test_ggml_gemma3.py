"""Gemma 3 on ggml's path: a tiny random Gemma 3 (four norms a layer, GELU, a scaled embedding,
queries scaled by 24 ** -0.5, windowed layers with their own rope base and full ones with linear
rope scaling) gives the torch path's logits, which match transformers' (tests/model/test_decoder.py),
over chunked prefill, whole prefill and decode steps far past the window, on one stage and on two
stages split between a windowed and a full layer. Gemma 2 likewise (every other layer windowed,
attention scores and logits soft-capped: ggml's flash attention caps the scores, and takes every
step's attention, as meshllm's own attention ops have no cap).
"""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.weights import SafetensorsSource
from tests.engine.test_ggml_sliding_window import _logits, assert_ggml_matches_torch

# ggml's GELU reads a float16 table (as llama.cpp runs Gemma): ~1e-3 of a logit; 0.0103 measured
# on logits up to 9 with float32 KV.
ATOL = 2e-2
SEQS = [[(7 * i + 13 * j) % 90 + 3 for j in range(30)] for i in range(3)]  # window 5: crossed early


def _source(tiny_model_dir, variant: str) -> SafetensorsSource:
    if runtime() is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    return SafetensorsSource(tiny_model_dir(variant))


@pytest.fixture(scope="module")
def source(tiny_model_dir):
    return _source(tiny_model_dir, "gemma3")


@pytest.mark.parametrize("variant", ["gemma3", "gemma2"])
@pytest.mark.parametrize("prompt_len, chunk", [(13, 5), (30, 30), (4, 4)],
                         ids=["chunked-prefill", "prefill", "mostly-decode"])
def test_gemma_on_ggml_matches_the_torch_path(tiny_model_dir, variant, prompt_len, chunk):
    source = _source(tiny_model_dir, variant)
    decoder = load_stage_decoder(source, source.config())
    assert isinstance(decoder.fast_path, GGMLStage)
    assert_ggml_matches_torch(decoder, SEQS, prompt_len, chunk, ATOL)


def test_gemma2_softcaps_on_ggml_with_bf16_kv(tiny_model_dir):
    """bf16 KV, where other families' decode rows take meshllm's attention op: Gemma 2's take
    ggml's flash attention over bf16 keys, its scores capped there too. Against the torch path
    with float32 KV: bf16 KV alone moves these logits up to 0.07 on the torch path, and ggml's
    rounds the scaled queries to bf16 as well (as llama.cpp's f16 cache does to f16): 0.092
    measured. A cap left out moves them by ~4 (either cap)."""
    source = _source(tiny_model_dir, "gemma2")
    config = source.config()
    assert (config.attn_softcap, config.final_softcap) == (4.0, 5.0)
    decoder = load_stage_decoder(source, config)
    assert decoder.fast_path._attention_op is None and decoder.fast_path._batched_ops is None
    fast = _logits(decoder, SEQS, 4, 4, True, torch.bfloat16)
    slow = _logits(decoder, SEQS, 4, 4, False, torch.float32)
    for a, b in zip(fast, slow):
        assert b.abs().max() > 1.0 and a.abs().max() < 5.0  # capped: |logit| < 5
        torch.testing.assert_close(a, b, rtol=0, atol=0.15)


@pytest.mark.parametrize("split", [2, 3], ids=["windowed-then-full", "full-then-windowed"])
def test_two_gemma3_stages_on_ggml_give_one_stage_logits(source, split):
    """Each stage takes its layers' windows and rotary bases by their index in the whole model."""
    whole = load_stage_decoder(source, source.config())
    first = load_stage_decoder(source, source.config(), 0, split)
    second = load_stage_decoder(source, source.config(), split, source.config().num_hidden_layers)
    assert isinstance(first.fast_path, GGMLStage) and isinstance(second.fast_path, GGMLStage)
    want = _logits(whole, SEQS, 13, 5, True, torch.float32)
    got = _logits([first, second], SEQS, 13, 5, True, torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # hidden states cross in float32: nothing rounds
