"""Decode steps as CUDA graphs (engine/cuda_graphs.py).

A recorded step runs in its static form (model/decoder.py StaticSlice): keys and values written
at a device index, attention over the cache's whole capacity through a mask. That form is plain
torch, so here it runs on the CPU against the ordinary step, sliding window and qk-norm included.
Recording and replaying need CUDA: those tests skip without a GPU, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from meshllm.engine import cuda_graphs, kv_cache
from meshllm.engine.kv_cache import SequenceKV
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import SeqSlice
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource
from meshllm.pipeline.local_generate import generate_many

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"no CUDA device on this machine (torch {torch.__version__}); "
                                                 "run on a GPU host")


def _prefilled(decoder, prompts: list[list[int]]) -> list[SequenceKV]:
    caches = []
    for ids in prompts:
        kv = SequenceKV(decoder.kv_layout())
        decoder(torch.tensor(ids), torch.arange(len(ids)), [SeqSlice(kv, 0, len(ids))])
        caches.append(kv)
    return caches


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen3"])
def test_the_static_step_gives_the_ordinary_steps_logits(tiny_model_dir, variant, monkeypatch):
    # Caches zeroed as on a GPU: the static step reads (masked) past the length, where a CPU
    # cache holds whatever memory held, a NaN included.
    monkeypatch.setattr(kv_cache, "ZERO_FILL_ON_CPU", True)
    source = SafetensorsSource(tiny_model_dir(variant))
    decoder = load_decoder(source, source.config())
    # three sequences of different lengths; the mistral window (5) is shorter than all of them
    prompts = [[5, 9, 2, 7, 11, 3, 8], [4, 4, 6, 1, 9, 20, 30, 31, 2, 12, 13], [7, 3, 9, 10, 11, 12]]
    ordinary, static = _prefilled(decoder, prompts), _prefilled(decoder, prompts)
    tokens = torch.tensor([17, 23, 5])
    for _ in range(70):  # past the caches' first capacity (64): they grow on the way
        positions = torch.tensor([kv.length for kv in ordinary])
        want = decoder(tokens, positions, [SeqSlice(kv, i, 1) for i, kv in enumerate(ordinary)])
        for kv in static:
            kv.reserve(kv.length + 1)
        step = cuda_graphs.StaticStep.build(decoder, tokens, positions, [SeqSlice(kv, i, 1) for i, kv in enumerate(static)])
        with torch.inference_mode():
            got = step.run(decoder, decoder.config.sliding_window)
        for kv in static:
            kv.length += 1
        # the same products; attention's sums run over the masked capacity, in another order
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        tokens = want.argmax(dim=-1)
    assert all(kv.capacity > 64 for kv in static)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_graphed_decode_replays_and_gives_the_ungraphed_tokens(tiny_model_dir, dtype, monkeypatch):
    source = SafetensorsSource(tiny_model_dir("llama", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=64))
    graphed = load_stage_decoder(source, source.config(), dtype=dtype, device="cuda")
    assert isinstance(graphed.fast_path, cuda_graphs.GraphedDecode)
    monkeypatch.setattr(cuda_graphs, "ENABLED", False)
    plain = load_stage_decoder(source, source.config(), dtype=dtype, device="cuda")
    assert plain.fast_path is None
    prompts = [list(range(3, 40)), list(range(50, 60)), [7, 8, 9]]
    for run in (prompts[:1], prompts):  # one sequence, then a batch of three
        kv_graphed, kv_plain = _prefilled(graphed, run), _prefilled(plain, run)
        tokens = torch.tensor([11] * len(run))
        for _ in range(80):  # the caches grow past 64 tokens: a new batch identity, recorded again
            slices = [SeqSlice(kv, i, 1) for i, kv in enumerate(kv_graphed)]
            got = graphed(tokens, torch.tensor([kv.length for kv in kv_graphed]), slices,
                          torch.arange(len(run)))
            want = plain(tokens, torch.tensor([kv.length for kv in kv_plain]),
                         [SeqSlice(kv, i, 1) for i, kv in enumerate(kv_plain)], torch.arange(len(run)))
            spread = (want.max() - want.min()).item()
            # fp32: the kernels' rounding alone; bf16: 8-bit mantissas through 4 layers
            tolerance = 1e-4 if dtype == torch.float32 else 0.05
            assert (got - want).abs().max().item() < tolerance * spread
            tokens = want.argmax(dim=-1).cpu()
    assert graphed.fast_path.recorded >= 4 and graphed.fast_path.replays >= 120
    assert graphed.fast_path.enabled


@needs_cuda
def test_greedy_generation_with_graphs_matches_without(aidreams_path, monkeypatch):
    files = open_model(aidreams_path)
    graphed = load_stage_decoder(files.source, files.config, dtype=torch.float32, device="cuda")
    monkeypatch.setattr(cuda_graphs, "ENABLED", False)
    plain = load_stage_decoder(files.source, files.config, dtype=torch.float32, device="cuda")
    prompts = [files.tokenizer.encode(p) for p in ("Once upon a time", "The robot dreamed of", "A")]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    got = generate_many(graphed, files.tokenizer, prompts, params)
    want = generate_many(plain, files.tokenizer, prompts, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphed.fast_path.replays > 0 and graphed.fast_path.enabled
