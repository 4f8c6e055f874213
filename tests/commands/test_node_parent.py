"""A node a launcher started (`meshllm demo`, LocalCluster) stops when that launcher dies, even by
SIGKILL, which gives it no chance to stop its children: they used to run on, re-parented to init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

LAUNCHER = """
import os, subprocess, sys
node = subprocess.Popen([sys.executable, "-m", "meshllm.cli", "node", "--host", "127.0.0.1", "--port", "0",
                         "--no-discovery", "--state-dir", sys.argv[1], "--parent-pid", str(os.getpid())],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
print(node.pid, flush=True)
for line in node.stdout:
    if "listening on" in line:
        print("ready", flush=True)
node.wait()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_node_stops_when_the_process_that_started_it_is_killed(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path / "state")], stdout=subprocess.PIPE,
                                text=True)
    node_pid = None
    try:
        node_pid = int(launcher.stdout.readline())
        assert launcher.stdout.readline().strip() == "ready"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 20
        while _alive(node_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(node_pid), "the node outlived the process that started it"
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if node_pid is not None and _alive(node_pid):
            os.kill(node_pid, signal.SIGKILL)
