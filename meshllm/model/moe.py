"""Mixture-of-experts layers (Qwen3-MoE, Qwen2-MoE, Mixtral, GPT-OSS, GLM-4.5, MiniMax-M2) read from
config.json.

Each layer's MLP is `num_experts` SwiGLU experts of `expert_intermediate_size` and a router: a
token's router logits go through a softmax, its `num_experts_per_tok` most probable experts run,
and their outputs are summed weighted by those probabilities (renormalized to sum to 1 where the
model says so: Mixtral always, Qwen3-MoE with norm_topk_prob). GPT-OSS differs: biases on the
router and on each expert's projections, the softmax over the chosen experts' logits only, a
clamped SwiGLU; and its attention has sinks and an o_proj bias, every other layer windowed.
GLM-4.5 (4.6, Air) scores experts by a sigmoid, picks them by score plus a learned bias per
expert, weights them by their scores (renormalized, scaled), runs a shared expert for every
token beside them, and keeps its first layers dense. MiniMax-M2 (M2.1, M2.5) routes as GLM-4.5
does, with neither shared expert nor dense layers, in Mixtral's layout (block_sparse_moe, w1/w3/w2),
and normalizes q and k across all heads at once. Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) is
Qwen3-MoE's routing beside a shared expert whose output a learned sigmoid gate scales per token,
under Qwen2's attention (q/k/v biases).
"""

from __future__ import annotations

from meshllm.errors import ModelLoadError, UnsupportedArchitecture

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "minimax_m2")


def moe_fields(d: dict, model_type: str, num_layers: int, origin: str) -> dict:
    """ModelConfig fields of a mixture-of-experts config.json."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or d.get("n_routed_experts") or 0)
    per_token = int(d.get("num_experts_per_tok") or 0)
    if not 0 < per_token <= experts:
        raise UnsupportedArchitecture(f"{origin}: {per_token} experts per token of {experts}: not a "
                                      f"mixture-of-experts config meshllm can run")
    if model_type in ("qwen3_moe", "qwen2_moe"):
        # Qwen's MoE configs can keep some layers dense; their released models make every layer sparse.
        step, dense = int(d.get("decoder_sparse_step") or 1), list(d.get("mlp_only_layers") or [])
        if step != 1 or dense:
            raise UnsupportedArchitecture(f"{origin}: decoder_sparse_step {step} / mlp_only_layers {dense}: "
                                          f"meshllm runs {model_type} models whose every layer is sparse")
        width, normalize = int(d["moe_intermediate_size"]), bool(d.get("norm_topk_prob", False))
        if model_type == "qwen2_moe":  # transformers' Qwen2MoeConfig default for the shared expert
            shared = int(d.get("shared_expert_intermediate_size", 5632))
            return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=width,
                        normalize_expert_weights=normalize, shared_expert_size=shared,
                        shared_expert_gated=shared > 0)
    elif model_type == "gpt_oss":
        alpha = float(d.get("swiglu_alpha", SWIGLU_ALPHA))
        if alpha != SWIGLU_ALPHA:
            raise UnsupportedArchitecture(f"{origin}: swiglu_alpha {alpha} is not supported (GPT-OSS's is "
                                          f"{SWIGLU_ALPHA})")
        return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=int(d["intermediate_size"]),
                    expert_biases=True, softmax_after_topk=True, swiglu_limit=float(d.get("swiglu_limit", 7.0)),
                    o_proj_bias=True, attention_sinks=True, **_gpt_oss_windows(d, num_layers, origin))
    elif model_type == "glm4_moe":
        return _glm4_moe_fields(d, experts, per_token, num_layers, origin)
    elif model_type == "minimax_m2":
        return _minimax_m2_fields(d, experts, per_token, num_layers, origin)
    else:  # Mixtral: every layer sparse, the top two always renormalized
        width, normalize = int(d["intermediate_size"]), True
    return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=width,
                normalize_expert_weights=normalize)


def _glm4_moe_fields(d: dict, experts: int, per_token: int, num_layers: int, origin: str) -> dict:
    groups, chosen_groups = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if chosen_groups < groups:  # DeepSeek-V3's: experts from the best groups only
        raise UnsupportedArchitecture(f"{origin}: group-limited routing ({chosen_groups} of {groups} expert groups) "
                                      f"is not supported")
    # transformers' Glm4MoeConfig defaults (every released config names both)
    dense = int(d.get("first_k_dense_replace", 1))
    if not 0 <= dense <= num_layers:
        raise ModelLoadError(f"{origin}: first_k_dense_replace {dense} of {num_layers} layers")
    width = int(d["moe_intermediate_size"])
    return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=width,
                normalize_expert_weights=bool(d.get("norm_topk_prob", True)), sigmoid_router=True,
                expert_weights_scale=float(d.get("routed_scaling_factor", 1.0)),
                shared_expert_size=width * int(d.get("n_shared_experts", 1)), dense_layers=dense,
                qk_norm=bool(d.get("use_qk_norm", False)))


def _minimax_m2_fields(d: dict, experts: int, per_token: int, num_layers: int, origin: str) -> dict:
    """MiniMax-M2's released config.json (and transformers' MiniMaxM2Config, which names fewer of
    these): each switch it may name that would change the computation is checked, not assumed."""
    scoring = d.get("scoring_func", "sigmoid")
    if scoring != "sigmoid" or d.get("use_routing_bias", True) is not True:
        raise UnsupportedArchitecture(f"{origin}: scoring_func {scoring!r} / use_routing_bias "
                                      f"{d.get('use_routing_bias')!r}: meshllm runs MiniMax-M2's sigmoid router "
                                      f"with its selection bias")
    if d.get("use_qk_norm", True) is not True or d.get("qk_norm_type", "per_layer") != "per_layer":
        raise UnsupportedArchitecture(f"{origin}: use_qk_norm {d.get('use_qk_norm')!r} / qk_norm_type "
                                      f"{d.get('qk_norm_type')!r}: meshllm runs MiniMax-M2's q/k norms across "
                                      f"all heads (per_layer)")
    if int(d.get("shared_intermediate_size") or 0):
        raise UnsupportedArchitecture(f"{origin}: a shared expert (shared_intermediate_size "
                                      f"{d['shared_intermediate_size']}) is not supported on minimax_m2")
    kinds = d.get("attn_type_list")
    if kinds is not None and (len(kinds) != num_layers or any(int(k) != 1 for k in kinds)):
        # MiniMax-01 / M1's lightning (linear) attention layers are 0 here
        raise UnsupportedArchitecture(f"{origin}: attn_type_list {kinds!r}: meshllm runs MiniMax-M2's full "
                                      f"attention (1) on every layer, not linear attention")
    # Its chosen weights are renormalized and never scaled: transformers' MiniMaxM2 router and
    # llama.cpp's minimax-m2 graph both ignore a routed_scaling_factor (the released config has none)
    return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=int(d["intermediate_size"]),
                normalize_expert_weights=True, sigmoid_router=True, qk_norm=True, qk_norm_across_heads=True)


def _gpt_oss_windows(d: dict, num_layers: int, origin: str) -> dict:
    """GPT-OSS's windowed layers: every other one (the first included) unless layer_types says."""
    types = d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"{origin}: layer_types must name sliding_attention or full_attention for each of "
                             f"the {num_layers} layers, got {types!r}")
    window = int(d.get("sliding_window") or 0)
    return dict(sliding_window=window or None, sliding_layers=tuple(t == "sliding_attention" for t in types))


SWIGLU_ALPHA = 1.702  # GPT-OSS's gate * sigmoid(alpha * gate), fixed in llama.cpp as in transformers


def router_name(model_type: str, layer: int) -> str:
    """The HF name of a layer's router weight [experts, hidden]."""
    return f"model.layers.{layer}.{_BLOCK[model_type]}.{'router' if model_type == 'gpt_oss' else 'gate'}.weight"


def expert_names(model_type: str, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of one expert's (gate, up, down) weights."""
    stem = f"model.layers.{layer}.{_BLOCK[model_type]}.experts.{expert}"
    return tuple(f"{stem}.{name}.weight" for name in _PROJECTIONS[model_type])


def selection_bias_name(model_type: str, layer: int) -> str:
    """GLM-4.5's and MiniMax-M2's bias [experts] added to a layer's sigmoid scores to pick its experts."""
    gate = "gate." if model_type == "glm4_moe" else ""
    return f"model.layers.{layer}.{_BLOCK[model_type]}.{gate}e_score_correction_bias"


def shared_expert_names(model_type: str, layer: int) -> tuple[str, str, str]:
    """HF names of the shared expert's (gate, up, down) weights in `layer` (GLM-4.5's, Qwen2-MoE's)."""
    module = "shared_expert" if model_type == "qwen2_moe" else "shared_experts"
    return tuple(f"model.layers.{layer}.mlp.{module}.{p}_proj.weight" for p in ("gate", "up", "down"))


def shared_gate_name(layer: int) -> str:
    """Qwen2-MoE's gate [1, hidden] whose sigmoid scales the shared expert's output per token."""
    return f"model.layers.{layer}.mlp.shared_expert_gate.weight"


def router_bias_name(layer: int) -> str:
    """GPT-OSS's router bias [experts]."""
    return router_name("gpt_oss", layer).removesuffix(".weight") + ".bias"


def expert_bias_names(layer: int, expert: int) -> tuple[str, str, str]:
    """GPT-OSS's (gate, up, down) biases of one expert (as a GGUF holds them: gate and up apart)."""
    return tuple(name.removesuffix(".weight") + ".bias" for name in expert_names("gpt_oss", layer, expert))


# gpt_oss: the names each expert's slice takes, of a GGUF's experts tensors (model/gguf.py) and of
# a folder's fused, transposed ones (model/gpt_oss_experts.py)
_BLOCK = {"qwen3_moe": "mlp", "qwen2_moe": "mlp", "mixtral": "block_sparse_moe", "gpt_oss": "mlp", "glm4_moe": "mlp",
          "minimax_m2": "block_sparse_moe"}
_PROJECTIONS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
                "mixtral": ("w1", "w3", "w2"),
                "gpt_oss": ("gate_proj", "up_proj", "down_proj"), "glm4_moe": ("gate_proj", "up_proj", "down_proj"),
                "minimax_m2": ("w1", "w3", "w2")}
