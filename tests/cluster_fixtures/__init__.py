"""Start real `meshllm node` processes for multi-process tests.

    from tests.cluster_fixtures import mesh_cluster, mesh_state_dir  # noqa: F401 (fixtures)

    def test_x(mesh_cluster):
        a = mesh_cluster.start(["--gossip-interval", "0.3"])
        b = mesh_cluster.start(["--peer", mesh_cluster.wait_ready(a)])
        mesh_cluster.wait_ready(b)
        wait_until(lambda: len(mesh_cluster.view(a)) == 2, timeout=5)

Every node listens on a free loopback port (--port 0; the port is read from
its ready line), shares one cluster key file, and is killed by pid when the
test ends. Extra CLI args, env vars and a command prefix (e.g. `ip netns exec
NS`) are per node.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from meshllm.cluster.card import Card
from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.profile import load_or_probe
from meshllm.transport.auth import generate_key, write_key

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_LINE = re.compile(r"meshllm node (\S+) listening on (\S+)")
T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float, interval: float = 0.1, message: str = "") -> T:
    """Poll `predicate` until it returns a truthy value (returned) or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not true within {timeout}s: {message or predicate}")
        time.sleep(interval)


def free_ports(count: int) -> list[int]:
    """Distinct loopback ports free right now, for nodes that must know each
    other's address before any of them is up (held open together so no two repeat)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass
class NodeProcess:
    proc: subprocess.Popen
    log_path: Path  # stderr of the node
    stdout_lines: list[str] = field(default_factory=list)
    node_id: str | None = None
    address: str | None = None
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def read_stdout(self) -> None:
        """Runs on a thread: drains stdout (so the pipe never blocks) and spots the ready line."""
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            match = READY_LINE.search(line)
            if match and not self.ready.is_set():
                self.node_id, self.address = match.group(1), match.group(2)
                self.ready.set()

    def log(self) -> str:
        return "\n".join(self.stdout_lines) + "\n--- stderr ---\n" + (
            self.log_path.read_text() if self.log_path.exists() else "")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)


class NodeCluster:
    """Starts and tracks node processes; `stop_all` kills every one it started."""

    def __init__(self, workdir: Path, state_dir: Path, key: bytes | None = None):
        self.workdir = workdir
        self.state_dir = state_dir  # shared: the profile cache is probed once
        self.key = key or generate_key()
        self.key_file = workdir / "cluster.key"
        if not self.key_file.exists():
            write_key(self.key_file, self.key)
        self.nodes: list[NodeProcess] = []

    def start(self, args: Sequence[str] = (), *, env: dict[str, str] | None = None, prefix: Sequence[str] = (),
              host: str = "127.0.0.1", port: int = 0, discovery: bool = False,
              key_file: Path | None = None, pass_key_file: bool = True) -> NodeProcess:
        """Start one node (returns at once; see `wait_ready`). `key_file` defaults to
        the cluster's; pass_key_file=False lets the node find or create its own."""
        key_args = ["--key-file", str(key_file or self.key_file)] if pass_key_file else []
        command = [*prefix, sys.executable, "-m", "meshllm.cli", "node", "--host", host, "--port", str(port),
                   *key_args, "--state-dir", str(self.state_dir),
                   *([] if discovery else ["--no-discovery"]), *args]
        full_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
        log_path = self.workdir / f"node-{len(self.nodes)}.log"
        with log_path.open("w") as stderr:
            proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL,
                                    text=True, env=full_env, cwd=REPO_ROOT)
        node = NodeProcess(proc, log_path)
        threading.Thread(target=node.read_stdout, daemon=True).start()
        self.nodes.append(node)
        return node

    def wait_ready(self, node: NodeProcess, timeout: float = 30.0) -> str:
        """The node's gRPC address once it printed its ready line."""
        deadline = time.monotonic() + timeout
        while not node.ready.wait(0.1):
            if node.proc.poll() is not None:
                raise AssertionError(f"node exited with {node.proc.returncode} before ready:\n{node.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"node not ready within {timeout}s:\n{node.log()}")
        return node.address

    def start_many(self, count: int, args_for: Callable[[int], Sequence[str]] = lambda i: (),
                   timeout: float = 60.0) -> list[NodeProcess]:
        nodes = [self.start(args_for(i)) for i in range(count)]
        for node in nodes:
            self.wait_ready(node, timeout)
        return nodes

    def view(self, node: NodeProcess, timeout: float = 5.0) -> list[Card]:
        return fetch_view(node.address, self.key, timeout)

    def stop_all(self, grace_s: float = 5.0) -> None:
        for node in self.nodes:
            node.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for node in self.nodes:
            try:
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                node.signal(signal.SIGKILL)
                node.proc.wait(timeout=5)


@pytest.fixture(scope="session")
def mesh_state_dir(tmp_path_factory) -> Path:
    """One state dir for the session's nodes, its speed probe already cached."""
    state_dir = tmp_path_factory.mktemp("mesh-state")
    load_or_probe("cpu", state_dir)
    return state_dir


@pytest.fixture
def mesh_cluster(tmp_path, mesh_state_dir):
    cluster = NodeCluster(tmp_path, mesh_state_dir)
    try:
        yield cluster
    finally:
        cluster.stop_all()
