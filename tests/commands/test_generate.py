"""`meshllm generate` as a user runs it: a real subprocess streaming text, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from meshllm.pipeline.local_generate import generate_many
from meshllm.engine.sampler import SamplingParams
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model

TIMEOUT_S = 120


def _meshllm(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "generate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr  # one line, no traceback
    assert lines[0].startswith("meshllm generate: error [")
    assert result.stdout == ""
    return lines[0]


def test_streams_the_greedy_text_of_the_local_loop(aidreams_path):
    prompt = "Echoes of vectors"
    result = _meshllm("--model", str(aidreams_path), "--prompt", prompt, "--temperature", "0",
                      "--max-tokens", "24", "--dtype", "fp32")
    assert result.returncode == 0, result.stderr
    files = open_model(aidreams_path)
    decoder = load_decoder(files.source, files.config)
    tokenizer = files.tokenizer
    prompt_ids = tokenizer.encode(prompt)
    [want] = generate_many(decoder, tokenizer, [prompt_ids], SamplingParams(temperature=0.0, max_tokens=24))
    # No chat template: the text goes on from the prompt, so what is printed is what the whole
    # decode adds to the prompt's, the space before the first word included.
    whole = tokenizer.decode(prompt_ids + list(want.token_ids))
    assert whole.startswith(prompt)
    assert result.stdout == whole[len(prompt):] + "\n"
    assert "[24 tokens, finish_reason length" in result.stderr


def test_a_seed_makes_sampling_repeatable(aidreams_path):
    args = ("--model", str(aidreams_path), "--prompt", "I dream", "--seed", "42", "--max-tokens", "20",
            "--top-p", "0.9", "--stop", "zzz")
    first, second = _meshllm(*args), _meshllm(*args)
    assert first.returncode == second.returncode == 0, first.stderr
    assert first.stdout == second.stdout and len(first.stdout) > 20


@pytest.mark.slow
@pytest.mark.parametrize("flags", [("--dtype", "bf16"), ("--int8",)])
def test_cpu_weight_forms_generate(aidreams_path, flags):
    result = _meshllm("--model", str(aidreams_path), "--prompt", "Echoes of vectors", "--temperature", "0",
                      "--max-tokens", "16", *flags)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip()) > 16 and "[16 tokens, finish_reason length" in result.stderr


def test_a_prompt_longer_than_the_context_is_one_line(aidreams_path):
    line = _error_line(_meshllm("--model", str(aidreams_path), "--prompt", "dream " * 200))
    assert "[context_length_exceeded]" in line and "128" in line


def test_max_tokens_beyond_the_context_is_one_line(aidreams_path):
    line = _error_line(_meshllm("--model", str(aidreams_path), "--prompt", "I dream", "--max-tokens", "500"))
    assert "[context_length_exceeded]" in line and "max_tokens is 500" in line


@pytest.mark.parametrize(("flags", "code"), [(("--temperature", "-1"), "bad_request"),
                                             (("--top-p", "-0.5"), "bad_request"),
                                             (("--model", "/nonexistent/model"), "model_load_failed")])
def test_bad_flags_are_one_line(aidreams_path, flags, code):
    args = ("--model", str(aidreams_path), "--prompt", "hi", *flags)
    assert f"[{code}]" in _error_line(_meshllm(*args))


@pytest.mark.slow
def test_default_model_answers_through_its_chat_template(smollm2_gguf_path):
    result = _meshllm("--prompt", "What is 2+2? Answer with a number.", "--temperature", "0", "--max-tokens", "16")
    assert result.returncode == 0, result.stderr
    assert "4" in result.stdout
