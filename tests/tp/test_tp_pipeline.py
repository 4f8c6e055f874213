"""A tensor-parallel group as one stage of a pipeline of real `meshllm node` processes.

Three nodes on loopback with --collective-port: node-0 holds layers 0-1 as stage 0; node-1
(rank 0) and node-2 (rank 1) hold layers 2-3 as a TP=2 group, stage 1. The OpenAI API is
served in this process over that plan, and concurrent requests must give exactly what the
single-process backend gives. Then the group's lifecycle on nodes: the ranks advertise
their slices, and a rank killed mid-generation takes its group down on the other node
within the group's timeout, and the leader fails over to a spare: the request completes with
the single process's text.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from meshllm.api.backend import Backend, build_local_backend
from meshllm.api.cluster_backend import build_cluster_backend
from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import NodeId
from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import GroupMember, Plan, StageAssignment
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, context_of, new_leader, wait_for_fleet
from meshllm.pipeline.deploy import deploy, plan_id_of
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.transport import RemotePipeline
from meshllm.tp.group import DEFAULT_TIMEOUT_S
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from tests.api.conftest import serve

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

# Batch-invariant and fp32, so every sequence's tokens are what it gets alone in one process.
OPTIONS = ServingOptions(context_length=128, max_batch=16, dtype="float32", batch_invariant=True,
                         scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))
PROMPTS = ["Echoes of vectors", "A gentle hum of precision and", "I dream", "The lattice of a dreaming machine",
           "Once upon a time", "Softly the model"]


@pytest.fixture(scope="module")
def nodes(aidreams_path, tmp_path_factory):
    local = LocalCluster(3, [aidreams_path], tmp_path_factory.mktemp("tp-cluster"),
                         extra_args=("--gossip-interval", "0.3", "--collective-port", "0"), threads_per_node=1)
    local.start(timeout_s=120)
    try:
        yield local
    finally:
        local.stop()


class TPCluster:
    def __init__(self, local: LocalCluster, files):
        self.local, self.files = local, files
        self.key = load_key(local.key_file)
        self.channels = ChannelPool(ChannelConfig("tp-test-leader", self.key))

    def view(self):
        return {c.node_id: c for c in fetch_view(self.local.addresses[0], self.key)}

    def deploy(self) -> tuple[Plan, str]:
        """Stage 0 on node-0 (layers 0-1); stage 1 a TP=2 group of node-1 and node-2 (layers 2-3)."""
        wait_for_fleet(lambda: list(self.view().values()), self.files.source.fingerprint(), 3, timeout_s=60)
        cards = self.view()
        a, n = self.local.addresses, self.local.node_ids
        stages = (StageAssignment(NodeId(n[0]), a[0], 0, 2, 0, 0, 0),
                  StageAssignment(NodeId(n[1]), a[1], 2, 4, 0, 0, 0, workers=(GroupMember(NodeId(n[2]), a[2]),),
                                  collective_endpoint=cards[n[1]].collective_endpoint))
        plan = Plan(self.files.model_id, self.files.source.fingerprint(), 4, OPTIONS.context_length,
                    OPTIONS.max_batch, 4, 4, stages, 0.0, False)
        return plan, deploy(plan, self.channels, OPTIONS.dtype, OPTIONS.batch_invariant)

    def backend(self, plan: Plan, plan_id: str) -> Backend:
        transport = RemotePipeline(self.channels.get(plan.stages[0].address, plan.stages[0].node_id), plan_id,
                                   len(plan.stages))
        metrics = MetricsObserver()
        leader = new_leader(self.files, transport, OPTIONS, metrics)
        return Backend(self.files.model_id, self.files.tokenizer, context_of(self.files, OPTIONS), leader, metrics)

    def shards(self, index: int, plan_id: str) -> list:
        stub = stage_pb2_grpc.StageStub(self.channels.get(self.local.addresses[index], self.local.node_ids[index]))
        return [s for s in stub.Info(stage_pb2.StageInfoRequest(), timeout=10).shards if s.plan_id == plan_id]


@pytest.fixture(scope="module")
def cluster(nodes, aidreams_path) -> TPCluster:
    return TPCluster(nodes, open_model(aidreams_path))


def _complete_all(client, model: str) -> list[str]:
    def one(prompt: str) -> str:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: they share decode steps
        return list(pool.map(one, PROMPTS))


def test_pipeline_with_a_tp_group_stage_serves_exactly_what_one_process_does(cluster, aidreams_path):
    reference = build_local_backend(aidreams_path, OPTIONS)
    with serve(reference) as live:
        want = _complete_all(live.client(), reference.model_id)
    reference.close()
    plan, plan_id = cluster.deploy()
    backend = cluster.backend(plan, plan_id)
    try:
        with serve(backend) as live:
            got = _complete_all(live.client(), backend.model_id)
            again = live.client().completions.create(model=backend.model_id, prompt=PROMPTS[1], max_tokens=24,
                                                     temperature=0)
            live.wait_for(lambda: not any(s.seq_ids for i in range(3) for s in cluster.shards(i, plan_id)),
                          timeout_s=20, what="every rank to free the finished sequences")
            [rank0], [rank1] = cluster.shards(1, plan_id), cluster.shards(2, plan_id)
    finally:
        backend.close()
    assert got == want and all(got)
    assert again.choices[0].text == want[1]
    # Each rank holds its slice of stage 1 and the same prefix blocks (rank-local KV, same hashes).
    assert (rank0.tp_rank, rank0.tp_size, rank1.tp_rank, rank1.tp_size) == (0, 2, 1, 2)
    assert rank0.num_prefix_blocks == rank1.num_prefix_blocks > 0
    assert rank0.kv_bytes == rank1.kv_bytes  # 2 of aidreams' 4 KV heads each
    # The leader's stream ended: rank 0 frees what it held, and so does every rank it tells.
    deadline = time.monotonic() + 20
    while any(s.num_prefix_blocks or s.seq_ids for i in (1, 2) for s in cluster.shards(i, plan_id)):
        assert time.monotonic() < deadline, "a rank kept the ended stream's prefix blocks"
        time.sleep(0.1)
    # Their cards advertise a slice of a group, which no planner mistakes for the whole range.
    cards = cluster.view()
    assert [(s.first_layer, s.last_layer, s.tp_size) for s in cards["node-2"].shards] == [(2, 4, 2)]


def _wait_gone(cluster: TPCluster, index: int, plan_id: str, timeout_s: float) -> float:
    started = time.monotonic()
    while cluster.shards(index, plan_id):
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"node-{index} still holds plan {plan_id} after {timeout_s}s")
        time.sleep(0.1)
    return time.monotonic() - started


def test_unload_of_rank_0_ends_its_group_and_frees_every_rank(cluster):
    plan, plan_id = cluster.deploy()  # the group of the first test, still alive: loaded again or reused
    [rank0], [rank1] = cluster.shards(1, plan_id), cluster.shards(2, plan_id)
    assert rank0.weight_bytes == rank1.weight_bytes > 0
    stub = stage_pb2_grpc.StageStub(cluster.channels.get(cluster.local.addresses[1], cluster.local.node_ids[1]))
    unloaded = stub.Unload(stage_pb2.UnloadRequest(plan_id=plan_id), timeout=30)
    assert unloaded.was_loaded and unloaded.weight_bytes_freed == rank0.weight_bytes  # never shared
    # Rank 0 told its worker to stop: the other node drops its rank at once, not after a timeout.
    assert _wait_gone(cluster, 2, plan_id, DEFAULT_TIMEOUT_S / 2) < DEFAULT_TIMEOUT_S / 2
    stage0 = stage_pb2_grpc.StageStub(cluster.channels.get(cluster.local.addresses[0], cluster.local.node_ids[0]))
    assert stage0.Unload(stage_pb2.UnloadRequest(plan_id=plan_id), timeout=30).was_loaded


def test_a_rank_killed_mid_generation_fails_its_group_and_the_leader_fails_over(cluster, aidreams_path):
    # Runs last in this module: the killed node does not come back. The leader plans by itself
    # (PlanOwner) with --tp 2 on the three nodes: one group of two, and a spare.
    reference = build_local_backend(aidreams_path, OPTIONS)
    with serve(reference) as live:
        want = live.client().completions.create(model=reference.model_id, prompt=PROMPTS[0], max_tokens=40,
                                                temperature=0).choices[0].text
    reference.close()
    wait_for_fleet(lambda: list(cluster.view().values()), cluster.files.source.fingerprint(), 3, timeout_s=60)
    backend, owner = build_cluster_backend(cluster.files, lambda: list(cluster.view().values()), cluster.channels,
                                           replace(OPTIONS, tensor_parallel=2, num_stages=1))
    try:
        [stage] = owner.plan.stages
        rank0, [worker] = stage.node_id, [w.node_id for w in stage.workers]
        [spare] = set(cluster.local.node_ids) - {rank0, worker}
        plan_id = plan_id_of(owner.plan, OPTIONS.dtype, OPTIONS.batch_invariant, None,
                             OPTIONS.step_limits(context_of(cluster.files, OPTIONS)))
        assert [s.tp_rank for s in cluster.shards(cluster.local.node_ids.index(worker), plan_id)] == [1]
        index = cluster.local.node_ids.index
        with serve(backend) as live:
            stream = live.client().completions.create(model=backend.model_id, prompt=PROMPTS[0], max_tokens=40,
                                                      temperature=0, stream=True)
            chunks = iter(stream)
            text = "".join(next(chunks).choices[0].text for _ in range(3))
            os.kill(cluster.local.processes[index(worker)].pid, signal.SIGKILL)
            # Rank 0's next collective finds the worker's sockets closed: its group fails at once,
            # and its node drops the stage well within the group's timeout.
            assert _wait_gone(cluster, index(rank0), plan_id, DEFAULT_TIMEOUT_S) < DEFAULT_TIMEOUT_S
            # The leader blames the stage, leaves out the rank that does not answer, gives its
            # slice to the spare, forms the group again and re-prefills: the text is unchanged.
            text += "".join(c.choices[0].text for c in chunks)
            assert live.metric("meshllm_failovers_total", {"code": "tp_group_failed"}) == 1
        [after] = owner.plan.stages
        assert after.node_ids == (rank0, spare)
        assert text == want
    finally:
        backend.close()
