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


def test_max_memory_caps_what_all_plans_hold_together():
    # The cap was applied to each reading of free memory, which already counts what the node's
    # plans hold: with 8 GiB offered and 6 GiB loaded, the card still said 8 GiB free.
    from meshllm.cluster.stage_budget import StageMemory
    from meshllm.node import capped_memory

    gib = 1 << 30
    assert capped_memory((64 * gib, 40 * gib), None, StageMemory(6 * gib)) == (64 * gib, 40 * gib)  # no cap: what is free
    assert capped_memory((64 * gib, 40 * gib), 8 * gib) == (8 * gib, 8 * gib)
    assert capped_memory((64 * gib, 40 * gib), 8 * gib, StageMemory(6 * gib)) == (8 * gib, 2 * gib)
    assert capped_memory((64 * gib, 40 * gib), 8 * gib, StageMemory(9 * gib)) == (8 * gib, 0)
    assert capped_memory((64 * gib, 1 * gib), 8 * gib, StageMemory(2 * gib)) == (8 * gib, 1 * gib)  # less free than the room left


def test_free_memory_leaves_out_the_kv_loaded_plans_may_still_grow_into():
    # The OS counts KV a plan has not grown into yet as free; a second plan placed into it would
    # run the node out of memory once the first one's sequences grow.
    from meshllm.cluster.stage_budget import StageMemory
    from meshllm.node import capped_memory

    gib = 1 << 30
    assert capped_memory((64 * gib, 40 * gib), None, StageMemory(6 * gib, 3 * gib)) == (64 * gib, 37 * gib)
    assert capped_memory((64 * gib, 2 * gib), None, StageMemory(6 * gib, 3 * gib)) == (64 * gib, 0)
    assert capped_memory((64 * gib, 40 * gib), 8 * gib, StageMemory(4 * gib, 3 * gib)) == (8 * gib, 1 * gib)


def test_threads_set_the_pool_a_node_or_server_computes_with():
    """`--threads` on node and serve (and demo, per node) reaches ggml's pool: applied before the
    first pool exists, in a fresh process since this one's pool may exist already."""
    import subprocess
    import sys

    import pytest

    from meshllm.commands.threads import apply_threads
    from meshllm.errors import BadRequest

    script = """
import argparse
from meshllm.commands import serve
from meshllm.commands.threads import apply_threads
from meshllm.engine.ggml_lib import runtime
parser = argparse.ArgumentParser()
serve.add_arguments(parser)
apply_threads(parser.parse_args(["--threads", "3"]).threads)
rt = runtime()
print("no ggml" if rt is None else rt.num_threads)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no ggml":
        pytest.skip("ggml is not built here (install.sh builds it)")
    assert done.stdout.strip() == "3"
    assert _parse("--threads", "2").threads == 2 and _parse().threads is None
    with pytest.raises(BadRequest, match="--threads must be at least 1"):
        apply_threads(0)
