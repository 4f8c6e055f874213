"""ggml-held quantized matrices against gguf's reference dequantization.

For each GGUF quant type meshllm keeps quantized, a random matrix is quantized by ggml's own
quantizer (what llama-quantize runs) and multiplied by ggml; the reference is gguf-py's
independent numpy dequantization of the same blocks, multiplied in fp64.

Tolerance, stated: ggml rounds the activations to 8-bit blocks before the integer dot products
(Q8_0 for Q4_0/Q4_1/Q5_x/Q8_0, Q8_K for the K-quants; bf16 for BF16 weights), exactly as
llama.cpp does. Rounding x to a block scale of max|x|/127 moves each x_j by at most
max|x|/254, so |y_i - ref_i| <= sum_j |w_ij| * max|x| / 254; we assert that bound (plus 1e-5
for fp32 accumulation). Weights themselves are exact: the blocks are used as stored.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import GGML_VERSION
from meshllm.engine.ggml_weights import BlockMatrix, GGMLMatrix, quantize

GGUF_TYPES = [GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K]
# Functions of ggml-python's ctypes layer meshllm calls that return pointers: each must be
# declared returning a pointer type (0.0.45 declares ggml_backend_cpu_buffer_type as int).
POINTER_RETURNING = ["ggml_init", "ggml_new_tensor_4d", "ggml_new_tensor_2d", "ggml_mul_mat", "ggml_get_rows",
                     "ggml_new_graph_custom", "ggml_backend_alloc_ctx_tensors_from_buft", "ggml_backend_dev_by_type",
                     "ggml_backend_dev_backend_reg", "ggml_backend_reg_get_proc_address",
                     "ggml_backend_dev_buffer_type", "ggml_threadpool_new", "ggml_rms_norm", "ggml_mul", "ggml_add",
                     "ggml_rope_ext", "ggml_flash_attn_ext", "ggml_view_4d", "ggml_cpy", "ggml_swiglu_split",
                     "ggml_reshape_3d", "ggml_permute", "ggml_cont", "ggml_set_rows", "ggml_view_1d",
                     "ggml_view_2d", "ggml_view_3d", "ggml_scale", "ggml_reshape_2d", "ggml_sum_rows",
                     "ggml_out_prod", "ggml_transpose", "ggml_custom_4d", "ggml_concat", "ggml_cast"]


def test_ctypes_layer_matches_the_library(rt):
    g = rt.lib
    assert g.ggml_version().decode() == GGML_VERSION
    assert g.ggml_tensor_overhead() == g.GGML_OBJECT_SIZE + ctypes.sizeof(g.ggml_tensor)
    for name in POINTER_RETURNING:
        restype = getattr(g, name).restype
        assert restype is ctypes.c_void_p or issubclass(restype, ctypes._Pointer), (name, restype)


def _bound(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # [n, rows]: sum_j |w_ij| * max|x_n| / 254 (see the module docstring)
    return (w.abs().sum(dim=1)[None, :] * x.abs().amax(dim=1, keepdim=True)) / 254 + 1e-5


@pytest.mark.parametrize("ggml_type", GGUF_TYPES + [GGML.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("num_rows", [1, 7, 64], ids=["decode", "batch", "prefill"])
def test_matmul_matches_reference_dequantization(rt, ggml_type, num_rows):
    g = torch.Generator().manual_seed(int(ggml_type) * 100 + num_rows)
    weight = torch.randn(264, 512, generator=g) * 0.05  # 264 rows: not a multiple of 16 or 64
    blocks = quantize(rt, weight, ggml_type)
    reference_weight = blocks.dequantize().double()  # gguf-py's numpy dequantization
    x = torch.randn(num_rows, 512, generator=g)
    y = GGMLMatrix(rt, blocks).matmul(x)
    expected = x.double() @ reference_weight.T
    error = (y.double() - expected).abs()
    assert bool((error <= _bound(reference_weight, x.double())).all()), float((error / _bound(reference_weight, x.double())).max())
    # and the blocks are close to the float weight (4-bit rounding moves a value by up to 1/16
    # of its block maximum): guards a wrong type or layout
    assert float((reference_weight - weight.double()).abs().max()) < 0.1 * float(weight.abs().max())


# The lower-bit types of llama.cpp's imatrix quantizations (unsloth's UD-Q2_K_XL files of big
# mixtures of experts are mostly these): the same bound, and the blocks still the weight's shape.
LOW_BIT_TYPES = [GGML.Q2_K, GGML.Q3_K, GGML.IQ4_XS, GGML.IQ4_NL, GGML.IQ3_S, GGML.IQ3_XXS, GGML.IQ2_XS,
                 GGML.IQ2_XXS]
# Any bytes are blocks of these (grid indices and signs), once the scale is a small normal float:
# ggml's quantizer takes 7 s (IQ2_S) and 15 s (IQ1_S, IQ1_M) to build their grids, so their
# products are checked on random blocks, against the same reference. The f16 scale's place: IQ2_S
# and IQ1_S open with it; IQ1_M spreads it over the top 4 bits of its four 16-bit block scales.
RANDOM_BLOCK_TYPES = [GGML.IQ2_S, GGML.IQ1_S, GGML.IQ1_M]


@pytest.mark.parametrize("ggml_type", LOW_BIT_TYPES, ids=lambda t: t.name)
def test_low_bit_matmul_matches_reference_dequantization(rt, ggml_type):
    g = torch.Generator().manual_seed(int(ggml_type))
    weight = torch.randn(40, 256, generator=g) * 0.05
    blocks = quantize(rt, weight, ggml_type)
    _assert_product_within_bound(rt, blocks, torch.randn(9, 256, generator=g))
    # 2-3 bits a weight: far from exact (IQ2_XXS keeps a cosine of ~0.94), but a wrong layout is noise
    reference_weight = blocks.dequantize().double()
    assert torch.nn.functional.cosine_similarity(reference_weight.flatten(), weight.double().flatten(), dim=0) > 0.9


@pytest.mark.parametrize("ggml_type", RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
def test_random_low_bit_blocks_multiply_as_the_reference_reads_them(rt, ggml_type):
    import numpy as np

    g = torch.Generator().manual_seed(int(ggml_type))
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    data = torch.randint(0, 256, (40 * block_bytes,), dtype=torch.uint8, generator=g).view(40, block_bytes)
    scale = int(np.float16(0.004).view(np.uint16))
    if ggml_type == GGML.IQ1_M:
        scales = data[:, -8:].contiguous().view(torch.int16).to(torch.int32) & 0x0FFF
        scales |= torch.tensor([(scale >> (4 * i) & 0xF) << 12 for i in range(4)], dtype=torch.int32)
        data[:, -8:] = scales.to(torch.int16).view(torch.uint8)
    else:
        data[:, :2] = torch.tensor([scale & 0xFF, scale >> 8], dtype=torch.uint8)
    _assert_product_within_bound(rt, BlockMatrix(data, ggml_type, 256), torch.randn(9, 256, generator=g))


def _assert_product_within_bound(rt, blocks: BlockMatrix, x: torch.Tensor) -> None:
    reference_weight = blocks.dequantize().double()
    assert reference_weight.abs().max() > 0 and bool(torch.isfinite(reference_weight).all())
    error = (GGMLMatrix(rt, blocks).matmul(x).double() - x.double() @ reference_weight.T).abs()
    assert bool((error <= _bound(reference_weight, x.double())).all())


@pytest.mark.parametrize("ggml_type", [GGML.Q4_0, GGML.Q4_K], ids=lambda t: t.name)
def test_repacked_and_plain_layouts_agree(rt, ggml_type):
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) * 0.05
    blocks = quantize(rt, weight, ggml_type)
    assert rt.buffer_type_for(int(ggml_type), 256) == rt.repack_buffer_type  # the fast kernel is used
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(4))
    repacked = GGMLMatrix(rt, blocks).matmul(x)
    plain = GGMLMatrix(rt, blocks, repack=False).matmul(x)
    torch.testing.assert_close(repacked, plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("ggml_type", GGUF_TYPES, ids=lambda t: t.name)
def test_slices_are_exact(rt, ggml_type):
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(5))
    blocks = quantize(rt, weight, ggml_type)
    full = blocks.dequantize()
    assert torch.equal(blocks.row_slice(8, 40).dequantize(), full[8:40])
    assert torch.equal(blocks.col_slice(256, 512).dequantize(), full[:, 256:512])
    with pytest.raises(ValueError, match="multiples"):
        blocks.col_slice(0, 100)
    halves = BlockMatrix.cat_rows([blocks.row_slice(0, 32), blocks.row_slice(32, 64)])
    assert torch.equal(halves.data, blocks.data)


def test_bad_shape_is_refused_before_ggml(rt):
    m = GGMLMatrix(rt, quantize(rt, torch.randn(32, 64), GGML.Q8_0))
    with pytest.raises(AssertionError):
        m.matmul(torch.randn(2, 32))  # ggml would abort the process through GGML_ASSERT


def test_q4_1_held_as_q4_0_plus_remainder_is_exactly_its_weights(rt):
    """ggml has repacked (fast) kernels for Q4_0 and none for Q4_1: a Q4_1 matrix is held as the
    Q4_0 blocks of the same scales and nibbles plus a per-block remainder 8d + m. Those weights are
    bitwise the Q4_1 ones (gguf's dequantization of both), and the form takes the 20 bytes a block
    Q4_1 takes: the remainder in float16, whose values it holds exactly."""
    from meshllm.engine.ggml_weights import remainder_by_block, split_q4_1

    blocks = quantize(rt, torch.randn(64, 512, generator=torch.Generator().manual_seed(6)) * 0.05, GGML.Q4_1)
    q4_0, remainder = split_q4_1(blocks)
    # group-major: group of 8 rows, block, row in the group (what the few-row op streams)
    assert q4_0.ggml_type == GGML.Q4_0 and remainder.shape == (64 // 8, 512 // 32, 8)
    by_block = remainder_by_block(remainder)
    assert by_block[3, 19] == remainder[19 // 8, 3, 19 % 8]
    held = q4_0.dequantize() + by_block.t().repeat_interleave(32, dim=1)
    assert torch.equal(held, blocks.dequantize())
    matrix = GGMLMatrix(rt, blocks)
    assert matrix.ggml_type == GGML.Q4_1 and matrix.remainder is not None  # this CPU repacks Q4_0
    assert matrix.remainder.dtype == torch.float16 and matrix.num_bytes == blocks.num_bytes
    # the plain layout (embedding lookups) keeps Q4_1 as stored
    assert GGMLMatrix(rt, blocks, repack=False).remainder is None


def test_a_q4_1_remainder_that_is_not_all_float16s_stays_float32_and_exact(rt):
    """8d + m can need more than float16's 11 significant bits (d = 1, m = 2^-10: 8 + 2^-10): then
    the matrix's remainder stays float32 (22 bytes a block), and the weights are still exactly its
    Q4_1 ones."""
    from meshllm.engine.ggml_weights import BlockMatrix, remainder_by_block, split_q4_1

    blocks = quantize(rt, torch.randn(16, 64, generator=torch.Generator().manual_seed(7)) * 0.05, GGML.Q4_1)
    data = blocks.data.clone().reshape(16, 2, 20)
    data[5, 1, 0:2] = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)  # d
    data[5, 1, 2:4] = torch.tensor([2.0 ** -10], dtype=torch.float16).view(torch.uint8)  # m
    odd = BlockMatrix(data.reshape(16, 40), GGML.Q4_1, 64)
    q4_0, remainder = split_q4_1(odd)
    assert remainder.dtype == torch.float32 and remainder_by_block(remainder)[1, 5] == 8 + 2.0 ** -10
    held = q4_0.dequantize() + remainder_by_block(remainder).t().repeat_interleave(32, dim=1)
    assert torch.equal(held, odd.dequantize())
    assert GGMLMatrix(rt, odd).num_bytes == odd.num_bytes * 22 // 20


def test_ggml_log_lines_go_to_python_logging_not_stderr(rt, caplog, capfd):
    """ggml's default logger writes every level to stderr: one "repack tensor" line per repacked
    matrix, hundreds a model, in every node's output. meshllm routes them to the "ggml" logger."""
    if rt.repack_buffer_type is None or not rt.repacks(GGML.Q4_0, 64):
        pytest.skip("this CPU has no repacked Q4_0 kernels, so ggml logs nothing at upload")
    capfd.readouterr()
    with caplog.at_level("DEBUG", logger="ggml"):
        GGMLMatrix(rt, quantize(rt, torch.randn(64, 256), GGML.Q4_0))
    assert any("repack" in r.getMessage() and r.levelname == "DEBUG" for r in caplog.records if r.name == "ggml")
    assert "repack" not in capfd.readouterr().err


@pytest.mark.parametrize("ggml_type", [GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1], ids=lambda t: t.name)
def test_without_ggml_the_plain_types_quantize_to_ggmls_bytes(rt, ggml_type):
    # A GPU host without a ggml build quantizes (--quantize, test files) by the gguf package's port.
    g = torch.Generator().manual_seed(int(ggml_type))
    weight = torch.randn(48, 256, generator=g) * 0.05
    weight[3] = 0.0  # an all-zero block: a zero scale, no division by it
    ours = quantize(None, weight, ggml_type)
    assert torch.equal(ours.data, quantize(rt, weight, ggml_type).data)
    assert ours.rows == 48 and ours.cols == 256
