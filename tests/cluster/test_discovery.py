"""mDNS/DNS-SD discovery between two nodes with no --peer, each in its own
network namespace, joined by a veth pair this test creates (and removes)."""

import os
import socket
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from meshllm.cluster import discovery
from meshllm.cluster.discovery import _instance_name
from tests.cluster_fixtures import REPO_ROOT
from tests.netns import namespace_pair

pytestmark = pytest.mark.slow

IP_A, IP_B = "10.77.0.1", "10.77.0.2"  # inside the test's own namespaces only


@pytest.fixture
def namespaces():
    with namespace_pair(IP_A, IP_B, multicast=True) as pair:
        yield pair


POLL_VIEWS = textwrap.dedent("""
    import sys, time
    from meshllm.cluster.gossip import fetch_view
    from meshllm.errors import MeshError
    from meshllm.transport.auth import load_key
    key, addresses, deadline = load_key(__import__("pathlib").Path(sys.argv[1])), sys.argv[2:], time.time() + 30
    while time.time() < deadline:
        try:
            views = [sorted(c.node_id for c in fetch_view(a, key, 2)) for a in addresses]
        except MeshError as e:
            views = [str(e)]
        if all(v == ["alpha", "beta"] for v in views):
            print("converged", views)
            sys.exit(0)
        time.sleep(0.2)
    print("not converged", views)
    sys.exit(1)
""")


@pytest.mark.timeout(120)
def test_two_nodes_without_peers_find_each_other_over_mdns(namespaces, mesh_cluster):
    fast = ["--gossip-interval", "0.3", "--ttl", "5"]
    a = mesh_cluster.start([*fast, "--node-id", "alpha"], prefix=["ip", "netns", "exec", namespaces.ns_a], host=IP_A,
                           discovery=True)
    b = mesh_cluster.start([*fast, "--node-id", "beta"], prefix=["ip", "netns", "exec", namespaces.ns_b], host=IP_B,
                           discovery=True)
    address_a, address_b = mesh_cluster.wait_ready(a), mesh_cluster.wait_ready(b)
    result = subprocess.run(["ip", "netns", "exec", namespaces.ns_a, sys.executable, "-c", POLL_VIEWS,
                             str(mesh_cluster.key_file), address_a, address_b],
                            capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n--- alpha ---\n{a.log()}\n--- beta ---\n{b.log()}"


def test_instance_names_fit_a_dns_label():
    assert _instance_name("mac-mini.local-7650") == "mac-mini-local-7650"
    long = _instance_name("x" * 200)
    assert len(long) <= 63 and long != _instance_name("x" * 199)


def test_a_node_on_all_interfaces_advertises_its_lan_address_before_container_bridges(monkeypatch):
    # Sorted as text, docker0's 172.17.0.1 came first: peers on other machines dialled their own bridge.
    def addr(ip):
        return SimpleNamespace(family=socket.AF_INET, address=ip)

    interfaces = {"docker0": [addr("172.17.0.1")], "eth0": [addr("192.168.1.20")], "lo": [addr("127.0.0.1")],
                  "virbr0": [addr("192.168.122.1")], "wlan0": [addr("169.254.3.4")], "eth1": [addr("10.0.0.9")]}
    stats = {name: SimpleNamespace(isup=name != "eth1") for name in interfaces}
    monkeypatch.setattr(discovery.psutil, "net_if_addrs", lambda: interfaces)
    monkeypatch.setattr(discovery.psutil, "net_if_stats", lambda: stats)
    monkeypatch.setattr(discovery, "_default_route_address", lambda: None)
    assert discovery.lan_ipv4_addresses() == ["192.168.1.20", "169.254.3.4", "172.17.0.1", "192.168.122.1",
                                              "10.0.0.9"]
    monkeypatch.setattr(discovery, "_default_route_address", lambda: "10.0.0.9")  # where the default route leaves
    assert discovery.lan_ipv4_addresses()[0] == "10.0.0.9"
