"""Model configuration for the Llama family, parsed from a Hugging Face config.json.

One frozen dataclass; the variants (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM)
are switches on it. Field names keep their config.json names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from meshllm.errors import ModelLoadError, UnsupportedArchitecture

# model_type -> switches that differ from plain Llama.
SUPPORTED_MODEL_TYPES = {
    "llama": {},
    "mistral": {},
    "qwen2": {"attention_bias": True},
    "qwen3": {"qk_norm": True},
}
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3 style frequency scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


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
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 adds a bias on q, k and v
    qk_norm: bool = False  # Qwen3 normalises q and k per head
    sliding_window: int | None = None  # Mistral; None = full attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")

    @property
    def num_parameters(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_hidden_layers * per_layer + h + head

    def layer_parameters(self) -> int:
        """Parameters of one decoder layer (all layers are the same size)."""
        h, i = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        bias = (q + 2 * kv) if self.attention_bias else 0
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return h * (q + 2 * kv) + q * h + 3 * h * i + bias + norms

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        layers = self.num_hidden_layers if num_layers is None else num_layers
        return 2 * layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a config.json dict; rejects architectures we do not implement."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = d.get("architectures") or []
            model_type = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if model_type is None:
            raise UnsupportedArchitecture(
                f"model_type {d.get('model_type')!r} / architectures {d.get('architectures')} is not supported; "
                f"meshllm runs {sorted(SUPPORTED_ARCHITECTURES)} (model_type {sorted(SUPPORTED_MODEL_TYPES)})")
        switches = SUPPORTED_MODEL_TYPES[model_type]
        try:
            heads = int(d["num_attention_heads"])
            hidden = int(d["hidden_size"])
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            head_dim = d.get("head_dim") or hidden // heads
            rope_scaling = _parse_rope_scaling(d.get("rope_scaling"))
            sliding = d.get("sliding_window") if d.get("use_sliding_window", model_type == "mistral") else None
            return cls(
                model_type=model_type,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(d.get("rope_theta", 10000.0)),
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", switches.get("attention_bias", False))),
                qk_norm=switches.get("qk_norm", False),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has a malformed field: {e}") from None

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path} not found: a Hugging Face model folder needs config.json")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
        return cls.from_dict(d)


def _parse_rope_scaling(raw: dict | None) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise UnsupportedArchitecture(f"rope_scaling type {rope_type!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(raw["factor"]),
        low_freq_factor=float(raw["low_freq_factor"]),
        high_freq_factor=float(raw["high_freq_factor"]),
        original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
    )
