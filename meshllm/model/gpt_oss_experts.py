"""GPT-OSS folders' experts, read as one nn.Linear-shaped tensor per expert and projection.

A GPT-OSS checkpoint holds each layer's experts as two 3-d tensors, transposed against
nn.Linear's [out, in] and with gate and up interleaved column by column (transformers'
GptOssExperts: gate_up_proj [experts, hidden, 2 * width], gate = [..., ::2], up = [..., 1::2];
down_proj [experts, width, hidden]; their biases [experts, 2 * width] and [experts, hidden]).
meshllm's MoE reads one expert at a time by the names model/moe.py gives them (as a GGUF
stores them: gate and up apart, [rows, cols]), so a folder source shows those names and reads
each one as its expert's slice of the stored tensor, de-interleaved and transposed here.
The released checkpoints store the experts in MXFP4 blocks instead, which meshllm reads from
the GGUF llama.cpp's converter writes of them (refused here by name).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm.errors import UnsupportedArchitecture
from meshllm.model import moe


@dataclass(frozen=True)
class ExpertView:
    stored: str  # the 3-d (or, for biases, 2-d) tensor holding every expert
    expert: int
    columns: slice  # of the expert's [hidden, 2 * width] (or [2 * width]) slice: gate's or up's
    transposed: bool  # a weight (to [out, in]); biases stay as they are


def expert_views(num_layers: int, num_experts: int, shapes: dict[str, tuple[int, ...]],
                 origin: str) -> dict[str, ExpertView]:
    """Each expert projection's name (model/moe.py) -> where it lies in the stored tensors."""
    if any(name.endswith(("_blocks", "_scales")) for name in shapes):
        raise UnsupportedArchitecture(
            f"{origin} stores GPT-OSS's experts in MXFP4 blocks (gate_up_proj_blocks); meshllm reads those from "
            f"a GGUF file (llama.cpp's convert_hf_to_gguf.py writes one, keeping them MXFP4) or from a BF16 checkpoint")
    views = {}
    every, gate, up = slice(None), slice(0, None, 2), slice(1, None, 2)
    for layer in range(num_layers):
        stem = f"model.layers.{layer}.mlp.experts"
        for e in range(num_experts):
            weights = moe.expert_names("gpt_oss", layer, e)
            biases = moe.expert_bias_names(layer, e)
            for names, suffix, transposed in ((weights, "", True), (biases, "_bias", False)):
                views[names[0]] = ExpertView(f"{stem}.gate_up_proj{suffix}", e, gate, transposed)
                views[names[1]] = ExpertView(f"{stem}.gate_up_proj{suffix}", e, up, transposed)
                views[names[2]] = ExpertView(f"{stem}.down_proj{suffix}", e, every, transposed)
    return views


def view_shape(view: ExpertView, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one expert's tensor, as read (stored_shape: the whole stored tensor's)."""
    one = torch.empty(stored_shape[1:], device="meta")
    return tuple(take(view, one).shape)


def take(view: ExpertView, expert_tensor: torch.Tensor) -> torch.Tensor:
    """One expert's tensor ([hidden, 2 * width] or [2 * width], ...) -> its projection's, as read."""
    out = expert_tensor[..., view.columns]
    return out.transpose(0, 1).contiguous() if view.transposed else out.contiguous()
