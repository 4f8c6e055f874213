"""Q8_0/Q4_0/Q4_1 blocks held as planes on a GPU (engine/block_planes.py) and the fused kernel
that reads them (engine/triton_blocks.py). Splitting is a permutation of the file's bytes, so
everything here is exact: the round trip, the dequantized values (bitwise the gguf reference for
any bytes, NaN scales included) and the rows an embedding looks up. The forms are plain torch
modules, so they run here on the CPU as on a GPU; the kernel needs CUDA with Triton, or Triton's
interpreter on a CPU (TRITON_INTERPRET=1, float32 only: the interpreter's 16-bit dot is wrong).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML

from meshllm.engine import block_planes, triton_blocks
from meshllm.engine.block_dequant import dequantize
from meshllm.engine.device_weights import BlockEmbedding
from meshllm.engine.ggml_weights import BlockMatrix

PLANAR = sorted(block_planes.PLANAR, key=lambda t: t.value)


def _any_bytes(ggml_type: GGML, rows: int, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, blocks * GGML_QUANT_SIZES[ggml_type][1]), generator=g, dtype=torch.uint8)


@pytest.mark.parametrize("ggml_type", PLANAR, ids=lambda t: t.name)
def test_planes_are_the_blocks_bytes_and_dequantize_bitwise(ggml_type):
    data = _any_bytes(ggml_type, 7, 5, ggml_type.value)
    planes = block_planes.split(data, ggml_type)
    assert planes.shape == data.shape and planes.dtype == torch.uint8
    assert torch.equal(planes.flatten().sort().values, data.flatten().sort().values)  # a permutation
    assert torch.equal(block_planes.join(planes, ggml_type), data)
    q, d, m = block_planes.parts(planes, ggml_type)
    assert q.stride(0) % 16 == 0 and d.shape == (7, 5) and (m is None) == (ggml_type != GGML.Q4_1)
    with np.errstate(invalid="ignore", over="ignore"):  # random f16 scales include NaN and inf
        want = BlockMatrix(data, ggml_type, 5 * 32).dequantize()
    torch.testing.assert_close(block_planes.dequantize(planes, ggml_type), want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(block_planes.dequantize(planes, ggml_type, torch.bfloat16), want.bfloat16(),
                               rtol=0, atol=0, equal_nan=True)
    ids = torch.tensor([6, 0, 3, 3])
    torch.testing.assert_close(block_planes.rows(planes, ggml_type, ids, torch.float32), want[ids],
                               rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("ggml_type", PLANAR, ids=lambda t: t.name)
def test_device_forms_hold_planes_and_a_tied_head_shares_them(ggml_type):
    weight = np.random.default_rng(0).standard_normal((48, 256)).astype(np.float32) * 0.05
    table = BlockMatrix(torch.from_numpy(gguf_quants.quantize(weight, ggml_type).copy()), ggml_type, 256)
    embedding = BlockEmbedding(table, torch.float32, torch.device("cpu"))
    head = embedding.head()
    assert head.blocks()[0][0] is embedding.blocks0  # one buffer, not a second copy
    assert torch.equal(block_planes.join(embedding.blocks0, ggml_type), table.data)
    dense = table.dequantize()
    ids = torch.tensor([5, 47, 0])
    assert torch.equal(embedding(ids), dense[ids])
    x = torch.randn(20, 256)  # 20 rows: past the fused kernel's 16, so the torch path here
    assert torch.equal(head(x), torch.nn.functional.linear(x, dense))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" and triton_blocks.available(torch.device("cpu"))


def _kernel_device() -> str:
    if triton_blocks.available(torch.device("cuda")):
        return "cuda"
    if _interpreting():
        return "cpu"
    pytest.skip(f"no CUDA device with Triton here (torch {torch.__version__}), nor Triton's interpreter "
                "(TRITON_INTERPRET=1 with triton installed); run on a GPU host")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ggml_type", PLANAR, ids=lambda t: t.name)
def test_the_fused_kernel_multiplies_planes_by_the_reference_weights(ggml_type, dtype):
    device = _kernel_device()
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("Triton's interpreter gets 16-bit dot products wrong; the GPU run checks them")
    cols = 18 * 32  # SmolLM2's 576: blocks per row not a multiple of any tile
    weight = np.random.default_rng(ggml_type.value).standard_normal((200, cols)).astype(np.float32) * 0.05
    blocks = torch.from_numpy(gguf_quants.quantize(weight, ggml_type).copy())
    planes = block_planes.split(blocks, ggml_type).to(device)
    reference = dequantize(blocks, ggml_type, cols, dtype).float().to(device)  # what the torch path multiplies by
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(0)).to(dtype).to(device)
    wide = torch.zeros(16, 300, device=device, dtype=dtype)
    out = wide[:, 50:250]  # a column slice of a wider output, as a fused qkv's parts are written
    triton_blocks.rows_times_planes(x, planes, ggml_type, out)
    want = x.float() @ reference.T
    # fp32 multiplies IEEE (no TF32); 16-bit the same products, fp32 sums in another order, one rounding out
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (out.float() - want).abs().max() <= tolerance * want.abs().max()
    assert not wide[:, :50].any() and not wide[:, 250:].any()
    # and a row's result does not depend on the rows beside it (a verify pass = its one-row steps)
    for m in (1, 5):
        alone = torch.empty(m, 200, device=device, dtype=dtype)
        triton_blocks.rows_times_planes(x[:m].contiguous(), planes, ggml_type, alone)
        assert torch.equal(alone, out[:m])


@pytest.mark.parametrize("ggml_type", PLANAR, ids=lambda t: t.name)
def test_every_tile_the_kernel_may_pick_sums_in_the_same_order(ggml_type):
    # Tuning picks a tile per shape by timing it, separately in each process: a pipeline's stages
    # and the single process they are compared with must still get the same bits.
    device = _kernel_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cols = 40 * 32
    weight = np.random.default_rng(1).standard_normal((300, cols)).astype(np.float32) * 0.05
    planes = block_planes.split(torch.from_numpy(gguf_quants.quantize(weight, ggml_type).copy()), ggml_type)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    planes = planes.to(device)
    want = torch.empty(3, 300, device=device, dtype=dtype)
    triton_blocks.rows_times_planes(x, planes, ggml_type, want)
    configs = triton_blocks.PLANE_CONFIGS
    for config in configs if device == "cuda" else configs[:3]:
        got = torch.empty_like(want)
        triton_blocks.rows_times_planes(x, planes, ggml_type, got, config=config)
        assert torch.equal(got, want), config
