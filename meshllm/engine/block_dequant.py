"""GGUF blocks dequantized by torch ops, on whatever device the blocks are on.

ggml's kernels are its CPU backend's; on a GPU (`--device cuda|mps`) a quantized weight stays
the GGUF blocks as stored (`[rows, bytes per row]` uint8 on the device: the file's bytes, no
more) and is dequantized by these functions when a product needs it. Each is a line-for-line
torch port of the reference dequantization in the gguf package (gguf/quants.py, llama.cpp's own
Python), so the values are bitwise those of `BlockMatrix.dequantize()`; tests check that.

    dequantize(data, ggml_type, cols, dtype) -> [rows, cols]
"""

from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from torch import Tensor

QK_K = 256


def _f16(b: Tensor) -> Tensor:
    """[..., 2] uint8 -> [..., 1] float32, little-endian float16."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """[..., m] packed bytes -> [..., 2m]: the low nibbles, then the high ones."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _q8_0(b: Tensor) -> Tensor:
    d, qs = _f16(b[:, :2]), b[:, 2:].contiguous().view(torch.int8)
    return d * qs.float()


def _q4_0(b: Tensor) -> Tensor:
    d, qs = _f16(b[:, :2]), _nibbles(b[:, 2:])
    return d * (qs.to(torch.int8) - 8).float()


def _q4_1(b: Tensor) -> Tensor:
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), _nibbles(b[:, 4:])
    return d * qs.float() + m


def _high_bits(qh: Tensor) -> Tensor:
    """[n, 4] uint8 (a little-endian uint32) -> [n, 32] bits 0..31 as uint8."""
    shifts = torch.arange(8, device=qh.device, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


def _q5_0(b: Tensor) -> Tensor:
    d, qh, ql = _f16(b[:, :2]), _high_bits(b[:, 2:6]), _nibbles(b[:, 6:])
    return d * ((ql | (qh << 4)).to(torch.int8) - 16).float()


def _q5_1(b: Tensor) -> Tensor:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qh, ql = _high_bits(b[:, 4:8]), _nibbles(b[:, 8:])
    return d * (ql | (qh << 4)).float() + m


def _k_scale_offset(b: Tensor) -> tuple[Tensor, Tensor]:
    """A Q4_K/Q5_K block's header: d, dmin and 12 bytes of 6-bit scales and mins (gguf's
    get_scale_min) -> [n, 8, 1] scale and offset of its eight 32-weight sub-blocks."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    s = b[:, 4:16].reshape(-1, 3, 4)
    dd, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((dd & 0x3F, (m_d & 0x0F) | ((dd >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return (d * sc.float()).reshape(n, -1, 1), (dmin * mn.float()).reshape(n, -1, 1)


def _q4_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scale, offset = _k_scale_offset(b)
    qs = b[:, 16:].reshape(n, -1, 32)  # 4 chunks of 32 bytes, each: 32 low nibbles then 32 high
    q = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, -1, 32).float()
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    scale, offset = _k_scale_offset(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    ql = torch.stack((qs.reshape(n, -1, 32) & 0x0F, qs.reshape(n, -1, 32) >> 4), dim=2).reshape(n, -1, 32)
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8).reshape(1, 8, 1)
    hi = ((qh.reshape(n, 1, 32) >> shifts) & 1).reshape(n, -1, 32)
    return (scale * (ql | (hi << 4)).float() - offset).reshape(n, QK_K)


def _q6_k(b: Tensor) -> Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    scale = (d * scales.contiguous().view(torch.int8).float()).reshape(n, QK_K // 16, 1)
    low = ql.reshape(n, -1, 1, 64)
    low = torch.cat((low & 0x0F, low >> 4), dim=2).reshape(n, -1, 32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & 3).reshape(n, -1, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, QK_K // 16, -1).float()
    return (scale * q).reshape(n, QK_K)


_E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # MXFP4's codes, times 2


def _mxfp4(b: Tensor) -> Tensor:
    # An E8M0 exponent byte, its value halved (ggml_e8m0_to_fp32_half: the codes are doubled)
    e = b[:, :1].to(torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    codes = torch.tensor(_E2M1_DOUBLED, dtype=torch.float32, device=b.device)
    return d * codes[_nibbles(b[:, 1:]).long()]


_BLOCKS = {GGML.Q8_0: _q8_0, GGML.Q4_0: _q4_0, GGML.Q4_1: _q4_1, GGML.Q5_0: _q5_0, GGML.Q5_1: _q5_1,
           GGML.Q4_K: _q4_k, GGML.Q5_K: _q5_k, GGML.Q6_K: _q6_k, GGML.MXFP4: _mxfp4}
SUPPORTED = frozenset((*_BLOCKS, GGML.BF16, GGML.F16))


def dequantize(data: Tensor, ggml_type: GGML, cols: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """`data` [rows, bytes per row] uint8 GGUF blocks -> [rows, cols] in `dtype`, on data's device."""
    rows = data.shape[0]
    if ggml_type == GGML.BF16:
        return data.contiguous().view(torch.bfloat16).reshape(rows, cols).to(dtype)
    if ggml_type == GGML.F16:
        return data.contiguous().view(torch.float16).reshape(rows, cols).to(dtype)
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    values = _BLOCKS[ggml_type](data.reshape(-1, block_bytes))  # fp32 [rows * blocks per row, block]
    return values.reshape(rows, cols).to(dtype)
