"""`meshllm generate --peer` as a user runs it against node processes on loopback: it plans,
streams, and survives a stage node that crashes mid-answer (fault injection), printing the
same text as an undisturbed run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from meshllm.cluster.gossip import fetch_view
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from tests.cluster_fixtures import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPT = "Once upon a time there was a little robot who"


def generate(cluster: LocalCluster, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "meshllm.cli", "generate", "--model", str(cluster.model_paths[0]),
            "--prompt", PROMPT, "--raw", "--max-tokens", "32", "--temperature", "0", "--dtype", "fp32",
            "--key-file", str(cluster.key_file), *extra]
    for address in cluster.live_addresses():
        args += ["--peer", address]
    return subprocess.run(args, capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_generate_peer_survives_a_crashing_stage_with_the_undisturbed_text(aidreams_path, tmp_path):
    # node-1 kills itself (SIGKILL) after computing 6 micro-batches: mid-answer in the first run.
    cluster = LocalCluster(3, [aidreams_path], tmp_path, extra_args=("--gossip-interval", "0.3"), threads_per_node=1,
                           node_env={1: {"MESHLLM_FAULT_INJECTION": "crash@6"}})
    cluster.start(timeout_s=120)
    try:
        key = load_key(cluster.key_file)
        wait_until(lambda: sum(bool(c.models) for c in fetch_view(cluster.addresses[0], key)) == 3, timeout=60,
                   message="every node's model in the fleet view")
        disturbed = generate(cluster, "--stages", "2")
        assert disturbed.returncode == 0, disturbed.stderr[-3000:]
        planned = re.search(r"\[(node-\d): layers [\d-]+, (node-\d): layers [\d-]+\]", disturbed.stderr)
        assert planned and "node-1" in planned.groups(), disturbed.stderr  # the crashing node held a stage
        assert cluster.processes[1].wait(timeout=30) == -9  # it did crash, mid-answer
        assert "failing over" in disturbed.stderr

        undisturbed = generate(cluster, "--stages", "2")  # on the two survivors, nothing fails
        assert undisturbed.returncode == 0, undisturbed.stderr[-3000:]
        assert "failing over" not in undisturbed.stderr
        assert disturbed.stdout == undisturbed.stdout and len(undisturbed.stdout.strip()) > 0
    finally:
        cluster.stop()
