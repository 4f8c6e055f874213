"""Linear layers in the form a CPU multiplies fastest; applied to a loaded Decoder.

Decoding one token reads every weight once, so on a CPU the matrix-vector products
set the speed, and torch 2.13's plain 16-bit ones are compute-bound well below the
memory bandwidth (measured on an AVX-512 Sapphire Rapids, 2 threads: ~11 GB/s for
fp16 and bf16 against ~24 GB/s of read bandwidth). Two faster forms:

- `pack_bf16`: bf16 weights reordered once into oneDNN's blocked layout, so each
  product skips the per-call reorder (decode 1.1x faster on SmolLM2-135M, 1.6x on a
  1.1B model than fp16; prefill ~0.6x, as bf16 GEMMs run slower than fp16 ones
  without AMX). Same arithmetic as a bf16 nn.Linear.
- `quantize_int8`: weight-only int8 with one scale per output row (torch's kernel
  from gpt-fast): half the bytes, decode ~1.6x faster than fp16 on both models, and
  output close to but not identical with 16-bit weights.

Both swap nn.Linear modules in place (the dense weights are dropped), so they apply
to a Decoder built by load_decoder; an embedding tied to the LM head keeps its
dense table for lookups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

MAX_INT8_KERNEL_ROWS = 32  # measured crossover: beyond it the dequantized matmul is faster
# torch 2.13's int8 kernel reads past the row end (NaNs, segfaults) unless in_features is a
# multiple of 32 (checked: 64, 96, 172 and 100 wide); real models' widths all are.
INT8_KERNEL_WIDTH_MULTIPLE = 32


class PackedBF16Linear(nn.Module):
    """nn.Linear with its bf16 weight in oneDNN's prepacked layout; input and output bf16."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight)  # opaque; not a state_dict entry
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(torch.bfloat16),
                                                                  requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: [rows, in_features] bf16 -> [rows, out_features] bf16
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 prepacked"


class Int8Linear(nn.Module):
    """y = x @ (weight_int8 * scale[:, None]).T (+ bias), in x's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight_int8", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)  # fp32 [out_features]
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16))
        self.bias = linear.bias
        self.kernel_fits = self.in_features % INT8_KERNEL_WIDTH_MULTIPLE == 0

    def forward(self, x: Tensor) -> Tensor:
        # x: [rows, in_features] -> [rows, out_features]
        if x.shape[0] <= MAX_INT8_KERNEL_ROWS and self.kernel_fits:
            # The int8 kernel is fast only with bf16 activations: cast around it.
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.weight_int8,
                                                   self.scale_bf16).to(x.dtype)
        else:
            y = F.linear(x, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None])
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row"


def pack_bf16(module: nn.Module) -> nn.Module:
    """Replace every bf16 nn.Linear inside `module` with a PackedBF16Linear, in place."""
    assert all(p.dtype == torch.bfloat16 for p in module.parameters()), "pack_bf16 needs a bf16 model"
    return _swap_linears(module, PackedBF16Linear)


def quantize_int8(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear inside `module` with an Int8Linear, in place."""
    return _swap_linears(module, Int8Linear)


def _swap_linears(module: nn.Module, make) -> nn.Module:
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
    return module
