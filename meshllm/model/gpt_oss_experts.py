"""GPT-OSS folders' experts, read as one nn.Linear-shaped tensor per expert and projection.

A GPT-OSS checkpoint holds each layer's experts as two 3-d tensors, transposed against
nn.Linear's [out, in] and with gate and up interleaved column by column (transformers'
GptOssExperts: gate_up_proj [experts, hidden, 2 * width], gate = [..., ::2], up = [..., 1::2];
down_proj [experts, width, hidden]; their biases [experts, 2 * width] and [experts, hidden]).
meshllm's MoE reads one expert at a time by the names model/moe.py gives them (as a GGUF
stores them: gate and up apart, [rows, cols]), so a folder source shows those names and reads
each one as its expert's slice of the stored tensor, de-interleaved and transposed here.

The released checkpoints (openai/gpt-oss-20b, -120b) store the experts in MXFP4 instead:
`gate_up_proj_blocks` [experts, 2 * width, blocks, 16] (not transposed; gate and up interleaved
by row) with one E8M0 exponent per 32 values in `gate_up_proj_scales` [experts, 2 * width,
blocks]; `down_proj_*` alike. Those stay MXFP4: `repack` lays each expert's rows out as ggml's
MXFP4 blocks (the same values, bytes moved, as llama.cpp's converter writes them to a GGUF), so
the folder loads as the GGUF would, at a quarter of the BF16 size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshllm.model import moe

MXFP4_BLOCK = 32  # values per exponent


@dataclass(frozen=True)
class ExpertView:
    stored: str  # the 3-d (or, for biases, 2-d) tensor holding every expert
    expert: int
    columns: slice  # of the expert's [hidden, 2 * width] (or [2 * width]) slice: gate's or up's
    transposed: bool  # a weight (to [out, in]); biases stay as they are
    # MXFP4 blocks: the stored exponents beside `stored` (the codes); `columns` then picks rows
    scales: str | None = None


def expert_views(num_layers: int, num_experts: int, shapes: dict[str, tuple[int, ...]]) -> dict[str, ExpertView]:
    """Each expert projection's name (model/moe.py) -> where it lies in the stored tensors."""
    in_blocks = any(name.endswith("_blocks") for name in shapes)
    views = {}
    every, gate, up = slice(None), slice(0, None, 2), slice(1, None, 2)
    for layer in range(num_layers):
        stem = f"model.layers.{layer}.mlp.experts"
        for e in range(num_experts):
            weights = moe.expert_names("gpt_oss", layer, e)
            biases = moe.expert_bias_names(layer, e)
            for names, suffix, transposed in ((weights, "", True), (biases, "_bias", False)):
                for name, stored, rows in zip(names, ("gate_up_proj", "gate_up_proj", "down_proj"), (gate, up, every)):
                    if in_blocks and names is weights:
                        views[name] = ExpertView(f"{stem}.{stored}_blocks", e, rows, False, f"{stem}.{stored}_scales")
                    else:
                        views[name] = ExpertView(f"{stem}.{stored}{suffix}", e, rows, transposed)
    return views


def view_shape(view: ExpertView, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one expert's tensor, as read (stored_shape: the whole stored tensor's)."""
    if view.scales is not None:  # [experts, rows, blocks, 16] -> [its rows, blocks * 32]
        return len(range(stored_shape[1])[view.columns]), stored_shape[2] * MXFP4_BLOCK
    one = torch.empty(stored_shape[1:], device="meta")
    return tuple(take(view, one).shape)


def take(view: ExpertView, expert_tensor: torch.Tensor) -> torch.Tensor:
    """One expert's tensor ([hidden, 2 * width] or [2 * width], ...) -> its projection's, as read."""
    out = expert_tensor[..., view.columns]
    return out.transpose(0, 1).contiguous() if view.transposed else out.contiguous()


def take_blocks(view: ExpertView, expert_blocks: torch.Tensor, expert_scales: torch.Tensor) -> torch.Tensor:
    """One expert's MXFP4 codes [rows, blocks, 16] and exponents [rows, blocks] -> its
    projection's rows as ggml MXFP4 blocks, uint8 [rows, blocks * 17]."""
    return repack(expert_blocks[view.columns], expert_scales[view.columns])


def repack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's MXFP4 layout -> ggml's, exactly (the same codes and exponents, moved).

    OpenAI's byte i of a block holds values 2i (low nibble) and 2i + 1 (high): transformers'
    convert_moe_packed_tensors. ggml's block_mxfp4 is the exponent byte, then byte j holding
    values j (low) and j + 16 (high): ggml's dequantize_row_mxfp4. Both exponents are E8M0 and
    both code the same E2M1 values (ggml's table doubled, its exponent halved)."""
    assert blocks.dtype == scales.dtype == torch.uint8 and blocks.shape[-1] == MXFP4_BLOCK // 2, blocks.shape
    assert blocks.shape[:-1] == scales.shape, (blocks.shape, scales.shape)
    values = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [..., 32] codes in order
    half = MXFP4_BLOCK // 2
    codes = values[..., :half] | (values[..., half:] << 4)
    return torch.cat((scales.unsqueeze(-1), codes), dim=-1).flatten(-2).contiguous()
