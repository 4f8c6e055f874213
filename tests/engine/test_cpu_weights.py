"""CPU weight forms: oneDNN-prepacked bf16 and weight-only int8, on the real aidreams model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from meshllm.engine.cpu_weights import (MAX_INT8_KERNEL_ROWS, Int8Linear, PackedBF16Linear, pack_bf16, quantize_int8,
                                        use_fast_bf16)
from meshllm.engine.kernels.gemv import load_gemv
from meshllm.pipeline.local_generate import generate_many
from meshllm.engine.sampler import SamplingParams
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource


def _linear(dtype: torch.dtype, bias: bool = False, in_features: int = 96) -> nn.Linear:
    torch.manual_seed(0)
    layer = nn.Linear(in_features, 40, bias=bias)
    return layer.to(dtype).requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 7, 100])
def test_packed_bf16_computes_what_the_bf16_linear_does(rows):
    dense = _linear(torch.bfloat16, bias=True)
    x = torch.randn(rows, 96).bfloat16()
    torch.testing.assert_close(PackedBF16Linear(dense)(x).float(), dense(x).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 19, MAX_INT8_KERNEL_ROWS, MAX_INT8_KERNEL_ROWS + 1, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 100, 172])  # the kernel takes multiples of 32; others fall back
def test_int8_matches_the_dequantized_weight_on_both_paths(rows, dtype, width):
    dense = _linear(dtype, bias=True, in_features=width)
    q = Int8Linear(dense)
    assert q.kernel_fits == (width % 32 == 0)
    x = torch.randn(rows, width).to(dtype)
    y = q(x)
    assert y.dtype == dtype and y.shape == (rows, 40)
    dequantized = q.weight_int8.float() * q.scale[:, None]
    assert (dequantized - dense.weight.float()).abs().max() <= q.scale.max() / 2 + 1e-6  # rounding only
    want = x.float() @ dequantized.T + dense.bias.float()
    exact_path = dtype == torch.float32 and (rows > MAX_INT8_KERNEL_ROWS or not q.kernel_fits)
    tolerance = 1e-4 if exact_path else 5e-2
    torch.testing.assert_close(y.float(), want, atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module")
def aidreams(aidreams_path):
    return open_model(aidreams_path)


def _decoder(files, dtype):
    return load_decoder(files.source, files.config, dtype=dtype)


def test_packed_bf16_decoder_gives_the_bf16_logits(aidreams):
    ids = torch.tensor(aidreams.tokenizer.encode("Echoes of vectors unfold"))
    want = _decoder(aidreams, torch.bfloat16).forward_full(ids)
    packed = pack_bf16(_decoder(aidreams, torch.bfloat16))
    assert not any(type(m) is nn.Linear for m in packed.modules())
    assert packed.embed_tokens.weight.dtype == torch.bfloat16  # the tied table stays dense for lookups
    torch.testing.assert_close(packed.forward_full(ids), want, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("prepare", [pack_bf16, use_fast_bf16])
def test_a_gemma_decoder_in_bf16_takes_the_bf16_forms(tiny_model_dir, prepare):
    # Gemma's norm weights stay float32 in a bf16 model: the forms swap the matrices only (they
    # once refused the whole model, so a --tp group of bf16 Gemma ranks failed to load)
    if prepare is use_fast_bf16 and load_gemv() is None:
        pytest.skip("meshllm's bf16 kernel is not built here (install.sh builds it)")
    source = SafetensorsSource(tiny_model_dir("gemma2"))
    decoder = load_decoder(source, source.config(), dtype=torch.bfloat16)
    assert decoder.layers[0].input_layernorm.weight.dtype == torch.float32
    ids = torch.arange(3, 15)
    want = decoder.forward_full(ids)
    prepared = prepare(decoder)
    assert not any(type(m) is nn.Linear for m in prepared.modules())
    torch.testing.assert_close(prepared.forward_full(ids), want, atol=0.1, rtol=0.05)


def test_int8_decoder_stays_close_to_fp32(aidreams):
    ids = torch.tensor(aidreams.tokenizer.encode("Echoes of vectors unfold, a gentle hum of precision"))
    want = _decoder(aidreams, torch.float32).forward_full(ids)
    got = quantize_int8(_decoder(aidreams, torch.float32)).forward_full(ids)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    assert (got - want).abs().max() < 0.1 * want.abs().max()


@pytest.mark.parametrize("prepare", [pack_bf16, quantize_int8])
def test_prepared_decoders_generate_batched_equal_to_solo(aidreams, prepare):
    decoder = prepare(_decoder(aidreams, torch.bfloat16))
    prompts = [aidreams.tokenizer.encode(t) for t in ("I dream", "Echoes of vectors unfold")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = generate_many(decoder, aidreams.tokenizer, prompts, params)
    solo = [generate_many(decoder, aidreams.tokenizer, [p], params)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in solo]
    assert all(len(c.token_ids) == 12 for c in batched)
