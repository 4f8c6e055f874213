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

from meshllm.errors import ShardUnavailable
from meshllm.pipeline import plan_owner as plan_owner_module
from meshllm.pipeline.deploy import LoadRefused
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.auth import generate_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2
from tests.pipeline.conftest import OPTIONS
from tests.pipeline.test_lease_renewal import FakeNode, FakeStage

REFUSAL = ShardUnavailable("layers [0, 2) are loaded here, but the plan's KV needs 1000 more bytes; this node has 10 "
                           "bytes free", missing_bytes=990, part="layers 0-1")


class RefusingStage(FakeStage):
    """Accepts every Load, unless `refuse_loads`: then RESOURCE_EXHAUSTED as stage_service.Load answers
    a node's failed memory check (its figures in trailing metadata); keeps the plans loaded."""

    def __init__(self):
        super().__init__()
        self.refuse_loads = False
        self.loaded: set[str] = set()

    def Load(self, request, context):
        if self.refuse_loads:
            context.set_trailing_metadata(stage_convert.shortfall_metadata(REFUSAL))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"[{REFUSAL.code}] {REFUSAL}")
        self.loaded.add(request.plan_id)
        return stage_pb2.LoadReply(plan_id=request.plan_id)

    def Unload(self, request, context):
        was = request.plan_id in self.loaded
        self.loaded.discard(request.plan_id)
        return stage_pb2.UnloadReply(was_loaded=was)


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
    assert all(nodes[n].stage.loaded == {owner.plan_id} for n in stages)  # the plan in service, and only it:
    assert not refuser.stage.loaded  # it refused: the failed attempt's part on the other node went at once (above)
    assert owner.health.report().ok
    assert any(f"planning without node {refuser.node_id}" in r.getMessage() for r in caplog.records)

    # Only the refuser in the fleet: the leader says what the node said, not that the fleet is empty.
    alone = PlanOwner(files, lambda: [refuser.card(files)], pool, replace(OPTIONS, num_stages=1))
    with pytest.raises(LoadRefused, match="plan's KV needs 1000 more bytes") as refused:
        alone.recover(None)
    assert refused.value.node_id == refuser.node_id
    assert (refused.value.missing_bytes, refused.value.part) == (990, "layers 0-1")  # the node's figures
    report = alone.health.report()
    assert report.status.value == "unavailable" and "1000 more bytes" in report.reason
    assert report.missing_bytes == 990


def test_a_rate_limited_load_is_not_taken_for_a_memory_refusal():
    """The node's auth answers RESOURCE_EXHAUSTED too (its replay window is full): that says nothing
    about the node's memory, so it is not a LoadRefused (which would leave the node out for a minute)."""
    from meshllm.errors import ShardUnavailable as Unavailable
    from meshllm.pipeline.deploy import _load_error

    class Rejected(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return "too many calls in the replay window; retry later"

        def trailing_metadata(self):
            return ()

    error = _load_error("node-a", "127.0.0.1:1", Rejected())
    assert isinstance(error, Unavailable) and not isinstance(error, LoadRefused)
