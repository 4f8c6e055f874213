"""One dtype vocabulary across commands: the same names, aliases and default on generate, serve
and demo, the same canonical name in ServingOptions, and a clear error for anything else."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshllm.cli import build_parser
from meshllm.engine.dtypes import (BATCH_INVARIANT_DTYPE, DEFAULT_DTYPE, DTYPES, cpu_has_native_bf16, dtype_name,
                                   preferred_dtype, torch_dtype)
from meshllm.errors import BadRequest
from meshllm.pipeline.cluster import ServingOptions

COMMANDS = {"generate": ["--prompt", "hi"], "serve": [], "demo": []}


@pytest.mark.parametrize("alias,name", [("fp32", "float32"), ("f32", "float32"), ("FP16", "float16"),
                                        ("half", "float16"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16"),
                                        ("auto", DEFAULT_DTYPE)])
def test_aliases_resolve_to_torch_names(alias, name):
    assert dtype_name(alias) == name
    assert torch_dtype(alias) == getattr(torch, name)
    assert ServingOptions(dtype=alias).dtype == name


def test_default_is_bfloat16_only_where_the_cpu_has_bf16_instructions():
    """bf16 halves the bytes a decode step streams where the CPU multiplies it natively; elsewhere it
    is emulated and float32 stays the default (engine/dtypes.py states the measurement)."""
    assert preferred_dtype(native_bf16=True) == "bfloat16"
    assert preferred_dtype(native_bf16=False) == "float32"
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    if {"avx512_bf16", "amx_bf16"} & flags:
        assert cpu_has_native_bf16() and DEFAULT_DTYPE == "bfloat16"
    elif flags:  # an x86 or ARM Linux CPU without them
        assert DEFAULT_DTYPE == "float32"
    assert dtype_name("auto") == DEFAULT_DTYPE
    # Batch-invariant mode runs torch's tiled matmuls, where float32 is the fast one.
    assert dtype_name("auto", batch_invariant=True) == BATCH_INVARIANT_DTYPE == "float32"
    assert dtype_name("bf16", batch_invariant=True) == "bfloat16"  # an explicit choice stands


def test_unknown_dtype_is_a_clear_error_listing_the_names():
    with pytest.raises(BadRequest, match="float32, float16, bfloat16"):
        dtype_name("int3")
    with pytest.raises(ValueError, match="unknown dtype"):
        ServingOptions(dtype="fp8")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_same_names_and_default(command):
    parser = build_parser(command)
    base = [command, *COMMANDS[command]]
    default = parser.parse_args(base).dtype
    assert ServingOptions(dtype=default).dtype == DEFAULT_DTYPE == ServingOptions().dtype
    assert ServingOptions(dtype=default, batch_invariant=True).dtype == BATCH_INVARIANT_DTYPE
    for alias in ("fp32", "bf16", "float16"):
        assert parser.parse_args([*base, "--dtype", alias]).dtype in DTYPES
    assert parser.parse_args([*base, "--dtype", "AUTO"]).dtype == default == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--dtype", "int3"])
