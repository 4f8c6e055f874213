"""Batch invariance: a sequence's logits must not depend on what shares its batch.

Plain CPU matmuls are not batch-invariant (different BLAS kernels per row count); the
test reports how far apart they land, and checks that batch-invariant mode is exact.
"""

from __future__ import annotations

import pytest
import torch

from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.engine.kv_cache import SequenceKV
from meshllm.model.decoder import SeqSlice
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource


def logits_solo_and_batched(decoder, prompts: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Last-position logits of a prefill + 3 decode steps, each sequence alone and all 16 together."""

    def run(group: list[list[int]]) -> list[list[torch.Tensor]]:
        kvs = [SequenceKV(decoder.kv_layout()) for _ in group]
        tokens = [list(p) for p in group]
        outputs: list[list[torch.Tensor]] = [[] for _ in group]
        for step in range(4):
            slices, ids, positions, row = [], [], [], 0
            for kv, seq in zip(kvs, tokens):
                new = seq[kv.length:] if step == 0 else seq[-1:]
                slices.append(SeqSlice(kv, row, len(new)))
                positions += range(kv.length, kv.length + len(new))
                ids += new
                row += len(new)
            rows = torch.tensor([s.row + s.num_tokens - 1 for s in slices])
            logits = decoder(torch.tensor(ids), torch.tensor(positions), slices, rows)
            for i, seq in enumerate(tokens):
                outputs[i].append(logits[i])
                seq.append(int(logits[i].argmax()))
        return [torch.stack(o) for o in outputs]

    solo = [run([p])[0] for p in prompts]
    return solo, run(prompts)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 90, (3 + 2 * i,), generator=g).tolist() for i in range(16)]


def test_batched_vs_solo_logits_close_by_default_and_equal_when_batch_invariant(tiny_model_dir, prompts, capsys):
    folder = tiny_model_dir("qwen2", seed=5)
    source = SafetensorsSource(folder)
    decoder = load_decoder(source, source.config())
    solo, batched = logits_solo_and_batched(decoder, prompts)
    plain_diff = max(float((a - b).abs().max()) for a, b in zip(solo, batched))
    with capsys.disabled():
        print(f"\nlargest logit difference, 16 sequences batched vs solo, default kernels: {plain_diff:.3g}")
    assert plain_diff < 1e-3  # the same math, summed in another order

    make_batch_invariant(decoder)
    solo, batched = logits_solo_and_batched(decoder, prompts)
    for a, b in zip(solo, batched):
        assert torch.equal(a, b)


def test_batch_invariant_mode_matches_default_within_rounding(tiny_model_dir, prompts):
    folder = tiny_model_dir("llama", seed=6)
    source = SafetensorsSource(folder)
    plain = load_decoder(source, source.config())
    tiled = make_batch_invariant(load_decoder(source, source.config()))
    ids = torch.tensor(prompts[5])
    assert torch.allclose(plain.forward_full(ids), tiled.forward_full(ids), atol=1e-4)
