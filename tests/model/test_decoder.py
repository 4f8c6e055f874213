"""Our decoder against transformers on the same weights, and our cached paths against our uncached one.

Reference models are random-weight transformers models of every supported variant (tests/conftest.py)
plus the real tiny Llama in ../shared/models/aidreams-260k.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from meshllm.engine.kv_cache import SequenceKV
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder, Rotary, SeqSlice
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource
from tests.conftest import TINY_VARIANTS

VOCAB = 96  # tests/conftest.py _COMMON


def _load(folder, first=0, last=None, dtype=torch.float32) -> Decoder:
    source = SafetensorsSource(folder)
    return load_decoder(source, source.config(), first, last, dtype)


def _reference(folder, **kwargs):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.float32,
                                                **kwargs).eval()


def _tokens(n: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _step(decoder: Decoder, x: torch.Tensor, kv: SequenceKV) -> torch.Tensor:
    """One forward of `x` (ids or hidden states) for one sequence, appending to its cache."""
    n = x.shape[0]
    positions = torch.arange(kv.length, kv.length + n)
    return decoder(x, positions, [SeqSlice(kv, 0, n)])


def _chunked_logits(decoder: Decoder, ids: torch.Tensor, chunk_sizes: list[int]) -> torch.Tensor:
    """Logits of every token of `ids`, fed as prefill chunks of `chunk_sizes`, then one token at a time."""
    kv = SequenceKV(decoder.kv_layout(), capacity=1)  # capacity 1: the cache must grow as it goes
    out, done = [], 0
    for size in chunk_sizes + [1] * (ids.numel() - sum(chunk_sizes)):
        out.append(_step(decoder, ids[done:done + size], kv))
        done += size
    assert kv.length == ids.numel()
    return torch.cat(out)


@pytest.mark.parametrize("variant", sorted(TINY_VARIANTS))
def test_logits_match_transformers(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    ids = _tokens(24, seed=1)
    with torch.no_grad():
        want = _reference(folder)(ids[None]).logits[0]
    got = _load(folder).forward_full(ids)
    assert got.shape == want.shape == (24, VOCAB)
    assert want.abs().max() > 1.0  # the weights are large enough for a wrong formula to show
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_a_released_gpt_oss_folder_gives_transformers_logits(tiny_model_dir, tmp_path):
    # experts as MXFP4 blocks (openai/gpt-oss-20b's layout): transformers dequantizes them at load
    from transformers import Mxfp4Config

    from tests.model.test_weights import released_gpt_oss_folder

    folder = released_gpt_oss_folder(tiny_model_dir("gpt-oss"), tmp_path / "gpt-oss")
    ids = _tokens(24, seed=1)
    with torch.no_grad():
        want = _reference(folder, quantization_config=Mxfp4Config(dequantize=True))(ids[None]).logits[0]
        dense = _reference(tiny_model_dir("gpt-oss"))(ids[None]).logits[0]
    assert (want - dense).abs().max() > 0.1  # the experts are the blocks' values, not the dense model's
    torch.testing.assert_close(_load(folder).forward_full(ids), want, atol=1e-4, rtol=0)


def test_glm4_moe_picks_experts_in_float32_in_a_bf16_model(tiny_model_dir, tmp_path):
    # GLM-4.5's bias that picks experts is a large offset with a small spread (~10.16 +- 0.04 in the
    # released models): in bf16 (steps of 0.06 there) most tokens would get other experts (found by
    # review: 16% agreed). The router and the bias stay float32, as in transformers.
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_model_dir("glm4-moe"), tmp_path / "glm")
    tensors = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith("e_score_correction_bias")]:
        tensors[name] = 10.16 + 0.04 * torch.randn(tensors[name].shape, generator=g)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    wide, narrow = _load(folder).layers[-1].mlp, _load(folder, dtype=torch.bfloat16).layers[-1].mlp
    assert narrow.selection_bias.dtype == narrow.router.weight.dtype == torch.float32
    x = torch.randn(200, 64, generator=g).to(torch.bfloat16)  # the same inputs for both
    assert torch.equal(narrow.route(x)[1].sort(-1).values, wide.route(x.float())[1].sort(-1).values)


def test_transformers_reference_applies_the_sliding_window(tiny_model_dir):
    # transformers' eager and sdpa paths both honour Mistral's sliding window (checked with 5.x); if a
    # version ignored it, test_logits_match_transformers[mistral] would compare against full attention.
    folder = tiny_model_dir("mistral")
    config = ModelConfig.from_folder(folder)
    ids = _tokens(24, seed=1)
    assert config.sliding_window is not None and config.sliding_window < ids.numel()
    with torch.no_grad():
        windowed = _reference(folder)(ids[None]).logits[0]
        sdpa = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa").eval()(ids[None]).logits[0]
        full = _reference(folder, sliding_window=None)(ids[None]).logits[0]
    torch.testing.assert_close(sdpa, windowed, atol=1e-4, rtol=0)
    assert (full - windowed).abs().max() > 0.1
    # Tokens inside the first window see the same keys either way.
    torch.testing.assert_close(full[:config.sliding_window], windowed[:config.sliding_window], atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen3", "gemma3"])
def test_chunked_prefill_then_decode_equals_uncached(tiny_model_dir, variant):
    # Gemma's norms after attention and after the MLP rescale small outputs, which magnifies the
    # float32 rounding of other chunkings ~10x (3.8e-5 here): its claim is checked in float64.
    dtype = torch.float64 if variant == "gemma3" else torch.float32
    decoder = _load(tiny_model_dir(variant), dtype=dtype)
    ids = _tokens(20, seed=2)
    want = decoder.forward_full(ids)
    # Chunks 3, 7 and 4 cross mistral's window of 5 mid-chunk; decode then runs 6 single tokens.
    got = _chunked_logits(decoder, ids, [3, 7, 4])
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1e-10, rtol=0)


@pytest.mark.parametrize("variant", ["llama", "mistral"])
def test_flat_batch_of_three_sequences_equals_each_alone(tiny_model_dir, variant):
    decoder = _load(tiny_model_dir(variant))
    prompts = [_tokens(n, seed=10 + n) for n in (7, 1, 12)]
    alone = [_chunked_logits(decoder, p, [p.numel() - 1]) for p in prompts]  # prefill, then the last token

    caches = [SequenceKV(decoder.kv_layout()) for _ in prompts]
    # Step 1: every sequence's prefill but its last token, in one flat batch.
    # Step 2: the last tokens of all three, as decode steps in one batch.
    for take in (lambda p: p[:-1], lambda p: p[-1:]):
        chunks = [take(p) for p in prompts]
        slices, positions, row = [], [], 0
        for kv, chunk in zip(caches, chunks):
            slices.append(SeqSlice(kv, row, chunk.numel()))
            positions.append(torch.arange(kv.length, kv.length + chunk.numel()))
            row += chunk.numel()
        logits = decoder(torch.cat(chunks), torch.cat(positions), slices)
        for s, ref, chunk in zip(slices, alone, chunks):
            start = s.kv.length - chunk.numel()  # the forward has committed the chunk
            torch.testing.assert_close(logits[s.row:s.row + s.num_tokens], ref[start:start + chunk.numel()],
                                       atol=1e-5, rtol=0)


def test_logit_rows_selects_rows(tiny_model_dir):
    decoder = _load(tiny_model_dir("llama"))
    ids = _tokens(9, seed=3)
    full = decoder.forward_full(ids)
    kv = SequenceKV(decoder.kv_layout())
    picked = decoder(ids, torch.arange(9), [SeqSlice(kv, 0, 9)], logit_rows=torch.tensor([8, 2]))
    torch.testing.assert_close(picked, full[[8, 2]], atol=1e-6, rtol=0)


# untied GQA; tied head read from the embedding; Gemma 3's per-layer rotary tables and windows
@pytest.mark.parametrize("variant", ["llama", "qwen2", "gemma3"])
def test_two_parts_equal_the_whole_model_bitwise(tiny_model_dir, variant):
    folder = tiny_model_dir(variant)
    whole = _load(folder)
    num_layers = whole.config.num_hidden_layers
    ids = _tokens(14, seed=4)
    chunks = [10, 1, 1, 1, 1]  # prefill then four decode steps: both attention paths
    whole_kv = SequenceKV(whole.kv_layout())
    want = [_step(whole, c, whole_kv) for c in ids.split(chunks)]
    for split in range(1, num_layers):  # includes a first part of only layer 0 and a last part of only L-1
        head, tail = _load(folder, 0, split), _load(folder, split, num_layers)
        assert not head.has_head and not tail.has_embedding
        head_kv, tail_kv = SequenceKV(head.kv_layout()), SequenceKV(tail.kv_layout())
        for chunk, expected in zip(ids.split(chunks), want):
            hidden = _step(head, chunk, head_kv)
            assert hidden.shape == (chunk.numel(), whole.config.hidden_size)
            got = _step(tail, hidden, tail_kv)
            assert torch.equal(got, expected), f"split at layer {split}"


def test_three_parts_equal_the_whole_model_bitwise(tiny_model_dir):
    folder = tiny_model_dir("qwen3")
    ids = _tokens(11, seed=5)
    want = _load(folder).forward_full(ids)
    x = ids
    for first, last in ((0, 1), (1, 3), (3, 4)):
        part = _load(folder, first, last)
        x = part(x, torch.arange(11), [SeqSlice(SequenceKV(part.kv_layout()), 0, 11)])
    assert torch.equal(x, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits_close_to_fp32(tiny_model_dir, dtype):
    folder = tiny_model_dir("llama")
    ids = _tokens(16, seed=6)
    want = _load(folder).forward_full(ids)
    decoder = _load(folder, dtype=dtype)
    assert all(p.dtype == dtype for p in decoder.parameters())
    got = decoder.forward_full(ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # Loose: half precision keeps 8 (bf16) or 11 (fp16) mantissa bits through 4 layers.
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    cached = _chunked_logits(decoder, ids, [5])
    assert (cached - want).abs().max() < 0.05 * want.abs().max()


def test_aidreams_logits_match_transformers(aidreams_path):
    ids = torch.tensor([1, 429, 491, 433, 295, 429, 444, 445, 265, 262, 263, 342, 430, 446, 277])
    with torch.no_grad():
        want = _reference(aidreams_path)(ids[None]).logits[0]
    got = _load(aidreams_path).forward_full(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("prompt_text", ["Echoes of vectors", "Once upon a time"])
def test_aidreams_greedy_generation_matches_transformers_generate(aidreams_path, prompt_text):
    from tokenizers import Tokenizer

    prompt = Tokenizer.from_file(str(aidreams_path / "tokenizer.json")).encode(prompt_text).ids
    num_new = 32
    with torch.no_grad():
        out = _reference(aidreams_path).generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                                                 pad_token_id=0)
    want = out[0, len(prompt):].tolist()
    assert len(want) == num_new  # these prompts run 32 tokens without reaching eos

    # The real cached path: prefill the prompt, then one token at a time through Decoder.forward.
    decoder = _load(aidreams_path)
    kv = SequenceKV(decoder.kv_layout())
    logits = _step(decoder, torch.tensor(prompt), kv)[-1]
    got = []
    for _ in range(num_new):
        got.append(int(logits.argmax()))
        logits = _step(decoder, torch.tensor(got[-1:]), kv)[-1]
    assert got == want
    assert kv.length == len(prompt) + num_new


def test_rotary_tables_grow_with_the_positions_used_not_the_whole_context():
    # Llama 3.1's 131072 positions would take 67 MB of tables per stage up front (bf16, head_dim 128)
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 112,
                                    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                    "max_position_embeddings": 131072})
    rotary = Rotary(config, torch.float32)
    assert rotary.cos.shape == (4096, 16)
    cos, sin = rotary(torch.tensor([6000, 3]))
    assert 6000 < rotary.cos.shape[0] < 131072
    angles = torch.tensor([6000.0, 3.0])[:, None] * rotary.inv_freq
    torch.testing.assert_close(cos, torch.cat((angles, angles), dim=-1).cos(), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin, torch.cat((angles, angles), dim=-1).sin(), atol=1e-6, rtol=0)


def test_gemma_norms_keep_one_plus_w_in_float32_in_a_bf16_model(tiny_model_dir):
    """transformers computes Gemma's norms as float32 1 + w; rounded to bf16 the 1 would leave w a
    step of 1/128 (found by review)."""
    from safetensors.torch import load_file

    folder = tiny_model_dir("gemma3")
    decoder = _load(folder, dtype=torch.bfloat16)
    stored = load_file(folder / "model.safetensors")
    norm = decoder.layers[1].attn_out_norm.weight
    assert norm.dtype == torch.float32
    assert torch.equal(norm, stored["model.layers.1.post_attention_layernorm.weight"].float() + 1)
    assert decoder.layers[1].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    ids = _tokens(10, seed=5)
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager",
                                                    dtype=torch.bfloat16).eval()(ids[None]).logits[0].float()
    got = decoder.forward_full(ids)
    torch.testing.assert_close(got, want, atol=0.05 * float(want.abs().max()), rtol=0)  # bf16 both ways
