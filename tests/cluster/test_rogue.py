"""A rogue that knows the cluster id and the model's fingerprint but not the key, given to
real nodes as a seed peer: over TLS from the key (the default) and over
--insecure-plaintext (where only the signed replies stand in its way), its forged card
never reaches any registry, and a plan over the fleet never places it.

The rogue answers gossip with a card of 32 TiB free memory holding the model, stamped
50 s ahead, and pushes the same card at the node twice a second (tests/cluster/rogue_node.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from meshllm import cli
from meshllm.cluster.gossip import fetch_view
from meshllm.model.weights import fingerprint
from meshllm.transport.auth import cluster_id
from meshllm.transport.tls import PLAINTEXT
from tests.cluster_fixtures import REPO_ROOT, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150)]

FAST = ["--gossip-interval", "0.3", "--ttl", "5"]


class RogueProcess:
    def __init__(self, mode: str, key: bytes, model_fingerprint: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cluster.rogue_node", mode, cluster_id(key), model_fingerprint],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.strip())
            if line.startswith("rogue ready"):
                self.address = line.split()[-1]
                self.ready.set()

    def attack(self, target: str) -> None:
        self.proc.stdin.write(target + "\n")
        self.proc.stdin.flush()

    def output(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.mark.parametrize("mode", ["tls", "plaintext"])
def test_a_rogue_seed_peer_never_gets_a_card_in_nor_a_stage(mode, mesh_cluster, aidreams_path, capsys):
    key = mesh_cluster.key
    tls = PLAINTEXT if mode == "plaintext" else None
    transport_flag = ["--insecure-plaintext"] if tls is PLAINTEXT else []
    rogue = RogueProcess(mode, key, fingerprint(aidreams_path))
    try:
        assert rogue.ready.wait(30), rogue.output()
        common = [*FAST, *transport_flag, "--models", str(aidreams_path)]
        a = mesh_cluster.start([*common, "--node-id", "a", "--peer", rogue.address])
        b = mesh_cluster.start([*common, "--node-id", "b", "--peer", mesh_cluster.wait_ready(a)])
        nodes = [a, b]
        mesh_cluster.wait_ready(b)
        rogue.attack(a.address)

        def views() -> list[set[str]]:
            return [{c.node_id for c in fetch_view(n.address, key, tls=tls)} for n in nodes]

        wait_until(lambda: all(v == {"a", "b"} for v in views()), timeout=20, message="a and b see each other")
        # Many gossip rounds, every one dialling the rogue and hearing its pushes.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert all(v == {"a", "b"} for v in views()), "the rogue's card reached a registry"
            time.sleep(0.2)
        assert "gossip with " + rogue.address in a.log()  # it was dialled, and the exchange failed
        assert "push accepted" not in rogue.output()
        if mode == "plaintext":
            # No TLS to stop it: the rogue was called and answered, but its reply is unsigned.
            assert "called Check" in rogue.output() and "no meshllm signature" in a.log()
            assert "push refused: UNAUTHENTICATED" in rogue.output()
        else:
            assert "TLS handshake failed" in a.log()
            assert "push refused: UNAVAILABLE" in rogue.output()

        capsys.readouterr()
        code = cli.main(["plan", "--model", str(aidreams_path), "--context", "64", "--stages", "2", "--peer",
                         a.address, "--key-file", str(mesh_cluster.key_file), "--json", *transport_flag])
        out, err = capsys.readouterr()
        assert code == 0, err
        assert sorted(s["node_id"] for s in json.loads(out)["stages"]) == ["a", "b"]
    finally:
        rogue.stop()
