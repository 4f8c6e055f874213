"""A 2-stage pipeline across two network namespaces joined by a veth pair shaped to
1 Gbit/s (tc tbf), with 2 ms of one-way delay added by a delaying TCP relay between
the stages: output still identical to single-process generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from meshllm.engine.sampler import SamplingParams
from meshllm.pipeline.cluster import local_leader
from meshllm.transport.auth import generate_key, write_key
from tests.netns import namespace_pair
from tests.pipeline.conftest import OPTIONS

pytestmark = pytest.mark.slow

IP_A, IP_B = "10.78.0.1", "10.78.0.2"  # inside the test's own namespaces only
NODE_PORT, RELAY_PORT = 7701, 7702
DELAY_MS = 2.0


@pytest.fixture
def namespaces():
    with namespace_pair(IP_A, IP_B, rate="1gbit") as pair:  # 1 Gbit/s each way (tc tbf)
        yield pair


def spawn(ns: str, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def wait_for_line(process: subprocess.Popen, mark: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if mark in line:
            return
    raise AssertionError(f"{mark!r} not seen; output:\n{''.join(seen[-20:])}")


def test_two_stages_in_namespaces_over_a_shaped_delayed_link(namespaces, aidreams_path, tmp_path):
    from meshllm.model.source import open_model

    key_file = tmp_path / "cluster.key"
    write_key(key_file, generate_key())
    node_args = ["-m", "meshllm.cli", "node", "--port", str(NODE_PORT), "--key-file", str(key_file),
                 "--models", str(aidreams_path), "--no-discovery", "--gossip-interval", "0.3"]
    processes = []
    try:
        a = spawn(namespaces.ns_a, [*node_args, "--host", IP_A, "--node-id", "a", "--state-dir", str(tmp_path / "a")])
        b = spawn(namespaces.ns_b, [*node_args, "--host", IP_B, "--node-id", "b", "--state-dir", str(tmp_path / "b")])
        # Stage 0 (in A) reaches stage 1 (in B) through the relay in A: every byte both ways waits 2 ms.
        relay = spawn(namespaces.ns_a, ["-m", "tests.pipeline.delay_relay", IP_A, str(RELAY_PORT), IP_B,
                                        str(NODE_PORT), str(DELAY_MS)])
        processes += [a, b, relay]
        wait_for_line(a, "listening on", 90)
        wait_for_line(b, "listening on", 90)
        wait_for_line(relay, "relay ready", 30)

        files = open_model(aidreams_path)
        prompt = files.tokenizer.encode("Once upon a time, in a quiet lab")
        leader_run = subprocess.run(
            ["ip", "netns", "exec", namespaces.ns_a, sys.executable, "-m", "tests.pipeline.netns_leader",
             str(aidreams_path), str(key_file), f"{IP_A}:{NODE_PORT}", f"{IP_A}:{RELAY_PORT}", "2", "24",
             json.dumps(prompt)],
            capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert leader_run.returncode == 0, leader_run.stderr[-3000:]
        result = json.loads(leader_run.stdout.strip().splitlines()[-1])

        reference = local_leader(files, OPTIONS)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            expected = [e.token_id for e in reference.generate(prompt, params) if e.token_id is not None]
        finally:
            reference.close()
        assert result["tokens"] == expected
        # Every token crosses the delayed hop twice (hidden states out, token back): >= 4 ms each.
        assert result["seconds"] >= 24 * 2 * DELAY_MS / 1000
    finally:
        for p in processes:
            p.kill()
            p.wait(timeout=10)
