"""One vocabulary of weight and activation dtypes for every command, and one default.

`generate`, `serve`, `demo`, stage loads (LoadRequest.dtype) and draft models all name dtypes
the same way: torch's names ("float32", "float16", "bfloat16") are canonical and travel on the
wire; the short names other tools use (fp32, f32, fp16, f16, half, bf16) are accepted as
aliases, and "auto" (every command's default) means DEFAULT_DTYPE, or BATCH_INVARIANT_DTYPE in
batch-invariant mode. The dtype is what dense weights, the KV cache and the
activations between stages are held in; GGUF block-quantized weights keep their own types.
"""

from __future__ import annotations

import argparse

import torch

from meshllm.errors import BadRequest

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_BYTES = {name: t.itemsize for name, t in DTYPES.items()}
ALIASES = {"fp32": "float32", "f32": "float32", "fp16": "float16", "f16": "float16", "half": "float16",
           "bf16": "bfloat16"}


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX tiles), as torch detects it."""
    probes = (getattr(torch.cpu, "_is_avx512_bf16_supported", None),
              getattr(torch.cpu, "_is_amx_tile_supported", None))
    return any(probe is not None and probe() for probe in probes)


def preferred_dtype(native_bf16: bool) -> str:
    """The default for dense weights, KV and activations, chosen by measurement.

    Measured (bench/decode.py rows smollm2:dense-*, SmolLM2-135M dense through ggml's whole-layer
    graph, 2 threads, 2-core AVX-512 BF16 CPU shared with other jobs): decode batch 1 / batch 8 /
    prefill 512 tok/s: float32 46 / 153 / 280, float16 83 / 145 / 257, bfloat16 77 / 214 / 306;
    again (bench/results/decode-smollm2-dense-dtypes.json): float32 44 / 148 / 296, float16
    55 / 137 / 209, bfloat16 82 / 186 / 311.
    bfloat16 halves the bytes every decode step streams and keeps float32's range; where the CPU
    has no bf16 instructions ggml and torch emulate it, so float32 stays the default there (float16
    was not measured on such a CPU). Identity tests pin float32 (or batch-invariant mode) explicitly.
    """
    return "bfloat16" if native_bf16 else "float32"


DEFAULT_DTYPE = preferred_dtype(cpu_has_native_bf16())
# Batch-invariant mode runs torch's tiled matmuls, not ggml's graph, and there bf16 is the slow
# one: one row through a 576x3072 TiledLinear (SmolLM2 shapes, 1 thread) took 0.60 ms in float32
# and 2.53 ms in bfloat16 (torch's bf16 bmm over an expanded weight). So "auto" is float32 there.
BATCH_INVARIANT_DTYPE = "float32"
AUTO = "auto"  # the default of every --dtype; resolved where batch-invariance is known


def dtype_name(text: str, batch_invariant: bool = False) -> str:
    """The canonical name of `text` (a canonical name, an alias, or "auto": the default for
    the mode, DEFAULT_DTYPE or, in batch-invariant mode, BATCH_INVARIANT_DTYPE)."""
    name = text.strip().lower()
    if name == AUTO:
        return BATCH_INVARIANT_DTYPE if batch_invariant else DEFAULT_DTYPE
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise BadRequest(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)} "
                         f"(or {', '.join(ALIASES)}, auto)")
    return name


def torch_dtype(text: str) -> torch.dtype:
    return DTYPES[dtype_name(text)]


def _argparse_dtype(text: str) -> str:
    """Canonical names for explicit dtypes; "auto" stays "auto" until ServingOptions knows the mode."""
    if text.strip().lower() == AUTO:
        return AUTO
    try:
        return dtype_name(text)
    except BadRequest as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype, the same on every command."""
    parser.add_argument("--dtype", type=_argparse_dtype, default=AUTO, metavar="|".join(DTYPES),
                        help=f"dense weights, KV cache and activations (aliases {', '.join(ALIASES)}; "
                             f"default auto: here {DEFAULT_DTYPE} (bfloat16 on CPUs with bf16 instructions, "
                             f"else float32), {BATCH_INVARIANT_DTYPE} in batch-invariant mode; GGUF "
                             f"quantized weights keep their own types)")
