"""`meshllm generate --peer` as a user runs it against node processes on loopback: it plans,
streams, and survives a stage node that crashes mid-answer (fault injection), printing the
same text as the whole model in one process (fp32, greedy)."""

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
    # the runs' leader slots in the cluster's folder, not in this user's state directory
    state = {"XDG_STATE_HOME": str(cluster.state_dir / "generate-state")}
    return subprocess.run(args, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **state})


def peers(cluster: LocalCluster) -> list[str]:
    return [arg for address in cluster.live_addresses() for arg in ("--peer", address)]


def test_generate_peer_survives_a_crashing_stage_with_the_undisturbed_text(aidreams_path, tmp_path):
    # node-1 and node-2 kill themselves (SIGKILL) after computing 6 micro-batches each: whichever
    # two nodes the planner picks, a crashing one holds a stage and dies mid-answer.
    crash = {"MESHLLM_FAULT_INJECTION": "crash@6"}
    cluster = LocalCluster(3, [aidreams_path], tmp_path, extra_args=("--gossip-interval", "0.3"), threads_per_node=1,
                           node_env={1: crash, 2: crash})
    cluster.start(timeout_s=120)
    try:
        undisturbed = generate(cluster)  # the whole model in this process: the reference
        assert undisturbed.returncode == 0, undisturbed.stderr[-3000:]
        key = load_key(cluster.key_file)
        wait_until(lambda: sum(bool(c.models) for c in fetch_view(cluster.addresses[0], key)) == 3, timeout=60,
                   message="every node's model in the fleet view")
        disturbed = generate(cluster, "--stages", "2", *peers(cluster))
        assert disturbed.returncode == 0, disturbed.stderr[-3000:]
        planned = re.search(r"\[(node-\d): layers [\d-]+, (node-\d): layers [\d-]+\]", disturbed.stderr)
        assert planned, disturbed.stderr
        crashed = [n for n in planned.groups() if n != "node-0"]
        assert crashed  # at least one of the stages was a crashing node
        for node in crashed:
            assert cluster.processes[int(node.removeprefix("node-"))].wait(timeout=30) == -9  # died mid-answer
        assert "failing over" in disturbed.stderr
        assert disturbed.stdout == undisturbed.stdout and len(undisturbed.stdout.strip()) > 0
    finally:
        cluster.stop()


def test_generate_runs_one_after_another_reuse_the_plan_as_one_leader(aidreams_path, tmp_path):
    # A run's plan outlives it by its lease, and the next run reuses it. Both runs must be the same
    # leader to the node: as two, each run added a context's KV to what the node reserves, until
    # a node with a memory cap refused the next run.
    cluster = LocalCluster(1, [aidreams_path], tmp_path, threads_per_node=1)
    cluster.start(timeout_s=120)
    try:
        key = load_key(cluster.key_file)
        wait_until(lambda: all(c.models for c in fetch_view(cluster.addresses[0], key)), timeout=60,
                   message="the node's model in its card")
        reservations = []
        for _ in range(2):
            run = generate(cluster, *peers(cluster))
            assert run.returncode == 0 and run.stdout.strip(), run.stderr[-3000:]
            (card,) = fetch_view(cluster.addresses[0], key)
            (shard,) = card.shards
            reservations.append(shard.kv_reservations)
        # One lineage of one leader, both times: its reservation is one context's KV. (Its bytes are
        # not compared: a card rebuilt while a run's sequence held KV reserves that much less.)
        first, second = ([r.leader_ids for r in run] for run in reservations)
        assert len(first) == 1 and len(first[0]) == 1 and first[0][0].endswith("-0")
        assert second == first
    finally:
        cluster.stop()
