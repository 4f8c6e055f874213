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
# Chosen by measurement (bench/decode.py rows smollm2:dense-*, 2 threads, this project's 2-core
# AVX-512 BF16 CPU, ggml's whole-layer graph): see DEFAULT_DTYPE_MEASUREMENT.
DEFAULT_DTYPE = "float32"
DEFAULT_DTYPE_MEASUREMENT = "pending"


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
