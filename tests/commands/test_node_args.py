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


def test_a_bad_log_level_is_a_usage_error_not_a_traceback(capsys):
    import pytest

    from meshllm.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser("status").parse_args(["--log-level", "bogus", "status"])
    assert exited.value.code == 2 and "invalid choice: 'BOGUS'" in capsys.readouterr().err
    assert build_parser("status").parse_args(["--log-level", "info", "status"]).log_level == "INFO"
