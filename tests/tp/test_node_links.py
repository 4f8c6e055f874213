"""Real `meshllm node` processes with --collective-port: the card advertises the endpoint, and
the lower node id measures its link to the other and advertises it, which the planner reads."""

from __future__ import annotations

import pytest

from meshllm.cluster.tp_cost import link_between
from tests.cluster_fixtures import mesh_cluster, mesh_state_dir, wait_until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_nodes_advertise_their_endpoint_and_measured_link(mesh_cluster):
    fast = ["--gossip-interval", "0.3", "--collective-port", "0"]
    a = mesh_cluster.start([*fast, "--node-id", "n-a"])
    b = mesh_cluster.start([*fast, "--node-id", "n-b", "--peer", mesh_cluster.wait_ready(a)])
    mesh_cluster.wait_ready(b)
    plain = mesh_cluster.start(["--gossip-interval", "0.3", "--node-id", "n-c", "--peer", a.address])
    mesh_cluster.wait_ready(plain)

    def cards():
        view = {c.node_id: c for c in mesh_cluster.view(b)}
        return view if view.keys() == {"n-a", "n-b", "n-c"} and view["n-a"].links else None

    view = wait_until(cards, timeout=60, message="n-a's card carries a measured link")
    assert view["n-a"].collective_endpoint.startswith("127.0.0.1:")
    assert view["n-b"].collective_endpoint.startswith("127.0.0.1:")
    assert view["n-c"].collective_endpoint is None  # no --collective-port: no part in groups, never probed
    [link] = view["n-a"].links
    assert link.peer == "n-b" and 0 < link.latency_s < 0.1 and link.bandwidth_gbps > 0.01
    assert view["n-b"].links == ()  # each pair is measured once, by its lower node id
    assert link_between(view["n-b"], view["n-a"]).latency_s == link.latency_s
