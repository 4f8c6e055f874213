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

- `use_fast_bf16`: plain bf16 weights multiplied by meshllm's own AVX-512 BF16 kernel
  (engine/kernels/gemv.c) for up to 8 rows, F.linear beyond; used instead of `pack_bf16`
  where the kernel is built and the CPU has avx512_bf16. One-row products 1.1-1.9x
  prepacked's speed (1.5x streaming from DRAM), SmolLM2-135M decode 1.1-1.4x, prefill on
  par (F.linear on the plain weight), and one copy of the weights instead of two.

All swap nn.Linear modules in place (the dense weights are dropped), so they apply
to a Decoder built by load_decoder; an embedding tied to the LM head keeps its
dense table for lookups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm.engine.kernels.gemv import load_gemv
from meshllm.model.decoder import MoE

MAX_GEMV_ROWS = 8  # the C kernel's tiles are built for decode; prefill-sized inputs go to oneDNN
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


class FastBF16Linear(nn.Linear):
    """bf16 nn.Linear whose few-row products run meshllm's C kernel (see kernels/gemv.c).

    A subclass of nn.Linear holding the same weight Parameter (a weight tied to the embedding
    stays tied); only forward changes. Build it only where load_gemv() is not None.
    """

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)  # adopt the existing Parameters instead of allocating new ones
        self.in_features, self.out_features = linear.in_features, linear.out_features
        assert linear.weight.dtype == torch.bfloat16 and linear.weight.is_contiguous(), \
            "FastBF16Linear needs a contiguous bf16 weight"
        self.weight, self.bias = linear.weight, linear.bias
        gemv = load_gemv()
        assert gemv is not None, "FastBF16Linear needs the C kernel; check load_gemv() first"
        self._gemv = gemv

    def forward(self, x: Tensor) -> Tensor:
        # x: [rows, in_features] bf16 -> [rows, out_features] bf16
        rows = x.shape[0]
        if x.dim() != 2 or rows > MAX_GEMV_ROWS or x.dtype != torch.bfloat16 or rows == 0:
            return F.linear(x, self.weight, self.bias)
        x = x.contiguous()
        y = torch.empty((rows, self.out_features), dtype=torch.bfloat16)
        self._gemv(self.weight.data_ptr(), x.data_ptr(), None if self.bias is None else self.bias.data_ptr(),
                   y.data_ptr(), rows, self.out_features, self.in_features, torch.get_num_threads())
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bf16 C kernel"


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
    assert _linears_in_bf16(module), "pack_bf16 needs a bf16 model"
    return _swap_linears(module, PackedBF16Linear)


def use_fast_bf16(module: nn.Module) -> nn.Module:
    """Replace every bf16 nn.Linear inside `module` with a FastBF16Linear, in place."""
    assert _linears_in_bf16(module), "use_fast_bf16 needs a bf16 model"
    return _swap_linears(module, FastBF16Linear)


def _linears_in_bf16(module: nn.Module) -> bool:
    # the matrices swapped, not every parameter: Gemma's norm weights stay float32 in a bf16 model
    return all(m.weight.dtype == torch.bfloat16 for m in module.modules() if type(m) is nn.Linear)


def quantize_int8(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear inside `module` with an Int8Linear, in place."""
    return _swap_linears(module, Int8Linear)


def _swap_linears(module: nn.Module, make) -> nn.Module:
    for parent in list(module.modules()):
        if isinstance(parent, MoE):  # it multiplies one expert's rows at a time: its matrices stay nn.Linear
            continue
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, make(child))
    return module
