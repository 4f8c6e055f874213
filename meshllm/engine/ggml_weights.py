"""Block-quantized matrices held by ggml, and products with torch activations.

`BlockMatrix` is the compact form every quantized weight takes in memory: the ggml blocks
as they are in the GGUF file (or as ggml's quantizer made them from a safetensors weight),
`[rows, bytes per row]` uint8, plus the ggml type. It slices by output rows exactly, and by
input columns at block boundaries (the tensor-parallel shards). `GGMLMatrix` uploads one to a
ggml backend buffer (repacked at upload for the types ggml re-lays out) and multiplies:
`x [n, in] fp32 -> [n, out] fp32`, where ggml quantizes x to the weight's dot-product type
exactly as llama.cpp does.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from torch import Tensor

from meshllm.engine.ggml_lib import Runtime
from meshllm.engine.host_memory import hint_huge_pages
from meshllm.engine.kernels.custom_ops import q8_0x8_ops
from meshllm.errors import ModelLoadError

# Types kept quantized in memory; gguf's numbering is ggml's.
KEPT_TYPES = (GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K,
              GGML.Q2_K, GGML.Q3_K, GGML.IQ4_NL, GGML.IQ4_XS, GGML.MXFP4, GGML.BF16, GGML.F16,
              # the i-quants of llama.cpp's imatrix files (UD-Q2_K_XL, IQ2_XXS ...): ggml's kernels
              GGML.IQ3_S, GGML.IQ3_XXS, GGML.IQ2_S, GGML.IQ2_XS, GGML.IQ2_XXS, GGML.IQ1_M, GGML.IQ1_S)


@dataclass(frozen=True, eq=False)
class BlockMatrix:
    """A [rows, cols] matrix as ggml blocks: `data` is uint8 [rows, bytes per row]."""

    data: Tensor
    ggml_type: GGML
    cols: int

    def __post_init__(self):
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        assert self.cols % block == 0 and self.data.dtype == torch.uint8, (self.cols, self.ggml_type)
        assert self.data.shape[1] == self.cols // block * block_bytes, (self.data.shape, self.cols)

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def num_bytes(self) -> int:
        return self.data.numel()

    def row_slice(self, start: int, stop: int) -> BlockMatrix:
        return BlockMatrix(self.data[start:stop].contiguous(), self.ggml_type, self.cols)

    def col_slice(self, start: int, stop: int) -> BlockMatrix:
        """Input columns [start, stop); both must fall on block boundaries."""
        block, block_bytes = GGML_QUANT_SIZES[self.ggml_type]
        if start % block or stop % block:
            raise ValueError(f"{self.ggml_type.name} columns split only at multiples of {block}, "
                             f"not [{start}, {stop})")
        data = self.data[:, start // block * block_bytes:stop // block * block_bytes].contiguous()
        return BlockMatrix(data, self.ggml_type, stop - start)

    @staticmethod
    def cat_rows(parts: list[BlockMatrix]) -> BlockMatrix:
        assert len({(p.ggml_type, p.cols) for p in parts}) == 1, "row parts must share type and width"
        return BlockMatrix(torch.cat([p.data for p in parts]), parts[0].ggml_type, parts[0].cols)

    def dequantize(self) -> Tensor:
        """fp32 [rows, cols] by gguf's reference dequantization (tests, fallbacks)."""
        from gguf import quants

        if self.ggml_type == GGML.BF16:
            return self.data.view(torch.bfloat16).float()
        if self.ggml_type == GGML.F16:
            return self.data.view(torch.float16).float()
        return torch.from_numpy(quants.dequantize(self.data.numpy(), self.ggml_type)).reshape(self.shape)


def split_q4_1(matrix: BlockMatrix) -> tuple[BlockMatrix, Tensor]:
    """Q4_1 blocks as Q4_0 blocks plus a per-block remainder: the form the fast kernels take.

    A Q4_1 block holds d, m (fp16) and 32 nibbles q: x = d*q + m. A Q4_0 block with the same d and
    nibbles means d*(q - 8), so W = Q4_0(d, q) + R with R = 8d + m constant over each block, and
    W x = Q4_0(W) x + sum over blocks b of R[b] * (x summed over block b). ggml repacks Q4_0 for its
    AVX2/AVX-512 kernels and has none for Q4_1, whose one-row product runs ~1.5x slower and whose
    k-row products cost ~k times one (Q4_0: 4 rows ~2.2x). R is group-major: [rows / 8, blocks per
    row, 8], a group of 8 rows' column of R block after block, which is how the op that multiplies a
    group of 8 repacked rows reads it (kernels/quant_few_rows.c); rows % 8 == 0, as ggml's repacked
    Q4_0 needs. 8d + m is exact in float32 (fp16 operands), so the weights are exactly the Q4_1
    ones. R is held in float16 where every value of the matrix is exactly a float16 (then the
    matrix takes the 20 bytes a block Q4_1 takes, and its products read 9% fewer bytes), else in
    float32 (22): either way the kernels read the same float32 values. Measured on SmolLM2-135M's
    Q4_1 file: 2 of 3,317,760 values are not float16s (8d + m needs more than float16's 11
    significant bits there), so 2 of the 120 matrices a stage holds (q, k, v and gate, up fused)
    keep float32; of Gaussian random weights about one value in 3,000 is not, so most random
    matrices do. The planner budgets float32 (held_block_bytes).
    """
    assert matrix.ggml_type == GGML.Q4_1 and matrix.rows % 8 == 0, (matrix.ggml_type, matrix.rows)
    rows, blocks = matrix.rows, matrix.cols // 32
    data = matrix.data.reshape(rows, blocks, 20)
    d = data[..., 0:2].contiguous().view(torch.float16).float()
    m = data[..., 2:4].contiguous().view(torch.float16).float()
    q4_0 = torch.cat((data[..., 0:2], data[..., 4:20]), dim=-1).reshape(rows, blocks * 18)
    remainder = (8 * d + m).reshape(rows // 8, 8, blocks).transpose(1, 2).contiguous()
    half = remainder.half()
    return BlockMatrix(q4_0, GGML.Q4_0, matrix.cols), half if torch.equal(half.float(), remainder) else remainder


def remainder_by_block(remainder: Tensor) -> Tensor:
    """A group-major remainder (split_q4_1) as [blocks per row, rows], float32: sums [n, blocks] @
    it is the remainder's term of the product."""
    groups, blocks, _ = remainder.shape
    return remainder.float().transpose(0, 1).reshape(blocks, groups * 8)


def splits_q4_1(rt: Runtime, ggml_type: GGML, rows: int) -> bool:
    """Whether a repacked matrix of this type and row count is held as Q4_0 plus remainder
    (split_q4_1): a Q4_1 one, where this CPU has repacked Q4_0 kernels for its row count."""
    return ggml_type == GGML.Q4_1 and rt.repacks(GGML.Q4_0, rows)


def held_block_bytes(rt: Runtime, ggml_type: GGML, rows: int, num_bytes: int) -> int:
    """Bytes a block matrix of `num_bytes` in the file takes once GGMLMatrix holds it repacked."""
    if not splits_q4_1(rt, ggml_type, rows):
        return num_bytes
    blocks = num_bytes // GGML_QUANT_SIZES[GGML.Q4_1][1]
    # + one float32 remainder a block: the most it can hold (split_q4_1 holds float16 where exact,
    # which only reading the blocks tells), so a plan never counts on memory a stage lacks
    return blocks * (GGML_QUANT_SIZES[GGML.Q4_0][1] + 4)


def block_sums(x: Tensor) -> Tensor:
    """x [n, cols] -> [n, cols / 32]: each 32-column block summed (the remainder's input)."""
    return x.reshape(x.shape[0], -1, 32).sum(dim=-1)


def quantize(rt: Runtime | None, weight: Tensor, ggml_type: GGML) -> BlockMatrix:
    """A float [rows, cols] matrix in ggml blocks, by ggml's own quantizer (what llama-quantize
    runs); without ggml (`rt` None: a GPU host where install.sh's build failed), the plain types
    (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) by the gguf package's numpy port, which gives the same bytes
    (tests/engine/test_ggml_weights.py), ~10x slower."""
    w = weight.detach().float().contiguous()
    rows, cols = w.shape
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if cols % block:
        raise ValueError(f"a {ggml_type.name} matrix needs a width that is a multiple of {block}, not {cols}")
    if rt is None:
        return BlockMatrix(torch.from_numpy(quants.quantize(w.numpy(), ggml_type)), ggml_type, cols)
    out = torch.empty(rows, cols // block * block_bytes, dtype=torch.uint8)
    # The lowest i-quants need an importance matrix (llama-quantize takes one measured on text):
    # here every column weighs alike (tests write such files; --quantize offers none of them).
    importance = torch.ones(cols) if rt.lib.ggml_quantize_requires_imatrix(int(ggml_type)) else None
    rt.lib.ggml_quantize_chunk(int(ggml_type), ctypes.cast(w.data_ptr(), ctypes.POINTER(ctypes.c_float)),
                               out.data_ptr(), 0, rows, cols,
                               None if importance is None else ctypes.cast(importance.data_ptr(),
                                                                           ctypes.POINTER(ctypes.c_float)))
    return BlockMatrix(out, ggml_type, cols)


def linear_block_parts(source, hf_names: list[str], rows: list[int], blocks, rt: Runtime | None,
                       quantize_to: GGML | None) -> list[BlockMatrix] | None:
    """A linear's row parts (`hf_names`, with `rows` each by the model config) as block matrices:
    the file's blocks (`blocks(source, name)`, None for a tensor without a block form here) or,
    for dense weights, ggml's quantization to `quantize_to` (by `rt`); None where neither applies
    and the linear stays dense. The weight forms of the CPU (stage_weights) and of GPUs
    (device_weights) both take their parts from here."""
    if all(getattr(source, "is_block_quantized", lambda _: False)(n) for n in hf_names):
        parts = [blocks(source, n) for n in hf_names]
        if any(p is None for p in parts):
            return None
    elif quantize_to is not None:
        block = GGML_QUANT_SIZES[quantize_to][0]
        if any(source.tensor_shapes()[n][-1] % block for n in hf_names):
            return None  # rows are not whole blocks (aidreams' 172-wide MLP): keep it dense
        parts = [quantize(rt, t, quantize_to) for t in source.read(hf_names, torch.float32).values()]
    else:
        return None
    for name, part, want in zip(hf_names, parts, rows):
        if part.rows != want:
            raise ModelLoadError(f"{source.path}: tensor {name!r} has {part.rows} rows, expected {want} "
                                 f"from the model config; the checkpoint does not match its config")
    return parts


_REPACK_ROWS = 512  # rows re-laid at a time by GGMLMatrix.repack_q8_0x8 (a multiple of 8)


class GGMLMatrix:
    """One BlockMatrix in a ggml backend buffer: a tensor with ne = [cols, rows], or, for the
    `experts` of a mixture (its rows expert after expert), ne = [cols, rows per expert, experts]."""

    def __init__(self, rt: Runtime, matrix: BlockMatrix, repack: bool = True, experts: int = 1):
        """`repack=False` keeps ggml's plain layout, which get_rows (embedding lookups) needs.
        `ggml_type` stays the source's; a Q4_1 matrix is held as Q4_0 plus `remainder` (split_q4_1)
        where this CPU has repacked Q4_0 kernels. An experts matrix is one 3-d tensor, as ggml's
        repacked expert product (mul_mat_id) reads it: each expert's rows are re-laid out
        among themselves (groups of 8 never straddle two experts)."""
        self._describe(rt, matrix)
        assert self.rows % experts == 0, (self.rows, experts)
        self.experts = experts
        g = self.g
        if repack and experts == 1 and splits_q4_1(rt, matrix.ggml_type, self.rows):
            matrix, self.remainder = split_q4_1(matrix)
        self.num_bytes = matrix.num_bytes + (0 if self.remainder is None else self.remainder.nbytes)
        self._new_tensor(matrix)
        if not repack:
            buffer_type = rt.cpu_buffer_type
        elif experts > 1:
            buffer_type = rt.experts_buffer_type_for(int(matrix.ggml_type), self.rows // experts)
        else:
            buffer_type = rt.buffer_type_for(int(matrix.ggml_type), self.rows)
        self._buffer = g.ggml_backend_alloc_ctx_tensors_from_buft(self._ctx, buffer_type)
        if not self._buffer:
            raise MemoryError(f"ggml could not allocate {matrix.num_bytes} bytes for a {matrix.shape} matrix")
        hint_huge_pages(*self._buffer_span())  # before the upload writes it (host_memory says why)
        data = matrix.data.contiguous()
        assert g.ggml_nbytes(self.tensor) == data.numel()
        # The repack buffer re-lays the blocks out as they are set: one call with the whole tensor.
        g.ggml_backend_tensor_set(self.tensor, ctypes.c_void_p(data.data_ptr()), 0, data.numel())

    def _describe(self, rt: Runtime, matrix: BlockMatrix) -> None:
        self.g, self.rt = rt.lib, rt
        self.ggml_type, (self.rows, self.cols) = matrix.ggml_type, matrix.shape
        self.remainder: Tensor | None = None
        self.layout = "ggml"  # or "q8_0x8": repack_q8_0x8 re-laid the blocks out for meshllm's op

    def _new_tensor(self, matrix: BlockMatrix) -> None:
        """The ggml tensor of `matrix`'s type and shape, in a context of its own (no data yet)."""
        g = self.g
        self._ctx = g.ggml_init(g.ggml_init_params(mem_size=g.ggml_tensor_overhead() * 2, mem_buffer=None,
                                                   no_alloc=True))
        if self.experts > 1:
            self.tensor = g.ggml_new_tensor_3d(self._ctx, int(matrix.ggml_type), self.cols, self.rows // self.experts,
                                               self.experts)
        else:
            self.tensor = g.ggml_new_tensor_2d(self._ctx, int(matrix.ggml_type), self.cols, self.rows)

    def __del__(self):
        g = getattr(self, "g", None)
        if g is None:
            return
        if getattr(self, "_buffer", None):
            g.ggml_backend_buffer_free(self._buffer)
            self._buffer = None
        if getattr(self, "_ctx", None):
            g.ggml_free(self._ctx)
            self._ctx = None

    def _buffer_span(self) -> tuple[int, int]:
        base = self.g.ggml_backend_buffer_get_base(self._buffer)
        return base, base + self.g.ggml_backend_buffer_get_size(self._buffer)

    def spans(self) -> list[tuple[int, int]]:
        """The (start, end) addresses of the memory this matrix holds: its ggml buffer, and its
        remainder where it has one."""
        out = [self._buffer_span()]
        if self.remainder is not None:
            out.append((self.remainder.data_ptr(), self.remainder.data_ptr() + self.remainder.nbytes))
        return out

    @property
    def fits_q8_0x8(self) -> bool:
        """Whether repack_q8_0x8 applies: a Q8_0 matrix in ggml's layout, of whole groups of 8 rows."""
        return self.ggml_type == GGML.Q8_0 and self.rows % 8 == 0 and self.layout == "ggml" and self._buffer is not None

    def repack_q8_0x8(self) -> None:
        """Re-lay this Q8_0 matrix's blocks out in place as meshllm's 8-row layout (quant_few_rows.c:
        per 8 rows and 32 columns, the 8 scales, then 4 chunks of 8 bytes of each row in turn), the
        same bytes in the same buffer. Only meshllm's ops read it afterwards (matmul and
        QuantizedEmbedding take them); ggml's own ops would read garbage, so the stage's graph
        builds none on it (ggml_stage.GGMLStage)."""
        assert self.fits_q8_0x8, (self.ggml_type, self.rows, self.layout)
        g, blocks_per_row = self.g, self.cols // 32
        row_bytes = blocks_per_row * 34
        # A group of 8 rows keeps its bytes' place, so the matrix is re-laid a few groups at a time:
        # all at once held three copies of it at load (a 1.1B model's 107 MB output matrix: peak
        # resident memory 1570 -> 1757 MiB).
        for first in range(0, self.rows, _REPACK_ROWS):
            n = min(_REPACK_ROWS, self.rows - first)
            plain = torch.empty(n * row_bytes, dtype=torch.uint8)
            g.ggml_backend_tensor_get(self.tensor, ctypes.c_void_p(plain.data_ptr()), first * row_bytes, n * row_bytes)
            blocks = plain.view(n // 8, 8, blocks_per_row, 34)  # group, row, block, (f16 scale, 32 int8)
            scales = blocks[..., :2].permute(0, 2, 1, 3).reshape(n // 8, blocks_per_row, 16)
            values = blocks[..., 2:].reshape(n // 8, 8, blocks_per_row, 4, 8).permute(0, 2, 3, 1, 4)
            relaid = torch.cat([scales, values.reshape(n // 8, blocks_per_row, 256)], dim=2).contiguous()
            g.ggml_backend_tensor_set(self.tensor, ctypes.c_void_p(relaid.data_ptr()), first * row_bytes, n * row_bytes)
        self.layout = "q8_0x8"

    def matmul(self, x: Tensor) -> Tensor:
        """x [n, cols] -> x @ W.T [n, rows], fp32."""
        assert x.dim() == 2 and x.shape[1] == self.cols, (tuple(x.shape), self.shape)  # ggml would abort
        x = x.float().contiguous()
        y = torch.empty(x.shape[0], self.rows, dtype=torch.float32)
        with GraphScope(self.rt) as s:
            xt = s.wrap(x)
            if self.layout == "q8_0x8":
                yt = custom_op(s, q8_0x8_ops()[0], (self.rows, x.shape[0]), self.tensor, xt)
            else:
                yt = s.g.ggml_mul_mat(s.ctx, self.tensor, xt)
            s.point(yt, y)
            s.compute(yt)
        if self.remainder is not None:
            y += block_sums(x) @ remainder_by_block(self.remainder)
        return y

    @property
    def repacked(self) -> bool:
        """Whether ggml re-laid the blocks out at upload (its repack buffer): rows then interleave."""
        rt = self.rt
        return self._buffer is not None and rt.repack_buffer_type is not None and \
            self.g.ggml_backend_buffer_get_type(self._buffer) == rt.repack_buffer_type

    def matmul_rows(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x [n, cols] -> x @ W[start:stop].T [n, stop - start], fp32: rows of a matrix in ggml's
        plain layout, or one expert's of an experts matrix (repacked ones: through ggml's expert
        product, which reads the re-laid rows; a plain view of them would read garbage)."""
        assert x.dim() == 2 and x.shape[1] == self.cols and 0 <= start < stop <= self.rows
        assert self.layout == "ggml" and self.remainder is None, "rows of a re-laid matrix"
        x = x.float().contiguous()
        n = x.shape[0]
        y = torch.empty(n, stop - start, dtype=torch.float32)
        with GraphScope(self.rt) as s:
            g = s.g
            if self.repacked:
                width = self.rows // self.experts
                assert self.experts > 1 and start % width == 0 and stop - start == width, "one expert's rows"
                ids = torch.full((n, 1), start // width, dtype=torch.int32)  # [rows, 1 chosen]
                rows = g.ggml_reshape_3d(s.ctx, s.wrap(x), self.cols, 1, n)
                yt = g.ggml_mul_mat_id(s.ctx, self.tensor, rows, s.wrap(s.keep(ids)))  # [width, 1, n]
            else:
                nb1 = self.tensor.contents.nb[1]
                yt = g.ggml_mul_mat(s.ctx, g.ggml_view_2d(s.ctx, self.tensor, self.cols, stop - start, nb1,
                                                          start * nb1), s.wrap(x))
            s.point(yt, y)
            s.compute(yt)
        return y

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def custom_op(s: GraphScope, op: int, shape: tuple[int, int], *sources):
    """An f32 [shape[0] (ggml ne0), shape[1]] result of meshllm custom op `op` (an address from
    kernels.custom_ops) over `sources`, in scope `s`."""
    g = s.g
    args = (ctypes.POINTER(type(sources[0].contents)) * len(sources))(*sources)
    return g.ggml_custom_4d(s.ctx, 0, shape[0], shape[1], 1, 1, args, len(sources), g.ggml_custom_op_t(op), -1, None)


_COMPUTE_LOCK = threading.Lock()
_GGML_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30, torch.int32: 26}


class GraphScope:
    """A throwaway ggml context whose tensors point into torch memory; compute on the shared pool."""

    _work = torch.empty(0, dtype=torch.uint8)  # grown on demand; one compute at a time per process

    def __init__(self, rt: Runtime, max_nodes: int = 64):
        self.rt, self.g = rt, rt.lib
        self._max_nodes = max_nodes
        # tensors (up to ~3 per node) plus the graph's own arrays
        self._ctx_bytes = 3 * max_nodes * rt.lib.ggml_tensor_overhead() + rt.lib.ggml_graph_overhead_custom(
            max_nodes, False)

    def __enter__(self) -> GraphScope:
        g = self.g
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=self._ctx_bytes, mem_buffer=None, no_alloc=True))
        self._kept: list[Tensor] = []
        return self

    def __exit__(self, *exc) -> None:
        self.g.ggml_free(self.ctx)
        self._kept = []

    def keep(self, t: Tensor) -> Tensor:
        """Hold `t` alive until the scope ends (ggml tensors point into its memory)."""
        self._kept.append(t)
        return t

    def new_graph(self):
        return self.g.ggml_new_graph_custom(self.ctx, self._max_nodes, False)

    def wrap(self, t: Tensor, keep: bool = True):
        """A ggml tensor over a contiguous torch tensor's memory (ggml dims are torch's reversed);
        `t` is kept alive until the scope ends unless `keep` is False (then the caller makes sure
        the graph never runs once `t` is gone)."""
        assert t.is_contiguous() and t.dtype in _GGML_DTYPES, (t.dtype, t.is_contiguous())
        if keep:
            self._kept.append(t)
        dims = list(reversed(t.shape)) + [1] * (4 - t.dim())
        gt = self.g.ggml_new_tensor_4d(self.ctx, _GGML_DTYPES[t.dtype], *dims)
        gt.contents.data = t.data_ptr()
        return gt

    def point(self, gt, t: Tensor) -> None:
        """Make ggml write result `gt` straight into torch tensor `t`."""
        assert t.is_contiguous() and self.g.ggml_nbytes(gt) == t.numel() * t.element_size()
        gt.contents.data = t.data_ptr()

    def compute(self, *outputs) -> None:
        self.compute_graph(self.new_graph(), *outputs)

    def compute_graph(self, graph, *outputs, allocator=None) -> None:
        """Compute `graph` after adding `outputs` (None entries skipped) to it. Intermediate tensors
        get memory from `allocator` (a ggml_gallocr); without one every tensor must point somewhere."""
        g, rt = self.g, self.rt
        for out in outputs:
            if out is not None:
                g.ggml_build_forward_expand(graph, out)
        if allocator is not None and not g.ggml_gallocr_alloc_graph(allocator, graph):
            raise MemoryError("ggml could not allocate the step's intermediate tensors")
        # One compute at a time per process: the work buffer and ggml's threads are shared (two
        # stages loaded on one node run on different gRPC threads).
        with _COMPUTE_LOCK:
            plan = g.ggml_graph_plan(graph, rt.num_threads, rt.threadpool)
            if plan.work_size > GraphScope._work.numel():
                GraphScope._work = torch.empty(plan.work_size, dtype=torch.uint8)
            plan.work_data = ctypes.cast(GraphScope._work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
            status = g.ggml_graph_compute(graph, ctypes.byref(plan))
            if status != 0:
                raise RuntimeError(f"ggml graph compute failed with status {status}")
