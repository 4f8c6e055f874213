"""One vocabulary of weight and activation dtypes for every command, and one default.

`generate`, `serve`, `demo`, stage loads (LoadRequest.dtype) and draft models all name dtypes
the same way: torch's names ("float32", "float16", "bfloat16") are canonical and travel on the
wire; the short names other tools use (fp32, f32, fp16, f16, half, bf16) are accepted as
aliases, and "auto" means DEFAULT_DTYPE. The dtype is what dense weights, the KV cache and the
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
# Measured (bench/decode.py rows smollm2:dense-*, SmolLM2-135M dense through ggml's whole-layer
# graph, 2 threads, 2-core AVX-512 BF16 CPU shared with other jobs): decode batch 1 / batch 8 /
# prefill 512 tok/s: float32 46 / 153 / 280, float16 83 / 145 / 257, bfloat16 77 / 214 / 306.
# bfloat16 is the fastest overall; the default stays float32 until the suite has been re-run with
# the change (every identity test's reference takes this default) - see the engine branch report.
DEFAULT_DTYPE = "float32"


def dtype_name(text: str) -> str:
    """The canonical name of `text` (a canonical name, an alias, or "auto")."""
    name = text.strip().lower()
    if name == "auto":
        return DEFAULT_DTYPE
    name = ALIASES.get(name, name)
    if name not in DTYPES:
        raise BadRequest(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)} "
                         f"(or {', '.join(ALIASES)}, auto)")
    return name


def torch_dtype(text: str) -> torch.dtype:
    return DTYPES[dtype_name(text)]


def _argparse_dtype(text: str) -> str:
    try:
        return dtype_name(text)
    except BadRequest as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--dtype, the same on every command."""
    parser.add_argument("--dtype", type=_argparse_dtype, default=DEFAULT_DTYPE, metavar="|".join(DTYPES),
                        help=f"dense weights, KV cache and activations (aliases {', '.join(ALIASES)}; "
                             f"default {DEFAULT_DTYPE}, the fastest measured; GGUF quantized weights "
                             f"keep their own types)")
