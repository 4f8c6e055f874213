"""Real `meshllm node` processes on loopback: convergence, TTL expiry after
SIGKILL, clean shutdown, the cluster key, and `meshllm status`."""

import json
import signal
import time

import grpc
import pytest

from meshllm import cli
from meshllm.cluster.gossip import fetch_view
from meshllm.transport import auth
from meshllm.transport.protos import cluster_pb2
from meshllm.transport.tls import channel_credentials
from tests.cluster_fixtures import NodeCluster, free_ports, wait_until

pytestmark = pytest.mark.slow

INTERVAL = 0.3
TTL = 3.0
# The CI box has two shared cores and each poll is a gRPC call: allow for
# scheduling noise on top of the protocol's own bound.
SLACK_S = 4.0
FAST = ["--gossip-interval", str(INTERVAL), "--ttl", str(TTL)]


def ids(cluster: NodeCluster, node) -> set[str]:
    return {c.node_id for c in cluster.view(node)}


@pytest.mark.timeout(120)
def test_line_of_five_converges_then_forgets_a_killed_node(mesh_cluster):
    ports = free_ports(5)
    # Each node knows only its left neighbour; all start at once (a seed that is
    # not up yet is just a failed exchange, retried next round).
    line = [mesh_cluster.start([*FAST, "--node-id", f"n{i}", *(["--peer", f"127.0.0.1:{ports[i - 1]}"] if i else [])],
                               port=ports[i]) for i in range(5)]
    for node in line:
        mesh_cluster.wait_ready(node)
    everyone = {f"n{i}" for i in range(5)}
    started = time.monotonic()
    wait_until(lambda: all(ids(mesh_cluster, n) == everyone for n in line),
               timeout=4 * INTERVAL + SLACK_S, interval=0.05, message="all five views hold all five cards")
    print(f"converged {time.monotonic() - started:.2f}s after the last node was ready")

    victim = line.pop(2)
    victim.signal(signal.SIGKILL)
    killed_at = time.monotonic()
    rest = {f"n{i}" for i in (0, 1, 3, 4)}
    wait_until(lambda: all(ids(mesh_cluster, n) == rest for n in line), timeout=TTL + 2 * INTERVAL + SLACK_S,
               interval=0.05, message="the killed node's card left every view, the others stayed")
    assert time.monotonic() - killed_at > TTL - INTERVAL - 0.5  # it aged out; nothing removed it early
    # The line is cut at the victim; random extra peers keep both halves fresh.
    time.sleep(TTL)
    assert all(ids(mesh_cluster, n) == rest for n in line)


@pytest.mark.timeout(60)
def test_node_with_the_wrong_key_can_neither_read_nor_write(mesh_cluster, tmp_path):
    ports = free_ports(2)
    other_key = tmp_path / "other.key"
    auth.write_key(other_key, auth.generate_key())
    good = mesh_cluster.start([*FAST, "--node-id", "good"], port=ports[0])
    address = mesh_cluster.wait_ready(good)  # up first: the intruder's first failure is the handshake
    intruder = mesh_cluster.start([*FAST, "--node-id", "intruder", "--peer", f"127.0.0.1:{ports[0]}"],
                                  port=ports[1], key_file=other_key)
    mesh_cluster.wait_ready(intruder)
    # Its certificates are not from our key's CA: every handshake fails, both ways.
    wait_until(lambda: "TLS handshake failed" in intruder.log(), timeout=10,
               message="the intruder logs the refused handshake and what to check")
    time.sleep(5 * INTERVAL)
    assert ids(mesh_cluster, good) == {"good"}
    assert "--key-file" in intruder.log()

    # A captured, valid request cannot be replayed.
    method = "/meshllm.Cluster/Exchange"
    body = cluster_pb2.ExchangeRequest().SerializeToString()
    metadata = auth.sign(mesh_cluster.key, "recorder", method, receiver="good", body=body)
    credentials, options = channel_credentials(mesh_cluster.key, None, "recorder")
    with grpc.secure_channel(address, credentials, options=options) as channel:
        call = channel.unary_unary(method, response_deserializer=cluster_pb2.ExchangeResponse.FromString)
        assert {c.node_id for c in call(body, metadata=metadata, timeout=5).cards} == {"good"}
        with pytest.raises(grpc.RpcError) as info:
            call(body, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def run_cli(capsys, *args) -> tuple[int, str, str]:
    """`meshllm ARGS` in this process (a subprocess would spend seconds on imports)."""
    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.timeout(90)
def test_status_shows_the_fleet(mesh_cluster, tmp_path, aidreams_path, capsys):
    ports = free_ports(2)
    a = mesh_cluster.start([*FAST, "--node-id", "alpha", "--models", str(aidreams_path)], port=ports[0],
                           env={"MESHLLM_CACHE_DIR": str(tmp_path / "cache")})
    b = mesh_cluster.start([*FAST, "--node-id", "beta", "--peer", f"127.0.0.1:{ports[0]}"], port=ports[1])
    mesh_cluster.wait_ready(a), mesh_cluster.wait_ready(b)
    # Beta learns alpha's models (fingerprinted on alpha in the background) through gossip.
    alpha_seen_by_b = wait_until(
        lambda: next((c for c in mesh_cluster.view(b) if c.node_id == "alpha" and c.models), None), timeout=30)
    assert [(m.model_id, m.num_layers) for m in alpha_seen_by_b.models] == [("aidreams-260k", 4)]
    assert len(alpha_seen_by_b.models[0].fingerprint) >= 16

    code, out, err = run_cli(capsys, "status", "--peer", a.address, "--key-file", str(mesh_cluster.key_file), "--json")
    assert code == 0, err
    nodes = json.loads(out)["nodes"]
    assert [n["node_id"] for n in nodes] == ["alpha", "beta"]
    assert nodes[1]["grpc_address"] == b.address and nodes[0]["memory_total_bytes"] > 0
    assert nodes[0]["device"] == "cpu" and nodes[0]["matmul_gflops"] > 0
    # Every node serves stages and, with zero weights, an n-gram proposer.
    assert nodes[0]["roles"] == ["stage", "proposer"]
    assert 0 <= nodes[0]["age_seconds"] < TTL

    code, out, err = run_cli(capsys, "status", "--peer", a.address, "--key-file", str(mesh_cluster.key_file))
    lines = out.splitlines()
    assert code == 0 and lines[0].split()[:3] == ["NODE", "ADDRESS", "DEVICE"] and len(lines) == 3
    assert lines[2].startswith("beta") and b.address in lines[2] and "GiB" in lines[2]
    assert "aidreams-260k" in lines[1]

    other_key = tmp_path / "other.key"
    auth.write_key(other_key, auth.generate_key())
    code, out, err = run_cli(capsys, "status", "--peer", a.address, "--key-file", str(other_key))
    assert code == 2 and "unauthenticated" in err and "--key-file" in err


@pytest.mark.timeout(60)
def test_first_start_makes_a_key_and_signals_stop_nodes_cleanly(mesh_cluster, tmp_path):
    state_dir = tmp_path / "fresh-state"
    fresh = mesh_cluster.start(FAST + ["--state-dir", str(state_dir)], pass_key_file=False)
    other = mesh_cluster.start(FAST)
    mesh_cluster.wait_ready(fresh), mesh_cluster.wait_ready(other)
    out = "\n".join(fresh.stdout_lines)
    assert f"generated a new cluster key in {state_dir / 'cluster.key'}" in out and "--key-file" in out
    key = auth.load_key(state_dir / "cluster.key")
    assert [c.node_id for c in fetch_view(fresh.address, key)] == [fresh.node_id]

    fresh.signal(signal.SIGTERM)
    other.signal(signal.SIGINT)
    assert fresh.proc.wait(timeout=10) == 0, fresh.log()
    assert other.proc.wait(timeout=10) == 0, other.log()
