"""Mixture-of-experts layers (Qwen3-MoE, Mixtral) read from config.json.

Each layer's MLP is `num_experts` SwiGLU experts of `expert_intermediate_size` and a router: a
token's router logits go through a softmax, its `num_experts_per_tok` most probable experts run,
and their outputs are summed weighted by those probabilities (renormalized to sum to 1 where the
model says so: Mixtral always, Qwen3-MoE with norm_topk_prob).
"""

from __future__ import annotations

from meshllm.errors import UnsupportedArchitecture

MODEL_TYPES = ("qwen3_moe", "mixtral")


def moe_fields(d: dict, model_type: str, origin: str) -> dict:
    """ModelConfig fields of a mixture-of-experts config.json."""
    experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    per_token = int(d.get("num_experts_per_tok") or 0)
    if not 0 < per_token <= experts:
        raise UnsupportedArchitecture(f"{origin}: {per_token} experts per token of {experts}: not a "
                                      f"mixture-of-experts config meshllm can run")
    if model_type == "qwen3_moe":
        # Qwen3-MoE can keep some layers dense; its released models make every layer sparse.
        step, dense = int(d.get("decoder_sparse_step") or 1), list(d.get("mlp_only_layers") or [])
        if step != 1 or dense:
            raise UnsupportedArchitecture(f"{origin}: decoder_sparse_step {step} / mlp_only_layers {dense}: "
                                          f"meshllm runs Qwen3-MoE models whose every layer is sparse")
        width, normalize = int(d["moe_intermediate_size"]), bool(d.get("norm_topk_prob", False))
    else:  # Mixtral: every layer sparse, the top two always renormalized
        width, normalize = int(d["intermediate_size"]), True
    return dict(num_experts=experts, num_experts_per_tok=per_token, expert_intermediate_size=width,
                normalize_expert_weights=normalize)


def router_name(model_type: str, layer: int) -> str:
    """The HF name of a layer's router weight [experts, hidden]."""
    return f"model.layers.{layer}.{_BLOCK[model_type]}.gate.weight"


def expert_names(model_type: str, layer: int, expert: int) -> tuple[str, str, str]:
    """HF names of one expert's (gate, up, down) weights."""
    stem = f"model.layers.{layer}.{_BLOCK[model_type]}.experts.{expert}"
    return tuple(f"{stem}.{name}.weight" for name in _PROJECTIONS[model_type])


_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
_PROJECTIONS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
