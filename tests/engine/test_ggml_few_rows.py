"""meshllm's bf16 few-row kernel as a ggml custom op (engine/kernels/gemv.c), inside stage graphs.

Against fp32 products of the same bf16 values (x rounded to bf16, as ggml rounds it for a bf16
weight), and the property the stage relies on: a row's result does not depend on how many rows
share the product, so a k+1-row verify pass scores exactly what k+1 one-row steps score.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from meshllm.engine import ggml_stage
from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_weights import GraphScope
from meshllm.engine.kernels.gemv import ggml_few_rows_op
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource


@pytest.fixture(scope="module")
def rt():
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if ggml_few_rows_op() is None:
        pytest.skip("the bf16 kernel was not built with ggml's header, or this CPU lacks AVX-512 BF16")
    return rt


def _product(rt, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x [n, K] fp32 . weight [N, K] bf16 ^T through the op in a one-node ggml graph."""
    g = rt.lib
    y = torch.empty(x.shape[0], weight.shape[0])
    with GraphScope(rt) as s:
        wt, xt = s.wrap(weight), s.wrap(x)
        args = (ctypes.POINTER(type(wt.contents)) * 2)(wt, xt)
        yt = g.ggml_custom_4d(s.ctx, 0, weight.shape[0], x.shape[0], 1, 1, args, 2,
                              g.ggml_custom_op_t(ggml_few_rows_op()), -1, None)
        s.point(yt, y)
        s.compute(yt)
    return y


# K not a multiple of 64 or 32 runs the masked tail; N of 1 and odd N split unevenly over threads.
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (7, 45), (130, 96), (33, 577), (960, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])  # 2 and 4 run special first passes
def test_op_matches_fp32_products_of_the_bf16_values(rt, out_features, in_features, rows):
    g = torch.Generator().manual_seed(out_features * 1000 + rows)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=g)
    expected = x.to(torch.bfloat16).float() @ weight.float().T
    torch.testing.assert_close(_product(rt, weight, x), expected, rtol=1e-5, atol=1e-4)


def test_each_row_is_independent_of_the_rows_beside_it(rt):
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(300, 1536, generator=g).to(torch.bfloat16)
    x = torch.randn(16, 1536, generator=g)
    alone = torch.cat([_product(rt, weight, x[i:i + 1].clone()) for i in range(16)])
    for n in (2, 3, 4, 5, 8, 9, 16):
        assert torch.equal(_product(rt, weight, x[:n].clone()), alone[:n]), n


@pytest.fixture(scope="module")
def bf16_decoder(rt, aidreams_path):
    files = open_model(aidreams_path)
    decoder = load_stage_decoder(files.source, files.config, dtype=torch.bfloat16)
    assert isinstance(decoder.fast_path, ggml_stage.GGMLStage)
    return decoder


def verify_pass_and_steps(d, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of `block_rows` rows of one sequence scored in one step (a speculative verify pass,
    then rolled back) and of the same positions one step each, after an 11-token prompt."""
    vocab = d.config.vocab_size
    prompt = torch.randint(3, vocab, (11,), generator=torch.Generator().manual_seed(2))
    block = torch.randint(3, vocab, (block_rows,), generator=torch.Generator().manual_seed(3))
    kv = SequenceKV(d.kv_layout(), 8)
    d(prompt, torch.arange(11), [SeqSlice(kv, 0, 11)], torch.tensor([10]))
    verify = d(block, torch.arange(11, 11 + block_rows), [SeqSlice(kv, 0, block_rows)], torch.arange(block_rows))
    kv.truncate(11)
    steps = torch.cat([d(block[i:i + 1], torch.tensor([11 + i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
                       for i in range(block_rows)])
    return verify, steps


def test_a_verify_pass_scores_what_one_row_steps_score(bf16_decoder):
    verify, steps = verify_pass_and_steps(bf16_decoder, 5)
    assert torch.equal(verify, steps)


def test_a_batch_of_decodes_scores_what_each_alone_scores(bf16_decoder):
    d = bf16_decoder
    vocab = d.config.vocab_size
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in (3, 9, 6)]
    kvs = [SequenceKV(d.kv_layout(), 8) for _ in prompts]
    for kv, p in zip(kvs, prompts):
        d(p, torch.arange(len(p)), [SeqSlice(kv, 0, len(p))], torch.tensor([len(p) - 1]))
    nxt = torch.randint(3, vocab, (3,), generator=g)
    lengths = [kv.length for kv in kvs]
    batched = d(nxt, torch.tensor(lengths), [SeqSlice(kv, i, 1) for i, kv in enumerate(kvs)], torch.arange(3))
    for kv, n in zip(kvs, lengths):
        kv.truncate(n)
    alone = torch.cat([d(nxt[i:i + 1], torch.tensor([lengths[i]]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
                       for i, kv in enumerate(kvs)])
    assert torch.equal(batched, alone)


def _verify_passes(d, prompt: torch.Tensor, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Verify passes one after another, each keeping 2 of its rows (rollback of the rest)."""
    kv = SequenceKV(d.kv_layout(), 64)
    d(prompt, torch.arange(len(prompt)), [SeqSlice(kv, 0, len(prompt))], torch.tensor([len(prompt) - 1]))
    out = []
    for block in blocks:
        start = kv.length
        out.append(d(block, torch.arange(start, start + len(block)), [SeqSlice(kv, 0, len(block))],
                     torch.arange(len(block))))
        kv.truncate(start + 2)
    return out


def test_a_reused_verify_graph_equals_a_fresh_one(bf16_decoder, monkeypatch):
    """Few-row graphs are kept and patched (KV offsets, lengths, causal masks) step to step."""
    d = bf16_decoder
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, d.config.vocab_size, (7,), generator=g)
    blocks = [torch.randint(3, d.config.vocab_size, (n,), generator=g) for n in (4, 4, 3, 4, 3, 4, 4)]
    reused = _verify_passes(d, prompt, blocks)
    assert d.fast_path._cached, "few-row graphs were not kept"
    monkeypatch.setattr(ggml_stage.GGMLStage, "_reuse_key", staticmethod(lambda *a: None))
    fresh = _verify_passes(d, prompt, blocks)
    for a, b in zip(reused, fresh):
        assert torch.equal(a, b)


def test_kept_graphs_of_finished_sequences_are_dropped(bf16_decoder):
    """A kept graph holds its sequences' KV tensors: once a sequence is gone (or its KV grew into
    new tensors) the graph can never match again and must not keep that memory alive."""
    d = bf16_decoder
    g = torch.Generator().manual_seed(6)
    vocab = d.config.vocab_size
    prompt = torch.randint(3, vocab, (7,), generator=g)
    _verify_passes(d, prompt, [torch.randint(3, vocab, (3,), generator=g)] * 2)  # its KV dies on return
    other = SequenceKV(d.kv_layout(), 64)
    d(prompt, torch.arange(7), [SeqSlice(other, 0, 7)], torch.tensor([6]))
    d(prompt[:1], torch.tensor([7]), [SeqSlice(other, 0, 1)], torch.tensor([0]))
    assert d.fast_path._cached and all(step.current() for step in d.fast_path._cached.values())
    assert all(ref() is other for step in d.fast_path._cached.values() for ref in step.kvs)


@pytest.mark.parametrize("variant", ["gemma2", "gpt-oss", "llama"])
def test_a_verify_pass_over_a_long_cache_scores_what_one_row_steps_score(rt, tiny_model_dir, variant):
    """Soft-capped scores (Gemma 2) and sinks (GPT-OSS) take ggml's flash attention for every
    step, where other models' few-row steps take meshllm's op: over bf16 KV (what these models
    run in) it scores each row alone, past 512 keys too (its one-row kernel splits longer f32/f16
    caches across threads, its multi-row ones do not; in float32 the products' kernels differ by
    row count anyway), so a verify pass still scores what its one-row steps score."""
    source = SafetensorsSource(tiny_model_dir(variant, max_position_embeddings=1024) if variant != "gpt-oss"
                               else tiny_model_dir(variant))
    d = load_stage_decoder(source, source.config(), dtype=torch.bfloat16)
    assert isinstance(d.fast_path, ggml_stage.GGMLStage)
    assert (d.fast_path._attention_op is None) == (variant != "llama")
    g = torch.Generator().manual_seed(5)
    prompt, block = torch.randint(3, 90, (600,), generator=g), torch.randint(3, 90, (5,), generator=g)
    kv = SequenceKV(d.kv_layout(), 8)
    d(prompt, torch.arange(600), [SeqSlice(kv, 0, 600)], torch.tensor([599]))
    verify = d(block, torch.arange(600, 605), [SeqSlice(kv, 0, 5)], torch.arange(5))
    kv.truncate(600)
    steps = torch.cat([d(block[i:i + 1], torch.tensor([600 + i]), [SeqSlice(kv, 0, 1)], torch.tensor([0]))
                       for i in range(5)])
    assert torch.equal(verify, steps)
