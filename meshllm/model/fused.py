"""Checkpoints that store q/k/v or gate/up as one tensor (Phi-3's `qkv_proj` and `gate_up_proj`,
llama.cpp's `attn_qkv`): the sources show each as the separate tensors the loader asks for.

A part is a row range of its fused tensor, so reading a part, a tensor-parallel slice of one or
its quantized blocks reads only those rows; nothing is split or copied at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from meshllm.errors import ModelLoadError
from meshllm.model.config import ModelConfig

# fused module -> its parts, in the order their rows are stored
_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


@dataclass(frozen=True, slots=True)
class FusedPart:
    fused: str  # the stored tensor's name
    start: int  # its first row of the fused tensor
    stop: int


def split_fused(config: ModelConfig, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, FusedPart]:
    """Each part name of every fused tensor in `shapes` (HF names) -> its rows."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    rows = {"self_attn.qkv_proj": (q, kv, kv), "mlp.gate_up_proj": (config.intermediate_size,) * 2}
    parts: dict[str, FusedPart] = {}
    for name, shape in shapes.items():
        for module, names in _PARTS.items():
            prefix, found, suffix = name.partition(f".{module}.")
            if not found:
                continue
            if not shape or shape[0] != sum(rows[module]):
                raise ModelLoadError(f"tensor {name!r} has shape {list(shape)}; fused {module} of this config "
                                     f"has {sum(rows[module])} rows ({' + '.join(map(str, rows[module]))})")
            start = 0
            for part, count in zip(names, rows[module]):
                parts[f"{prefix}.{part}.{suffix}"] = FusedPart(name, start, start + count)
                start += count
    return parts


def visible_names(stored: list[str] | set[str], parts: Mapping[str, FusedPart]) -> list[str]:
    """The names a source shows: the stored ones, each fused tensor replaced by its parts."""
    fused = {p.fused for p in parts.values()}
    return sorted({n for n in stored if n not in fused} | set(parts))
