"""`meshllm serve` as a user runs it: a real process answering the openai client."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI

from meshllm.cli import main

pytestmark = pytest.mark.timeout(180)


def read_line_matching(process: subprocess.Popen, pattern: str, timeout_s: float) -> re.Match:
    """The first stdout line matching `pattern`, read on a helper thread so a silent process
    cannot hang the test."""
    found: list[re.Match] = []
    seen: list[str] = []

    def read() -> None:
        for line in process.stdout:
            seen.append(line)
            match = re.search(pattern, line)
            if match:
                found.append(match)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert found, f"no line matching {pattern!r} within {timeout_s} s; output so far: {''.join(seen)!r}"
    return found[0]


@pytest.mark.slow
def test_serve_answers_openai_requests_and_stops_on_sigterm(aidreams_path, tmp_path):
    env = {**os.environ, "MESHLLM_API_KEY": "k3y", "MESHLLM_CACHE_DIR": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "meshllm.cli", "serve", "--model", str(aidreams_path), "--port", "0",
               "--api-port", "0", "--no-discovery", "--state-dir", str(tmp_path / "state"), "--max-context", "64"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = read_line_matching(process, r"serving aidreams-260k at (http://127\.0\.0\.1:\d+)/v1", 120).group(1)
        client = OpenAI(base_url=f"{url}/v1", api_key="k3y", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list()] == ["aidreams-260k"]
        assert client.models.list().data[0].max_model_len == 64  # --max-context took effect
        reply = client.chat.completions.create(model="aidreams-260k", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens >= 1
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # the key came from the environment
        # The node's own card is in the fleet view with the API address, and (once the background
        # model scan has fingerprinted it) the served model.
        deadline = time.monotonic() + 60
        while True:
            # The fleet view (addresses, memory) needs the key too.
            [node] = httpx.get(f"{url}/v1/cluster", headers={"authorization": "Bearer k3y"}, timeout=10).json()["nodes"]
            if node["models"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert node["api_address"] == url.removeprefix("http://") and node["models"] == ["aidreams-260k"]

        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
        assert code == 0, process.stdout.read()[-4000:]  # the rest of its output says why it did not stop cleanly
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_a_signal_while_waiting_for_the_fleet_stops_serve_at_once(aidreams_path, tmp_path):
    # Start-up (waiting up to --fleet-timeout for the nodes, then loading) ignored Ctrl-C and
    # systemd's stop until it was over: the handler only set a flag the main thread read later.
    # SIGTERM takes the same handler (the suite's time is tight: one signal here).
    sig = signal.SIGINT
    command = [sys.executable, "-m", "meshllm.cli", "--log-level", "INFO", "serve", "--model", str(aidreams_path),
               "--stages", "2", "--fleet-timeout", "120", "--port", "0", "--api-port", "0", "--no-discovery",
               "--state-dir", str(tmp_path / "state")]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        read_line_matching(process, r"found \d+ model\(s\) on disk", 60)  # started; waiting for a 2nd node
        process.send_signal(sig)
        assert process.wait(timeout=15) == 128 + sig
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_bad_flags_exit_with_a_message(tmp_path, capsys):
    base = ["serve", "--state-dir", str(tmp_path), "--no-discovery", "--port", "0"]
    for flags, message in ((["--request-timeout", "0"], "--request-timeout"),
                           (["--api-port", "70000"], "--api-port"),
                           (["--max-batch", "0"], "--max-batch")):
        with pytest.raises(SystemExit) as caught:  # refused before any model loads
            main(base + flags)
        assert message in str(caught.value)


def test_a_taken_api_port_fails_before_anything_starts(tmp_path, capsys):
    """serve (and demo, whose flag is --port) bind the API first: a taken port used to surface
    only after a plan had loaded the model's weights on other nodes of the fleet."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        assert main(["serve", "--state-dir", str(tmp_path / "s"), "--no-discovery", "--port", "0",
                     "--api-port", str(port)]) != 0
        assert "cannot listen" in capsys.readouterr().err and not (tmp_path / "s" / "cluster.key").exists()
        assert main(["demo", "--once", "--port", str(port)]) != 0
        error = capsys.readouterr().err
        assert "pick another --port" in error and "--api-port" not in error
        assert time.monotonic() - started < 20  # no node was started, no model loaded


@pytest.mark.slow
def test_sigterm_ends_an_open_stream_with_an_error_event_not_a_cut_connection(smollm2_gguf_path, tmp_path):
    command = [sys.executable, "-m", "meshllm.cli", "serve", "--model", str(smollm2_gguf_path), "--port", "0",
               "--api-port", "0", "--no-discovery", "--state-dir", str(tmp_path / "state"), "--max-context", "1024"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = read_line_matching(process, r"at (http://127\.0\.0\.1:\d+)/v1", 120).group(1)
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(model=client.models.list().data[0].id, prompt="Once upon a time",
                                           max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in stream:
                chunks += 1
                if chunks == 5:
                    process.send_signal(signal.SIGTERM)
        assert chunks < 1000
        assert process.wait(timeout=30) == 0
        output = process.stdout.read()
        assert "Traceback" not in output and "CancelledError" not in output, output[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
