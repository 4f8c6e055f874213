"""`meshllm node` / `serve` argument handling that needs no process: what the draft flags become."""

from __future__ import annotations

import argparse

from meshllm.commands import node as node_command


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    node_command.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_draft_models_are_int8_unless_asked_otherwise():
    assert node_command.draft_options(_parse()).quantization == "int8"
    assert node_command.draft_options(_parse("--draft-quantize", "int4")).quantization == "int4"
    assert node_command.draft_options(_parse("--draft-quantize", "none")).quantization is None
