"""Block-scaled FP8 checkpoints: DeepSeek-V3's format, which Qwen3-*-FP8 and MiniMax-M2 are
released in (config.json: quantization_config quant_method "fp8" with a weight_block_size,
usually [128, 128]; `fmt` "e4m3" in Qwen's and DeepSeek's, "float8_e4m3fn" in MiniMax's).

Each quantized weight is float8_e4m3fn, beside a `<name>_scale_inv` of one factor per tile of
block rows x block columns ([ceil(rows / br), ceil(cols / bc)], the last tiles cut short where a
dimension is not a multiple): a value is its code times its tile's factor. Other tensors (norms,
embeddings, routers, lm_head: the config's modules_to_not_convert) are stored unquantized.

meshllm dequantizes them as they are read, multiplying in float32 and rounding once to the run
dtype; `--quantize int8|int4` quantizes the linears on from there. Other quantization methods
(GPTQ, AWQ, bitsandbytes, compressed-tensors, per-tensor FP8, ...) are refused by name, before any
tensor is read (their packed codes and factors would otherwise fail the load as missing or unused
tensors, which names the symptom, not the cause).
"""

from __future__ import annotations

import torch

from meshllm.errors import ModelLoadError, UnsupportedArchitecture

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
_OTHER_HANDLED_METHODS = ("mxfp4",)  # GPT-OSS's experts (model/gpt_oss_experts.py)


def block_shape(config: dict, origin: str) -> tuple[int, int] | None:
    """The (rows, cols) tile of a block-scaled FP8 config.json; None for an unquantized one."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ModelLoadError(f"{origin}: quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method in _OTHER_HANDLED_METHODS:
        return None
    if method != "fp8":
        raise UnsupportedArchitecture(f"{origin}: weights quantized by {method!r} are not supported; meshllm reads "
                                      f"unquantized and block-scaled FP8 folders, and GGUF files (convert the "
                                      f"model to GGUF, or use its unquantized release)")
    size = q.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
        raise UnsupportedArchitecture(f"{origin}: FP8 without a weight_block_size ({size!r}: per-tensor scales) "
                                      f"is not supported; meshllm reads block-scaled FP8 (DeepSeek-V3's format)")
    # `fmt` is not read (Qwen's and DeepSeek's say "e4m3", MiniMax's "float8_e4m3fn", as transformers
    # and vLLM ignore it): each tensor's own dtype says, and only float8_e4m3fn weights are read
    return size[0], size[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a weight of `shape`: one factor per (possibly cut short) tile."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def scale_region(rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
                 ) -> tuple[tuple[int, int], tuple[int, int]]:
    """The scale grid's rows and columns covering a weight's rows [r0, r1) and columns [c0, c1)."""
    (r0, r1), (c0, c1), (br, bc) = rows, cols, block
    return (r0 // br, -(-r1 // br)), (c0 // bc, -(-c1 // bc))


def dequantize(codes: torch.Tensor, scales: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int],
               block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The values of a weight's rows [r0, r1) and columns [c0, c1): `codes` those FP8 codes,
    `scales` the factors scale_region names, multiplied in float32 and rounded once to `dtype`."""
    (r0, r1), (c0, c1), (br, bc) = rows, cols, block
    factors = scales.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    factors = factors[r0 - r0 // br * br:, c0 - c0 // bc * bc:][:r1 - r0, :c1 - c0]
    return (codes.float() * factors).to(dtype)
