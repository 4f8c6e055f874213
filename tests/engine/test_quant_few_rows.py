"""meshllm's few-row products of quantized matrices as ggml custom ops (engine/kernels/quant_few_rows.c).

Repacked Q4_0 (and a Q4_1 matrix held as Q4_0 plus its remainder) and plain Q8_0, times 1..16
activation rows. What the stage relies on:
  - one row is bitwise ggml's own one-row product (the same 8-bit activation blocks, the same
    integer dots, scaled and summed in ggml's order), so turning the op on changes no output;
  - a row's result does not depend on the rows beside it, so a speculative verify pass of k+1 rows
    scores bitwise what k+1 one-row steps score (with ggml's own products on AMD Zen 4 an extra
    row cost nearly a whole step, the reason for the op);
  - against float products of the reference dequantization, no worse than ggml's own error (the
    8-bit activation blocks' rounding: ~0.5% of the largest output).
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine import ggml_stage
from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_weights import GGMLMatrix, GraphScope, block_sums, quantize, remainder_by_block, split_q4_1
from meshllm.engine.kernels.custom_ops import q4_few_rows_op, q4_remainder_op, q8_few_rows_op
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from tests.engine.test_ggml_few_rows import verify_pass_and_steps


@pytest.fixture(scope="module")
def rt():
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if q4_few_rows_op() is None or q8_few_rows_op() is None:
        pytest.skip("the quantized few-row ops were not built, or this CPU lacks AVX-512 VNNI")
    return rt


def _matrix(rt, ggml_type: GGML, rows: int, cols: int, seed: int) -> tuple[GGMLMatrix, torch.Tensor]:
    """A random matrix in ggml's blocks (Q4 repacked, Q8_0 plain), and its reference dequantization."""
    g = torch.Generator().manual_seed(seed)
    blocks = quantize(rt, torch.randn(rows, cols, generator=g) * 0.05, ggml_type)
    matrix = GGMLMatrix(rt, blocks, repack=ggml_type != GGML.Q8_0)
    if ggml_type != GGML.Q8_0:
        assert rt.repacks(GGML.Q4_0, rows), "the op reads the repacked layout: rows must be a multiple of 8"
    return matrix, blocks.dequantize().double()


def _op(rt, matrix: GGMLMatrix, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] through the op in a one-node ggml graph."""
    g = rt.lib
    op = q8_few_rows_op() if matrix.ggml_type == GGML.Q8_0 else q4_few_rows_op()
    y = torch.empty(x.shape[0], matrix.rows)
    with GraphScope(rt) as s:
        xt = s.wrap(x.contiguous())
        remainder = None if matrix.remainder is None else s.wrap(matrix.remainder)
        args = (ctypes.POINTER(type(xt.contents)) * 3)(matrix.tensor, xt, remainder)
        yt = g.ggml_custom_4d(s.ctx, 0, matrix.rows, x.shape[0], 1, 1, args, 2 if remainder is None else 3,
                              g.ggml_custom_op_t(op), -1, None)
        s.point(yt, y)
        s.compute(yt)
    return y


def _ggml_one_row(rt, matrix: GGMLMatrix, row: torch.Tensor) -> torch.Tensor:
    """ggml's own product of one row (its gemv), plus q4_remainder.c's term for a split Q4_1."""
    g = rt.lib
    y = torch.empty(1, matrix.rows)
    with GraphScope(rt) as s:
        xt = s.wrap(row.contiguous())
        out = g.ggml_mul_mat(s.ctx, matrix.tensor, xt)
        if matrix.remainder is not None:
            s.point(out, s.keep(torch.empty(1, matrix.rows)))  # no allocator here: every tensor needs memory
            args = (ctypes.POINTER(type(out.contents)) * 3)(out, xt, s.wrap(matrix.remainder))
            out = g.ggml_custom_4d(s.ctx, 0, matrix.rows, 1, 1, 1, args, 3, g.ggml_custom_op_t(q4_remainder_op()),
                                   -1, None)
        s.point(out, y)
        s.compute(out)
    return y


# Q8_0 with 17 blocks a row (544 wide) and 9 rows: an odd block count and rows that do not split
# evenly over the threads; Q4 rows come in the repacked groups of 8.
SHAPES = [(GGML.Q4_0, 64, 576), (GGML.Q4_0, 1536, 576), (GGML.Q4_0, 576, 1536), (GGML.Q4_1, 1536, 576),
          (GGML.Q4_1, 104, 2048), (GGML.Q8_0, 9, 544), (GGML.Q8_0, 1000, 576)]


@pytest.mark.parametrize("ggml_type,rows,cols", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_one_row_is_bitwise_ggmls_product(rt, ggml_type, rows, cols):
    matrix, _ = _matrix(rt, ggml_type, rows, cols, seed=rows + cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(7)) * 3
    for i in range(3):
        assert torch.equal(_op(rt, matrix, x[i:i + 1]), _ggml_one_row(rt, matrix, x[i:i + 1])), i


@pytest.mark.parametrize("ggml_type,rows,cols", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_each_row_is_independent_of_the_rows_beside_it(rt, ggml_type, rows, cols):
    matrix, _ = _matrix(rt, ggml_type, rows, cols, seed=rows * cols)
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([_op(rt, matrix, x[i:i + 1]) for i in range(16)])
    for n in (2, 3, 5, 8, 9, 12, 13, 16):  # 12 | 13: one pass | two (rows_per_pass)
        assert torch.equal(_op(rt, matrix, x[:n]), alone[:n]), n


@pytest.mark.parametrize("ggml_type,rows,cols", [s for s in SHAPES if s[0] != GGML.Q8_0],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_q4_prefill_chunks_are_their_rows_one_by_one(rt, ggml_type, rows, cols):
    """The Q4_0 op takes prefill chunks too (ggml_stage.ALL_ROWS_OPS): each row of a chunk of any
    size is its one-row product, bit for bit, past the 16 rows of a verify pass and its passes of
    12 (a Q4_1 remainder added in each pass, as in a one-row product)."""
    matrix, _ = _matrix(rt, ggml_type, rows, cols, seed=rows + 3 * cols)
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(10))
    alone = torch.cat([_op(rt, matrix, x[i:i + 1]) for i in range(70)])
    for n in (17, 23, 70):  # two passes of 9 / 8, two of 12 / 11, five of 12 and 10 (rows_per_pass)
        assert torch.equal(_op(rt, matrix, x[:n]), alone[:n]), n


@pytest.mark.parametrize("ggml_type,rows,cols", SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_products_are_as_close_to_the_reference_as_ggmls(rt, ggml_type, rows, cols):
    matrix, weight = _matrix(rt, ggml_type, rows, cols, seed=rows + 2 * cols)
    g = torch.Generator().manual_seed(9)
    for n in (1, 4, 11):
        x = torch.randn(n, cols, generator=g)
        reference = x.double() @ weight.T
        scale = reference.abs().max().item()
        ours = (_op(rt, matrix, x).double() - reference).abs().max().item() / scale
        ggml = (matrix.matmul(x).double() - reference).abs().max().item() / scale
        assert ours <= 1.05 * ggml + 1e-6 and ours < 1e-2, (n, ours, ggml)


def test_the_q4_1_remainder_is_the_split_matrixs_own(rt):
    """A split Q4_1 matrix through the op is its Q4_0 part through the op plus R^T blocksums(x):
    the remainder term is plain float arithmetic on the exact block sums."""
    blocks = quantize(rt, torch.randn(256, 576, generator=torch.Generator().manual_seed(11)) * 0.05, GGML.Q4_1)
    matrix = GGMLMatrix(rt, blocks)
    assert matrix.remainder is not None, "Q4_1 is held as Q4_0 plus remainder where Q4_0 is repacked"
    q4_0, remainder = split_q4_1(blocks)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(12))
    expected = _op(rt, GGMLMatrix(rt, q4_0), x).double() + (block_sums(x) @ remainder_by_block(remainder)).double()
    torch.testing.assert_close(_op(rt, matrix, x).double(), expected, rtol=1e-5, atol=1e-5)


def test_a_q4_1_remainder_held_in_float16_gives_the_products_of_its_float32_values(rt):
    """split_q4_1 holds a remainder in float16 where all its values are float16s: both ops read the
    same float32 values from either form, so every product is bitwise the float32 form's. (Seed
    16: one of the random matrices whose remainder is all float16s; on Gaussian weights about one
    value in 3,000 is not, so most such matrices of this size keep float32.)"""
    blocks = quantize(rt, torch.randn(256, 576, generator=torch.Generator().manual_seed(16)) * 0.05, GGML.Q4_1)
    half = GGMLMatrix(rt, blocks)
    assert half.remainder is not None and half.remainder.dtype == torch.float16
    single = GGMLMatrix(rt, blocks)
    single.remainder = single.remainder.float()
    x = torch.randn(13, 576, generator=torch.Generator().manual_seed(14))
    for n in (1, 4, 13):
        assert torch.equal(_op(rt, half, x[:n]), _op(rt, single, x[:n])), n
    remainder_op = q4_remainder_op()
    if remainder_op is None:
        pytest.skip("the remainder op (q4_remainder.c) is not built here")

    def plus_remainder(matrix: GGMLMatrix) -> torch.Tensor:
        main = torch.randn(13, 256, generator=torch.Generator().manual_seed(15))  # stands in for a Q4_0 product
        y = torch.empty(13, 256)
        with GraphScope(rt) as s:
            args = (ctypes.POINTER(type(matrix.tensor.contents)) * 3)(s.wrap(main), s.wrap(x), s.wrap(matrix.remainder))
            yt = rt.lib.ggml_custom_4d(s.ctx, 0, 256, 13, 1, 1, args, 3, rt.lib.ggml_custom_op_t(remainder_op), -1, None)
            s.point(yt, y)
            s.compute(yt)
        return y

    assert torch.equal(plus_remainder(half), plus_remainder(single))


@pytest.fixture(scope="module")
def q4_1_decoder(rt, smollm2_gguf_path):
    files = open_model(smollm2_gguf_path)  # SmolLM2 as shipped: Q4_1 layers, a Q8_0 embedding and head
    decoder = load_stage_decoder(files.source, files.config)
    assert isinstance(decoder.fast_path, ggml_stage.GGMLStage)
    assert decoder.fast_path._quant_few_rows_ops, "the stage did not pick up the ops"
    return decoder


def test_a_verify_pass_scores_what_one_row_steps_score_on_q4_1(q4_1_decoder):
    verify, steps = verify_pass_and_steps(q4_1_decoder, 9)  # past one 8-row pass of the kernels
    assert torch.equal(verify, steps)


def test_the_ops_change_no_logit_of_the_shipped_model(q4_1_decoder, monkeypatch):
    """Decode steps with the few-row ops against the same steps on ggml's own products: bitwise
    equal. (The head is Q8_0 in meshllm's 8-row layout in both runs, which ggml cannot read: its
    products differ from ggml's in the last bits, test_q8_0x8_products_match_the_plain_layouts.)"""
    d = q4_1_decoder
    vocab = d.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 8)]

    def steps() -> list[torch.Tensor]:
        kvs = [SequenceKV(d.kv_layout(), 32) for _ in prompts]
        for kv, p in zip(kvs, prompts):
            d(p, torch.arange(len(p)), [SeqSlice(kv, 0, len(p))], torch.tensor([len(p) - 1]))
        out, tokens = [], torch.tensor([3, 4])
        for _ in range(4):
            logits = d(tokens, torch.tensor([kv.length for kv in kvs]),
                       [SeqSlice(kv, i, 1) for i, kv in enumerate(kvs)], torch.arange(2))
            out.append(logits)
            tokens = logits.argmax(dim=-1)
        return out

    with_ops = steps()
    monkeypatch.setattr(d.fast_path, "_quant_few_rows_ops", {})
    monkeypatch.setattr(ggml_stage.GGMLStage, "_reuse_key", staticmethod(lambda *a: None))
    for a, b in zip(with_ops, steps()):
        assert torch.equal(a, b)


# --- Q8_0 in meshllm's 8-row layout (an LM head: ggml_stage.GGMLStage re-lays it out) -------------

@pytest.fixture(scope="module")
def q8_0x8(rt):
    from meshllm.engine.kernels.custom_ops import q8_0x8_ops

    if q8_0x8_ops() is None:
        pytest.skip("the 8-row Q8_0 ops are not built here, or this CPU lacks AVX-512 VNNI")
    plain, weight = _matrix(rt, GGML.Q8_0, 72, 544, seed=11)  # 17 blocks a row, 9 groups of 8 rows
    relaid, _ = _matrix(rt, GGML.Q8_0, 72, 544, seed=11)
    relaid.repack_q8_0x8()
    return plain, relaid, weight


def test_q8_0x8_products_match_the_plain_layouts(q8_0x8):
    """The same blocks give the same products to float rounding (the plain op sums each row's 8
    partial lanes, this one each block's whole integer dot), and no further from the float64
    reference; any number of rows, past the 16 of the few-row ops."""
    plain, relaid, weight = q8_0x8
    g = torch.Generator().manual_seed(12)
    for n in (1, 4, 9, 40):
        x = torch.randn(n, 544, generator=g)
        reference = x.double() @ weight.T
        scale = reference.abs().max().item()
        ours = relaid.matmul(x).double()
        assert (ours - plain.matmul(x).double()).abs().max().item() < 1e-5 * scale, n
        assert (ours - reference).abs().max().item() < 1e-2 * scale, n


def test_q8_0x8_rows_are_independent_of_the_rows_beside_them(q8_0x8):
    _, relaid, _ = q8_0x8
    x = torch.randn(20, 544, generator=torch.Generator().manual_seed(13))
    alone = torch.cat([relaid.matmul(x[i:i + 1]) for i in range(20)])
    for n in (2, 7, 8, 9, 12, 13, 17, 20):
        assert torch.equal(relaid.matmul(x[:n]), alone[:n]), n


def test_q8_0x8_lookups_are_ggmls_get_rows(rt, q8_0x8):
    """A tied embedding reads the re-laid table: every row dequantized bitwise as ggml's get_rows."""
    from meshllm.engine.quantized import QuantizedEmbedding

    plain, relaid, _ = q8_0x8
    ids = torch.tensor([0, 7, 8, 71, 33, 33, 64])
    assert torch.equal(QuantizedEmbedding(rt, relaid, torch.float32)(ids),
                       QuantizedEmbedding(rt, plain, torch.float32)(ids))


def test_q8_0x8_is_relaid_a_few_groups_at_a_time(rt, q8_0x8, monkeypatch):
    """Re-laid in chunks of rows (so load never holds three copies of a large head): the same
    bytes as all at once, whatever the chunk."""
    from meshllm.engine import ggml_weights

    _, whole, _ = q8_0x8
    monkeypatch.setattr(ggml_weights, "_REPACK_ROWS", 16)  # 72 rows: 4 chunks of 16, then 8
    chunked, _ = _matrix(rt, GGML.Q8_0, 72, 544, seed=11)
    chunked.repack_q8_0x8()
    size = rt.lib.ggml_nbytes(whole.tensor)
    a, b = (torch.empty(size, dtype=torch.uint8) for _ in range(2))
    for m, out in ((whole, a), (chunked, b)):
        rt.lib.ggml_backend_tensor_get(m.tensor, ctypes.c_void_p(out.data_ptr()), 0, size)
    assert torch.equal(a, b)
