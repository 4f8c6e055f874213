"""Model configuration for the Llama family, parsed from a Hugging Face config.json.

One frozen dataclass; the variants (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM, Phi-3/4)
are switches on it. Field names keep their config.json names.
"""

from __future__ import annotations

import json
import math
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.errors import ModelLoadError, UnsupportedArchitecture
from meshllm.model import gemma, moe

# model_type -> switches that differ from plain Llama.
SUPPORTED_MODEL_TYPES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
    # Phi-3 and Phi-4 are Llama computed from fused q/k/v and gate/up tensors (the sources split
    # them, model/fused.py), with Mistral's sliding window when the config sets one.
    "phi3": {},
    # Gemma 2 and Gemma 3's text model: see model/gemma.py for what sets them apart.
    "gemma2": {},
    "gemma3_text": {},
    # Mixtures of experts (model/moe.py): Qwen3 attention with expert MLPs, and Mixtral (Mistral's)
    "qwen3_moe": {"qk_norm": True},
    "qwen2_moe": {"attention_bias": True},
    "mixtral": {},
    # SmolLM3: Llama with no rotary on every fourth layer (NoPE, rope_layers)
    "smollm3": {},
    # Granite 3.x: Llama with four multipliers (embedding, attention, residual, logits)
    "granite": {},
    # GLM-4 (0414, Z1): q/k/v biases, fused gate/up, norms after attention and the MLP too, half of
    # each head turned in interleaved pairs (model/rope_rows.py reorders q/k at load)
    "glm4": {"attention_bias": True},
    # GPT-OSS: a mixture of experts with biases everywhere, attention sinks, every other layer
    # windowed (model/moe.py); GGUF files, BF16 and MXFP4 folders (model/gpt_oss_experts.py)
    "gpt_oss": {"attention_bias": True},
    # GLM-4.5 / 4.6 / Air: experts picked by sigmoid scores, a shared expert, dense first layers
    # (model/moe.py); q/k/v biases, half of each head turned (rotate-half, not GLM-4's pairs)
    "glm4_moe": {},
    # MiniMax-M2 (M2.1, M2.5): GLM-4.5's routing in Mixtral's layout, q/k norms across all heads,
    # half of each head turned rotate-half (model/moe.py)
    "minimax_m2": {},
}
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Glm4ForCausalLM": "glm4",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "MiniMaxM2ForCausalLM": "minimax_m2",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class YarnScaling:
    """YaRN ("rope_type": "yarn"; Qwen3's and Qwen2.5's long-context configs, Ministral): each
    frequency between its extrapolated and its interpolated (divided by `factor`) value, by a
    ramp between the dims that turn beta_fast and beta_slow times over the original context. The
    cos/sin scale it implies goes in ModelConfig.rope_attention_factor."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True  # the ramp's ends rounded out to whole dims (all but GPT-OSS)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | YarnScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 adds a bias on q, k and v
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    # MiniMax-M2 normalises them across all heads at once (one RMS over q, one over k; weights of
    # heads * head_dim), before the heads are split out
    qk_norm_across_heads: bool = False
    sliding_window: int | None = None  # Mistral, Phi-3; None = full attention
    # Partial rotary (Phi-4-mini): only the first rotary_dim dims of each head rotate, the rest
    # pass through. None: the whole head (every other model).
    rotary_dim: int | None = None
    # Which layers rotate q and k at all (SmolLM3 skips every fourth); None: every layer.
    rope_layers: tuple[bool, ...] | None = None
    # LongRoPE (Phi-3.5, Phi-3 128k): each rotary frequency divided by its factor, cos and sin
    # multiplied by the attention factor. None and 1.0 for every other model.
    rope_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    # Gemma 3 (model/gemma.py); the defaults are every other family's.
    hidden_act: str = "silu"  # or "gelu_tanh": the MLP's gate
    embedding_scale: float = 1.0  # the embedding lookup times this
    sandwich_norms: bool = False  # a norm after attention and after the MLP too
    norm_weight_offset: float = 0.0  # added to norm weights at load (Gemma stores w of a 1 + w norm)
    attention_scale: float | None = None  # None: head_dim ** -0.5
    sliding_layers: tuple[bool, ...] | None = None  # the layers sliding_window applies to; None: all
    local_rope_theta: float | None = None  # the sliding layers' rope base; None: rope_theta
    rope_linear_factor: float = 1.0  # positions of the other layers divided by it (rope "linear")
    # Mixture of experts (model/moe.py); 0 experts: a dense MLP of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    expert_intermediate_size: int = 0
    normalize_expert_weights: bool = False  # the chosen experts' weights rescaled to sum to 1
    # GPT-OSS: the router and every expert's projections have biases; a token's weights are the
    # softmax of its chosen experts' logits (not of all of them); its SwiGLU is clamped
    # (gate <= limit, |up| <= limit, gate * sigmoid(1.702 gate) * (up + 1))
    expert_biases: bool = False
    softmax_after_topk: bool = False
    swiglu_limit: float | None = None
    # GPT-OSS's attention: a bias on o_proj, and a learned logit per head (a "sink") that joins
    # each row's softmax and takes its share of the weight without a value
    o_proj_bias: bool = False
    attention_sinks: bool = False
    # GLM-4.5: a token's experts are those of the highest sigmoid scores once a learned bias per
    # expert is added (the bias only picks: the weights are the scores, renormalized where
    # normalize_expert_weights says, times expert_weights_scale); a shared expert, a SwiGLU of
    # shared_expert_size, runs for every token beside them; the first dense_layers layers have a
    # dense MLP of intermediate_size instead of experts.
    sigmoid_router: bool = False
    expert_weights_scale: float = 1.0
    shared_expert_size: int = 0
    dense_layers: int = 0
    # Qwen2-MoE: the shared expert's output times sigmoid(a learned gate [1, hidden] . x) per token
    shared_expert_gated: bool = False
    # Granite: each layer's attention and MLP outputs times residual_scale before they join the
    # stream; the logits divided by logit_scale. 1.0 for every other family.
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    # Gemma 2: attention scores and logits pass through cap * tanh(x / cap); None: not capped
    attn_softcap: float | None = None
    final_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ModelLoadError(f"config field sliding_window must be positive or null, got {self.sliding_window}")
        if not (self.logit_scale > 0 and self.residual_scale > 0 and self.embedding_scale > 0):
            raise ModelLoadError(f"multipliers must be positive: logits_scaling {self.logit_scale}, residual "
                                 f"{self.residual_scale}, embedding {self.embedding_scale}")
        if any(cap is not None and not cap > 0 for cap in (self.attn_softcap, self.final_softcap)):
            raise ModelLoadError(f"logit soft caps must be positive or null: attention {self.attn_softcap}, "
                                 f"final {self.final_softcap}")
        if self.rope_layers is not None and len(self.rope_layers) != self.num_hidden_layers:
            raise ModelLoadError(f"{len(self.rope_layers)} no_rope_layers entries for {self.num_hidden_layers} layers")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.num_hidden_layers:
            raise ModelLoadError(f"{len(self.sliding_layers)} layer types for {self.num_hidden_layers} layers")
        if self.rotary_dim is not None and not (0 < self.rotary_dim < self.head_dim and self.rotary_dim % 2 == 0):
            raise ModelLoadError(f"a partial rotary of {self.rotary_dim} dims in a head of {self.head_dim}: it must "
                                 f"be even, positive and less than the head")
        if self.rope_factors is not None and len(self.rope_factors) != self.rotated_dims // 2:
            raise ModelLoadError(f"rope short_factor has {len(self.rope_factors)} entries; {self.rotated_dims} "
                                 f"rotated dims of a head make {self.rotated_dims // 2} frequencies")

    @property
    def rotated_dims(self) -> int:
        """Dims of each head the rotary embedding turns (the first ones; the rest pass through)."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def num_parameters(self) -> int:
        h, v = self.hidden_size, self.vocab_size
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + sum(self.layer_parameters(i) for i in range(self.num_hidden_layers)) + h + head

    def layer_is_moe(self, layer: int) -> bool:
        """Whether `layer` (0-based in the whole model) has experts (GLM-4.5's first ones do not)."""
        return self.num_experts > 0 and layer >= self.dense_layers

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer` (0-based in the whole model), or None for full attention."""
        return None if self.sliding_layers is not None and not self.sliding_layers[layer] else self.sliding_window

    def layer_rope(self, layer: int) -> tuple[float, float] | None:
        """(rope base, linear factor) of `layer`: Gemma 3's sliding layers have their own. None: the
        layer does not rotate q and k (SmolLM3's NoPE layers)."""
        if self.rope_layers is not None and not self.rope_layers[layer]:
            return None
        if self.local_rope_theta is not None and self.sliding_layers is not None and self.sliding_layers[layer]:
            return self.local_rope_theta, 1.0
        return self.rope_theta, self.rope_linear_factor

    def layer_parameters(self, layer: int | None = None) -> int:
        """Parameters of decoder layer `layer`; None: of the largest (a mixture of experts' first
        layers may be dense, the rest are all the same size)."""
        if layer is None:  # the layers are of two kinds: the first dense_layers, and the rest
            return max(self.layer_parameters(0), self.layer_parameters(self.num_hidden_layers - 1))
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        bias = ((q + 2 * kv) if self.attention_bias else 0) + (h if self.o_proj_bias else 0)
        qk_norms = (q + kv if self.qk_norm_across_heads else 2 * self.head_dim) if self.qk_norm else 0
        norms = (4 if self.sandwich_norms else 2) * h + qk_norms
        sinks = self.num_attention_heads if self.attention_sinks else 0
        e, w = self.num_experts, self.expert_intermediate_size
        mlp = 3 * h * i if not self.layer_is_moe(layer) else (
            e * (3 * h * w + h) + (e * (2 * w + h + 1) if self.expert_biases else 0)
            + (e if self.sigmoid_router else 0) + 3 * h * self.shared_expert_size
            + (h if self.shared_expert_gated else 0))
        return h * (q + 2 * kv) + q * h + mlp + bias + norms + sinks

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        layers = self.num_hidden_layers if num_layers is None else num_layers
        return 2 * layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict, origin: str = "config.json") -> "ModelConfig":
        """Build from a config.json dict; rejects architectures we do not implement.

        `origin` names where the dict came from, for error messages.
        """
        if not isinstance(d, dict):
            raise ModelLoadError(f"{origin} must hold a JSON object, got {type(d).__name__}")
        model_type = _model_type(d, origin)
        switches = SUPPORTED_MODEL_TYPES[model_type]
        _reject_unsupported_switches(d, model_type, origin)
        try:
            heads = _positive_int(d, "num_attention_heads")
            hidden = _positive_int(d, "hidden_size")
            eos = d.get("eos_token_id")
            eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            head_dim = d.get("head_dim") or hidden // heads
            # as transformers rounds it; a GGUF's dict (model/gguf.py) gives the file's count exactly
            rotary_dim = int(d.get("_rotated_dims") or int(head_dim) * _partial_rotary_factor(d, model_type))
            rope_theta, rope_scaling = _parse_rope(d, origin) if model_type not in gemma.MODEL_TYPES else (0.0, None)
            long_rope = _long_rope(d)
            max_positions = int(d.get("max_position_embeddings") or 2048)
            if long_rope is not None:
                # The short factors hold up to the original context; past it transformers switches
                # every position to the long factors (and llama.cpp does for a context that long).
                # One set of factors for a sequence's whole life keeps its cached keys valid, so
                # the context stops at the original length.
                max_positions = min(max_positions, long_rope[2])
            sliding = d.get("sliding_window") if d.get("use_sliding_window", model_type in ("mistral", "phi3",
                                                                                          "mixtral")) \
                else None
            if sliding and int(sliding) >= max_positions:
                sliding = None  # a window as long as the context hides nothing (Phi-3.5's is 262144)
            # Gemma's switches replace the generic ones they overlap (rope, window, norms)
            family = gemma.gemma_fields(d, model_type, int(d["num_hidden_layers"]), origin) \
                if model_type in gemma.MODEL_TYPES else {}
            if model_type in moe.MODEL_TYPES:
                family = moe.moe_fields(d, model_type, int(d["num_hidden_layers"]), origin)
            if model_type == "glm4":
                family = dict(sandwich_norms=True)
            if model_type == "granite":  # transformers' GraniteConfig defaults
                # rounded to float32, as torch multiplies by them and a GGUF stores them
                scales = array("f", [float(d.get(k, 1.0)) for k in ("embedding_multiplier", "attention_multiplier",
                                                                    "residual_multiplier", "logits_scaling")])
                family = dict(zip(("embedding_scale", "attention_scale", "residual_scale", "logit_scale"),
                                  scales.tolist()))
            fields = dict(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=max_positions,
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # Qwen2-MoE's config names it qkv_bias (transformers 5)
                attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", switches.get("attention_bias", False)))),
                qk_norm=switches.get("qk_norm", False),
                sliding_window=int(sliding) if sliding else None,
                rotary_dim=None if rotary_dim == int(head_dim) else rotary_dim,
                rope_layers=_rope_layers(d, model_type, int(d["num_hidden_layers"])),
                rope_factors=None if long_rope is None else long_rope[0],
                rope_attention_factor=_rope_attention_factor(d, long_rope, rope_scaling),
                bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
                eos_token_ids=eos_ids,
            )
            return cls(**{**fields, **family})
        except KeyError as e:
            raise ModelLoadError(f"{origin} lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{origin} has a malformed field: {e}") from None
        except ModelLoadError as e:
            raise type(e)(f"{origin}: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: a Hugging Face model folder needs config.json")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d, origin=str(path))


def _model_type(d: dict, origin: str) -> str:
    model_type = d.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    archs = d.get("architectures") or []
    if isinstance(archs, list):
        for arch in archs:
            if arch in SUPPORTED_ARCHITECTURES:
                return SUPPORTED_ARCHITECTURES[arch]
    raise UnsupportedArchitecture(
        f"{origin}: model_type {model_type!r} / architectures {archs} is not supported; meshllm runs "
        f"{sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(SUPPORTED_MODEL_TYPES)})")


def _reject_unsupported_switches(d: dict, model_type: str, origin: str) -> None:
    # Each of these changes the computation; running without it would give silently wrong logits.
    act = d.get("hidden_act", "silu")
    if act != "silu" and model_type not in gemma.MODEL_TYPES:  # Gemma's is checked in model/gemma.py
        raise UnsupportedArchitecture(f"{origin}: hidden_act {act!r} is not supported (meshllm runs silu MLPs)")
    if d.get("mlp_bias"):
        raise UnsupportedArchitecture(f"{origin}: mlp_bias=true is not supported (meshllm runs bias-free MLPs)")
    o_proj_bias_families = ("llama", "qwen3", "qwen3_moe", "granite", "smollm3", *gemma.MODEL_TYPES)
    if model_type in o_proj_bias_families and d.get("attention_bias"):
        # In these families attention_bias also adds a bias to o_proj, which the decoder does not have.
        raise UnsupportedArchitecture(f"{origin}: attention_bias=true on {model_type} (a bias on o_proj too) "
                                      f"is not supported")
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3") and d.get("use_sliding_window"):
        raise UnsupportedArchitecture(f"{origin}: use_sliding_window=true on {model_type} (sliding attention on "
                                      f"some layers only) is not supported; set it to false")
    partial = _partial_rotary_factor(d, model_type)
    if partial != 1.0 and model_type not in PARTIAL_ROTARY_TYPES:  # of the families here, theirs only
        raise UnsupportedArchitecture(f"{origin}: partial_rotary_factor {partial} on {model_type} is not supported "
                                      f"(meshllm rotates part of the head for {', '.join(PARTIAL_ROTARY_TYPES)} only)")
    if not 0.0 < partial <= 1.0:
        raise ModelLoadError(f"{origin}: partial_rotary_factor must be in (0, 1], got {partial}")


def _rope_layers(d: dict, model_type: str, layers: int) -> tuple[bool, ...] | None:
    """SmolLM3's no_rope_layers (1: the layer rotates), made as transformers makes them when the
    config has none: every no_rope_layer_interval-th layer without."""
    if model_type != "smollm3":
        return None
    flags = d.get("no_rope_layers")
    if flags is None:
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    return tuple(bool(f) for f in flags)


PARTIAL_ROTARY_TYPES = ("phi3", "glm4", "glm4_moe", "minimax_m2")


def _partial_rotary_factor(d: dict, model_type: str) -> float:
    """The share of each head the rotary turns (Phi-4-mini: 0.75), from either config layout;
    transformers' Glm4Config and Glm4MoeConfig default it to 0.5. MiniMax-M2's released config
    names a rotary_dim instead (64 of 128), as transformers reads it."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    inner = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    value = d.get("partial_rotary_factor", inner)
    if value is None and model_type == "minimax_m2" and d.get("rotary_dim") and d.get("head_dim"):
        value = int(d["rotary_dim"]) / int(d["head_dim"])
    return (0.5 if model_type in ("glm4", "glm4_moe") else 1.0) if value is None else float(value)


def _positive_int(d: dict, key: str) -> int:
    value = int(d[key])
    if value <= 0:
        raise ModelLoadError(f"config field {key} must be positive, got {value}")
    return value


def _parse_rope(d: dict, origin: str) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(rope_theta, scaling) from either layout of config.json.

    transformers < 5 writes `rope_theta` and `rope_scaling` at the top level; transformers >= 5
    writes one `rope_parameters` dict holding `rope_theta` and the scaling keys.
    """
    raw = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise ModelLoadError(f"rope_parameters / rope_scaling must be an object, got {raw!r}")
    rope_theta = float(raw.get("rope_theta") or d.get("rope_theta") or 10000.0)
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default", *_LONG_ROPE_TYPES):
        return rope_theta, None
    if rope_type == "yarn":
        return rope_theta, _yarn(d, raw)
    if rope_type != "llama3":
        raise UnsupportedArchitecture(f"rope scaling type {rope_type!r} is not supported (supported: llama3, "
                                      f"yarn, longrope)")
    try:
        scaling = RopeScaling(
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings")
                                                 or d["max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelLoadError(f"llama3 rope scaling lacks required field {e.args[0]!r}") from None
    return rope_theta, scaling


def _yarn(d: dict, raw: dict) -> YarnScaling:
    """A yarn rope config, its original context as transformers finds it (the top-level field
    first, then the rope's, then max_position_embeddings)."""
    original = d.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings") \
        or d.get("max_position_embeddings")
    factor = raw.get("factor") or (int(d["max_position_embeddings"]) / int(original) if original else None)
    if not factor or not original or float(factor) < 1.0 or int(original) <= 0:
        raise ModelLoadError(f"yarn rope scaling needs a factor >= 1 and an original context, got factor {factor} "
                             f"and original_max_position_embeddings {original}")
    return YarnScaling(factor=float(factor), original_max_position_embeddings=int(original),
                       beta_fast=float(raw.get("beta_fast") or 32.0), beta_slow=float(raw.get("beta_slow") or 1.0),
                       truncate=bool(raw.get("truncate", True)))


def _rope_attention_factor(d: dict, long_rope, scaling) -> float:
    """The scale on cos and sin: LongRoPE's, YaRN's, or none (1.0)."""
    if long_rope is not None:
        return long_rope[1]
    if isinstance(scaling, YarnScaling):
        return _yarn_attention_factor(d.get("rope_parameters") or d.get("rope_scaling"), scaling)
    return 1.0


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude scale for a context `factor` times the original (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn_attention_factor(raw: dict, yarn: YarnScaling) -> float:
    """YaRN's cos/sin scale, as transformers computes it (_compute_yarn_parameters), in float32."""
    given = raw.get("attention_factor")
    if given is None:
        m, m_all = raw.get("mscale"), raw.get("mscale_all_dim")
        given = yarn_mscale(yarn.factor, m) / yarn_mscale(yarn.factor, m_all) if m and m_all \
            else yarn_mscale(yarn.factor)
    return array("f", [float(given)]).tolist()[0]


_LONG_ROPE_TYPES = ("longrope", "su")  # "su": Phi-3's first name for it


def _long_rope(d: dict) -> tuple[tuple[float, ...], float, int] | None:
    """(short factors, attention factor, original context) of a LongRoPE config, else None.

    As transformers computes them (modeling_rope_utils._compute_longrope_parameters): the
    attention factor is sqrt(1 + ln(s) / ln(original)) for s = max_position_embeddings / original,
    unless the config gives it.
    """
    raw = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if raw.get("rope_type", raw.get("type")) not in _LONG_ROPE_TYPES:
        return None
    try:
        short = tuple(float(f) for f in raw["short_factor"])
        # transformers reads Phi-3's top-level field first
        original = int(d.get("original_max_position_embeddings") or raw["original_max_position_embeddings"])
    except KeyError as e:
        raise ModelLoadError(f"longrope scaling lacks required field {e.args[0]!r}") from None
    if original <= 0 or not all(f > 0 for f in short):
        raise ModelLoadError("longrope needs a positive original_max_position_embeddings and "
                             "positive short_factor entries")
    factor = raw.get("factor") or int(d.get("max_position_embeddings") or original) / original
    attention = raw.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    # Rounded to float32, as every consumer computes with them and a GGUF stores them: a
    # folder and its GGUF conversion then have equal configs.
    short, (attention,) = tuple(array("f", short).tolist()), array("f", [attention]).tolist()
    return short, attention, original
