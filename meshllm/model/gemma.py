"""What sets Gemma 2 and Gemma 3 apart from Llama, read from their config.json (model_type gemma2,
gemma3_text).

Every layer has four norms (before and after attention, before and after the MLP), norms scale by
1 + w, the MLP gates with tanh-approximated GELU, the embedding lookup is scaled by
sqrt(hidden_size), queries by query_pre_attn_scalar ** -0.5, and some layers attend within a
sliding window. Gemma 3: five of six layers are windowed, with their own rope base (10000); the
sixth attends to everything with rope_theta (1e6), its positions divided by a linear factor (8 on
the 4B and larger models); q and k are normed per head. Gemma 2: every other layer is windowed,
one rope base for all, no q/k norms, and attention scores and logits are soft-capped
(cap * tanh(x / cap): 50 and 30).
"""

from __future__ import annotations

import math

from meshllm.errors import ModelLoadError, UnsupportedArchitecture

MODEL_TYPES = ("gemma2", "gemma3_text")
# Each family's default layer pattern: every n-th layer attends to everything
_DEFAULT_PATTERN = {"gemma2": 2, "gemma3_text": 6}
# Gemma 2's caps where its config.json names none (transformers' Gemma2Config defaults)
_GEMMA2_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}


def gemma_fields(d: dict, model_type: str, num_layers: int, origin: str) -> dict:
    """ModelConfig fields of a Gemma 2 or 3 config.json (transformers 4.5x or 5 layout)."""
    if d.get("use_bidirectional_attention"):
        raise UnsupportedArchitecture(f"{origin}: use_bidirectional_attention (an embedding model) is not supported")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedArchitecture(f"{origin}: hidden_activation {act!r} is not supported on {model_type} "
                                      f"(meshllm runs gelu_pytorch_tanh)")
    types = d.get("layer_types")
    if types is None:
        pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern")
                      or _DEFAULT_PATTERN[model_type])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must name sliding_attention or full_attention for each of the "
                             f"{num_layers} layers, got {types!r}")
    if model_type == "gemma3_text":
        global_theta, linear, local_theta = _rope(d)
    else:  # Gemma 2: one rope base for every layer
        global_theta, linear, local_theta = _one_rope(d), 1.0, None
    head_dim = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    caps = {key: d.get(key, _GEMMA2_SOFTCAPS[key] if model_type == "gemma2" else None) for key in _GEMMA2_SOFTCAPS}
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
        qk_norm=model_type == "gemma3_text",
        attn_softcap=_cap(caps["attn_logit_softcapping"]),
        final_softcap=_cap(caps["final_logit_softcapping"]),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
    )


def _cap(value) -> float | None:
    return None if value is None else float(value)


def _one_rope(d: dict) -> float:
    """Gemma 2's rope base, the same for every layer (no scaling)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    _check_type(params, ("default",))
    return float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)


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
        raise UnsupportedArchitecture(f"rope type {kind!r} on gemma is not supported (supported: "
                                      f"{', '.join(allowed)})")
