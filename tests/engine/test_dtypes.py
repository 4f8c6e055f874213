"""One dtype vocabulary across commands: the same names, aliases and default on generate, serve
and demo, the same canonical name in ServingOptions, and a clear error for anything else."""

from __future__ import annotations

import pytest
import torch

from meshllm.cli import build_parser
from meshllm.engine.dtypes import DEFAULT_DTYPE, DTYPES, dtype_name, torch_dtype
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


def test_unknown_dtype_is_a_clear_error_listing_the_names():
    with pytest.raises(BadRequest, match="float32, float16, bfloat16"):
        dtype_name("int3")
    with pytest.raises(ValueError, match="unknown dtype"):
        ServingOptions(dtype="fp8")


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_the_same_names_and_default(command):
    parser = build_parser(command)
    base = [command, *COMMANDS[command]]
    assert parser.parse_args(base).dtype == DEFAULT_DTYPE == ServingOptions().dtype
    for alias in ("fp32", "bf16", "float16", "auto"):
        assert parser.parse_args([*base, "--dtype", alias]).dtype in DTYPES
    with pytest.raises(SystemExit):
        parser.parse_args([*base, "--dtype", "int3"])
