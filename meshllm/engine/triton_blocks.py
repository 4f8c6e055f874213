"""GGUF blocks times a few activation rows in one GPU kernel (Triton): decode on `--device cuda`.

Why: engine/device_weights.py keeps a GGUF matrix as its blocks on the GPU and, by default,
dequantizes the whole matrix with ~10 torch ops before each product. At decode that is launch-
bound on a small model (SmolLM2-135M Q4_1 on an H200: 1924 CUDA kernels per step against 592
dense, 30 tok/s against 82) and on a large one it moves the weight ~4 times (blocks in, a dense
16-bit copy out and back in). Here one kernel per matrix reads the blocks, dequantizes them in
registers (the reference's arithmetic: f16 scales widened to fp32, d * q (+ m)) and multiplies:
the bytes read are the file's. Measured there: 538 kernels a step, 59-68 tok/s; one 14336x4096
Q4_0 product of one row 85 us against 803 us dequantizing first (dense bf16: 32 us; the kernel
reaches ~390 GB/s, far from the card's bandwidth: room left).

Q8_0, Q4_0 and Q4_1 (the demo's types and the common plain ones); other types, and more rows
than ROWS_MAX (prefill chunks, where dequantize-then-GEMM is compute-bound anyway), keep the
torch path. Weights are rounded to the activations' dtype before the product, as the torch path
rounds its dense copy, and products accumulate in fp32 (fp32 activations: IEEE, not TF32).

    rows_times_blocks(x [m, K], blocks [N, bytes], ggml_type, K, out [m, N])
"""

from __future__ import annotations

import os

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (CPU-only torch, macOS): the torch path runs
    triton = None

ROWS_MAX = 16  # activation rows one kernel takes (tl.dot's smallest tile side)
TYPES = {GGML.Q8_0: 0, GGML.Q4_0: 1, GGML.Q4_1: 2}
# Off: every product takes the torch path (bench/device_decode.py measures both in one run).
ENABLED = os.environ.get("MESHLLM_FUSED_BLOCKS", "1") != "0"


def available(device: torch.device) -> bool:
    """Whether the fused kernel runs on `device` (CUDA with Triton; anywhere under TRITON_INTERPRET)."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


if triton is not None:
    @triton.jit
    def _f16_at(ptr, mask):
        """The little-endian f16 at each of `ptr` (byte pointers) as fp32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
        return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _rows_times_blocks(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                           KIND: tl.constexpr, BLOCK_BYTES: tl.constexpr, FP32: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_K: tl.constexpr):
        # y[m, n] = sum_k x[m, k] * W[n, k], W[n] the GGUF blocks at w_ptr + n * row_bytes; each
        # program takes BLOCK_N rows of W, BLOCKS_K 32-value blocks of each per step. A block's
        # bytes are loaded as one contiguous run and its scale once; the values come out in the
        # block's byte order (Q4: value t and t + 16 share byte t), so x is gathered in that order.
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, BLOCK_M)
        n_ok, m_ok = offs_n < N, offs_m < M
        rows = w_ptr + offs_n.to(tl.int64) * row_bytes  # 64-bit: a large vocabulary's table passes 2 GiB
        j = tl.arange(0, BLOCKS_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for b0 in range(0, K // 32, BLOCKS_K):
            block = rows[:, None] + (b0 + j)[None, :] * BLOCK_BYTES  # [BN, BK] first byte of each block
            ok = n_ok[:, None] & ((b0 + j) < K // 32)[None, :]
            d = _f16_at(block, ok)[:, :, None]
            if KIND == 0:  # Q8_0: d, 32 int8; w = d q
                t = tl.arange(0, 32)
                q = tl.load(block[:, :, None] + 2 + t[None, None, :], mask=ok[:, :, None], other=0)
                w = d * q.to(tl.int8, bitcast=True).to(tl.float32)  # [BN, BK, 32]
                k = (b0 + j)[:, None] * 32 + t[None, :]  # [BK, 32]
            else:
                t = tl.arange(0, 16)
                first = 2 if KIND == 1 else 4  # Q4_0: d, 16 bytes; Q4_1: d, m, 16 bytes
                byte = tl.load(block[:, :, None] + first + t[None, None, :], mask=ok[:, :, None], other=0)
                q = tl.join(byte & 0xF, byte >> 4).to(tl.float32)  # [BN, BK, 16, 2]: values t, t + 16
                if KIND == 1:  # w = d (q - 8)
                    w = d[:, :, :, None] * (q - 8.0)
                else:  # w = d q + m
                    w = d[:, :, :, None] * q + _f16_at(block + 2, ok)[:, :, None, None]
                k = tl.join(((b0 + j)[:, None] * 32 + t[None, :]), ((b0 + j)[:, None] * 32 + t[None, :] + 16))
            w = tl.reshape(w, (BLOCK_N, BLOCKS_K * 32))
            k = tl.reshape(k, (BLOCKS_K * 32,))
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & (k < K)[None, :],
                        other=0.0)
            if FP32:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    # On CUDA the tile sizes are picked by measurement on the device at first use of each shape
    # (device_weights.warm_fused_kernels does that at load); under TRITON_INTERPRET (checking the
    # kernel on a CPU by hand) one fixed config runs.
    _CONFIGS = [triton.Config({"BLOCK_N": n, "BLOCKS_K": b}, num_warps=w)
                for n, b, w in ((16, 8, 4), (32, 4, 4), (32, 8, 4), (64, 4, 4), (64, 8, 8), (128, 4, 8))]
    _tuned = triton.autotune(configs=_CONFIGS, key=["N", "K", "KIND"])(_rows_times_blocks)


def rows_times_blocks(x: Tensor, blocks: Tensor, ggml_type: GGML, cols: int, out: Tensor) -> None:
    """out[m, N] = x[m, cols] @ W.T for W the `ggml_type` blocks [N, bytes per row]; m <= ROWS_MAX.
    `out` may be a column slice of a wider matrix (its rows strided), as a BlockLinear's parts are."""
    m, n = x.shape[0], blocks.shape[0]
    assert 0 < m <= ROWS_MAX and x.shape[1] == cols and cols % 32 == 0 and out.shape == (m, n), (x.shape, out.shape)
    assert x.stride(1) == 1 and out.stride(1) == 1 and blocks.is_contiguous()
    args = (x, blocks, out, m, n, cols, blocks.stride(0), x.stride(0), out.stride(0))
    constants = dict(KIND=TYPES[ggml_type], BLOCK_BYTES=GGML_QUANT_SIZES[ggml_type][1], FP32=x.dtype == torch.float32,
                     BLOCK_M=16)
    if x.device.type == "cuda":
        _tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **constants)
    else:
        _rows_times_blocks[(triton.cdiv(n, 32),)](*args, **constants, BLOCK_N=32, BLOCKS_K=4)
