"""GET /v1/cluster (the fleet as this node sees it) and the dashboard page that polls it."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from meshllm.api.backend import Backend
from meshllm.cluster.card import Card, LoadedShard, ModelOnDisk, NodeId

from tests.cluster_fixtures import wait_until

from .conftest import MODEL, serve

pytestmark = pytest.mark.timeout(60)


def card(node_id: str, free_gib: int, shards: tuple[LoadedShard, ...] = ()) -> Card:
    return Card(node_id=NodeId(node_id), grpc_address=f"10.0.0.{len(node_id)}:7650", platform="linux-x86_64",
                device="cpu", memory_total_bytes=16 << 30, memory_free_bytes=free_gib << 30,
                memory_bandwidth_gbps=20.0, matmul_gflops=100.0,
                models=(ModelOnDisk(MODEL, "ab" * 32, 4, "/secret/local/path"),), shards=shards,
                api_address="10.0.0.9:8000" if node_id == "b-node" else None, announced_at=time.time() - 2)


def test_cluster_view_lists_nodes_and_load(backend):
    fleet = [card("b-node", 4, (LoadedShard(MODEL, "ab" * 32, 0, 2, queue_depth=3),)),
             card("a-node", 12, (LoadedShard(MODEL, "ab" * 32, 2, 4),))]
    with_fleet = Backend(backend.model_id, backend.tokenizer, backend.max_context, backend.leader, backend.metrics,
                         fleet_view=lambda: fleet)
    with serve(with_fleet) as live:
        live.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
        view = httpx.get(f"{live.url}/v1/cluster", timeout=10).json()
    served = view["served"]
    assert served["model_id"] == MODEL and served["ready"] is True and served["plan_error"] is None
    assert served["max_context"] == 128 and served["generated_tokens"] >= 4 and served["tokens_per_second"] > 0
    assert [n["node_id"] for n in view["nodes"]] == ["a-node", "b-node"]
    b = view["nodes"][1]
    assert b["memory_free_bytes"] == 4 << 30 and b["memory_total_bytes"] == 16 << 30
    assert b["shards"] == [{"model_id": MODEL, "first_layer": 0, "last_layer": 2, "queue_depth": 3}]
    assert b["api_address"] == "10.0.0.9:8000" and b["models"] == [MODEL]
    assert 1.0 <= b["age_s"] < 30
    assert "/secret/local/path" not in str(view)  # other machines' paths stay private


def test_dashboard_page_is_plain_html_polling_the_cluster_view(server):
    page = httpx.get(f"{server.url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'fetch("/v1/cluster"' in page.text and "<script>" in page.text
    assert "<script src" not in page.text  # no build step, no external assets
    view = httpx.get(f"{server.url}/v1/cluster", timeout=10).json()
    if server.stage_addresses:  # the cluster backend: both stage nodes, each holding its shard
        # A node's card with its new shard reaches the serving node by gossip (a round or two after
        # the Load: run alone, this test asks right after the deploy), so wait for the view to agree.
        def first_layers() -> list[int]:
            view = httpx.get(f"{server.url}/v1/cluster", timeout=10).json()
            return sorted(s["first_layer"] for n in view["nodes"] for s in n["shards"])
        wait_until(lambda: first_layers() == [0, 2], timeout=20, message="both shards in the fleet view")
        assert sorted(n["node_id"] for n in view["nodes"]) == ["node-0", "node-1"]
    else:
        assert view["nodes"] == []  # a single process has no fleet


def test_a_slow_fleet_view_holds_up_no_other_request(backend):
    # The demo's fleet view asks a node over gRPC (up to 5 s when it is down); run on the event
    # loop, it stalled every open stream and request for that long.
    def slow_fleet():
        time.sleep(2.0)
        return []

    slow = Backend(backend.model_id, backend.tokenizer, backend.max_context, backend.leader, backend.metrics,
                   fleet_view=slow_fleet)
    with serve(slow) as live:
        viewing = threading.Thread(target=lambda: httpx.get(f"{live.url}/v1/cluster", timeout=10))
        viewing.start()
        time.sleep(0.3)  # the view is waiting on the fleet
        started = time.monotonic()
        assert httpx.get(f"{live.url}/v1/models", timeout=10).status_code == 200
        waited = time.monotonic() - started
        viewing.join()
    assert waited < 1.0, waited
