"""The C bf16 matrix-vector kernel (engine/kernels/gemv.c) and the FastBF16Linear built on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshllm.engine.cpu_weights import MAX_GEMV_ROWS, FastBF16Linear, use_fast_bf16
from meshllm.pipeline.local_generate import generate_many
from meshllm.engine.kernels.build import build
from meshllm.engine.kernels.gemv import REQUIRED_CPU_FLAGS, cpu_flags, gemv_bf16, load_gemv
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.weight_forms import prepare_for_cpu
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model


def _kernel_or_skip():
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        pytest.skip(f"CPU lacks {', '.join(missing)}: the bf16 kernel cannot run here")
    if load_gemv() is None and build() is None:
        pytest.skip("the bf16 kernel could not be built (gcc missing or failing); see the build log")
    load_gemv.cache_clear()
    if load_gemv() is None:
        pytest.skip("the bf16 kernel was built but did not load; run with --log-level=DEBUG for why")


@pytest.fixture(autouse=True)
def kernel():
    _kernel_or_skip()


def _reference(weight, x, bias):
    """fp32 products of the same bf16 values: what the kernel computes before rounding to bf16."""
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()


# K not a multiple of 32 and N not a multiple of 4 exercise the masked and single-row tails.
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (3, 31), (37, 45), (16, 32), (33, 577), (130, 96)])
@pytest.mark.parametrize("rows", range(1, MAX_GEMV_ROWS + 1))
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_fp32_products_of_the_bf16_values(out_features, in_features, rows, with_bias):
    generator = torch.Generator().manual_seed(out_features * 1000 + in_features + rows)
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16() if with_bias else None
    want = _reference(weight, x, bias)
    for threads in (1, 2):
        got = gemv_bf16(weight, x, bias, threads=threads)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        scale = want.abs().max().clamp_min(1e-3)
        assert ((got.float() - want).abs().max() / scale).item() < 1e-2


def test_each_row_is_independent_of_the_others_and_of_threads():
    # Rows are dot products over the same k order whatever the batch: batching does not change bits.
    weight = torch.randn(203, 300).bfloat16()
    x = torch.randn(MAX_GEMV_ROWS, 300).bfloat16()
    batched = gemv_bf16(weight, x, threads=2)
    for m in range(MAX_GEMV_ROWS):
        assert torch.equal(gemv_bf16(weight, x[m:m + 1], threads=1)[0], batched[m])


@pytest.mark.parametrize("rows", [1, MAX_GEMV_ROWS, MAX_GEMV_ROWS + 1, 64])
def test_fast_linear_computes_what_the_bf16_linear_does(rows):
    torch.manual_seed(0)
    dense = nn.Linear(100, 45, bias=True).bfloat16().requires_grad_(False)
    fast = FastBF16Linear(dense)
    assert fast.weight is dense.weight  # shares, does not copy
    x = torch.randn(rows, 100).bfloat16()
    torch.testing.assert_close(fast(x).float(), _reference(dense.weight, x, dense.bias), atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def aidreams(aidreams_path):
    return open_model(aidreams_path)


def _decoder(files, dtype):
    return load_decoder(files.source, files.config, dtype=dtype)


def test_prepare_for_cpu_runs_bf16_on_the_kernel_with_the_same_logits(aidreams):
    ids = torch.tensor(aidreams.tokenizer.encode("Echoes of vectors unfold"))
    want = _decoder(aidreams, torch.bfloat16).forward_full(ids)
    decoder = prepare_for_cpu(_decoder(aidreams, torch.bfloat16), quantization=None, batch_invariant=False)
    linears = [m for m in decoder.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is FastBF16Linear for m in linears)
    torch.testing.assert_close(decoder.forward_full(ids), want, atol=0.1, rtol=0.05)


def test_kernel_decoder_generates_batched_equal_to_solo(aidreams):
    decoder = use_fast_bf16(_decoder(aidreams, torch.bfloat16))
    prompts = [aidreams.tokenizer.encode(t) for t in ("I dream", "Echoes of vectors unfold")]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    batched = generate_many(decoder, aidreams.tokenizer, prompts, params)
    solo = [generate_many(decoder, aidreams.tokenizer, [p], params)[0] for p in prompts]
    assert [c.token_ids for c in batched] == [c.token_ids for c in solo]


def test_single_rows_match_f_linear_on_a_smollm2_sized_matrix():
    weight = torch.randn(1536, 576).bfloat16()
    x = torch.randn(1, 576).bfloat16()
    want = F.linear(x.float(), weight.float())
    assert ((gemv_bf16(weight, x).float() - want).abs().max() / want.abs().max()).item() < 1e-2
