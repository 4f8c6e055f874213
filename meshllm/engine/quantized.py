"""Linear and embedding layers whose weights stay ggml-quantized in memory.

Built at load from `BlockMatrix` parts (GGUF blocks as stored, or a safetensors weight run
through ggml's quantizer for `--quantize int8|int4`). Types ggml repacks for its fast x86
kernels (Q4_0, Q4_K, IQ4_NL) live in ggml's repack buffer, and so does Q4_1, held as Q4_0 plus a
per-block remainder (ggml_weights.split_q4_1); every other type is held as stored in a plain
ggml CPU buffer. Products: `x [n, in] -> [n, out]`
in x's dtype, computed in fp32 by ggml with x quantized to the weight's 8-bit dot-product type
(as llama.cpp does), so decode and prefill both run ggml's kernels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from gguf.constants import GGMLQuantizationType as GGML
from torch import Tensor, nn

from meshllm.engine.ggml_lib import Runtime
from meshllm.engine.ggml_weights import BlockMatrix, GGMLMatrix, GraphScope, custom_op
from meshllm.engine.kernels.custom_ops import q8_0x8_ops

if TYPE_CHECKING:
    from meshllm.model.gguf import FileRows

_STORED_AS_FLOATS = frozenset({GGML.F32, GGML.F16, GGML.BF16})  # a lookup's rows need no dequantizing


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W the row-concatenation of `parts` (q|k|v or gate|up when fused)."""

    def __init__(self, matrices: list[GGMLMatrix], bias: Tensor | None = None):
        super().__init__()
        assert matrices and len({m.cols for m in matrices}) == 1, "row parts must share the input width"
        self.in_features = matrices[0].cols
        self.out_features = sum(m.rows for m in matrices)
        self.matrices = matrices
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_parts(cls, rt: Runtime, parts: list[BlockMatrix], bias: Tensor | None = None,
                   repack: bool = True, experts: bool = False) -> QuantizedLinear:
        """`repack=False`: ggml's plain layout, whose rows views can read. `experts`: the parts
        are a mixture's experts, one each: held as one experts matrix when they share a type."""
        count = len(parts)
        if len(parts) > 1 and len({p.ggml_type for p in parts}) == 1:
            parts = [BlockMatrix.cat_rows(parts)]  # one matrix, one product
        return cls([GGMLMatrix(rt, p, repack=repack, experts=count if experts and len(parts) == 1 else 1)
                    for p in parts], bias)

    @property
    def num_bytes(self) -> int:
        return sum(m.num_bytes for m in self.matrices)

    @property
    def weight_types(self) -> list[str]:
        return [m.ggml_type.name for m in self.matrices]

    def forward(self, x: Tensor) -> Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        flat = x.reshape(-1, self.in_features)
        outs = [m.matmul(flat) for m in self.matrices]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def rows_product(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x [n, in_features] times rows [start, stop) of W (one expert's, engine/moe): [n, stop - start]."""
        (matrix,) = self.matrices
        y = matrix.matmul_rows(x.reshape(-1, self.in_features), start, stop)
        if self.bias is not None:
            y = y + self.bias[start:stop]
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, ggml {'+'.join(self.weight_types)}"


class QuantizedEmbedding(nn.Module):
    """Rows of a block-quantized table, dequantized on lookup by ggml's get_rows."""

    def __init__(self, rt: Runtime, table: GGMLMatrix, dtype: torch.dtype):
        super().__init__()
        self.rt, self.table, self.dtype = rt, table, dtype
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [n] int64 -> [n, embedding_dim]
        ids32 = ids.to(torch.int32).contiguous()
        out = torch.empty(ids32.numel(), self.embedding_dim, dtype=torch.float32)
        with GraphScope(self.rt) as s:
            if self.table.layout == "q8_0x8":  # a tied head re-laid out for meshllm's op (ggml_stage.py)
                rows = custom_op(s, q8_0x8_ops()[1], (self.embedding_dim, ids32.numel()), self.table.tensor,
                                 s.wrap(ids32))
            else:
                rows = s.g.ggml_get_rows(s.ctx, self.table.tensor, s.wrap(ids32))
            s.point(rows, out)
            s.compute(rows)
        return out.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, ggml {self.table.ggml_type.name}"


class FileRowsEmbedding(nn.Module):
    """An embedding table left in the model file: each lookup reads its rows from there
    (gguf.FileRows says why), dequantized by ggml's get_rows for a block-quantized table, as
    QuantizedEmbedding's are (the same floats); a float table's rows come as stored (`dtype`).
    ggml_stage reads the rows into each step's own buffer the same way."""

    def __init__(self, rt: Runtime, rows: FileRows, ggml_type: GGML, shape: tuple[int, int], dtype: torch.dtype):
        super().__init__()
        self.rt, self.rows, self.ggml_type, self.dtype = rt, rows, ggml_type, dtype
        self.num_embeddings, self.embedding_dim = shape

    def read(self, ids: Tensor, out: Tensor) -> None:
        """Rows `ids` as stored into `out` ([n, row bytes] uint8)."""
        self.rows.read(ids.tolist(), out.numpy())

    def looked_up(self, s: GraphScope, stored: Tensor):
        """A ggml node of the f32 rows of `stored` (rows as read, [n, row bytes] uint8, kept alive by
        `s`): get_rows over a table of just them, which converts each as a lookup in the whole
        table would."""
        n = stored.shape[0]
        table = s.g.ggml_new_tensor_2d(s.ctx, int(self.ggml_type), self.embedding_dim, n)
        table.contents.data = s.keep(stored).data_ptr()
        return s.g.ggml_get_rows(s.ctx, table, s.wrap(torch.arange(n, dtype=torch.int32)))

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [n] int64 -> [n, embedding_dim]
        stored = torch.empty(ids.numel(), self.rows.row_bytes, dtype=torch.uint8)
        self.read(ids.reshape(-1), stored)
        if self.ggml_type in _STORED_AS_FLOATS:
            return stored.view(self.dtype).reshape(ids.numel(), self.embedding_dim)
        out = torch.empty(ids.numel(), self.embedding_dim, dtype=torch.float32)
        with GraphScope(self.rt) as s:
            rows = self.looked_up(s, stored)
            s.point(rows, out)
            s.compute(rows)
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.ggml_type.name} rows read from {self.rows.path}"


def ggml_matrices(module: nn.Module) -> list[GGMLMatrix]:
    """Every ggml-held matrix under `module`, each once (a tied LM head shares the embedding's)."""
    matrices: dict[int, GGMLMatrix] = {}
    for m in module.modules():
        if isinstance(m, QuantizedLinear):
            matrices.update((id(x), x) for x in m.matrices)
        elif isinstance(m, QuantizedEmbedding):
            matrices[id(m.table)] = m.table
    return list(matrices.values())
