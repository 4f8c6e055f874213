"""Plans are leased on the stages (issue 12): a leader that is gone for good (kill -9, never
closed) leaves nothing loaded past the node's --plan-lease; a live idle leader keeps its plan
(its idle probes renew it); a leader that left its plan unused past the lease finds it dropped
and loads it again, with the same greedy output. Of two leaders sharing a plan, one that stops
loses its claim after the lease while the other keeps the plan. A node's proposer releases the
sequences no leader named for the same lease. Real `meshllm node` processes on loopback."""

from __future__ import annotations

import json
import signal
import time
from dataclasses import replace

import psutil
import pytest

from meshllm.cluster.gossip import fetch_view
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.pipeline.cluster import deploy_plan, wait_for_fleet
from meshllm.pipeline.failover import FailoverConfig
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.spec.proposer import ProposeRequest
from meshllm.spec.remote import RemoteProposer
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from tests.cluster_fixtures import wait_until
from tests.pipeline.conftest import OPTIONS
from tests.pipeline import leader_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

LEASE_S = 1.5  # the nodes' --plan-lease; swept every LEASE_S / 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


class LeaseCluster:
    def __init__(self, local: LocalCluster, fingerprint: str):
        self.local = local
        self.key = load_key(local.key_file)
        self.channels = ChannelPool(ChannelConfig("lease-test-leader", self.key))
        self.view = lambda: fetch_view(local.addresses[0], self.key)
        wait_for_fleet(self.view, fingerprint, 2, timeout_s=60)

    def plans(self) -> list[set[str]]:
        """The plan ids each node holds."""
        return [{s.plan_id for s in stage_pb2_grpc.StageStub(self.channels.get(a, n)).Info(
            stage_pb2.StageInfoRequest(), timeout=10).shards} for a, n in zip(self.local.addresses, self.local.node_ids)]

    def weight_bytes(self) -> int:
        return sum(s.weight_bytes for a, n in zip(self.local.addresses, self.local.node_ids)
                   for s in stage_pb2_grpc.StageStub(self.channels.get(a, n)).Info(
                       stage_pb2.StageInfoRequest(), timeout=10).shards)

    def owner(self, files, idle_probe_interval_s: float) -> PlanOwner:
        options = replace(OPTIONS, num_stages=2, failover=FailoverConfig(
            idle_probe_interval_s=idle_probe_interval_s, idle_probe_timeout_s=1.0))
        return PlanOwner(files, self.view, self.channels, options)


@pytest.fixture(scope="module")
def lease_cluster(pipeline_models, model_files, tmp_path_factory):
    local = LocalCluster(2, [pipeline_models["aidreams"]], tmp_path_factory.mktemp("lease"),
                         extra_args=("--gossip-interval", "0.3", "--plan-lease", str(LEASE_S)), threads_per_node=1)
    local.start(timeout_s=120)
    try:
        yield LeaseCluster(local, model_files["aidreams"].source.fingerprint())
    finally:
        local.stop()


def test_a_killed_leaders_plan_is_unloaded_within_its_lease(lease_cluster, pipeline_models):
    process = leader_process.spawn(pipeline_models["aidreams"], lease_cluster.local.key_file, 90, 1,
                                   lease_cluster.local.addresses)
    try:
        plan_id = json.loads(process.stdout.readline())["plan_id"]
        assert all(plan_id in held for held in lease_cluster.plans())
        weights = lease_cluster.weight_bytes()
        assert weights > 0
        rss = [psutil.Process(p.pid).memory_info().rss for p in lease_cluster.local.processes]
        process.send_signal(signal.SIGKILL)  # mid-stream, never closed: only the lease can tell
        killed_at = time.monotonic()
        process.wait(timeout=10)
        wait_until(lambda: not any(plan_id in held for held in lease_cluster.plans()), timeout=LEASE_S + 8,
                   interval=0.05, message="the stages to drop a killed leader's plan")
        dropped_s = time.monotonic() - killed_at
        assert lease_cluster.weight_bytes() == 0  # its layers went with it (no other plan used them)
        after = [psutil.Process(p.pid).memory_info().rss for p in lease_cluster.local.processes]
        print(f"plan dropped {dropped_s:.2f} s after kill -9 (lease {LEASE_S} s); {weights} weight bytes; "
              f"node RSS {[r >> 20 for r in rss]} -> {[r >> 20 for r in after]} MiB")
        # The lease, not the broken stream, dropped it: the leader stepped until the kill.
        assert LEASE_S - 0.3 <= dropped_s <= LEASE_S + 6
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_a_stopped_leaders_claim_lapses_while_another_leader_keeps_the_shared_plan(lease_cluster, pipeline_models,
                                                                                 model_files):
    """Two leaders share one plan: a leader process, stopped (SIGSTOP: hung, or cut off) mid-stream,
    and one that goes on renewing it naming itself (as its probes do). After the lease each node's
    card reserves KV for the live leader only, and the plan stays loaded for it."""
    local = lease_cluster.local
    process = leader_process.spawn(pipeline_models["aidreams"], local.key_file, 90, 1, local.addresses)
    channels = ChannelPool(ChannelConfig("leader-b", lease_cluster.key))
    plan_id = None
    try:
        plan_id = json.loads(process.stdout.readline())["plan_id"]
        process.send_signal(signal.SIGSTOP)  # mid-stream: it neither steps nor renews from now on
        plan = leader_process.even_plan(model_files["aidreams"], local.addresses)
        assert deploy_plan(model_files["aidreams"], plan, channels, leader_process.OPTIONS).plan_id == plan_id

        def reserved_for() -> list[set[tuple[str, ...]]]:
            """Per node, the leader sets its card reserves KV for (itself as it gossips it)."""
            cards = {c.node_id: c for c in lease_cluster.view()}
            return [{r.leader_ids for s in cards[n].shards for r in s.kv_reservations} for n in local.node_ids]

        both = {tuple(sorted((leader_process.LEADER_ID, "leader-b")))}
        wait_until(lambda: reserved_for() == [both, both], timeout=LEASE_S, interval=0.05,
                   message="the cards to show both leaders' claim")

        def renewed_and_lapsed() -> bool:
            for a, n in zip(local.addresses, local.node_ids):  # leader-b's probe
                assert stage_pb2_grpc.StageStub(channels.get(a, n)).Renew(
                    stage_pb2.RenewRequest(plan_id=plan_id, leader_id="leader-b"), timeout=10).loaded
            return reserved_for() == [{("leader-b",)}, {("leader-b",)}]

        wait_until(renewed_and_lapsed, timeout=LEASE_S + 8, interval=0.1,
                   message="the killed leader's claim to lapse on both nodes")
        assert all(plan_id in held for held in lease_cluster.plans())
    finally:
        process.kill()  # a stopped process takes SIGKILL too
        process.wait(timeout=10)
        for a, n in zip(local.addresses, local.node_ids) if plan_id else ():
            stage_pb2_grpc.StageStub(channels.get(a, n)).Unload(
                stage_pb2.UnloadRequest(plan_id=plan_id, leader_id="leader-b"), timeout=10)
        channels.close()


def test_an_idle_leader_keeps_its_plan_and_one_that_was_away_loads_it_again(lease_cluster, model_files):
    files = model_files["aidreams"]
    prompt = files.tokenizer.encode("The little robot looked at the stars and")

    def run(leader) -> list[int]:
        return [e.token_id for e in leader.generate(prompt, GREEDY) if e.token_id is not None]

    # Away: a leader that does not renew (its idle probes far apart) past the lease, as a paused or
    # cut-off one. Its next request finds the plan unknown, loads it again and is served.
    away = lease_cluster.owner(files, idle_probe_interval_s=600)
    leader = away.start()
    try:
        plan_id = leader.transport.plan_id
        expected = run(leader)
        wait_until(lambda: not any(plan_id in held for held in lease_cluster.plans()), timeout=LEASE_S + 8,
                   interval=0.1, message="the stages to drop a plan unused past its lease")
        assert run(leader) == expected
        assert away.health.report().num_failovers == 1  # one re-deploy, blaming no node
        assert all(plan_id in held for held in lease_cluster.plans())
    finally:
        leader.close()

    # Live and idle: its probes renew the plan, which outlives several leases untouched otherwise.
    live = lease_cluster.owner(files, idle_probe_interval_s=0.25)
    leader = live.start()
    try:
        plan_id = leader.transport.plan_id
        assert run(leader) == expected
        time.sleep(3 * LEASE_S)
        assert all(plan_id in held for held in lease_cluster.plans())
        assert live.health.report().num_failovers == 0
        # A plan dropped while it idles (the lease ran out while it was away) is loaded again by
        # its next idle probe, before any request needs it.
        node = lease_cluster.local
        stage_pb2_grpc.StageStub(lease_cluster.channels.get(node.addresses[1], node.node_ids[1])).Unload(
            stage_pb2.UnloadRequest(plan_id=plan_id), timeout=10)
        wait_until(lambda: all(leader.transport is not None and leader.transport.plan_id in held
                               for held in lease_cluster.plans()), timeout=10, interval=0.05,
                   message="the idle leader to load its dropped plan again")
        assert live.health.report().num_failovers == 1
        assert run(leader) == expected
    finally:
        leader.close()


def test_a_proposer_releases_the_sequences_no_leader_named_for_the_lease(lease_cluster):
    """Leader A crashed (it stopped calling; the node cannot tell the difference), leader B drafts on."""
    node = lease_cluster.local
    remote = RemoteProposer(lease_cluster.channels.get(node.addresses[0], node.node_ids[0]), "ngram",
                            node.node_ids[0], deadline_s=5.0)
    crashed, live = SeqId(11), SeqId(12)
    first = remote.propose([ProposeRequest(crashed, 0, (1, 2, 3, 1, 2), 3), ProposeRequest(live, 0, (4, 5, 6, 4, 5), 3)])
    assert [d.tokens for d in first] == [(3, 1), (6, 4)]
    until = time.monotonic() + 2 * LEASE_S + 0.5
    while time.monotonic() < until:
        (draft,) = remote.propose([ProposeRequest(live, 5, (6,), 0)])  # only what changed: the node keeps the rest
        assert draft.resync_from is None  # named within every lease: kept
        time.sleep(0.2)
    (draft,) = remote.propose([ProposeRequest(crashed, 5, (3,), 2)])
    assert draft.resync_from == 0  # released: the node asks for the whole context again
    (draft,) = remote.propose([ProposeRequest(live, 5, (6,), 2)])
    assert draft.resync_from is None and draft.tokens == (4, 5)
