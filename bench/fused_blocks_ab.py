"""A/B on a CUDA GPU of meshllm's kernel for a few activation rows times Q8_0/Q4_0/Q4_1 planes
(engine/triton_blocks.py: tiles through tl.dot, 16 rows a tile, tiles picked by timing) against a
candidate without the matrix units (below: elementwise products summed in fp32, up to R_MAX rows
a program, each row's partial sums added in a fixed pairwise tree so its bits depend on nothing
but the row), each product replayed as a CUDA graph, at 1, 2, 4, 8 and 16 rows, a dense bf16
F.linear beside. Also checks, on the GPU, what the CPU's interpreter cannot: each row of an
m-row product is bitwise its one-row product (a verify pass = its one-row decode steps), for
both kernels, and both stay within tolerance of the reference dequantization's product.

    python bench/fused_blocks_ab.py > ab.json      (on a CUDA machine with Triton; ~40 s)

History (bench/results/fused-blocks-ab-h200.json): one-row programs of elementwise products
read the blocks 1.4-2.9x faster than the tl.dot kernel for one row (a sweep of 24 tiles,
bench/results/fused-gemv-sweep-h200.json) but 0.4-0.6x at 4 rows. This candidate takes up to 8
rows a program and passed the GPU tests as the module's kernel, but was slower where it counts:
1.0-2.4x for one row up to 4096x4096, 0.9-1.0x at 14336x4096, 0.36-0.65x for a 49152x576 head,
0.2-0.9x at 4-16 rows on the large shapes. Read from its compiled form (TTGIR, on a CPU): with R
rows the leading axis, tl.zeros((R, BLOCK_N, L)) gets warpsPerCTA [8, 1, 1], so at R = 1 its 8
warps compute the same values, and the tree's one layout change leaves every thread summing all
L values of its rows, both costs per program, which a short-K, many-row head multiplies (at one
row it was also ~30% slower than the sweep's one-row kernel, which had neither). The next try:
one [BLOCK_N, L] accumulator per row (up to 8, written out under `if R > i`), each fed the same
dequantized tile, so every row's code and layout are the R = 1 kernel's whatever R is, and the
sweep's 3-D tile with tl.sum at a fixed tile (row-invariant by that construction, not
tile-invariant: no tuning).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from device_decode import graph_replay_us as timed  # noqa: E402
from meshllm.engine import block_planes, triton_blocks  # noqa: E402
from meshllm.engine.block_dequant import dequantize  # noqa: E402

R_MAX = 8  # activation rows one program takes
BLOCKS_K = 8  # blocks of each weight row a program reads a step (sets the sums' order: fixed)
TILE = {"BLOCK_N": 8, "num_warps": 8, "num_stages": 2}  # among the sweep's fastest for one row


@triton.jit
def _halve(v):
    """[R, N, 2L] -> [R, N, L]: neighbours 2i and 2i + 1 summed."""
    a, b = tl.split(tl.reshape(v, (v.shape[0], v.shape[1], v.shape[2] // 2, 2)))
    return a + b


@triton.jit
def _tree_sum(v, L: tl.constexpr):
    """[R, N, L] -> [R, N], L a power of two up to 256, summed as a fixed pairwise tree: the
    order is the code's, not the layout's, so it is the same whatever the tile, the warps
    or the rows beside (tl.sum's order follows the layout, which those change)."""
    if L >= 256:
        v = _halve(v)
    if L >= 128:
        v = _halve(v)
    if L >= 64:
        v = _halve(v)
    if L >= 32:
        v = _halve(v)
    if L >= 16:
        v = _halve(v)
    if L >= 8:
        v = _halve(v)
    if L >= 4:
        v = _halve(v)
    if L >= 2:
        v = _halve(v)
    return tl.reshape(v, (v.shape[0], v.shape[1]))


@triton.jit
def _products(w, x):
    """w [N, L] (fp32, rounded to x's dtype as the torch path's dense copy is) times x [R, L]
    elementwise: [R, N, L] in fp32 (16-bit products are exact there)."""
    return w.to(x.dtype).to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]

# M is not specialized: one compiled kernel per R serves every row count up to R.

@triton.jit(do_not_specialize=["M"])
def _rows_times_planes(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, stride_xm, stride_ym,
                       NB: tl.constexpr, KIND: tl.constexpr, BLOCKS_K: tl.constexpr, R: tl.constexpr, BLOCK_N: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * W[n, k], W held as planes (engine/block_planes.py): codes
    # [N, NB * QB] at q_ptr, f16 scales [N, NB] at d_ptr (minimums at m_ptr for Q4_1).
    # Program (i, g) takes weight rows [i * BLOCK_N, +BLOCK_N) and activation rows
    # [g * R, +R), BLOCKS_K blocks a step: a block's codes are one 16-byte-aligned run,
    # dequantized once for the R rows. Q4 codes hold value t low and t + 16 high.
    # No matrix units: each element of acc [R, BLOCK_N, L] sums the products at depths
    # k = j (mod L) in step order, and _tree_sum adds those L partial sums in a fixed tree.
    # So a row's bits depend on nothing but its row and L: not on R, the rows beside it (a
    # verify pass = its one-row steps), BLOCK_N or the warps.
    QB: tl.constexpr = 32 if KIND == 0 else 16
    L: tl.constexpr = BLOCKS_K * QB
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * R + tl.arange(0, R)
    n_ok, m_ok = offs_n < N, offs_m < M
    n64 = offs_n.to(tl.int64)  # 64-bit: a large vocabulary's table passes 2 GiB
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm  # [R, 1]
    j = tl.arange(0, BLOCKS_K)
    t = tl.arange(0, QB)
    acc = tl.zeros((R, BLOCK_N, L), dtype=tl.float32)
    for b0 in range(0, NB, BLOCKS_K):
        blk = b0 + j
        blk_ok = blk < NB
        ok = n_ok[:, None] & blk_ok[None, :]  # [BN, BK]
        at = n64[:, None] * NB + blk[None, :]  # each block's index in the scale planes
        d = tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        q = tl.load(q_ptr + at[:, :, None] * QB + t[None, None, :], mask=ok[:, :, None], other=0)
        k = tl.reshape(blk[:, None] * 32 + t[None, :], (L,))
        x_ok = m_ok[:, None] & tl.reshape(blk_ok[:, None] & (t < QB)[None, :], (L,))[None, :]
        x_low = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)  # [R, L]
        if KIND == 0:  # Q8_0: w = d q
            acc += _products(tl.reshape(d * q.to(tl.float32), (BLOCK_N, L)), x_low)
        else:
            x_high = tl.load(x_rows + (k + 16)[None, :], mask=x_ok, other=0.0)
            low = (q & 0xF).to(tl.float32)
            high = (q >> 4).to(tl.float32)
            if KIND == 1:  # Q4_0: w = d (q - 8)
                w_low, w_high = d * (low - 8.0), d * (high - 8.0)
            else:  # Q4_1: w = d q + m
                mins = tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
                w_low, w_high = d * low + mins, d * high + mins
            acc += _products(tl.reshape(w_low, (BLOCK_N, L)), x_low)
            acc += _products(tl.reshape(w_high, (BLOCK_N, L)), x_high)
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, _tree_sum(acc, L).to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def candidate_product(x, planes, ggml_type, out, tile: dict | None = None) -> None:
    q, d, mins = block_planes.parts(planes, ggml_type)
    m, n, nb = x.shape[0], d.shape[0], d.shape[1]
    tile = {**TILE, "R": min(R_MAX, 1 << (m - 1).bit_length()), **(tile or {})}
    grid = (triton.cdiv(n, tile["BLOCK_N"]), triton.cdiv(m, tile["R"]))
    _rows_times_planes[grid](x, q, d, d if mins is None else mins, out, m, n, x.stride(0), out.stride(0),
                             NB=nb, KIND=triton_blocks.TYPES[ggml_type], BLOCKS_K=BLOCKS_K, **tile)


def random_planes(n: int, k: int, ggml_type: GGML, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes are valid blocks once their f16 scales are set (small; Q4_1's minimum negative)."""
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = torch.randint(0, 256, (n, k // block * size), device=device, dtype=torch.uint8)
    scales = blocks.view(n, k // block, size)
    scales[:, :, :2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8, device=device)  # f16 ~0.0104
    if ggml_type == GGML.Q4_1:
        scales[:, :, 2:4] = torch.tensor([0x1F, 0xA1], dtype=torch.uint8, device=device)
    return blocks, block_planes.split(blocks, ggml_type)


SHAPES = [(4096, 4096), (14336, 4096), (1536, 576), (49152, 576)]
ROWS = (1, 2, 4, 8, 16)


def main() -> None:
    device = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "triton": triton.__version__, "candidate_tile": TILE, "r_max": R_MAX,
                 "rows": {}}
    for n, k in SHAPES:
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for ggml_type in (GGML.Q4_0, GGML.Q4_1, GGML.Q8_0):
            blocks, planes = random_planes(n, k, ggml_type, device)
            weight = dequantize(blocks, ggml_type, k, torch.bfloat16).float()
            x = torch.randn(16, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x.float(), weight)
            row: dict = {"bytes": blocks.numel()}
            for m in ROWS:
                candidate = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                fused = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                candidate_us = timed(lambda: candidate_product(x[:m], planes, ggml_type, candidate), device)
                fused_us = timed(lambda: triton_blocks.rows_times_planes(x[:m], planes, ggml_type, fused), device)
                dense_us = timed(lambda: F.linear(x[:m], dense), device)
                scale = want[:m].abs().max()
                solo = torch.empty(1, n, device=device, dtype=torch.bfloat16)
                invariant = {"candidate": True, "fused": True}
                for i in range(m):
                    candidate_product(x[i:i + 1], planes, ggml_type, solo)
                    invariant["candidate"] &= bool(torch.equal(solo[0], candidate[i]))
                    triton_blocks.rows_times_planes(x[i:i + 1], planes, ggml_type, solo)
                    invariant["fused"] &= bool(torch.equal(solo[0], fused[i]))
                row[f"rows{m}"] = {
                    "candidate_us": round(candidate_us, 2), "fused_us": round(fused_us, 2), "dense_bf16_us": round(dense_us, 2),
                    "candidate_speedup": round(fused_us / candidate_us, 2),
                    "candidate_gb_s": round(blocks.numel() / candidate_us / 1e3, 1),
                    "candidate_error_rel": float(f"{((candidate.float() - want[:m]).abs().max() / scale).item():.2g}"),
                    "fused_error_rel": float(f"{((fused.float() - want[:m]).abs().max() / scale).item():.2g}"),
                    "rows_bitwise_their_one_row_product": invariant}
            key = f"{n}x{k} {ggml_type.name}"
            out["rows"][key] = row
            print(json.dumps({key: row}), file=sys.stderr, flush=True)  # a run cut short keeps these
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
