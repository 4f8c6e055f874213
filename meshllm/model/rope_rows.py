"""q/k rows stored for an interleaved rotary, put in the order meshllm's rotary turns.

meshllm (as transformers' Llama) turns each head's first rotated dims as two halves: dim i with
dim i + rotated/2. Some checkpoints store q and k for a rotary that turns neighbouring pairs
(2i, 2i + 1) instead: llama.cpp's converter writes Llama's that way for ggml's rope, and GLM-4
is trained that way. Reordering each head's rotated rows (evens first, then odds) turns such a
model into the half form exactly: q and k move together, so every q.k product is the same sum.
"""

from __future__ import annotations

import torch

from meshllm.model.config import ModelConfig

# Families whose checkpoints (folders and GGUF files alike) store q/k in interleaved pairs
INTERLEAVED_ROPE_TYPES = frozenset({"glm4"})


def is_qk(name: str) -> bool:
    """Whether an HF tensor name is a q or k projection's (weight or bias)."""
    return ".q_proj." in name or ".k_proj." in name


def trained_in_pairs(config: ModelConfig, name: str) -> int | None:
    """How many of each head's rows a q/k tensor of this family's checkpoints holds in pairs (its
    turned dims: GLM-4's); None for other tensors and families."""
    return config.rotated_dims if config.model_type in INTERLEAVED_ROPE_TYPES and is_qk(name) else None


def rope_rows_to_half(w: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    """Rows of whole heads (a weight [heads * head_dim, cols], or a bias) with each head's first
    `rotated` rows in interleaved pairs -> the same rows with those halves apart."""
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    pairs = heads[:, :rotated].reshape(heads.shape[0], rotated // 2, 2, *w.shape[1:]).transpose(1, 2)
    turned = pairs.reshape(heads.shape[0], rotated, *w.shape[1:])
    return torch.cat((turned, heads[:, rotated:]), dim=1).reshape(w.shape)
