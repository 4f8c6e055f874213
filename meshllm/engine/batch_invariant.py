"""Batch-invariant matmuls: a row's result never depends on what else shares its batch.

CPU BLAS picks a different kernel (gemv, small-M gemm, large-M gemm) by the
number of rows, and each sums in another order, so a sequence decoded alone and
the same sequence decoded among 15 others differ in the last bits of their
logits (measured: up to 7e-5 in fp32) — enough to flip a greedy choice between
near-tied tokens. Here every linear layer runs on tiles of exactly TILE_ROWS
rows (zero-padded), so each row always goes through the same kernel with the
same summation order. Attention is already per sequence, and in this mode it runs
one query row at a time with the decode kernel, so a row's bits do not depend on the
chunk it is in either: a prefill chunk, a verification step of k + 1 draft rows and a
failover re-prefill give each position exactly the bits of one-row decode steps.

This costs speed (a decode row pays for TILE_ROWS rows of arithmetic), so it is
a mode: exactness tests and users who need bit-reproducible output turn it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm.model.decoder import Attention

TILE_ROWS = 8


class TiledLinear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        out = _tiled_product(x, self.weight)
        return out + self.bias if self.bias is not None else out

    def rows_product(self, x: Tensor, start: int, stop: int) -> Tensor:
        """x times rows [start, stop) of the weight (one expert's, decoder.MoE), tiled the same way."""
        out = _tiled_product(x, self.weight[start:stop])
        return out + self.bias[start:stop] if self.bias is not None else out


def _tiled_product(x: Tensor, weight: Tensor) -> Tensor:
    """x [n, k] @ weight.T in tiles of TILE_ROWS rows (zero-padded)."""
    n, k = x.shape
    pad = (-n) % TILE_ROWS
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    tiles = x.shape[0] // TILE_ROWS
    # bmm runs each tile as its own [TILE_ROWS, k] x [k, out] product.
    out = torch.bmm(x.view(tiles, TILE_ROWS, k), weight.t().unsqueeze(0).expand(tiles, k, -1))
    return out.view(-1, weight.shape[0])[:n]


def make_batch_invariant(module: nn.Module) -> nn.Module:
    """Switch every nn.Linear inside `module` to TiledLinear and attention to one row at a
    time, in place (weights shared)."""
    for m in module.modules():
        if type(m) is nn.Linear:
            m.__class__ = TiledLinear
        elif isinstance(m, Attention):
            m.per_row = True
    return module
