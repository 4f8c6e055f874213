"""The README's run command: `meshllm demo` brings up a local cluster and answers a chat."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


def test_demo_once_serves_the_default_model_across_node_processes(smollm2_gguf_path, tmp_path):
    run = subprocess.run([sys.executable, "-m", "meshllm.cli", "demo", "--once", "--nodes", "2", "--port", "0"],
                         capture_output=True, text=True, timeout=360, cwd=tmp_path,
                         env={**os.environ, "MESHLLM_MODEL": ""})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    out = run.stdout
    assert "stage 0: node-0" in out and "stage 1: node-1" in out  # both node processes hold layers
    assert "holds layers 0-" in out and "-29\n" in out  # SmolLM2's 30 layers, all placed
    answer = out.split("> What is the capital of France?")[1].split("Try it yourself")[0]
    assert "Paris" in answer
    assert "curl http://127.0.0.1:" in out and "from openai import OpenAI" in out
