"""meshllm's few-row products of K-quant matrices as ggml custom ops (engine/kernels/k_quant_few_rows.c):
Q4_K, Q5_K and Q6_K in ggml's plain layout, and Q4_K in ggml's repack buffer (where it mostly lies).

What the stage relies on, as for the Q4_0 / Q8_0 ops (test_quant_few_rows.py):
  - one row is bitwise ggml's own one-row product (plain: its vec_dot; repacked Q4_K: its gemv),
    the same Q8_K activation blocks, the same integers, scaled and summed in ggml's order, so
    turning the ops on changes no output;
  - a row's result does not depend on the rows beside it, so a verify pass of k+1 rows scores
    bitwise what k+1 one-row steps score (ggml's tiled GEMM, which takes 8 rows and more of the
    plain types, does not, test_k_quant_steps.test_ggml_alone_would_not_keep_rows_independent;
    nor its 4-row GEMM of repacked Q4_K, test_ggml_alone_would_not_keep_repacked_q4_k_rows_independent);
  - against float products of the reference dequantization, exactly ggml's own error.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine import ggml_stage
from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_weights import GGMLMatrix, GraphScope, quantize
from meshllm.engine.kernels.custom_ops import k_quant_few_rows_op, q4_kx8_few_rows_op
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from tests.quantized_gguf import write_quantized_llama


@pytest.fixture(scope="module")
def rt():
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if k_quant_few_rows_op() is None or q4_kx8_few_rows_op() is None:
        pytest.skip("the K-quant few-row ops were not built, or this CPU lacks AVX-512 VNNI")
    return rt


def _matrix(rt, ggml_type: GGML, repacked: bool, rows: int, cols: int, seed: int) -> tuple[GGMLMatrix, torch.Tensor]:
    """A random matrix in ggml's blocks, plain or repacked, and its reference dequantization."""
    g = torch.Generator().manual_seed(seed)
    blocks = quantize(rt, torch.randn(rows, cols, generator=g) * 0.05, ggml_type)
    matrix = GGMLMatrix(rt, blocks, repack=repacked)
    assert not repacked or rt.repacks(ggml_type, rows), "ggml has no repacked layout for this matrix"
    return matrix, blocks.dequantize().double()


def _op(rt, matrix: GGMLMatrix, repacked: bool, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] through the op for the matrix's layout in a one-node ggml graph."""
    g = rt.lib
    op = q4_kx8_few_rows_op() if repacked else k_quant_few_rows_op()
    y = torch.empty(x.shape[0], matrix.rows)
    with GraphScope(rt) as s:
        xt = s.wrap(x.contiguous())
        args = (ctypes.POINTER(type(xt.contents)) * 2)(matrix.tensor, xt)
        yt = g.ggml_custom_4d(s.ctx, 0, matrix.rows, x.shape[0], 1, 1, args, 2, g.ggml_custom_op_t(op), -1, None)
        s.point(yt, y)
        s.compute(yt)
    return y


def _one_row_products(matrix: GGMLMatrix, x: torch.Tensor) -> torch.Tensor:
    """ggml's own product of each row alone (its vec_dot, or for repacked Q4_K its gemv)."""
    return torch.cat([matrix.matmul(x[i:i + 1]) for i in range(x.shape[0])])


# Plain: 9 rows (not a multiple of 8, uneven over the threads); repacked rows come in groups of 8.
# 1024 and 2048 columns: 4 and 8 blocks of 256; 5632 the 1.1B shape's down projection (22 blocks).
SHAPES = [(t, False, rows, cols) for t in (GGML.Q6_K, GGML.Q5_K, GGML.Q4_K)
          for rows, cols in ((9, 1024), (520, 2048), (64, 5632))]
SHAPES += [(GGML.Q4_K, True, rows, cols) for rows, cols in ((16, 1024), (520, 2048), (64, 5632))]


def _id(v) -> str:
    return {True: "repacked", False: "plain"}.get(v) if isinstance(v, bool) else getattr(v, "name", str(v))


@pytest.mark.parametrize("ggml_type,repacked,rows,cols", SHAPES, ids=_id)
def test_one_row_is_bitwise_ggmls_product(rt, ggml_type, repacked, rows, cols):
    matrix, _ = _matrix(rt, ggml_type, repacked, rows, cols, seed=rows + cols)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(7)) * 3
    for i in range(3):
        assert torch.equal(_op(rt, matrix, repacked, x[i:i + 1]), matrix.matmul(x[i:i + 1])), i


@pytest.mark.parametrize("ggml_type,repacked,rows,cols", SHAPES, ids=_id)
def test_each_row_is_independent_of_the_rows_beside_it(rt, ggml_type, repacked, rows, cols):
    matrix, _ = _matrix(rt, ggml_type, repacked, rows, cols, seed=rows * cols)
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(8))
    alone = _one_row_products(matrix, x)
    for n in (2, 3, 4, 7, 8, 9, 12, 13, 16):  # 12 | 13: one pass | two (rows_per_pass)
        assert torch.equal(_op(rt, matrix, repacked, x[:n]), alone[:n]), n


KINDS = [(GGML.Q6_K, False), (GGML.Q5_K, False), (GGML.Q4_K, False), (GGML.Q4_K, True)]


@pytest.mark.parametrize("ggml_type,repacked", KINDS, ids=_id)
def test_a_block_of_zeros_in_a_row_changes_nothing_beside_it(rt, ggml_type, repacked):
    """ggml's Q8_K quantization leaves an all-zero block's scale 0 (and its sums unwritten): the row
    still matches ggml's, and the other rows are untouched."""
    matrix, _ = _matrix(rt, ggml_type, repacked, 40, 1024, seed=3)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(4))
    x[1, 256:512] = 0
    assert torch.equal(_op(rt, matrix, repacked, x), _one_row_products(matrix, x))


@pytest.mark.parametrize("ggml_type,repacked", KINDS, ids=_id)
def test_products_are_as_close_to_the_reference_as_ggmls(rt, ggml_type, repacked):
    matrix, weight = _matrix(rt, ggml_type, repacked, 520, 2048, seed=5)
    g = torch.Generator().manual_seed(9)
    for n in (1, 4, 11):
        x = torch.randn(n, 2048, generator=g)
        reference = x.double() @ weight.T
        scale = reference.abs().max().item()
        ours = (_op(rt, matrix, repacked, x).double() - reference).abs().max().item() / scale
        ggml = (_one_row_products(matrix, x).double() - reference).abs().max().item() / scale
        assert ours == ggml and ours < 1e-2, (n, ours, ggml)


def test_ggml_alone_would_not_keep_repacked_q4_k_rows_independent(rt):
    """Why the op: ggml multiplies 4 rows and more of repacked Q4_K with its own GEMM (other
    activation blocks and sums), which differs from its one-row products. (If a later ggml makes
    them agree, this fails and the op is no longer needed for exactness.)"""
    matrix, _ = _matrix(rt, GGML.Q4_K, True, 512, 1024, seed=6)
    x = torch.randn(4, 1024, generator=torch.Generator().manual_seed(7))
    assert not torch.equal(matrix.matmul(x), _one_row_products(matrix, x))


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: f"{k[0].name}-{_id(k[1])}")
def k_quant_decoder(request, rt, smollm2_gguf_path, tmp_path_factory):
    ggml_type, repacked = request.param
    path = write_quantized_llama(rt, smollm2_gguf_path, tmp_path_factory.mktemp("kq") / "tiny.gguf", ggml_type,
                                 num_layers=2, head_type=ggml_type)
    files = open_model(path)
    with pytest.MonkeyPatch.context() as patch:
        if not repacked:  # Q4_K held plain, as where ggml has no repacked kernel for it
            patch.setattr(type(rt), "repacked_types", property(lambda r: frozenset({r.lib.GGML_TYPE_Q4_0})))
        decoder = load_stage_decoder(files.source, files.config)
    stage = decoder.fast_path
    assert isinstance(stage, ggml_stage.GGMLStage)
    parts = stage.head.parts  # an LM head of the type: its products of a few rows take the op
    assert parts and all(stage._repacked(t.contents) == repacked for t, *_ in parts)
    assert all(stage._quant_few_rows_op(t, 4) is not None for t, *_ in parts)
    return decoder


def test_the_op_changes_no_logit(k_quant_decoder, monkeypatch):
    """Prompts of 3-8 rows, batches of 3 decode steps and a 12-row verify pass with the ops, against
    the same tokens one row at a time without them (ggml's one-row kernels): bitwise equal."""
    d = k_quant_decoder
    vocab = d.config.vocab_size
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (5, 8, 3)]
    block = torch.randint(3, vocab, (12,), generator=g)

    def steps(one_row_steps: bool) -> list[torch.Tensor]:
        kvs = [SequenceKV(d.kv_layout(), 32) for _ in prompts]
        for kv, p in zip(kvs, prompts):
            if one_row_steps:  # the prompts too: 4+ rows of repacked Q4_K take ggml's GEMM
                for i in range(len(p)):
                    d(p[i:i + 1], torch.tensor([i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
            else:
                d(p, torch.arange(len(p)), [SeqSlice(kv, 0, len(p))], torch.tensor([len(p) - 1]))
        out, tokens = [], torch.tensor([3, 4, 5])
        for _ in range(3):
            lengths = [kv.length for kv in kvs]
            if one_row_steps:
                logits = torch.cat([d(tokens[i:i + 1], torch.tensor([lengths[i]]), [SeqSlice(kv, 0, 1)],
                                      torch.tensor([0])) for i, kv in enumerate(kvs)])
            else:
                logits = d(tokens, torch.tensor(lengths), [SeqSlice(kv, i, 1) for i, kv in enumerate(kvs)],
                           torch.arange(3))
            out.append(logits)
            tokens = logits.argmax(dim=-1)
        kv, start = kvs[0], kvs[0].length
        if one_row_steps:
            out.append(torch.cat([d(block[i:i + 1], torch.tensor([start + i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
                                  for i in range(12)]))
        else:
            out.append(d(block, torch.arange(start, start + 12), [SeqSlice(kv, 0, 12)], torch.arange(12)))
        return out

    with_op = steps(one_row_steps=False)
    monkeypatch.setattr(d.fast_path, "_quant_few_rows_ops", {})
    monkeypatch.setattr(ggml_stage.GGMLStage, "_reuse_key", staticmethod(lambda *a: None))
    for a, b in zip(with_op, steps(one_row_steps=True)):  # without the op: every product one row
        assert torch.equal(a, b)
