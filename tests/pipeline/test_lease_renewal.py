"""Renew refusals at the plan owner (lease_renewal.py): a node that answers health checks but
refuses the leader's Renew must not be taken for a dead one (excluded, let back in because it
answers, planned again, refused again: a loop of re-plans).

Real gRPC servers in this process (the node's server, its auth interceptor included) with fake
Stage and Health services: a real node refuses a Renew only when it cannot authenticate it, or
is too old to have one, which a test cannot make a `meshllm node` process do on demand. Loads
are stubbed out (deploy): what is checked is whom the plan owner plans on, and its health.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest

from meshllm.cluster.card import Card, ModelOnDisk, NodeId
from meshllm.pipeline import plan_owner as plan_owner_module
from meshllm.pipeline.failover import StageFailure, StageProbe
from meshllm.pipeline.lease_renewal import Lease, LeaseRenewer
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.auth import generate_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc, stage_pb2, stage_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from tests.pipeline.conftest import OPTIONS

GIB = 1 << 30


class FakeStage(stage_pb2_grpc.StageServicer):
    """Holds every plan; its Renew is refused with `refuse` when set."""

    def __init__(self):
        self.refuse: grpc.StatusCode | None = None

    def Renew(self, request, context):
        if self.refuse is not None:
            context.abort(self.refuse, "refused by the test")
        return stage_pb2.RenewReply(loaded=True)


class FakeHealth(cluster_pb2_grpc.HealthServicer):
    def __init__(self, node_id: str):
        self.node_id = node_id

    def Check(self, request, context):
        return cluster_pb2.HealthResponse(node_id=self.node_id, serving=True)


class FakeNode:
    def __init__(self, key: bytes, node_id: str, with_stage: bool = True, stage: FakeStage | None = None):
        self.node_id = NodeId(node_id)
        self.stage = stage or FakeStage()
        self.server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id=node_id))
        self.server.add(cluster_pb2_grpc.add_HealthServicer_to_server, FakeHealth(node_id))
        if with_stage:  # without: a node older than the Stage service answers UNIMPLEMENTED
            self.server.add(stage_pb2_grpc.add_StageServicer_to_server, self.stage)
        self.server.start()
        self.address = self.server.address

    def card(self, files) -> Card:
        return Card(node_id=self.node_id, grpc_address=self.address, platform="test", device="cpu",
                    memory_total_bytes=8 * GIB, memory_free_bytes=8 * GIB, memory_bandwidth_gbps=50.0,
                    matmul_gflops=100.0, models=(ModelOnDisk(files.model_id, files.source.fingerprint(),
                                                             files.config.num_hidden_layers),))


@pytest.fixture
def key() -> bytes:
    return generate_key()


@pytest.fixture
def channels(key) -> Iterator[ChannelPool]:
    pool = ChannelPool(ChannelConfig("test-leader", key))
    yield pool
    pool.close()


@pytest.fixture
def nodes(key) -> Iterator[dict[str, FakeNode]]:
    made = {name: FakeNode(key, name) for name in ("node-a", "node-b", "node-c")}
    yield made
    for node in made.values():
        node.server.stop(0)


def test_renewals_tell_refusals_and_older_nodes_from_silence(key, channels, nodes):
    renewer = LeaseRenewer(channels)
    node = nodes["node-a"]
    assert renewer.renew(node.address, node.node_id, "p", 2.0).lease is Lease.HELD
    # Addressed to another node id than the one at that address: the node's auth refuses it.
    refused = renewer.renew(node.address, NodeId("node-gone"), "p", 2.0)
    assert refused.lease is Lease.REFUSED and "UNAUTHENTICATED" in refused.detail
    node.stage.refuse = grpc.StatusCode.PERMISSION_DENIED
    assert renewer.renew(node.address, node.node_id, "p", 2.0).lease is Lease.REFUSED
    node.stage.refuse = grpc.StatusCode.UNIMPLEMENTED  # an older node: its health check stands in
    assert renewer.renew(node.address, node.node_id, "p", 2.0).lease is Lease.HELD
    older = FakeNode(key, "node-old", with_stage=False)  # no Stage service at all
    try:
        assert renewer.renew(older.address, older.node_id, "p", 2.0).lease is Lease.HELD
    finally:
        older.server.stop(0)
    # Gone: no answer is silence, whatever the service would have said.
    assert renewer.renew(older.address, older.node_id, "p", 0.5).lease is Lease.SILENT


def test_a_node_refusing_renew_is_left_out_while_it_refuses_not_readmitted_because_it_answers(
        model_files, channels, nodes, monkeypatch, caplog):
    files = model_files["aidreams"]
    monkeypatch.setattr(plan_owner_module, "deploy", lambda plan, *a, **k: "plan-" + "-".join(
        s.node_id for s in plan.stages))
    fleet = [n.card(files) for n in nodes.values()]
    owner = PlanOwner(files, lambda: fleet, channels, replace(OPTIONS, num_stages=2))
    owner.recover(None)
    first = [s.node_id for s in owner.plan.stages]
    refuser = nodes[first[1]]
    refuser.stage.refuse = grpc.StatusCode.UNAUTHENTICATED

    probe = owner.probe(2.0)
    assert probe.refused == (1,) and probe.unresponsive == () and probe.unloaded == ()
    report = owner.health.report()  # degraded at the probe, before any re-plan
    assert report.status.value == "degraded" and report.failed_node == refuser.node_id
    assert "refuses" in report.reason

    with caplog.at_level(logging.WARNING, logger=plan_owner_module.__name__):
        owner.recover(StageFailure(1, "plan_refused", "stage 1 refuses this leader's calls"))
        assert refuser.node_id not in [s.node_id for s in owner.plan.stages]
        assert owner.health.report().ok
        # Another re-plan (any cause): the refuser answers health checks, yet stays out while it refuses.
        for _ in range(2):
            owner.recover(StageFailure(None, "shard_not_loaded", "re-deploy"))
            assert refuser.node_id not in [s.node_id for s in owner.plan.stages]
    warnings = [r for r in caplog.records if "refuses this leader's calls" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]

    refuser.stage.refuse = None  # fixed (its key, its clock): the next re-plan may use it again
    owner.recover(StageFailure(None, "shard_not_loaded", "re-deploy"))
    assert refuser.node_id not in owner._excluded


def test_an_older_node_without_renew_is_alive_while_it_answers_health_checks(model_files, channels, nodes,
                                                                             monkeypatch):
    files = model_files["aidreams"]
    monkeypatch.setattr(plan_owner_module, "deploy", lambda plan, *a, **k: "plan-1")
    fleet = [n.card(files) for n in nodes.values()]
    owner = PlanOwner(files, lambda: fleet, channels, replace(OPTIONS, num_stages=2))
    owner.recover(None)
    for node in nodes.values():
        node.stage.refuse = grpc.StatusCode.UNIMPLEMENTED
    assert owner.probe(2.0) == StageProbe()  # nothing found: no re-plan
    assert owner.health.report().ok
