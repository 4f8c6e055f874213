"""ModelConfig from config.json: every supported variant, both rope layouts, and clear refusals."""

from __future__ import annotations

import json
import math
from array import array

import pytest
import torch
from transformers import AutoModelForCausalLM

from meshllm.errors import ModelLoadError, UnsupportedArchitecture
from meshllm.model.config import ModelConfig, RopeScaling, YarnScaling

LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "eos_token_id": [2, 7],
}


def _folder_with(tmp_path, text: str):
    (tmp_path / "config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize("variant, expect", [
    ("llama", dict(model_type="llama", num_key_value_heads=2, tie_word_embeddings=False, rope_scaling=None)),
    ("llama-mha-tied", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("llama3", dict(rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 32))),
    ("mistral", dict(model_type="mistral", sliding_window=5, attention_bias=False)),
    ("qwen2", dict(model_type="qwen2", attention_bias=True, qk_norm=False, sliding_window=None)),
    ("qwen3", dict(model_type="qwen3", attention_bias=False, qk_norm=True, num_key_value_heads=1)),
    ("phi3", dict(model_type="phi3", sliding_window=5, rope_factors=None, max_position_embeddings=256)),
    ("gemma3", dict(model_type="gemma3_text", sliding_window=5, sliding_layers=(True, True, False, True),
                    rope_theta=1e6, rope_linear_factor=8.0, local_rope_theta=10000.0, attention_scale=24 ** -0.5,
                    embedding_scale=8.0, sandwich_norms=True, norm_weight_offset=1.0, hidden_act="gelu_tanh",
                    qk_norm=True, tie_word_embeddings=True)),
    ("gemma2", dict(model_type="gemma2", sliding_window=5, sliding_layers=(True, False, True, False),
                    rope_theta=10000.0, rope_linear_factor=1.0, attention_scale=24 ** -0.5, embedding_scale=8.0,
                    sandwich_norms=True, norm_weight_offset=1.0, hidden_act="gelu_tanh", qk_norm=False,
                    attn_softcap=4.0, final_softcap=5.0, tie_word_embeddings=True)),
    ("qwen3-moe", dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, expert_intermediate_size=48,
                       normalize_expert_weights=False, qk_norm=True)),
    ("gpt-oss", dict(model_type="gpt_oss", num_experts=4, num_experts_per_tok=2, expert_intermediate_size=64,
                     expert_biases=True, softmax_after_topk=True, swiglu_limit=1.5, o_proj_bias=True,
                     attention_sinks=True, attention_bias=True, sliding_window=5,
                     sliding_layers=(True, False, True, False), rope_theta=150000.0,
                     rope_scaling=YarnScaling(32.0, 4096, truncate=False), tie_word_embeddings=False)),
    ("mixtral", dict(model_type="mixtral", num_experts=4, num_experts_per_tok=2, expert_intermediate_size=48,
                     normalize_expert_weights=True, qk_norm=False)),
    ("qwen2-moe", dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, expert_intermediate_size=64,
                       normalize_expert_weights=False, shared_expert_size=96, shared_expert_gated=True,
                       attention_bias=True, qk_norm=False, sigmoid_router=False)),
    ("phi3-partial", dict(model_type="phi3", rotary_dim=8, rope_factors=(1.0, 1.5, 2.0, 2.5))),
    ("qwen3-yarn", dict(rope_scaling=YarnScaling(8.0, 4096), max_position_embeddings=32768,
                        rope_attention_factor=array("f", [1 + 0.1 * math.log(8)])[0])),
    ("smollm3", dict(model_type="smollm3", rope_layers=(True, True, True, False), tie_word_embeddings=True)),
    ("glm4", dict(model_type="glm4", rotary_dim=8, attention_bias=True, sandwich_norms=True)),
    ("minimax-m2", dict(model_type="minimax_m2", rotary_dim=4, num_experts=4, num_experts_per_tok=2,
                        expert_intermediate_size=64, normalize_expert_weights=True, sigmoid_router=True,
                        qk_norm=True, qk_norm_across_heads=True, shared_expert_size=0, dense_layers=0)),
    ("granite", dict(model_type="granite", embedding_scale=3.0, attention_scale=array("f", [0.15])[0],
                     residual_scale=array("f", [0.4])[0], logit_scale=2.5)),
])
def test_every_variant_written_by_transformers_parses(tiny_model_dir, variant, expect):
    config = ModelConfig.from_folder(tiny_model_dir(variant))
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim, config.vocab_size) == (64, 4, 16, 96)
    assert config.eos_token_ids == (2,) and config.bos_token_id == 1
    for key, value in expect.items():
        assert getattr(config, key) == value, key


@pytest.mark.parametrize("variant", ["llama", "llama-mha-tied", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3-moe",
                                     "mixtral", "smollm3", "granite", "glm4", "gpt-oss", "glm4-moe", "minimax-m2",
                                     "qwen2-moe"])
def test_parameter_count_matches_transformers(tiny_model_dir, variant):
    # The planner budgets memory from these counts. The bias that picks GLM-4.5's and MiniMax-M2's
    # experts is a buffer to transformers, and weights all the same.
    folder = tiny_model_dir(variant)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = ModelConfig.from_folder(folder)

    def weights(module) -> int:
        return sum(p.numel() for p in module.parameters()) + sum(
            b.numel() for name, b in module.named_buffers() if name.endswith("e_score_correction_bias"))
    assert config.num_parameters == weights(model)
    assert config.layer_parameters() == max(weights(model.model.layers[i]) for i in (0, -1))


def test_transformers_4_and_5_rope_layouts_parse_the_same():
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **scaling}})
    old_key = ModelConfig.from_dict({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"type": "llama3", **scaling}})
    v5 = ModelConfig.from_dict({k: v for k, v in LLAMA.items() if k != "rope_theta"}
                               | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **scaling}})
    assert v4 == old_key == v5
    assert v5.rope_theta == 500000.0 and v5.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    plain = ModelConfig.from_dict({**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_longrope_runs_its_short_factors_within_the_original_context(tiny_model_dir):
    config = ModelConfig.from_folder(tiny_model_dir("phi3-longrope"))  # 256 positions, 32 original
    assert config.max_position_embeddings == 32  # past it the long factors would apply to every position
    assert config.rope_factors == tuple(array("f", [1.0 + 0.35 * i for i in range(8)]))
    assert config.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(256 / 32) / math.log(32)))
    assert config.rope_scaling is None


def test_phi3_windows_and_the_longrope_attention_factor_from_config_json():
    phi = {**LLAMA, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "max_position_embeddings": 4096}
    assert ModelConfig.from_dict({**phi, "sliding_window": 2047}).sliding_window == 2047  # Phi-3 mini 4k
    assert ModelConfig.from_dict({**phi, "sliding_window": None}).sliding_window is None  # Phi-4
    # Phi-3.5 mini: a 262144 window over 4096 positions hides nothing (ggml's path runs no window then)
    long = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    phi35 = ModelConfig.from_dict({**phi, "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                                   "sliding_window": 262144, "rope_scaling": long})
    assert phi35.sliding_window is None and phi35.max_position_embeddings == 4096
    given = ModelConfig.from_dict({**phi, "original_max_position_embeddings": 1024,
                                   "rope_scaling": {**long, "attention_factor": 1.5}})
    assert given.rope_attention_factor == 1.5
    # Both places name the original context: transformers takes Phi-3's top-level field
    both = ModelConfig.from_dict({**phi, "original_max_position_embeddings": 1024,
                                  "rope_scaling": {**long, "original_max_position_embeddings": 2048}})
    assert both.max_position_embeddings == 1024


def test_gemma3_written_by_transformers_4_parses_as_by_5():
    # What google/gemma-3-4b-it's text config says under transformers 4.5x
    v4 = {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
          "intermediate_size": 112, "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 256, "query_pre_attn_scalar": 16, "sliding_window": 8,
          "sliding_window_pattern": 6, "rope_theta": 1e6, "rope_local_base_freq": 10000.0,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "hidden_activation": "gelu_pytorch_tanh"}
    config = ModelConfig.from_dict(v4)
    assert config.sliding_layers == (True, True, True, True, True, False, True)
    assert (config.rope_theta, config.rope_linear_factor, config.local_rope_theta) == (1e6, 8.0, 10000.0)
    assert config.layer_rope(5) == (1e6, 8.0) and config.layer_rope(6) == (10000.0, 1.0)
    assert config.layer_window(5) is None and config.layer_window(6) == 8
    assert config.tie_word_embeddings and config.attention_scale == 0.25


def test_gemma2_as_its_checkpoints_say_parses():
    # What google/gemma-2-2b-it's config.json says (transformers 4.4x): no layer_types, rope_theta
    # at the top, the caps and query_pre_attn_scalar named
    v4 = {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "vocab_size": 96, "hidden_size": 64,
          "intermediate_size": 112, "num_hidden_layers": 5, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 16, "max_position_embeddings": 8192, "query_pre_attn_scalar": 16, "sliding_window": 4096,
          "rope_theta": 10000.0, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
          "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
          "cache_implementation": "hybrid"}
    config = ModelConfig.from_dict(v4)
    assert config.sliding_layers == (True, False, True, False, True)  # even layers windowed, as transformers
    assert config.layer_rope(0) == config.layer_rope(1) == (10000.0, 1.0)
    assert (config.attn_softcap, config.final_softcap, config.attention_scale) == (50.0, 30.0, 0.25)
    assert config.tie_word_embeddings and not config.qk_norm
    # caps left out take Gemma 2's own; null turns one off
    config = ModelConfig.from_dict({k: v for k, v in v4.items() if not k.endswith("softcapping")})
    assert (config.attn_softcap, config.final_softcap) == (50.0, 30.0)
    assert ModelConfig.from_dict({**v4, "final_logit_softcapping": None}).final_softcap is None
    with pytest.raises(ModelLoadError, match="soft caps must be positive"):
        ModelConfig.from_dict({**v4, "attn_logit_softcapping": 0.0})
    # Gemma 3 caps nothing unless its config says so
    gemma3 = {**LLAMA, "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}
    assert ModelConfig.from_dict(gemma3).final_softcap is None
    assert ModelConfig.from_dict({**gemma3, "final_logit_softcapping": 30.0}).final_softcap == 30.0


@pytest.mark.parametrize("model_type, change, words", [
    ("gemma3_text", {"hidden_activation": "gelu"}, ["hidden_activation", "'gelu'"]),
    ("gemma3_text", {"use_bidirectional_attention": True}, ["use_bidirectional_attention"]),
    ("gemma3_text", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, ["'yarn'", "gemma"]),
    ("gemma3_text", {"attention_bias": True}, ["attention_bias"]),
    ("gemma2", {"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, ["'linear'", "gemma"]),
    ("gemma2", {"attention_bias": True}, ["attention_bias"]),
])
def test_gemma_features_meshllm_lacks_are_refused(model_type, change, words):
    gemma = {**LLAMA, "model_type": model_type}
    with pytest.raises(UnsupportedArchitecture) as info:
        ModelConfig.from_dict({**gemma, **change})
    for word in words:
        assert word in str(info.value)


@pytest.mark.parametrize("change, words", [
    ({"decoder_sparse_step": 2}, ["decoder_sparse_step 2", "every layer is sparse"]),
    ({"mlp_only_layers": [0]}, ["mlp_only_layers [0]"]),
    ({"num_experts_per_tok": 9}, ["9 experts per token of 8"]),
])
def test_mixture_of_experts_layouts_meshllm_lacks_are_refused(change, words):
    qwen_moe = {**LLAMA, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    ModelConfig.from_dict(qwen_moe)  # as it is: runs
    with pytest.raises(UnsupportedArchitecture) as info:
        ModelConfig.from_dict({**qwen_moe, **change})
    for word in words:
        assert word in str(info.value)


# MiniMaxAI/MiniMax-M2's config.json as released (M2.1 and M2.5 name the same fields), its 62-entry
# attn_type_list aside
MINIMAX_M2 = {
    "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 3072, "intermediate_size": 1536, "max_position_embeddings": 196608, "mtp_transformer_layers": 1,
    "num_attention_heads": 48, "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8,
    "num_local_experts": 256, "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-06,
    "rope_theta": 5000000, "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0,
    "tie_word_embeddings": False, "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True,
    "vocab_size": 200064, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                            "weight_block_size": [128, 128],
                            "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]},
}


def test_minimax_m2_as_released_parses():
    config = ModelConfig.from_dict({**MINIMAX_M2, "attn_type_list": [1] * 62})
    assert (config.rotary_dim, config.rope_theta, config.num_experts, config.num_experts_per_tok) == (64, 5e6, 256, 8)
    assert (config.expert_intermediate_size, config.shared_expert_size, config.dense_layers) == (1536, 0, 0)
    assert config.sigmoid_router and config.normalize_expert_weights and config.expert_weights_scale == 1.0
    assert config.qk_norm and config.qk_norm_across_heads
    # a layer: q/k/v/o, 256 experts, the router and its bias, two norms and the q/k norms at their
    # width (6144 + 1024); ~229B in all (MiniMax's "230B-A10B")
    attention = 3072 * (6144 + 2 * 1024) + 6144 * 3072
    assert config.layer_parameters() == attention + 256 * (3 * 3072 * 1536 + 3072 + 1) + 2 * 3072 + 6144 + 1024
    assert 228e9 < config.num_parameters < 230e9


@pytest.mark.parametrize("change, words", [
    ({"scoring_func": "softmax"}, ["scoring_func 'softmax'", "sigmoid router"]),
    ({"use_routing_bias": False}, ["use_routing_bias False"]),
    ({"qk_norm_type": "per_head"}, ["qk_norm_type 'per_head'", "across all heads"]),
    ({"shared_intermediate_size": 512}, ["shared_intermediate_size 512"]),
    ({"attn_type_list": [0] + [1] * 61}, ["attn_type_list", "not linear attention"]),
])
def test_minimax_layouts_meshllm_lacks_are_refused(change, words):
    with pytest.raises(UnsupportedArchitecture) as info:
        ModelConfig.from_dict({**MINIMAX_M2, **change})
    for word in words:
        assert word in str(info.value)


def test_mixture_of_experts_models_are_not_split_by_tensor_parallelism(tiny_model_dir):
    from meshllm.errors import TensorParallelUnsplittable
    from meshllm.tp.shard import check_splittable

    config = ModelConfig.from_folder(tiny_model_dir("mixtral"))
    with pytest.raises(TensorParallelUnsplittable, match="mixture-of-experts.*pipeline stages.*without tensor"):
        check_splittable(config, 2)


def test_defaults_and_fallbacks():
    d = {k: v for k, v in LLAMA.items() if k not in ("num_key_value_heads", "model_type")}
    config = ModelConfig.from_dict(d)  # model_type found from architectures; MHA when kv heads are absent
    assert config.model_type == "llama" and config.num_key_value_heads == 4 and config.head_dim == 16
    assert config.eos_token_ids == (2, 7) and config.sliding_window is None
    assert ModelConfig.from_dict({**LLAMA, "model_type": "mistral", "sliding_window": None}).sliding_window is None
    assert config.kv_bytes_per_token(2) == 2 * 2 * 4 * 16 * 2  # k and v, 2 layers, 4 heads, dim 16, 2 bytes


def test_aidreams_config(aidreams_path):
    config = ModelConfig.from_folder(aidreams_path)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.vocab_size) == ("llama", 64, 4, 512)
    assert config.tie_word_embeddings and config.max_position_embeddings == 128 and config.eos_token_ids == (2,)


def test_phi4_mini_turns_three_quarters_of_each_head():
    # Phi-4-mini: 24 heads of 128 in 3072, partial_rotary_factor 0.75, LongRoPE over the 96 turned dims
    phi4 = {**LLAMA, "model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "hidden_size": 3072,
            "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "partial_rotary_factor": 0.75,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}}
    config = ModelConfig.from_dict(phi4)
    assert (config.head_dim, config.rotary_dim, config.rotated_dims) == (128, 96, 96)
    assert len(config.rope_factors) == 48 and config.max_position_embeddings == 4096
    whole_head = {**phi4["rope_scaling"], "short_factor": [1.0] * 64}  # factors for 128 turned dims
    assert ModelConfig.from_dict({**phi4, "partial_rotary_factor": 1.0, "rope_scaling": whole_head}).rotary_dim is None
    with pytest.raises(ModelLoadError, match="96 rotated dims of a head make 48 frequencies"):
        ModelConfig.from_dict({**phi4, "rope_scaling": whole_head})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_dict({**phi4, "partial_rotary_factor": 1.5})


def test_yarn_from_config_json_and_from_gguf_metadata():
    from meshllm.model.gguf import _yarn

    qwen = {**LLAMA, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "max_position_embeddings": 131072}
    config = ModelConfig.from_dict({**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": 32768}})
    assert config.rope_scaling == YarnScaling(4.0, 32768) and config.max_position_embeddings == 131072
    assert config.rope_attention_factor == pytest.approx(1 + 0.1 * math.log(4))
    # no factor: the context's ratio to the original, as transformers takes it; a given attention factor wins
    implied = ModelConfig.from_dict({**qwen, "rope_scaling": {"type": "yarn", "original_max_position_embeddings": 32768,
                                                              "attention_factor": 1.25, "beta_fast": 16}})
    assert implied.rope_scaling == YarnScaling(4.0, 32768, beta_fast=16.0) and implied.rope_attention_factor == 1.25
    with pytest.raises(ModelLoadError, match="yarn"):
        ModelConfig.from_dict({**qwen, "rope_scaling": {"rope_type": "yarn", "factor": 0.5}})
    # a GGUF: llama.cpp's cos/sin scale times rope.scaling.attn_factor; DeepSeek's log multiplier as a ratio
    meta = {"qwen3.rope.scaling.factor": 4.0, "qwen3.rope.scaling.original_context_length": 32768,
            "qwen3.context_length": 131072}
    assert _yarn(meta, "qwen3")["attention_factor"] == pytest.approx(1 + 0.1 * math.log(4))
    assert _yarn({**meta, "qwen3.rope.scaling.attn_factor": 2.0}, "qwen3")["attention_factor"] == \
        pytest.approx(2 * (1 + 0.1 * math.log(4)))
    assert _yarn({**meta, "qwen3.rope.scaling.yarn_log_multiplier": 0.707}, "qwen3")["attention_factor"] == \
        pytest.approx((1 + 0.1 * math.log(4)) / (1 + 0.0707 * math.log(4)))


def test_smollm3_skips_the_rotary_on_every_fourth_layer():
    smol = {**LLAMA, "model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 8}
    assert ModelConfig.from_dict(smol).rope_layers == (True, True, True, False) * 2  # transformers' default
    given = ModelConfig.from_dict({**smol, "no_rope_layers": [1, 0] * 4})
    assert [given.layer_rope(i) is None for i in range(8)] == [False, True] * 4
    assert ModelConfig.from_dict(LLAMA).rope_layers is None and ModelConfig.from_dict(LLAMA).layer_rope(3) is not None
    with pytest.raises(ModelLoadError, match="3 no_rope_layers entries for 8 layers"):
        ModelConfig.from_dict({**smol, "no_rope_layers": [1, 1, 0]})
    with pytest.raises(UnsupportedArchitecture, match="use_sliding_window"):
        ModelConfig.from_dict({**smol, "use_sliding_window": True, "sliding_window": 64})


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, ["'gpt2'", "LlamaForCausalLM", "qwen3"]),
    ({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}, ["'deepseek_v3'", "MixtralForCausalLM"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, ["'dynamic'", "llama3", "yarn"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "'gelu'"]),
    ({"mlp_bias": True}, ["mlp_bias"]),
    ({"attention_bias": True}, ["attention_bias", "o_proj"]),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 64}, ["use_sliding_window"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
])
def test_unsupported_architectures_are_refused_by_name(tmp_path, change, words):
    folder = _folder_with(tmp_path, json.dumps({**LLAMA, **change}))
    with pytest.raises(UnsupportedArchitecture) as info:
        ModelConfig.from_folder(folder)
    for word in [str(folder / "config.json"), *words]:
        assert word in str(info.value)
    assert info.value.code == "unsupported_architecture"


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": None}, ["hidden_size"]),
    ({"vocab_size": "many"}, ["malformed", "many"]),
    ({"num_attention_heads": 0}, ["num_attention_heads", "positive"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads 3"]),
    ({"intermediate_size": -1}, ["intermediate_size", "-1"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["low_freq_factor"]),
    ({"rope_scaling": [1, 2]}, ["rope_parameters"]),
    ({"sliding_window": -4, "model_type": "mistral"}, ["sliding_window"]),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0] * 8}, "original_max_position_embeddings": 64},
     ["longrope", "short_factor"]),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 3}, "original_max_position_embeddings": 64},
     ["short_factor has 3", "8 frequencies"]),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, ["original_max_position_embeddings"]),
])
def test_malformed_configs_name_the_field(tmp_path, change, words):
    d = {**LLAMA, **change}
    folder = _folder_with(tmp_path, json.dumps({k: v for k, v in d.items() if v is not None}))
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_folder(folder)
    assert not isinstance(info.value, UnsupportedArchitecture)
    for word in [str(folder / "config.json"), *words]:
        assert word in str(info.value)


@pytest.mark.parametrize("text, words", [
    ('{"model_type": "llama", ', ["not valid JSON"]),
    ("[1, 2, 3]", ["JSON object", "list"]),
    (b"\xff\xfe\x00garbage".decode("latin-1"), ["not valid JSON"]),
])
def test_unreadable_config_json(tmp_path, text, words):
    folder = _folder_with(tmp_path, text)
    with pytest.raises(ModelLoadError) as info:
        ModelConfig.from_folder(folder)
    for word in [str(folder / "config.json"), *words]:
        assert word in str(info.value)


def test_missing_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json not found"):
        ModelConfig.from_folder(tmp_path)
