"""Tensor parallelism over 2 real processes (gloo on loopback) against one process.

Both ranks are spawned once for the module and run every case in its own freshly formed
group; rank 0 drives a Leader (continuous batching, chunked prefill, prefix cache) over
the group while rank 1 mirrors its commands. fp32 logits must agree within 1e-4 and
greedy tokens exactly, for the real model and random models whose head counts divide
and whose KV heads must be replicated. The CPU weight forms (bf16 kernel, int8) apply to
the sharded linears too; their output is compared with the same form in one process.
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
SPEC_TOKENS = 32
# name -> (tiny variant or None for the real model, layers of the ordinary stage in front of the group)
CASES = {
    "aidreams": (None, None),  # real weights: 4 heads, 4 KV heads, tied embeddings
    "llama-gqa": ("llama", None),  # 4 heads, 2 KV heads: both split
    "qwen3-kv1": ("qwen3", None),  # 1 KV head: replicated on both ranks; q/k norms
    "qwen2-bias": ("qwen2", None),  # q/k/v biases sliced with their rows; tied embeddings
    "phi3-fused": ("phi3", None),  # fused q/k/v and gate/up stored: each rank reads its rows of them
    "gemma3": ("gemma3", None),  # four norms a layer, windowed and full layers, scaled embedding lookups
    "gemma2": ("gemma2", None),  # each rank's heads' scores soft-capped; the gathered logits capped
    "glm4": ("glm4", None),  # q/k rows reordered from interleaved pairs in each rank's slice of heads
    # The group as the second stage: hidden states cross the command channel in frames of 64
    # words, so every prefill chunk's command spans several frames.
    "aidreams-second-stage": (None, 2),
}
# name -> weight form of the real model's ranks (engine/weight_forms.py), compared with one process in it
FORMS = {"aidreams-bf16": dict(dtype="bfloat16"), "aidreams-int8": dict(quantization="int8")}
# Speculative decoding (n-gram proposer) through the group as the second stage, on prompts that repeat
# themselves so drafts are made and both kept and rejected.
SPECULATIVE = "aidreams-speculative-second-stage"
REPETITIVE = ("Lily and Ben went to the park. Lily said: we go to the park, we go to the park, we",
              "The cat sat on the mat. The dog sat on the log. The bird sat on the")


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
    for name, form in FORMS.items():
        folders[name] = aidreams_path
        cases.append(dict(model_dir=str(aidreams_path), prompts=_prompts(aidreams_path), max_tokens=MAX_TOKENS,
                          **form))
    tok = open_model(aidreams_path).tokenizer
    folders[SPECULATIVE] = aidreams_path
    cases.append(dict(model_dir=str(aidreams_path), prompts=[tok.encode(p) for p in REPETITIVE],
                      max_tokens=SPEC_TOKENS, split_at=2, frame_words=64, speculative=True))
    rank0, rank1 = spawn_group(2, equality_rank, (cases,), timeout_s=300)
    names = [*CASES, *FORMS, SPECULATIVE]
    return {name: (case, folders[name], r0, r1) for name, case, r0, r1 in zip(names, cases, rank0, rank1)}


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
    # The second wave finds every prompt's full blocks published (prefix blocks attached on both
    # ranks): its count is fixed and must match. The first wave's is not compared: it depends on
    # whether prompt 0's blocks, which prompt 1 shares, were published before prompt 1 was
    # admitted, a race between the submitting thread and the leader's loop that load decides.
    assert rank0["cached"][1] == want["cached"][1] > 0
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


@pytest.mark.parametrize("name", list(FORMS))
def test_weight_forms_apply_to_the_sharded_linears(results, name):
    case, _, rank0, rank1 = results[name]
    form = FORMS[name]
    want = reference_run(case["model_dir"], case["prompts"], MAX_TOKENS, **form)
    fp32 = results["aidreams"][2]["logits"]
    assert rank0["forms"] == (["FastBF16Linear", "FastBF16Linear"] if "dtype" in form and _has_bf16_kernel()
                              else ["PackedBF16Linear", "PackedBF16Linear"] if "dtype" in form
                              else ["Int8Linear", "Int8Linear"])
    # Split in the same form, the model is no further from fp32 than the form itself takes it
    # (twice, at most: each rank rounds its partial sums before they are added).
    form_error = (want["logits"] - fp32).abs().max()
    tp_error = (rank0["logits"] - fp32).abs().max()
    assert 0 < tp_error <= 2 * form_error, (tp_error, form_error)
    # Greedy tokens in a 16/8-bit form are not promised identical; report how many match.
    same = sum(a == b for wave, ref in zip(rank0["tokens"], want["tokens"]) for t, r in zip(wave, ref)
               for a, b in zip(t, r))
    total = sum(len(t) for wave in want["tokens"] for t in wave)
    print(f"{name}: max |logit - fp32| {tp_error:.4f} split vs {form_error:.4f} in one process; "
          f"{same}/{total} greedy tokens identical")
    assert rank1["exit"] == "shutdown"


def _has_bf16_kernel() -> bool:
    from meshllm.engine.kernels.gemv import load_gemv
    return load_gemv() is not None


def test_speculative_steps_through_the_group_give_one_process_greedy_tokens(results):
    case, _, rank0, rank1 = results[SPECULATIVE]
    # One process, no speculation, the same batch-invariant arithmetic: the tokens to match.
    want = reference_run(case["model_dir"], case["prompts"], SPEC_TOKENS, batch_invariant=True)
    assert rank0["tokens"] == want["tokens"]
    # Steps scored k+1 positions on every rank; some drafts were kept and some rolled back on
    # each rank's own KV (a worker that kept a rejected position would change later tokens).
    assert 0 < rank0["accepted"] < rank0["drafted"], (rank0["accepted"], rank0["drafted"])
    print(f"{SPECULATIVE}: {rank0['accepted']}/{rank0['drafted']} draft tokens accepted")
    assert rank1["exit"] == "shutdown" and rank1["steps"] > 0
    assert rank0["held_after"] == rank1["held_after"] and rank0["held_after"][0] == 0


def test_tp3_of_the_real_gguf_model_matches_one_process(smollm2_gguf_path):
    # SmolLM2-135M (Q4_1 GGUF) has 9 heads and 3 KV heads: 2 ranks cannot split it (named in
    # tests/tp/test_shard.py), 3 can. Each rank reads its rows of the quantized blocks, and its
    # whole 32-wide blocks of columns for o_proj and down_proj.
    tok = open_model(smollm2_gguf_path).tokenizer
    prompts = [tok.encode("Echoes of vectors drift through the quiet lattice of a dreaming machine"),
               tok.encode("I dream")]
    case = dict(model_dir=str(smollm2_gguf_path), prompts=prompts, max_tokens=8)
    [[rank0], [rank1], [rank2]] = spawn_group(3, equality_rank, ([case],), timeout_s=300)  # one case each
    want = reference_run(case["model_dir"], prompts, 8)
    torch.testing.assert_close(rank0["logits"], want["logits"], atol=1e-4, rtol=0)
    assert rank0["tokens"] == want["tokens"]
    assert rank1["exit"] == rank2["exit"] == "shutdown"
    whole = smollm2_gguf_path.stat().st_size
    assert all(r["bytes_read"] < 0.45 * whole for r in (rank0, rank1, rank2))
