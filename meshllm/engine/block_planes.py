"""Q8_0/Q4_0/Q4_1 blocks split into planes: the same bytes, laid out for a GPU's wide loads.

A GGUF block interleaves its scale with its codes (Q4_0: an f16 and 16 bytes, 18 in all), so a
matrix stored as the file has it is only 2-byte aligned block by block: a GPU kernel reading it
issues a load per byte or two. Here each matrix keeps exactly its file's bytes, moved into
planes: all the codes (row-major, 16 or 32 bytes a block, so every block starts 16-byte
aligned), then all the f16 scales, then (Q4_1) all the f16 minimums. The buffer keeps the file's
shape, [rows, bytes per row], so byte counts, device moves and a tied head's sharing are those of
the blocks.
Splitting and dequantizing are exact: `dequantize` gives bitwise the reference's values. On an
H200 the fused decode kernel (engine/triton_blocks.py) multiplies one row by a 14336x4096 Q4_0
matrix in 63 us from planes, 84 from the interleaved blocks (8 rows: 72 and 99); a 4096x4096 one
goes the other way (63 against 41), and SmolLM2-135M Q4_1 decodes at 311 tok/s from planes, 291
from blocks (bench/results/device-decode-h200-graphs.json).

    split(data, ggml_type) -> planar buffer (same shape)      join(buffer, ggml_type) -> blocks
    parts(buffer, ggml_type) -> (codes, scales, minimums | None)
    dequantize(buffer, ggml_type, dtype) -> [rows, cols];  rows(buffer, ggml_type, ids, dtype)
"""

from __future__ import annotations

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from torch import Tensor

# Code bytes per 32-value block, and whether the block carries a minimum after its scale.
_CODES = {GGML.Q8_0: 32, GGML.Q4_0: 16, GGML.Q4_1: 16}
_HAS_MIN = {GGML.Q8_0: False, GGML.Q4_0: False, GGML.Q4_1: True}
PLANAR = frozenset(_CODES)


def _shape(data: Tensor, ggml_type: GGML) -> tuple[int, int, int]:
    """rows, blocks per row, code bytes per block of a [rows, bytes per row] buffer."""
    block_bytes = GGML_QUANT_SIZES[ggml_type][1]
    assert data.dtype == torch.uint8 and data.dim() == 2 and data.shape[1] % block_bytes == 0, (data.shape, ggml_type)
    return data.shape[0], data.shape[1] // block_bytes, _CODES[ggml_type]


def split(data: Tensor, ggml_type: GGML) -> Tensor:
    """The file's blocks [rows, bytes per row] -> the planar buffer of the same shape and bytes."""
    rows, nb, codes = _shape(data, ggml_type)
    blocks = data.reshape(rows, nb, -1)
    head = blocks.shape[2] - codes  # the scale (and minimum) bytes before each block's codes
    planes = [blocks[:, :, head:].reshape(-1), blocks[:, :, :2].reshape(-1)]
    if _HAS_MIN[ggml_type]:
        planes.append(blocks[:, :, 2:4].reshape(-1))
    return torch.cat(planes).reshape(data.shape)


def parts(buffer: Tensor, ggml_type: GGML) -> tuple[Tensor, Tensor, Tensor | None]:
    """Views of a planar buffer: codes [rows, blocks * code bytes] (int8 for Q8_0, else uint8:
    two 4-bit codes a byte, value t of a block low and t + 16 high), f16 scales [rows, blocks],
    and f16 minimums [rows, blocks] (Q4_1) or None."""
    rows, nb, codes = _shape(buffer, ggml_type)
    flat = buffer.reshape(-1)
    code_end, scale_end = rows * nb * codes, rows * nb * (codes + 2)
    q = flat[:code_end].view(rows, nb * codes)
    d = flat[code_end:scale_end].view(torch.float16).view(rows, nb)
    m = flat[scale_end:].view(torch.float16).view(rows, nb) if _HAS_MIN[ggml_type] else None
    return (q.view(torch.int8) if ggml_type == GGML.Q8_0 else q), d, m


def join(buffer: Tensor, ggml_type: GGML) -> Tensor:
    """The planar buffer back into the file's blocks (tests; the inverse of `split`)."""
    q, d, m = parts(buffer, ggml_type)
    rows, nb = d.shape
    head = [d.view(torch.uint8).view(rows, nb, 2)]
    if m is not None:
        head.append(m.view(torch.uint8).view(rows, nb, 2))
    return torch.cat([*head, q.view(torch.uint8).view(rows, nb, -1)], dim=2).reshape(buffer.shape)


def _values(q: Tensor, d: Tensor, m: Tensor | None, ggml_type: GGML) -> Tensor:
    """Planes of n rows -> fp32 [n, cols], by the reference's arithmetic (gguf/quants.py)."""
    n, nb = d.shape
    d = d.float().unsqueeze(-1)
    if ggml_type == GGML.Q8_0:
        return (d * q.view(n, nb, 32).float()).reshape(n, -1)
    q = q.view(n, nb, 16)
    codes = torch.cat((q & 0x0F, q >> 4), dim=-1)  # the block's values in order
    if ggml_type == GGML.Q4_0:
        return (d * (codes.to(torch.int8) - 8).float()).reshape(n, -1)
    return (d * codes.float() + m.float().unsqueeze(-1)).reshape(n, -1)


def dequantize(buffer: Tensor, ggml_type: GGML, dtype: torch.dtype = torch.float32,
               rows: slice = slice(None)) -> Tensor:
    """A planar buffer (or a range of its rows) -> the dense [rows, cols] matrix in `dtype`, on
    the buffer's device."""
    q, d, m = parts(buffer, ggml_type)
    return _values(q[rows], d[rows], None if m is None else m[rows], ggml_type).to(dtype)


def rows(buffer: Tensor, ggml_type: GGML, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows `ids` of a planar buffer, dense in `dtype` (an embedding lookup: only those rows)."""
    q, d, m = parts(buffer, ggml_type)
    return _values(q[ids], d[ids], None if m is None else m[ids], ggml_type).to(dtype)
