"""Tensor parallelism over 2 real processes (gloo on loopback) against one process.

Both ranks are spawned once for the module and run every case in its own freshly formed
group; rank 0 drives a Leader (continuous batching, chunked prefill, prefix cache) over
the group while rank 1 mirrors its commands. fp32 logits must agree within 1e-4 and
greedy tokens exactly, for the real model and random models whose head counts divide
and whose KV heads must be replicated.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from meshllm.model.config import ModelConfig
from meshllm.model.source import open_model
from tests.tp.ranks import equality_rank, reference_run, spawn_group

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
MAX_TOKENS = 12
# name -> (tiny variant or None for the real model, layers of the ordinary stage in front of the group)
CASES = {
    "aidreams": (None, None),  # real weights: 4 heads, 4 KV heads, tied embeddings
    "llama-gqa": ("llama", None),  # 4 heads, 2 KV heads: both split
    "qwen3-kv1": ("qwen3", None),  # 1 KV head: replicated on both ranks; q/k norms
    "qwen2-bias": ("qwen2", None),  # q/k/v biases sliced with their rows; tied embeddings
    # The group as the second stage: hidden states cross the command channel in frames of 64
    # words, so every prefill chunk's command spans several frames.
    "aidreams-second-stage": (None, 2),
}


@pytest.fixture(scope="module")
def results(aidreams_path, tiny_model_dir):
    cases, folders = [], {}
    for name, (variant, split_at) in CASES.items():
        if variant is None:
            folder = aidreams_path
        else:  # random weights, with aidreams' 512-token tokenizer so prompts are real text
            folder = tiny_model_dir(variant, seed=11, vocab_size=512)
            for f in TOKENIZER_FILES:
                shutil.copy(aidreams_path / f, folder / f)
        folders[name] = folder
        case = dict(model_dir=str(folder), prompts=_prompts(folder), max_tokens=MAX_TOKENS)
        if split_at is not None:
            case.update(split_at=split_at, frame_words=64)
        cases.append(case)
    rank0, rank1 = spawn_group(2, equality_rank, (cases,), timeout_s=300)
    return {name: (case, folders[name], r0, r1) for name, case, r0, r1 in zip(CASES, cases, rank0, rank1)}


def _prompts(model_dir) -> list[list[int]]:
    tok = open_model(model_dir).tokenizer
    base = tok.encode("Echoes of vectors drift through the quiet lattice of a dreaming machine")
    # Different lengths (several prefill chunks of 16), and two sharing their first blocks.
    return [base, base[:20] + tok.encode(" and a gentle hum"), tok.encode("I dream"), base[:9]]


@pytest.mark.parametrize("name", list(CASES))
def test_tp2_matches_one_process(results, name):
    case, folder, rank0, rank1 = results[name]
    want = reference_run(case["model_dir"], case["prompts"], MAX_TOKENS)
    vocab = ModelConfig.from_folder(folder).vocab_size
    assert rank0["logits"].shape == want["logits"].shape == (24, vocab)
    torch.testing.assert_close(rank0["logits"], want["logits"], atol=1e-4, rtol=0)
    assert rank0["tokens"] == want["tokens"]
    assert all(len(t) == MAX_TOKENS for wave in rank0["tokens"] for t in wave)
    assert rank0["cached"][1] > 0  # the second wave attached prefix blocks on both ranks
    assert rank0["cached"] == want["cached"]
    assert rank1["exit"] == "shutdown" and rank1["steps"] > 0
    # Both ranks freed every sequence and keep the same prefix blocks (rank-local KV, same hashes).
    assert rank0["held_after"] == rank1["held_after"] and rank0["held_after"][0] == 0


@pytest.mark.parametrize("name", [n for n, (_, split_at) in CASES.items() if split_at is None])
def test_each_rank_reads_only_its_slices(results, name):
    _, folder, rank0, rank1 = results[name]
    whole = (folder / "model.safetensors").stat().st_size
    # About half the file each (norms are read whole by both).
    assert rank0["bytes_read"] < 0.55 * whole and rank1["bytes_read"] < 0.55 * whole
    assert rank0["bytes_read"] + rank1["bytes_read"] > 0.95 * whole
