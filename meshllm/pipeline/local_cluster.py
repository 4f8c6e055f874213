"""Several `meshllm node` processes on this machine, on loopback: the demo's cluster.

Each node knows the one started before it (a line of seed peers); gossip does
the rest. Processes are stopped by pid, SIGTERM first, SIGKILL if they linger.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from meshllm.errors import MeshError
from meshllm.transport.auth import generate_key, write_key

READY_MARK = "listening on"


class NodeStartFailed(MeshError):
    code = "node_start_failed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    def __init__(self, num_nodes: int, model_paths: list[Path], state_dir: Path,
                 extra_args: tuple[str, ...] = (), threads_per_node: int | None = None):
        if num_nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.num_nodes = num_nodes
        self.model_paths = model_paths
        self.state_dir = state_dir
        self.extra_args = extra_args
        self.threads_per_node = threads_per_node
        self.key_file = state_dir / "cluster.key"
        self.addresses: list[str] = []
        self.node_ids = [f"node-{i}" for i in range(num_nodes)]  # node i listens at addresses[i]
        self.processes: list[subprocess.Popen] = []
        self.logs: list[list[str]] = []

    def start(self, timeout_s: float = 120.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.key_file.exists():
            write_key(self.key_file, generate_key())
        ports = [free_port() for _ in range(self.num_nodes)]
        self.addresses = [f"127.0.0.1:{p}" for p in ports]
        env = dict(os.environ)
        if self.threads_per_node:
            env["OMP_NUM_THREADS"] = str(self.threads_per_node)
        ready = []
        for i, port in enumerate(ports):
            args = [sys.executable, "-m", "meshllm.cli", "node", "--host", "127.0.0.1", "--port", str(port),
                    "--key-file", str(self.key_file), "--node-id", self.node_ids[i], "--no-discovery",
                    "--state-dir", str(self.state_dir / f"node-{i}"), *self.extra_args]
            for path in self.model_paths:
                args += ["--models", str(path)]
            if i:
                args += ["--peer", self.addresses[i - 1]]
            process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                       start_new_session=True)
            self.processes.append(process)
            lines: list[str] = []
            self.logs.append(lines)
            event = threading.Event()
            ready.append(event)
            threading.Thread(target=_follow, args=(process, lines, event), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        for i, event in enumerate(ready):
            while not event.wait(0.1):
                if self.processes[i].poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise NodeStartFailed(f"node {i} did not start:\n" + "\n".join(self.logs[i][-20:]))

    def stop(self, grace_s: float = 5.0) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.processes:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _follow(process: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
    for line in process.stdout:
        lines.append(line.rstrip())
        if READY_MARK in line:
            ready.set()
