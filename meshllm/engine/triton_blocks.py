"""Q8_0/Q4_0/Q4_1 weights times a few activation rows in one GPU kernel (Triton): decode on
`--device cuda`.

Why: engine/device_weights.py keeps a GGUF matrix's bytes on the GPU (as planes, see
engine/block_planes.py) and could dequantize the whole matrix by torch ops before each product.
At decode that is ~3x the kernels (SmolLM2-135M Q4_1: 1713 a step against 629), and on a large
matrix it moves the weight ~4 times (bytes in, a dense 16-bit copy out and back in: one
14336x4096 Q4_0 product of one row 806 us on an H200). Here one kernel per matrix reads the
bytes once, dequantizes them in registers (the reference's arithmetic: f16 scales widened to
fp32, d * q (+ m)) and multiplies with the matrix units: that product 63 us (8 rows: 72), where
the file's interleaved blocks read by the same kernel took 84 (99) and a dense bf16 matrix 34.
Measured in bench/device_decode.py. Without the matrix units (elementwise products, row-invariant
too) one row went up to 2.9x faster, but several rows and wide heads slower; not adopted
(bench/fused_blocks_ab.py).

Q8_0, Q4_0 and Q4_1 (the demo's types and the common plain ones); other types, and more rows
than ROWS_MAX (prefill chunks, where dequantize-then-GEMM is compute-bound anyway), keep the
torch path. Weights are rounded to the activations' dtype before the product, as the torch path
rounds its dense copy, and products accumulate in fp32 (fp32 activations: IEEE, not TF32).

    rows_times_planes(x [m, K], planes [N, bytes per row], ggml_type, out [m, N])
"""

from __future__ import annotations

import os

import torch
from gguf.constants import GGMLQuantizationType as GGML
from torch import Tensor

from meshllm.engine import block_planes

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch, macOS): the torch path runs
    triton = None

ROWS_MAX = 16  # activation rows one kernel takes (tl.dot's smallest tile side)
TYPES = {GGML.Q8_0: 0, GGML.Q4_0: 1, GGML.Q4_1: 2}
assert set(TYPES) == block_planes.PLANAR
# Off: every product takes the torch path (bench/device_decode.py measures both in one run).
ENABLED = os.environ.get("MESHLLM_FUSED_BLOCKS", "1") != "0"


def available(device: torch.device) -> bool:
    """Whether the fused kernel runs on `device` (CUDA with Triton; anywhere under TRITON_INTERPRET)."""
    if triton is None:
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    @triton.jit
    def _plus_rows_times(acc, x_ptr, offs_m, m_ok, stride_xm, k, k_ok, w, FP32: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] + x[:, k] @ w.T for w [BLOCK_N, len(k)] in fp32."""
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if FP32:
            return acc + tl.dot(x, tl.trans(w), input_precision="ieee")
        return acc + tl.dot(x, tl.trans(w.to(x.dtype)))

    # M is not specialized: a kernel compiled for one row serves every row count (warmed at load;
    # otherwise the first step of a batch compiles one, inside a request).
    @triton.jit(do_not_specialize=["M"])
    def _rows_times_planes(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, stride_xm, stride_ym,
                           NB: tl.constexpr, KIND: tl.constexpr, FP32: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * W[n, k], W held as planes (engine/block_planes.py): codes
        # [N, NB * QB] at q_ptr, f16 scales [N, NB] at d_ptr (minimums at m_ptr for Q4_1). Each
        # program takes BLOCK_N rows, BLOCKS_K blocks of each per step; a block's codes are one
        # 16-byte-aligned run. Q4 codes hold value t low and t + 16 high: the two halves are two
        # products, each against x gathered at those positions. Every product is 128 values deep
        # whatever the tile (BLOCK_N, warps, stages are what tuning picks), so the sums run in one
        # order on every process, and a row's result does not depend on the rows beside it.
        # (Depths of 256 and 512, and the depth split over several programs, were tried on an
        # H200: none timed faster; bench/results/device-decode-h200-families.json.)
        QB: tl.constexpr = 32 if KIND == 0 else 16
        BLOCKS_K: tl.constexpr = 128 // QB
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = offs_n < N, offs_m < M
        n64 = offs_n.to(tl.int64)  # 64-bit: a large vocabulary's table passes 2 GiB
        j = tl.arange(0, BLOCKS_K)
        t = tl.arange(0, QB)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b0 in range(0, NB, BLOCKS_K):
            blk = b0 + j
            ok = n_ok[:, None] & (blk < NB)[None, :]  # [BN, BK]
            at = n64[:, None] * NB + blk[None, :]  # each block's index in the scale planes
            d = tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
            q = tl.load(q_ptr + at[:, :, None] * QB + t[None, None, :], mask=ok[:, :, None], other=0)
            k = tl.reshape(blk[:, None] * 32 + t[None, :], (BLOCKS_K * QB,))
            k_ok = tl.reshape((blk < NB)[:, None] & (t < QB)[None, :], (BLOCKS_K * QB,))
            if KIND == 0:  # Q8_0: w = d q
                w = tl.reshape(d * q.to(tl.float32), (BLOCK_N, BLOCKS_K * QB))
                acc = _plus_rows_times(acc, x_ptr, offs_m, m_ok, stride_xm, k, k_ok, w, FP32)
            else:
                low = (q & 0xF).to(tl.float32)
                high = (q >> 4).to(tl.float32)
                if KIND == 1:  # Q4_0: w = d (q - 8)
                    w_low, w_high = d * (low - 8.0), d * (high - 8.0)
                else:  # Q4_1: w = d q + m
                    mins = tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
                    w_low, w_high = d * low + mins, d * high + mins
                acc = _plus_rows_times(acc, x_ptr, offs_m, m_ok, stride_xm, k, k_ok,
                                       tl.reshape(w_low, (BLOCK_N, BLOCKS_K * QB)), FP32)
                acc = _plus_rows_times(acc, x_ptr, offs_m, m_ok, stride_xm, k + 16, k_ok,
                                       tl.reshape(w_high, (BLOCK_N, BLOCKS_K * QB)), FP32)
        out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    # Tuned per shape at load (device_weights.warm_fused_kernels), by timing on the device; on a
    # CPU under TRITON_INTERPRET (checking the kernel by hand) one fixed tile runs.
    PLANE_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
                     for n, w, s in ((16, 4, 2), (16, 4, 3), (32, 4, 3), (32, 4, 4), (64, 4, 3), (64, 8, 3),
                                     (128, 8, 3), (32, 8, 2))]
    _tuned_planes = triton.autotune(configs=PLANE_CONFIGS, key=["N", "NB", "KIND"])(_rows_times_planes)


def rows_times_planes(x: Tensor, planes: Tensor, ggml_type: GGML, out: Tensor, config=None,
                      rows: slice = slice(None)) -> None:
    """out[m, N] = x[m, K] @ W[rows].T for W a planar buffer (engine/block_planes.py) of
    `ggml_type`; m <= ROWS_MAX. `out` may be a column slice of a wider matrix (rows strided).
    `rows`: a range of W's rows (one expert's of an experts matrix; each plane's rows are
    contiguous, so a range of them is too). `config`: one of PLANE_CONFIGS instead of the tuned
    one (tests: every tile sums alike)."""
    q, d, mins = (None if p is None else p[rows] for p in block_planes.parts(planes, ggml_type))
    m, n, nb = x.shape[0], d.shape[0], d.shape[1]
    assert 0 < m <= ROWS_MAX and x.shape[1] == nb * 32 and out.shape == (m, n), (x.shape, out.shape, d.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1
    args = (x, q, d, d if mins is None else mins, out, m, n, x.stride(0), out.stride(0))
    constants = dict(NB=nb, KIND=TYPES[ggml_type], FP32=x.dtype == torch.float32, BLOCK_M=16)
    if config is not None:
        _rows_times_planes[(triton.cdiv(n, config.kwargs["BLOCK_N"]),)](
            *args, **constants, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    elif x.device.type == "cuda":
        _tuned_planes[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **constants)
    else:
        _rows_times_planes[(triton.cdiv(n, 32),)](*args, **constants, BLOCK_N=32)
