"""Several `meshllm node` processes on this machine, on loopback: the demo's cluster.

Each node knows the one started before it (a line of seed peers); gossip does
the rest. Processes are stopped by pid, SIGTERM first, SIGKILL if they linger. A node
that dies on its own (killed, crashed) is reaped at once, never left a zombie, and
reported through `on_exit`.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from meshllm.errors import MeshError
from meshllm.transport.auth import generate_key, write_key

READY_MARK = "listening on"


class NodeStartFailed(MeshError):
    code = "node_start_failed"


def free_port() -> int:
    """A loopback port free now, below the kernel's ephemeral range. A port the kernel hands out
    (bind to 0) is free only until the node binds it, and in between any outgoing connection on
    the machine may take it as its own local port (the other nodes start gossiping at once): the
    demo failed 1 run in 4 with 'Address already in use'. Outgoing connections never take a port
    below the ephemeral range."""
    low = _ephemeral_low()
    for _ in range(200 if low - 1024 >= 1000 else 0):  # some containers give out ports from 1024 up
        port = random.randrange(max(1024, low - 20000), low)
        if port in _handed_out:  # not yet bound by the node it went to
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:  # a machine with that whole range taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class LocalCluster:
    """`node_env` adds environment variables per node index (e.g. fault injection for tests);
    `on_exit(index, returncode)` hears of a node that exited before `stop` (negative: killed
    by that signal), on a reader thread."""

    def __init__(self, num_nodes: int, model_paths: list[Path], state_dir: Path,
                 extra_args: tuple[str, ...] = (), threads_per_node: int | None = None,
                 node_env: Mapping[int, Mapping[str, str]] | None = None,
                 on_exit: Callable[[int, int], None] | None = None):
        if num_nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.num_nodes = num_nodes
        self.model_paths = model_paths
        self.state_dir = state_dir
        self.extra_args = extra_args
        self.threads_per_node = threads_per_node
        self.node_env = dict(node_env or {})
        self.node_args: dict[int, tuple[str, ...]] = {}
        self.on_exit = on_exit
        self.key_file = state_dir / "cluster.key"
        self.addresses: list[str] = []
        self.node_ids = [f"node-{i}" for i in range(num_nodes)]  # node i listens at addresses[i]
        self.processes: list[subprocess.Popen] = []
        self.logs: list[list[str]] = []
        self.exit_codes: dict[int, int] = {}  # nodes that died on their own, by index
        self._stopping = False

    def start(self, timeout_s: float = 120.0) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if not self.key_file.exists():
            write_key(self.key_file, generate_key())
        ready = [self._spawn() for _ in range(self.num_nodes)]
        deadline = time.monotonic() + timeout_s
        for i, event in enumerate(ready):
            self._wait_ready(i, event, deadline)

    def add_node(self, env: Mapping[str, str] | None = None, args: tuple[str, ...] = (),
                 timeout_s: float = 120.0) -> int:
        """Start one more node (a spare, or a machine joining later), with its own environment
        and CLI args besides the cluster's; returns its index."""
        if env:
            self.node_env[len(self.processes)] = dict(env)
        if args:
            self.node_args[len(self.processes)] = tuple(args)
        event = self._spawn()
        index = len(self.processes) - 1
        self._wait_ready(index, event, time.monotonic() + timeout_s)
        self.num_nodes = len(self.processes)
        return index

    def live_addresses(self) -> list[str]:
        """Addresses of the nodes still running (a killed node's address is useless as a peer)."""
        return [a for a, p in zip(self.addresses, self.processes) if p.poll() is None]

    def live_nodes(self) -> list[tuple[str, str]]:
        """(address, node id) of the nodes still running."""
        return [(a, n) for a, n, p in zip(self.addresses, self.node_ids, self.processes) if p.poll() is None]

    def _spawn(self) -> threading.Event:
        i = len(self.processes)
        if i == len(self.node_ids):
            self.node_ids.append(f"node-{i}")
        port = free_port()
        self.addresses.append(f"127.0.0.1:{port}")
        env = dict(os.environ)
        if self.threads_per_node:
            env["OMP_NUM_THREADS"] = str(self.threads_per_node)
        env.update(self.node_env.get(i, {}))
        args = [sys.executable, "-m", "meshllm.cli", "node", "--host", "127.0.0.1", "--port", str(port),
                "--key-file", str(self.key_file), "--node-id", self.node_ids[i], "--no-discovery",
                "--state-dir", str(self.state_dir / f"node-{i}"), "--parent-pid", str(os.getpid()),
                *self.extra_args, *self.node_args.get(i, ())]
        for path in self.model_paths:
            args += ["--models", str(path)]
        for peer in self.live_addresses()[-1:]:  # the newest live node: a line of seeds
            args += ["--peer", peer]
        process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                   start_new_session=True)
        self.processes.append(process)
        lines: list[str] = []
        self.logs.append(lines)
        event = threading.Event()
        threading.Thread(target=self._follow, args=(i, process, lines, event), daemon=True,
                         name=f"node-{i}-log").start()
        return event

    def _wait_ready(self, i: int, event: threading.Event, deadline: float) -> None:
        while not event.wait(0.1):
            if self.processes[i].poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise NodeStartFailed(f"node {i} did not start:\n" + "\n".join(self.logs[i][-20:]))

    def _follow(self, index: int, process: subprocess.Popen, lines: list[str], ready: threading.Event) -> None:
        for line in process.stdout:
            lines.append(line.rstrip())
            if READY_MARK in line:
                ready.set()
        returncode = process.wait()  # reaps it: a dead node never lingers as a zombie
        if not self._stopping:
            self.exit_codes[index] = returncode
            if self.on_exit is not None:
                self.on_exit(index, returncode)

    def stop(self, grace_s: float = 5.0) -> None:
        self._stopping = True
        for p in self.processes:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped node cannot act on SIGTERM
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

