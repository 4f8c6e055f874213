"""What sets Gemma 3 apart from Llama, read from its config.json (model_type gemma3_text).

Every layer has four norms (before and after attention, before and after the MLP), norms scale by
1 + w, the MLP gates with tanh-approximated GELU, the embedding lookup is scaled by
sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5, and layers alternate: five of six
attend within a sliding window with their own rope base (10000), the sixth attends to everything
with rope_theta (1e6), its positions divided by a linear factor (8 on the 4B and larger models).
"""

from __future__ import annotations

import math

from meshllm.errors import ModelLoadError, UnsupportedArchitecture

MODEL_TYPES = ("gemma3_text",)
# Gemma 3's own default layer pattern: every sixth layer attends to everything
_DEFAULT_PATTERN = 6


def gemma_fields(d: dict, num_layers: int, origin: str) -> dict:
    """ModelConfig fields of a Gemma 3 config.json (transformers 4.5x or 5 layout)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:  # Gemma 2's; Gemma 3 has none
            raise UnsupportedArchitecture(f"{origin}: {key} {d[key]} is not supported (Gemma 2's logit soft "
                                          f"capping; meshllm runs Gemma 3)")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedArchitecture(f"{origin}: use_bidirectional_attention (an embedding model) is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(f"{origin}: hidden_activation {act!r} is not supported on gemma3 "
                                      f"(meshllm runs gelu_pytorch_tanh)")
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or _DEFAULT_PATTERN)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must name sliding_attention or full_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
    global_theta, linear, local_theta = _rope(d)
    head_dim = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    return dict(
        hidden_act="gelu_tanh",
        embedding_scale=math.sqrt(int(d["hidden_size"])),
        sandwich_norms=True,
        norm_weight_offset=0.0 if d.get("norm_weights_include_one") else 1.0,  # a GGUF has added it
        attention_scale=float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        sliding_window=int(d["sliding_window"]) if d.get("sliding_window") else None,
        sliding_layers=tuple(t == "sliding_attention" for t in types),
        rope_theta=global_theta,
        rope_linear_factor=linear,
        local_rope_theta=local_theta,
        qk_norm=True,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def _rope(d: dict) -> tuple[float, float, float]:
    """(full layers' theta, their linear factor, sliding layers' theta)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5: one dict per layer type
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
        _check_type(full, ("default", "linear"))
        _check_type(local, ("default",))
        return (float(full.get("rope_theta", 1e6)), float(full.get("factor") or 1.0)
                if full.get("rope_type") == "linear" else 1.0, float(local.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or {}
    _check_type(scaling, ("default", "linear"))
    linear = float(scaling.get("factor") or 1.0) if scaling.get("rope_type", scaling.get("type")) == "linear" else 1.0
    return float(d.get("rope_theta", 1e6)), linear, float(d.get("rope_local_base_freq", 10000.0))


def _check_type(params: dict, allowed: tuple[str, ...]) -> None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in allowed:
        raise UnsupportedArchitecture(f"rope type {kind!r} on gemma3 is not supported (supported: "
                                      f"{', '.join(allowed)})")
