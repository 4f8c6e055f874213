"""A/B of two GPU kernels for a few activation rows times Q8_0/Q4_0/Q4_1 planes (decode on
`--device cuda`): meshllm's fused kernel (engine/triton_blocks.py: tiles through tl.dot, each
product 128 values deep) against a candidate that multiplies without the matrix units (each
program one activation row and BLOCK_N weight rows, elementwise products summed at the end, so a
row's bits never depend on the rows beside it, and each tile shape sums in one fixed order).

The fused kernel reads the blocks at ~0.4-0.6 TB/s on an H200 where a dense bf16 product reads
2.7-3.6 TB/s (bench/results/device-decode-h200-graphed-products.json); this measures whether
the candidate closes that gap, over its tile shapes, each time replayed as a CUDA graph, with
its results checked against the reference dequantization and for row invariance.

    python bench/fused_gemv_sweep.py > sweep.json      (on a CUDA machine with Triton)

Status: written for a lent GPU whose loan ended before it ran (2026-11-28), so no timing exists
yet. The candidate's arithmetic was checked on the CPU under TRITON_INTERPRET=1 (triton 3.6.0
installed beside the project, not in it): Q4_0, Q8_0 and Q4_1, fp32 and bf16 activations,
within 3.3e-7 (fp32) of the reference dequantization's product, and row 0 of a 3-row call
bitwise the 1-row call. Adopting it would mean a fixed tile per shape (not timing-based
autotuning: tiles sum in different orders) and the GPU tests' bitwise expectations rechecked.
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


@triton.jit(do_not_specialize=["M"])
def gemv_planes(x_ptr, q_ptr, d_ptr, m_ptr, y_ptr, M, N, stride_xm, stride_ym,
                NB: tl.constexpr, KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCKS_K: tl.constexpr):
    # program (n, m): y[m, n .. n + BLOCK_N) = x[m] . W[n .. n + BLOCK_N), W as planes
    # (engine/block_planes.py); products of weights rounded to x's dtype, summed in fp32 per
    # element over the K steps and reduced once at the end.
    QB: tl.constexpr = 32 if KIND == 0 else 16
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    n_ok = offs_n < N
    n64 = offs_n.to(tl.int64)
    j = tl.arange(0, BLOCKS_K)
    t = tl.arange(0, QB)
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCKS_K, QB), dtype=tl.float32)
    for b0 in range(0, NB, BLOCKS_K):
        blk = b0 + j
        blk_ok = blk < NB
        ok = n_ok[:, None] & blk_ok[None, :]
        at = n64[:, None] * NB + blk[None, :]
        d = tl.load(d_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        q = tl.load(q_ptr + at[:, :, None] * QB + t[None, None, :], mask=ok[:, :, None], other=0)
        k = blk[:, None] * 32 + t[None, :]
        x_lo = tl.load(x_row + k, mask=blk_ok[:, None], other=0.0)
        if KIND == 0:
            w = (d * q.to(tl.float32)).to(x_lo.dtype).to(tl.float32)
            acc += w * x_lo.to(tl.float32)[None, :, :]
        else:
            x_hi = tl.load(x_row + k + 16, mask=blk_ok[:, None], other=0.0)
            low = (q & 0xF).to(tl.float32)
            high = (q >> 4).to(tl.float32)
            if KIND == 1:
                w_lo, w_hi = d * (low - 8.0), d * (high - 8.0)
            else:
                mins = tl.load(m_ptr + at, mask=ok, other=0.0).to(tl.float32)[:, :, None]
                w_lo, w_hi = d * low + mins, d * high + mins
            acc += w_lo.to(x_lo.dtype).to(tl.float32) * x_lo.to(tl.float32)[None, :, :]
            acc += w_hi.to(x_hi.dtype).to(tl.float32) * x_hi.to(tl.float32)[None, :, :]
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(y_ptr + row * stride_ym + offs_n, out.to(y_ptr.dtype.element_ty), mask=n_ok)


def gemv(x, planes, ggml_type, out, block_n, blocks_k, warps, stages):
    q, d, mins = block_planes.parts(planes, ggml_type)
    m, n, nb = x.shape[0], d.shape[0], d.shape[1]
    gemv_planes[(triton.cdiv(n, block_n), m)](
        x, q, d, d if mins is None else mins, out, m, n, x.stride(0), out.stride(0),
        NB=nb, KIND=triton_blocks.TYPES[ggml_type], BLOCK_N=block_n, BLOCKS_K=blocks_k,
        num_warps=warps, num_stages=stages)


def random_planes(n: int, k: int, ggml_type: GGML, device) -> tuple[torch.Tensor, torch.Tensor]:
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = torch.randint(0, 256, (n, k // block * size), device=device, dtype=torch.uint8)
    scales = blocks.view(n, k // block, size)
    scales[:, :, :2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8, device=device)  # f16 ~0.0104
    if ggml_type == GGML.Q4_1:
        scales[:, :, 2:4] = torch.tensor([0x1F, 0xA1], dtype=torch.uint8, device=device)
    return blocks, block_planes.split(blocks, ggml_type)


CONFIGS = [(bn, bk, w, st) for bn in (8, 16, 32) for bk in (4, 8) for w in (4, 8) for st in (2, 3)]
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1536, 576)]


def main() -> None:
    device = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                 "triton": triton.__version__, "rows": {}}
    for n, k in SHAPES:
        dense = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        for ggml_type in (GGML.Q4_0, GGML.Q8_0):
            blocks, planes = random_planes(n, k, ggml_type, device)
            weight = dequantize(blocks, ggml_type, k, torch.bfloat16).float()
            x = torch.randn(4, k, device=device, dtype=torch.bfloat16)
            want = F.linear(x.float(), weight)
            y = torch.empty(4, n, device=device, dtype=torch.bfloat16)
            one = torch.empty(1, n, device=device, dtype=torch.bfloat16)
            row = {"bytes": blocks.numel()}
            for rows in (1, 4):
                row[f"fused_us_rows{rows}"] = round(timed(
                    lambda: triton_blocks.rows_times_planes(x[:rows], planes, ggml_type, y[:rows]), device), 2)
                row[f"dense_bf16_us_rows{rows}"] = round(timed(lambda: F.linear(x[:rows], dense), device), 2)
            tried = []
            for config in CONFIGS:
                try:
                    us = timed(lambda: gemv(x[:1], planes, ggml_type, one, *config), device)
                except Exception as e:  # a tile the compiler refuses (registers, shared memory)
                    tried.append({"config": config, "failed": f"{type(e).__name__}: {str(e)[:80]}"})
                    continue
                gemv(x, planes, ggml_type, y, *config)
                error = ((y.float() - want).abs().max() / want.abs().max()).item()
                gemv(x[:1], planes, ggml_type, one, *config)
                tried.append({"config": config, "us": round(us, 2), "error": float(f"{error:.2g}"),
                              "row_invariant": bool(torch.equal(one[0], y[0]))})
            good = sorted([t for t in tried if "us" in t and t["error"] < 2e-2 and t["row_invariant"]],
                          key=lambda t: t["us"])
            if good:
                best = good[0]
                row["candidate_best_rows1"] = best
                row["candidate_us_rows4"] = round(timed(lambda: gemv(x, planes, ggml_type, y, *best["config"]),
                                                        device), 2)
                row["fused_gb_s"] = round(blocks.numel() / row["fused_us_rows1"] / 1e3, 1)
                row["candidate_gb_s"] = round(blocks.numel() / best["us"] / 1e3, 1)
                row["speedup_rows1"] = round(row["fused_us_rows1"] / best["us"], 2)
                row["speedup_rows4"] = round(row["fused_us_rows4"] / row["candidate_us_rows4"], 2)
            row["top5"] = good[:5]
            row["bad"] = [t for t in tried if t not in good][:6]
            key = f"{n}x{k} {ggml_type.name}"
            out["rows"][key] = row
            print(key, json.dumps({k: v for k, v in row.items() if k not in ("top5", "bad")}), file=sys.stderr,
                  flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
