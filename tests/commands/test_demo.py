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


def test_demo_reaps_and_reports_a_node_that_dies_and_keeps_answering(aidreams_path, tmp_path):
    """kill -9 of a stage node under a serving demo: the demo says which node died and how, the
    process is reaped (no zombie), and the next chat is answered by a new plan."""
    import queue
    import re
    import signal
    import threading
    import time

    import psutil
    from openai import OpenAI

    process = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "demo", "--nodes", "3", "--port", "0",
                                "--model", str(aidreams_path), "--max-context", "128"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()

    def wait_for(pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                match = re.search(pattern, lines.get(timeout=max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                break
            if match:
                return match
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s")

    try:
        stage = wait_for(r"stage 1: (node-\d+) at 127\.0\.0\.1:(\d+)", 120)
        url = wait_for(r"API at (http://127\.0\.0\.1:\d+)/v1", 120).group(1)
        wait_for(r"serving; press Ctrl-C", 120)
        victim_port = int(stage.group(2))
        [victim] = [p for p in psutil.Process(process.pid).children()
                    if any(c.laddr.port == victim_port for c in p.net_connections(kind="tcp")
                           if c.status == psutil.CONN_LISTEN)]
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(rf"{stage.group(1)} died \(killed by SIGKILL\)", 30)
        assert not psutil.pid_exists(victim.pid) or victim.status() != psutil.STATUS_ZOMBIE
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="aidreams-260k", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Hi"}])
        assert reply.usage.completion_tokens >= 1
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
