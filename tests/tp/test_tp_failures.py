"""A tensor-parallel group's failures on real `meshllm node` processes: a rank whose Load fails,
and a worker rank stopped (SIGSTOP) mid-generation.

Four nodes on loopback with --collective-port: node-0..2 are healthy, node-3 fails every Load
after its first, once it has read its weights (fault injection fail_load@1, as a disk read
error would). Every node loads once first (a 4-stage plan): a node's first Load pays for
importing the loading code (~7 s on a loaded 2-core machine), which is not what is timed here. A group
with node-3 must fail its whole deploy in seconds (not after the rendezvous timeout), naming
the rank and node, and the leader must plan without node-3. A SIGSTOPped worker rank must be
detected and its group failed over to a plan without it, the text unchanged.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import replace

import pytest

from meshllm.api.backend import build_local_backend
from meshllm.api.cluster_backend import build_cluster_backend
from meshllm.cluster.card import NodeId
from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import GroupMember, Plan, StageAssignment
from meshllm.errors import PeerUnreachable
from meshllm.model.source import open_model
from meshllm.pipeline.deploy import RankLoadFailed, deploy, plan_id_of
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from tests.api.conftest import serve
from tests.cluster_fixtures import wait_until
from tests.tp.test_tp_pipeline import OPTIONS

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

FAILING = 3  # node-3's Loads fail
PROMPT = "Once upon a time"
MAX_TOKENS = 32
STOP_AFTER = 6  # streamed tokens before the worker is stopped
STEP_TIMEOUT_S = 10.0  # the leader's step deadline at most (its stall watch starts far lower)
RECOVERY_S = 5.0  # re-plan, the new group's Load and the re-prefill, on a loaded 2-core machine


@pytest.fixture(scope="module")
def nodes(aidreams_path, tmp_path_factory):
    local = LocalCluster(4, [aidreams_path], tmp_path_factory.mktemp("tp-failures"),
                         extra_args=("--gossip-interval", "0.3", "--collective-port", "0"), threads_per_node=1,
                         node_env={FAILING: {"MESHLLM_FAULT_INJECTION": "fail_load@1"}})
    local.start(timeout_s=120)
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def files(aidreams_path):
    return open_model(aidreams_path)


@pytest.fixture(scope="module")
def channels(nodes):
    return ChannelPool(ChannelConfig("tp-failures-leader", load_key(nodes.key_file)))


@pytest.fixture(scope="module")
def warm(nodes, files, channels) -> dict:
    """Every node's first Load done (node-3's only successful one); the nodes' cards."""
    cards = wait_for_cards(nodes, files.source.fingerprint())
    stages = tuple(StageAssignment(NodeId(nodes.node_ids[i]), nodes.addresses[i], i, i + 1, 0, 0, 0) for i in range(4))
    deploy(Plan(files.model_id, files.source.fingerprint(), 4, OPTIONS.context_length, OPTIONS.max_batch, 4, 4,
                stages, 0.0, False), channels, OPTIONS.dtype, OPTIONS.batch_invariant)
    return cards


@pytest.fixture(scope="module")
def reference(aidreams_path) -> str:
    backend = build_local_backend(aidreams_path, OPTIONS)
    with serve(backend) as live:
        text = live.client().completions.create(model=backend.model_id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                temperature=0).choices[0].text
    backend.close()
    return text


def view(nodes: LocalCluster, visible: set[str]) -> list:
    key = load_key(nodes.key_file)
    for address in nodes.live_addresses():
        try:
            return [c for c in fetch_view(address, key) if c.node_id in visible]
        except PeerUnreachable:
            continue  # a stopped node does not answer: ask the next
    raise PeerUnreachable("no live node answers")


def wait_for_cards(nodes: LocalCluster, fingerprint: str) -> dict:
    def ready():
        cards = {c.node_id: c for c in view(nodes, set(nodes.node_ids))}
        return cards if len(cards) == 4 and all(c.collective_endpoint and any(
            m.fingerprint == fingerprint for m in c.models) for c in cards.values()) else None
    return wait_until(ready, timeout=60, message="4 nodes with collective endpoints in the view")


def shards(nodes: LocalCluster, channels: ChannelPool, index: int, plan_id: str) -> list:
    stub = stage_pb2_grpc.StageStub(channels.get(nodes.addresses[index], nodes.node_ids[index]))
    return [s for s in stub.Info(stage_pb2.StageInfoRequest(), timeout=10).shards if s.plan_id == plan_id]


def test_a_rank_whose_load_fails_fails_its_group_at_once_and_the_leader_plans_without_it(nodes, warm, files,
                                                                                          channels, reference):
    cards = warm
    a, n = nodes.addresses, nodes.node_ids
    # By hand: rank 0 on node-0 loads fine and waits for rank 1 on node-3, whose Load fails.
    plan = Plan(files.model_id, files.source.fingerprint(), 4, OPTIONS.context_length, OPTIONS.max_batch, 4, 4,
                (StageAssignment(NodeId(n[0]), a[0], 0, 4, 0, 0, 0, workers=(GroupMember(NodeId(n[FAILING]),
                                                                                         a[FAILING]),),
                                 collective_endpoint=cards[n[0]].collective_endpoint),), 0.0, False)
    started = time.monotonic()
    with pytest.raises(RankLoadFailed) as failed:
        deploy(plan, channels, OPTIONS.dtype, OPTIONS.batch_invariant)
    seconds = time.monotonic() - started
    print(f"a group with a failing rank: deploy failed in {seconds:.2f}s")  # was the 120 s rendezvous timeout
    assert seconds < 5.0
    assert failed.value.node_id == n[FAILING]
    assert "rank 1 of 2" in str(failed.value) and "fault injection" in str(failed.value)
    assert not shards(nodes, channels, 0, plan_id_of(plan, OPTIONS.dtype, OPTIONS.batch_invariant))  # nothing left

    # The leader plans itself (--tp 2). The view shows node-3 with the most free memory, so the
    # planner groups it first; its Load fails, the leader leaves it out and groups two others.
    def boosted_view():
        return [replace(c, memory_free_bytes=c.memory_free_bytes * 4) if c.node_id == n[FAILING] else c
                for c in view(nodes, {n[0], n[1], n[FAILING]})]

    started = time.monotonic()
    backend, owner = build_cluster_backend(files, boosted_view, channels,
                                           replace(OPTIONS, tensor_parallel=2, num_stages=1))
    planned_s = time.monotonic() - started
    try:
        [stage] = owner.plan.stages
        assert set(stage.node_ids) == {n[0], n[1]}
        with serve(backend) as live:
            text = live.client().completions.create(model=backend.model_id, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                                    temperature=0).choices[0].text
    finally:
        backend.close()
    print(f"leader planned around the failing rank in {planned_s:.2f}s")
    assert planned_s < 10.0
    assert text == reference


def test_a_stopped_worker_rank_is_detected_and_its_group_fails_over(nodes, warm, files, channels, reference):
    healthy = set(nodes.node_ids[:3])
    options = replace(OPTIONS, tensor_parallel=2, num_stages=1, step_timeout_s=STEP_TIMEOUT_S)
    backend, owner = build_cluster_backend(files, lambda: view(nodes, healthy), channels, options)
    stopped_pid = None
    try:
        [stage] = owner.plan.stages
        rank0, [worker] = stage.node_id, [w.node_id for w in stage.workers]
        [spare] = healthy - {rank0, worker}
        with serve(backend) as live:
            stream = live.client(timeout=60).completions.create(model=backend.model_id, prompt=PROMPT,
                                                                max_tokens=MAX_TOKENS, temperature=0, stream=True)
            text, stopped_at = "", None
            for i, chunk in enumerate(stream):
                text += chunk.choices[0].text
                if i + 1 == STOP_AFTER:
                    stopped_pid = nodes.processes[nodes.node_ids.index(worker)].pid
                    os.kill(stopped_pid, signal.SIGSTOP)
                    stopped_at = time.monotonic()
            recovered_s = time.monotonic() - stopped_at
            assert live.metric("meshllm_failovers_total", {"code": "pipeline_stalled"}) == 1
        [after] = owner.plan.stages
        print(f"stopped worker: stream finished {recovered_s:.2f}s after the SIGSTOP")
        assert worker not in after.node_ids and set(after.node_ids) == {rank0, spare}
        # Detection within the step deadline (~1.5 s here), then re-plan, the new group's Load and
        # the re-prefill (~2 s): 3.5-4 s measured. Nothing of the old group's stuck all-reduce
        # may delay the new plan.
        assert recovered_s < STEP_TIMEOUT_S + RECOVERY_S
        assert text == reference
    finally:
        if stopped_pid is not None:
            os.kill(stopped_pid, signal.SIGCONT)
        backend.close()
