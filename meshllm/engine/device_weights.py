"""Quantized weights that stay quantized on a GPU (`--device cuda|mps`).

ggml's fast kernels are its CPU backend's, so on another device a GGUF block-quantized weight
is held as the file's blocks, `[rows, bytes per row]` uint8 on the device (Q4_K: 4.5 bits a
weight, where the dense form takes 16). Q8_0/Q4_0/Q4_1 are held as the same bytes split into
planes (codes, scales, minimums: engine/block_planes.py), which GPU kernels load 16 bytes at a
time. Products of up to 16 rows (decode, verify passes) of those types on CUDA run one fused
Triton kernel (engine/triton_blocks.py); others dequantize by torch ops (engine/block_dequant.py)
into the activations' dtype inside each product; only one layer's matrix is ever dense at a time,
for the length of its product.
`--quantize int8|int4` on a device makes the same blocks from a 16/32-bit weight with ggml's
quantizer (Q8_0 / Q4_0; without a ggml build, the gguf package's port of it) before it leaves the
CPU. GGUF types without a torch port here (Q2_K,
Q3_K, the IQ types) load dense, as before.

The forms are plain torch modules whose blocks are buffers, so `Decoder.to(device)` moves
them and the stage's byte count (stage_weights.decoder_bytes) sees the compact size.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from gguf.constants import GGMLQuantizationType as GGML
from torch import Tensor, nn

from meshllm.engine import block_planes, triton_blocks
from meshllm.engine.block_dequant import SUPPORTED, dequantize
from meshllm.engine.ggml_weights import BlockMatrix, linear_block_parts
from meshllm.errors import ModelLoadError
from meshllm.model.decoder import MoE
from meshllm.model.weights import TensorSource

log = logging.getLogger(__name__)


def _held(data: Tensor, ggml_type: GGML) -> Tensor:
    """A matrix's blocks as the device forms hold them: split into planes for the planar types."""
    return block_planes.split(data, ggml_type) if ggml_type in block_planes.PLANAR else data


def _dense(data: Tensor, ggml_type: GGML, cols: int, dtype: torch.dtype, rows: slice = slice(None)) -> Tensor:
    """A held buffer (planes for the planar types, else the file's blocks), or a range of its
    rows -> the dense [rows, cols] matrix in `dtype`."""
    if ggml_type in block_planes.PLANAR:
        return block_planes.dequantize(data, ggml_type, dtype, rows)
    return dequantize(data[rows], ggml_type, cols, dtype)


class BlockLinear(nn.Module):
    """y = x @ W.T (+ bias), W the row-concatenation of block matrices held as device buffers."""

    def __init__(self, parts: list[BlockMatrix], device: torch.device, bias: Tensor | None = None,
                 held: bool = False):
        # held: the parts' data are buffers as the device forms hold them already (a tied head)
        super().__init__()
        assert parts and len({p.cols for p in parts}) == 1, "row parts must share the input width"
        if len(parts) > 1 and len({p.ggml_type for p in parts}) == 1:
            parts = [BlockMatrix.cat_rows(parts)]
        self.in_features = parts[0].cols
        self.out_features = sum(p.rows for p in parts)
        self.types = [p.ggml_type for p in parts]
        self._fused_types = all(t in triton_blocks.TYPES for t in self.types)  # fixed: checked once
        for i, p in enumerate(parts):
            data = p.data.to(device)
            self.register_buffer(f"blocks{i}", data if held else _held(data, p.ggml_type), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def blocks(self) -> list[tuple[Tensor, GGML]]:
        return [(getattr(self, f"blocks{i}"), t) for i, t in enumerate(self.types)]

    def weight(self, dtype: torch.dtype) -> Tensor:
        """The dense [out, in] matrix in `dtype` (made now, dropped after the product)."""
        dense = [_dense(data, t, self.in_features, dtype) for data, t in self.blocks()]
        return dense[0] if len(dense) == 1 else torch.cat(dense)

    def forward(self, x: Tensor) -> Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        if self._takes_fused(x):
            return self._fused(x.contiguous())
        return F.linear(x, self.weight(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    @property
    def fusable(self) -> bool:
        """Whether every part is of a type the fused decode kernel reads (engine/triton_blocks.py)."""
        return triton_blocks.ENABLED and self._fused_types

    def _takes_fused(self, x: Tensor) -> bool:
        """Whether a product with these activation rows runs the fused kernel."""
        return self.fusable and x.shape[0] <= triton_blocks.ROWS_MAX and triton_blocks.available(x.device)

    def rows_product(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x [n, in_features] times rows [start, stop) of W (one expert's, decoder.MoE), the
        range in one part: [n, stop - start]. Only those rows are read or made dense."""
        bias = None if self.bias is None else self.bias[start:stop].to(x.dtype)
        for data, t in self.blocks():
            if start < data.shape[0]:
                break
            start, stop = start - data.shape[0], stop - data.shape[0]
        assert stop <= data.shape[0], "an expert's rows lie in one part"
        rows = slice(start, stop)
        if self._takes_fused(x):
            out = torch.empty(x.shape[0], stop - start, dtype=x.dtype, device=x.device)
            triton_blocks.rows_times_planes(x.contiguous(), data, t, out, rows=rows)
        else:
            out = F.linear(x, _dense(data, t, self.in_features, x.dtype, rows))
        return out if bias is None else out + bias

    def _fused(self, x: Tensor) -> Tensor:
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        row = 0
        for data, t in self.blocks():  # the fused types are planar (triton_blocks.TYPES)
            triton_blocks.rows_times_planes(x, data, t, out[:, row:row + data.shape[0]])
            row += data.shape[0]
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"blocks {'+'.join(t.name for t in self.types)}")


def warm_fused_kernels(decoder: nn.Module, dtype: torch.dtype) -> None:
    """Run each fused product shape once now, at load: on CUDA the first product of a shape
    compiles Triton's kernels and picks their tiles by timing them (engine/triton_blocks.py),
    seconds in all, which would otherwise land on the first request (measured on an H200: the
    first 8 tokens of a SmolLM2 answer at 0.6 tok/s)."""
    # An experts matrix is multiplied one expert's rows at a time (decoder.MoE): warm that shape.
    expert_rows = {id(projection): projection.out_features // mlp.router.out_features
                   for mlp in decoder.modules() if isinstance(mlp, MoE)
                   for projection in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)}
    seen: set[tuple] = set()
    for module in decoder.modules():
        if not isinstance(module, BlockLinear) or not module.fusable:
            continue
        device = module.blocks()[0][0].device
        rows = expert_rows.get(id(module))
        key = (module.in_features, rows or module.out_features, tuple(module.types))
        if device.type != "cuda" or not triton_blocks.available(device) or key in seen:
            continue
        seen.add(key)
        x = torch.zeros(1, module.in_features, dtype=dtype, device=device)
        if rows is None:
            module(x)
        else:
            module.rows_product(x, 0, rows)


class BlockEmbedding(nn.Module):
    """Rows of a block-quantized table on the device; only the looked-up rows are dequantized."""

    def __init__(self, table: BlockMatrix, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.register_buffer("blocks0", _held(table.data.to(device), table.ggml_type), persistent=False)
        self.ggml_type, self.dtype = table.ggml_type, dtype
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [n] -> [n, embedding_dim]
        if self.ggml_type in block_planes.PLANAR:
            return block_planes.rows(self.blocks0, self.ggml_type, ids, self.dtype)
        return dequantize(self.blocks0[ids], self.ggml_type, self.embedding_dim, self.dtype)

    def blocks(self) -> list[tuple[Tensor, GGML]]:
        return [(self.blocks0, self.ggml_type)]

    def head(self) -> BlockLinear:
        """The tied LM head over the same buffer (no second copy: it is on the device already, so
        Decoder.to(device) leaves both modules' references to it alone)."""
        return BlockLinear([BlockMatrix(self.blocks0, self.ggml_type, self.embedding_dim)], self.blocks0.device,
                           held=True)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, blocks {self.ggml_type.name}"


class DeviceBlockForm:
    """loader.WeightForm for a stage on `device`: GGUF blocks kept as they are, or dense weights
    quantized to `quantize_to` by ggml's quantizer (`rt`, the CPU runtime; None: gguf's port).
    The blocks go to the device as they are read; embeddings come out in `dtype`."""

    def __init__(self, device: torch.device, dtype: torch.dtype, quantize_to: GGML | None = None, rt=None):
        self.device, self.dtype, self.quantize_to, self.rt = device, dtype, quantize_to, rt
        self._dense_types: set[str] = set()

    def _blocks(self, source: TensorSource, name: str) -> BlockMatrix | None:
        if not getattr(source, "is_block_quantized", lambda _: False)(name):
            return None
        matrix = source.read_blocks(name)
        if matrix.ggml_type not in SUPPORTED:
            if matrix.ggml_type.name not in self._dense_types:
                self._dense_types.add(matrix.ggml_type.name)
                log.info("%s: %s tensors have no device form here; they load dequantized",
                         source.path, matrix.ggml_type.name)
            return None
        return matrix

    def linear(self, source: TensorSource, hf_names: list[str], rows: list[int]) -> nn.Module | None:
        parts = linear_block_parts(source, hf_names, rows, self._blocks, self.rt, self.quantize_to)
        if parts is None:
            return None
        return BlockLinear(parts, self.device)

    def embedding(self, source: TensorSource, hf_name: str, shape: torch.Size,
                  shared_with_head: bool) -> nn.Module | None:
        table = self._blocks(source, hf_name)
        if table is None:
            return None
        if table.shape != tuple(shape):
            raise ModelLoadError(f"{source.path}: tensor {hf_name!r} has shape {table.shape}, expected {tuple(shape)}")
        return BlockEmbedding(table, self.dtype, self.device)

    def tied_head(self, embedding: nn.Module) -> nn.Module | None:
        return embedding.head() if isinstance(embedding, BlockEmbedding) else None
