"""Steps of a few rows over K-quant weights (Q5_K, Q6_K, Q3_K, IQ4_XS in ggml's plain layout, Q4_K
in its repack buffer).

ggml (0.25.3) multiplies 8 activation rows and more of these types with a tiled GEMM and fewer
with one dot product per row and output, which sum alike whatever the other rows are. The
stage keeps steps of up to QUANT_FEW_ROWS_MAX rows (decode batches, speculative verify passes)
on per-row arithmetic, so a verify pass scores bitwise what its one-row steps score and a
sequence's logits do not depend on what shares its batch: Q5_K and Q6_K through meshllm's op
(kernels/k_quant_few_rows.c, test_k_quant_few_rows.py), the other types in pieces of fewer than 8
rows; prefill chunks take the GEMM. Q4_K, which ggml holds repacked and multiplies 4 rows and
more at a time with its own GEMM, takes meshllm's op for its layout (bitwise ggml's one-row gemv)
where that op runs (AVX-512 VNNI; elsewhere its verify passes are not bitwise, as Q2_K's below).

Not covered: Q2_K, which ggml holds repacked (as llama.cpp does) and multiplies 4 rows at a
time with its own GEMM; there a verify pass of 5+ rows differs from its one-row steps by ~2e-6
in the logits (measured on these random models), as before ggml 0.25.3.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine import ggml_stage
from meshllm.engine.ggml_weights import GGMLMatrix, quantize
from meshllm.engine.kernels.custom_ops import q4_kx8_few_rows_op
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.source import open_model
from tests.engine.test_ggml_few_rows import verify_pass_and_steps
from tests.quantized_gguf import write_quantized_llama


@pytest.fixture(scope="module", params=[GGML.Q6_K, GGML.Q5_K, GGML.Q4_K, GGML.Q3_K, GGML.IQ4_XS],
                ids=lambda t: t.name)
def k_quant_decoder(request, rt, smollm2_gguf_path, tmp_path_factory):
    if request.param == GGML.Q4_K and rt.repacks(GGML.Q4_K, 8) and q4_kx8_few_rows_op() is None:
        pytest.skip("repacked Q4_K keeps its rows apart only through meshllm's op (AVX-512 VNNI), not built here")
    path = write_quantized_llama(rt, smollm2_gguf_path, tmp_path_factory.mktemp("kq") / "tiny.gguf", request.param,
                                 num_layers=2, head_type=request.param)
    files = open_model(path)
    decoder = load_stage_decoder(files.source, files.config)
    assert isinstance(decoder.fast_path, ggml_stage.GGMLStage)
    return decoder


@pytest.mark.parametrize("rows", [8, 12, 16])
def test_a_verify_pass_scores_what_one_row_steps_score(k_quant_decoder, rows):
    verify, steps = verify_pass_and_steps(k_quant_decoder, rows)
    assert torch.equal(verify, steps)


@pytest.mark.parametrize("ggml_type", [GGML.Q6_K, GGML.Q5_K], ids=lambda t: t.name)
def test_ggml_alone_would_not_keep_rows_independent(rt, ggml_type):
    """Why the stage splits: ggml's own 8-row product differs from its one-row products. (If a
    later ggml makes them agree, this fails and the split can go.)"""
    g = torch.Generator().manual_seed(7)
    matrix = GGMLMatrix(rt, quantize(rt, torch.randn(512, 1024, generator=g) * 0.05, ggml_type))
    x = torch.randn(8, 1024, generator=g)
    alone = torch.cat([matrix.matmul(x[i:i + 1]) for i in range(8)])
    assert not torch.equal(matrix.matmul(x), alone)
