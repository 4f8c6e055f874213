"""GGUF blocks kept compact on a GPU (engine/device_weights.py, engine/block_dequant.py).

The torch dequantizers must give bitwise the gguf reference's values (they are what a GPU stage
multiplies by), for every byte pattern a block can hold. The forms themselves are plain torch
modules, so they run here on the CPU exactly as on a GPU: a model loaded through them gives
bitwise the logits of the same model loaded dense from the same file, and holds its weights in
the file's bytes. The tests that need a real GPU skip with the reason where there is none.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML

from meshllm.engine.block_dequant import SUPPORTED, dequantize
from meshllm.engine.device_weights import BlockEmbedding, BlockLinear, DeviceBlockForm
from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_weights import BlockMatrix, quantize
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import decoder_bytes, load_stage_decoder
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource
from meshllm.pipeline.local_generate import generate_many
from tests.quantized_gguf import write_quantized_llama

BLOCK_TYPES = sorted(SUPPORTED - {GGML.BF16, GGML.F16}, key=lambda t: t.value)
GPUS = {"cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_torch_dequantization_is_bitwise_the_reference_for_any_bytes(ggml_type):
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    g = torch.Generator().manual_seed(ggml_type.value)
    # Random bytes: every scale, min and code pattern, NaN and infinite fp16 scales included.
    data = torch.randint(0, 256, (7, 3 * block_bytes), generator=g, dtype=torch.uint8)
    with np.errstate(invalid="ignore", over="ignore"):  # the reference warns on NaN/inf scales
        want = BlockMatrix(data, ggml_type, 3 * block).dequantize()
    got = dequantize(data, ggml_type, 3 * block)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("ggml_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_quantized_weights_dequantize_to_the_reference(ggml_type):
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it): no quantizer for real blocks")
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(1)) * 0.05
    blocks = quantize(rt, weight, ggml_type)
    assert torch.equal(dequantize(blocks.data, ggml_type, 512), blocks.dequantize())
    # and in a 16-bit activation dtype, as a GPU product takes it
    assert torch.equal(dequantize(blocks.data, ggml_type, 512, torch.bfloat16), blocks.dequantize().bfloat16())


@pytest.fixture(scope="module")
def tiny_q4k(smollm2_gguf_path, tmp_path_factory):
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it): no quantizer to write the model")
    return write_quantized_llama(rt, smollm2_gguf_path, tmp_path_factory.mktemp("q") / "tiny.gguf", GGML.Q4_K)


def test_a_model_in_device_form_gives_the_dense_models_logits_bitwise(tiny_q4k):
    files = open_model(tiny_q4k)
    form = DeviceBlockForm(torch.device("cpu"), torch.float32)
    compact = load_decoder(files.source, files.config, weight_form=form)
    dense = load_decoder(files.source, files.config)  # the same file dequantized at load
    assert all(isinstance(layer.mlp.gate_up_proj, BlockLinear) for layer in compact.layers)
    assert isinstance(compact.embed_tokens, BlockEmbedding) and isinstance(compact.lm_head, BlockLinear)
    # The tied head multiplies the embedding's own blocks: one copy.
    assert compact.lm_head.blocks()[0][0] is compact.embed_tokens.blocks()[0][0]
    ids = torch.tensor(files.tokenizer.encode("The quick brown fox jumps over the lazy dog"))
    assert torch.equal(compact.forward_full(ids), dense.forward_full(ids))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [a] = generate_many(compact, files.tokenizer, [ids.tolist()], params)
    [b] = generate_many(dense, files.tokenizer, [ids.tolist()], params)
    assert a.token_ids == b.token_ids


def test_the_device_form_holds_the_files_bytes_not_a_dense_copy(tiny_q4k):
    files = open_model(tiny_q4k)
    compact = load_decoder(files.source, files.config, weight_form=DeviceBlockForm(torch.device("cpu"), torch.float32))
    dense = load_decoder(files.source, files.config, dtype=torch.float16)
    blocks = sum(info.num_bytes for info in files.source.file.tensors.values())
    # Q4_K layers and a Q8_0 table: ~4.5-8.5 bits a weight against 16 (norms stay dense in both).
    assert decoder_bytes(compact) <= blocks * 1.05
    assert decoder_bytes(compact) < 0.6 * decoder_bytes(dense)


def test_quantize_at_load_in_device_form_stays_close_to_dense(tiny_model_dir):
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here: --quantize needs its quantizer")
    # A safetensors model whose rows are whole Q8_0 blocks (no tokenizer: token ids are enough here).
    source = SafetensorsSource(tiny_model_dir("llama", hidden_size=128, intermediate_size=256))
    q8 = load_decoder(source, source.config(), weight_form=DeviceBlockForm(torch.device("cpu"), torch.float32,
                                                                           GGML.Q8_0, rt))
    dense = load_decoder(source, source.config())
    assert isinstance(q8.layers[0].self_attn.qkv_proj, BlockLinear)
    ids = torch.arange(3, 40)
    want = dense.forward_full(ids)
    # Q8_0 keeps ~8 bits of each weight: logits within 2% of their spread.
    assert (q8.forward_full(ids) - want).abs().max() < 0.02 * (want.max() - want.min())


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_a_gguf_stays_blocks_on_the_device_and_decodes_as_on_the_cpu(smollm2_gguf_path, device):
    if not GPUS[device]:
        pytest.skip(f"no {device} device on this machine (torch {torch.__version__}); run on a GPU host")
    files = open_model(smollm2_gguf_path)
    on_device = load_stage_decoder(files.source, files.config, dtype=torch.float32, device=device)
    held = [data for m in on_device.modules() if isinstance(m, BlockLinear | BlockEmbedding) for data, _ in m.blocks()]
    assert held and {d.device.type for d in held} == {device}
    assert on_device.kv_layout().device.type == device
    file_bytes = smollm2_gguf_path.stat().st_size
    assert decoder_bytes(on_device) < 1.1 * file_bytes  # compact: the dense fp32 model is ~4x the file
    cpu = load_decoder(files.source, files.config)  # dequantized, fp32, torch path
    ids = files.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    [got] = generate_many(on_device, files.tokenizer, [ids], params)
    [want] = generate_many(cpu, files.tokenizer, [ids], params)
    assert got.token_ids == want.token_ids
