"""A node that refuses its Load for memory (RESOURCE_EXHAUSTED: its card promised room its own
check did not find, e.g. KV another leader's plans reserve there) is left out of the plan for a
while, and the leader plans without it; with nowhere else to go, the leader reports the node's
own refusal.

Real gRPC servers in this process (a node's server with its auth interceptor) and the real
deploy; the Stage service is a stand-in whose Load refuses on demand: a real node refuses only
when the OS reports too little free memory, which a test cannot arrange in another process.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace

import grpc
import pytest

from meshllm.pipeline import plan_owner as plan_owner_module
from meshllm.pipeline.deploy import LoadRefused
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.auth import generate_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import stage_pb2
from tests.pipeline.conftest import OPTIONS
from tests.pipeline.test_lease_renewal import FakeNode, FakeStage

REFUSAL = "layers [0, 2) are loaded here, but the plan's KV needs 1000 more bytes; this node has 10 bytes free"


class RefusingStage(FakeStage):
    """Accepts every Load, unless `refuse_loads`: then RESOURCE_EXHAUSTED, as a node's memory check."""

    def __init__(self):
        super().__init__()
        self.refuse_loads = False
        self.loads: list[str] = []

    def Load(self, request, context):
        if self.refuse_loads:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSAL)
        self.loads.append(request.plan_id)
        return stage_pb2.LoadReply(plan_id=request.plan_id)


@pytest.fixture
def channels() -> Iterator[tuple[bytes, ChannelPool]]:
    key = generate_key()
    pool = ChannelPool(ChannelConfig("test-leader", key))
    yield key, pool
    pool.close()


@pytest.fixture
def nodes(channels) -> Iterator[dict[str, FakeNode]]:
    key, _ = channels
    made = {name: FakeNode(key, name, stage=RefusingStage()) for name in ("node-a", "node-b", "node-c")}
    yield made
    for node in made.values():
        node.server.stop(0)


def test_a_node_refusing_its_load_is_planned_around_and_alone_it_is_reported(model_files, channels, nodes,
                                                                               caplog):
    files = model_files["aidreams"]
    _, pool = channels
    fleet = [n.card(files) for n in nodes.values()]
    owner = PlanOwner(files, lambda: fleet, pool, replace(OPTIONS, num_stages=2))
    planned = [s.node_id for s in PlanOwner(files, lambda: fleet, pool, replace(OPTIONS, num_stages=2))
               ._choose_plan(None, None).stages]
    refuser = nodes[planned[0]]
    refuser.stage.refuse_loads = True

    with caplog.at_level(logging.WARNING, logger=plan_owner_module.__name__):
        owner.recover(None)
    stages = [s.node_id for s in owner.plan.stages]
    assert refuser.node_id not in stages and len(stages) == 2
    assert all(nodes[n].stage.loads for n in stages)  # the plan that went out loaded on the other two
    assert owner.health.report().ok
    assert any(f"planning without node {refuser.node_id}" in r.getMessage() for r in caplog.records)

    # Only the refuser in the fleet: the leader says what the node said, not that the fleet is empty.
    alone = PlanOwner(files, lambda: [refuser.card(files)], pool, replace(OPTIONS, num_stages=1))
    with pytest.raises(LoadRefused, match="plan's KV needs 1000 more bytes") as refused:
        alone.recover(None)
    assert refused.value.node_id == refuser.node_id
    report = alone.health.report()
    assert report.status.value == "unavailable" and "1000 more bytes" in report.reason
