"""Which form a loaded stage's linear weights take, decided in one place for every path
(single process, stage node): batch-invariant tiles, int8, or on CPU bf16 run by the C kernel (else prepacked)."""

from __future__ import annotations

import torch

from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.engine.cpu_weights import pack_bf16, quantize_int8, use_fast_bf16
from meshllm.engine.kernels.gemv import load_gemv
from meshllm.errors import BadRequest
from meshllm.model.decoder import Decoder

QUANTIZATIONS = ("int8",)


def prepare_for_cpu(decoder: Decoder, quantization: str | None, batch_invariant: bool) -> Decoder:
    """Swap the decoder's linears in place for the fastest form that keeps the promised output.

    Batch invariance wins: its fixed row tiles are what make a sequence's bits independent
    of its batch, so it is not combined with the other forms.
    """
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise BadRequest(f"unknown quantization {quantization!r}; supported: {', '.join(QUANTIZATIONS)}")
    if batch_invariant:
        if quantization is not None:
            raise BadRequest("batch-invariant mode runs 16/32-bit weights; drop the quantization")
        return make_batch_invariant(decoder)
    if quantization == "int8":
        return quantize_int8(decoder)
    if decoder.dtype == torch.bfloat16 and _on_cpu(decoder):
        if load_gemv() is not None:
            return use_fast_bf16(decoder)  # own AVX-512 BF16 kernel: faster decode, prefill on par
        return pack_bf16(decoder)  # bf16 matrix-vector products are 2x faster prepacked for oneDNN
    return decoder


def _on_cpu(decoder: Decoder) -> bool:
    return next(decoder.parameters()).device.type == "cpu"
