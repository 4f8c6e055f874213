"""A node budgets the KV its loaded plans may still grow into, not only what they hold now.

Caches grow as sequences do, so free memory as the OS reports it includes KV a loaded plan will
take later: a second plan placed into that room (another model, another leader's plan) runs the
node out of memory once the first plan's sequences grow. The node's stages reserve what each
plan's limits allow (its planner budget); the card leaves that out of its free memory and names
it per loaded range, a Load counts its own KV and the others' reservations, and a re-plan over a
loaded range may use the room its own replaced plan reserved. Each leader's claim on a shared plan
lapses on its own: one that stops renewing it (a finished `meshllm generate`, a killed server)
stops reserving its streams' KV after a lease while the others keep the plan; renewals and steps
name their leader, and one that never names itself (an older leader) keeps its claim until the
plan lapses. Real StageControl and StageRunner on the tiny Llama, and real stage services on
loopback gRPC for the steps; the one stand-in is the OS's free-memory reading in the refusal
test (this machine cannot be made short of memory on demand)."""

from __future__ import annotations

from types import SimpleNamespace

import time

import pytest
import torch

import meshllm.pipeline.stage_control as stage_control
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import SeqWork, Step
from meshllm.engine.step_limits import StepLimits
from meshllm.errors import BadRequest, ShardUnavailable
from meshllm.model.source import open_model
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.loaded_stages import LoadedStages
from meshllm.pipeline.stage_control import StageControl
from meshllm.pipeline.stage_service import StageService
from meshllm.pipeline.transport import RemotePipeline, next_step_id
from meshllm.transport import auth, stage_convert
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig

CONTEXT, SEQS, BLOCK, BLOCKS = 64, 4, 16, 8
LIMITS = StepLimits(CONTEXT, SEQS, 32, BLOCK, BLOCKS)
LEASE_S = 0.4


@pytest.fixture
def files(aidreams_path):
    return open_model(aidreams_path)


@pytest.fixture
def control(files):
    control = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path)
    yield control
    control.close()


def _request(files, plan_id: str, first: int = 0, last: int = 2, seqs: int = SEQS, leader: str = "leader-a"):
    request = stage_pb2.LoadRequest(plan_id=plan_id, model_id=files.model_id, fingerprint=files.source.fingerprint(),
                                    num_layers=files.config.num_hidden_layers, first_layer=first, last_layer=last,
                                    dtype="float32", leader_id=leader)
    stage_convert.limits_to_pb(StepLimits(CONTEXT, seqs, 32, BLOCK, BLOCKS), request)
    return request


def _budget(files, layers: int, seqs: int = SEQS, leaders: int = 1) -> int:
    return (CONTEXT * seqs * leaders + BLOCKS * BLOCK) * files.config.kv_bytes_per_token(4, layers)


def test_a_plan_reserves_the_kv_its_limits_allow_until_its_sequences_hold_it(control, files):
    stages = control._stages
    control.load(_request(files, "plan-a"))
    weights = stages.memory().held
    assert weights > 0 and stages.memory().reserved == _budget(files, 2)

    # A prompt of 10 tokens: its cache takes its first capacity, which moves from reserved to held.
    stage = stages.get("plan-a")
    work = SeqWork(SeqId(1), 0, 10, 1, SamplingParams(temperature=0.0, seed=1))
    stage.runner.run(Step(1, (work,), torch.arange(10)))
    kv = stage.runner.cache.num_bytes
    assert kv > 0
    memory = stages.memory()
    assert memory.held == weights + kv and memory.reserved == _budget(files, 2) - kv

    # A second leader on the same plan may hold as many sequences again.
    control.load(_request(files, "plan-a", leader="leader-b"))
    assert stages.memory().reserved == _budget(files, 2, leaders=2) - kv

    # Freed: all of it reserved again.
    stage.runner.release([SeqId(1)])
    assert stages.memory().reserved == _budget(files, 2, leaders=2)


def test_plans_over_one_range_reserve_the_largest_budget_and_other_ranges_add_theirs(control, files):
    stages = control._stages
    control.load(_request(files, "plan-a"))
    # A re-plan over the same weights (failover) takes the old plan's place, so the two reserve the
    # larger budget, not both.
    control.load(_request(files, "plan-b", seqs=2 * SEQS))
    assert stages.memory().reserved == _budget(files, 2, seqs=2 * SEQS)
    by_range = stages.kv_reserved()
    assert list(by_range.values()) == [_budget(files, 2, seqs=2 * SEQS)]
    # Another range's plan reserves its own.
    control.load(_request(files, "plan-c", first=2, last=4))
    assert stages.memory().reserved == _budget(files, 2, seqs=2 * SEQS) + _budget(files, 2)
    assert sorted(stages.kv_reserved().values()) == sorted([_budget(files, 2, seqs=2 * SEQS), _budget(files, 2)])


def test_plans_of_independent_leaders_over_one_range_reserve_both_budgets(control, files):
    stages = control._stages
    control.load(_request(files, "plan-a", leader="leader-a"))
    # Another serving process plans the same layers for itself: the weights are shared, the KV is not.
    control.load(_request(files, "plan-b", seqs=2 * SEQS, leader="leader-b"))
    assert stages.memory().reserved == _budget(files, 2) + _budget(files, 2, seqs=2 * SEQS)
    (key,) = stages.kv_reserved()  # one range; the card names each lineage's leaders (node_stage.py)
    assert sorted(stages.kv_reservations()[key], key=lambda r: sorted(r[0])) == [
        ({"leader-a"}, _budget(files, 2)), ({"leader-b"}, _budget(files, 2, seqs=2 * SEQS))]
    # leader-a re-plans over the range (failover): its new plan replaces its old, the other stays.
    control.load(_request(files, "plan-c", seqs=3 * SEQS, leader="leader-a"))
    assert stages.memory().reserved == _budget(files, 2, seqs=3 * SEQS) + _budget(files, 2, seqs=2 * SEQS)
    # And a leader that joins leader-b's plan ties the lineages: one plan and its replacement, shared.
    control.load(_request(files, "plan-b", seqs=2 * SEQS, leader="leader-a"))
    assert stages.memory().reserved == max(_budget(files, 2, seqs=3 * SEQS), _budget(files, 2, seqs=2 * SEQS, leaders=2))


def test_a_plan_shared_by_two_leaders_links_their_lineages_in_any_order(control, files):
    stages = control._stages
    control.load(_request(files, "plan-a", leader="leader-a"))
    control.load(_request(files, "plan-b", seqs=2 * SEQS, leader="leader-b"))
    # A third plan (loaded after both) that leader-a loads and leader-b then joins: the three are one lineage.
    control.load(_request(files, "plan-d", leader="leader-a"))
    assert stages.memory().reserved == _budget(files, 2) + _budget(files, 2, seqs=2 * SEQS)
    control.load(_request(files, "plan-d", leader="leader-b"))
    assert stages.memory().reserved == max(_budget(files, 2, leaders=2), _budget(files, 2, seqs=2 * SEQS))


def test_kv_one_leader_holds_does_not_offset_what_anothers_plan_may_grow_into(control, files):
    stages = control._stages
    control.load(_request(files, "plan-a", leader="leader-a"))
    control.load(_request(files, "plan-b", leader="leader-b"))
    stage = stages.get("plan-a")
    stage.runner.run(Step(1, (SeqWork(SeqId(1), 0, 10, 1, SamplingParams(temperature=0.0, seed=1)),), torch.arange(10)))
    kv = stage.runner.cache.num_bytes
    assert 0 < kv < _budget(files, 2)
    # plan-a's sequence takes from plan-a's reservation only: plan-b may still grow into all of its own.
    assert stages.kv_reserved() == {stage.weights.key: 2 * _budget(files, 2) - kv}
    # Leaders without an id link nothing: each such plan reserves its own budget.
    control.load(_request(files, "plan-c", leader=""))
    control.load(_request(files, "plan-e", leader=""))
    assert stages.memory().reserved == 4 * _budget(files, 2) - kv


def test_a_load_over_loaded_weights_is_refused_when_its_kv_does_not_fit(control, files, monkeypatch):
    def free(available: int):  # the OS's reading of free memory (this machine has ~20 GiB free)
        monkeypatch.setattr(stage_control.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))

    control.load(_request(files, "plan-a", leader="leader-a"))
    reserved = control._stages.memory().reserved
    # Another leader's plan over the same layers reads no weights, but its KV must fit beside plan-a's.
    free(reserved + _budget(files, 2) - 1)
    with pytest.raises(ShardUnavailable, match="are loaded here") as refused:
        control.load(_request(files, "plan-b", leader="leader-b"))
    assert refused.value.missing_bytes == 1
    assert control._stages.get("plan-b") is None
    # A second leader joining plan-a may hold as many sequences again (the prefix blocks are shared).
    joining = _budget(files, 2, leaders=2) - _budget(files, 2)
    free(reserved + joining - 1)
    with pytest.raises(ShardUnavailable, match="are loaded here") as refused:
        control.load(_request(files, "plan-a", leader="leader-b"))
    assert refused.value.missing_bytes == 1
    assert control._stages.get("plan-a").leaders == {"leader-a"}
    # leader-a's own re-plan with the same limits adds nothing: its old plan's room is its room.
    free(reserved)
    control.load(_request(files, "plan-c", leader="leader-a"))
    free(reserved + _budget(files, 2))
    control.load(_request(files, "plan-b", leader="leader-b"))
    control.load(_request(files, "plan-a", leader="leader-b"))  # joins: plan-a's lineage now spans both
    assert control._stages.memory().reserved == _budget(files, 2, leaders=2)
    # plan-a loaded again with other limits: its new stage serves both leaders, and is checked for both.
    reserved = control._stages.memory().reserved
    free(reserved + _budget(files, 2, seqs=2 * SEQS, leaders=2) - _budget(files, 2, leaders=2) - 1)
    with pytest.raises(ShardUnavailable, match="are loaded here") as refused:
        control.load(_request(files, "plan-a", seqs=2 * SEQS, leader="leader-a"))
    assert refused.value.missing_bytes == 1
    free(reserved + _budget(files, 2, seqs=2 * SEQS, leaders=2) - _budget(files, 2, leaders=2))
    control.load(_request(files, "plan-a", seqs=2 * SEQS, leader="leader-a"))
    assert control._stages.get("plan-a").leaders == {"leader-a", "leader-b"}
    assert control._stages.memory().reserved == _budget(files, 2, seqs=2 * SEQS, leaders=2)


def test_a_leader_joining_a_plan_whose_sequences_hold_kv_adds_only_its_own_streams(control, files, monkeypatch):
    control.load(_request(files, "plan-a", leader="leader-a"))
    stage = control._stages.get("plan-a")
    stage.runner.run(Step(1, (SeqWork(SeqId(1), 0, 10, 1, SamplingParams(temperature=0.0, seed=1)),), torch.arange(10)))
    reserved = control._stages.memory().reserved
    assert 0 < reserved < _budget(files, 2)  # the KV held now is the plan's, out of its reservation
    joining = _budget(files, 2, leaders=2) - _budget(files, 2)  # the KV held stays counted as the plan's
    monkeypatch.setattr(stage_control.psutil, "virtual_memory",
                        lambda: SimpleNamespace(available=reserved + joining))
    control.load(_request(files, "plan-a", leader="leader-b"))
    assert stage.leaders == {"leader-a", "leader-b"}
    assert control._stages.memory().reserved == reserved + joining


def test_a_card_names_a_joining_leader_at_once(files):
    # A leader joining a loaded plan changes what the node reserves: its card must say so now (the
    # node rebuilds it on each change), not at the next gossip round, or a planner reads it stale.
    changes = []
    control = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path,
                           on_change=lambda: changes.append(control._stages.kv_reservations()))
    try:
        control.load(_request(files, "plan-a", leader="leader-a"))
        control.load(_request(files, "plan-a", leader="leader-a"))  # a renewal by the same leader changes nothing
        control.load(_request(files, "plan-a", leader="leader-b"))
    finally:
        control.close()
    leaders = [[tuple(sorted(ids)) for ids, _ in lineages] for change in changes for lineages in change.values()]
    assert leaders == [[("leader-a",)], [("leader-a", "leader-b")]]


def test_a_leader_id_a_card_could_not_carry_is_refused(control, files):
    for bad in ("x" * 200, "two words", "tab\there", "nul\x00"):
        with pytest.raises(BadRequest, match="is not a node id"):
            control.load(_request(files, "plan-a", leader=bad))
    assert control._stages.get("plan-a") is None


def test_a_load_counts_its_own_kv_and_the_kv_other_plans_reserved(control, files, monkeypatch):
    def free(available: int):  # the OS's reading of free memory: this machine has ~20 GiB free
        monkeypatch.setattr(stage_control.psutil, "virtual_memory", lambda: SimpleNamespace(available=available))

    # What a Load of layers 2-4 needs on a node with nothing loaded: all it misses with nothing free.
    free(0)
    with pytest.raises(ShardUnavailable) as refused:
        control.load(_request(files, "plan-c", first=2, last=4))
    need = refused.value.missing_bytes
    free(1 << 40)
    probe = control.load(_request(files, "probe", first=2, last=4, seqs=1))
    assert probe.plan_id == "probe"
    without_kv = need - _budget(files, 2)  # its own KV is part of the need: the rest is the weights
    assert 0 < without_kv <= control._stages.memory().held
    control.unload(stage_pb2.UnloadRequest(plan_id="probe"))

    control.load(_request(files, "plan-a"))
    reserved = control._stages.memory().reserved
    assert reserved == _budget(files, 2)
    free(need + reserved - 1)
    with pytest.raises(ShardUnavailable, match="its plans' KV may still take"):
        control.load(_request(files, "plan-c", first=2, last=4))
    free(need + reserved)
    control.load(_request(files, "plan-c", first=2, last=4))
    assert control._stages.get("plan-c") is not None


def test_loads_keep_to_the_nodes_max_memory_whatever_the_os_has_free(files):
    """--max-memory bounds what the node's plans take together (weights, KV held and reserved), at
    Load too: a card a few seconds old, or another leader's plan, must not take the node past it."""
    control = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path, memory_cap=1)
    try:  # a 1-byte cap: no plan fits, however much the OS has free
        with pytest.raises(ShardUnavailable, match="within its --max-memory"):
            control.load(_request(files, "plan-a"))
    finally:
        control.close()
    probe = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path)
    try:
        probe.load(_request(files, "plan-a"))
        memory = probe._stages.memory()
        cap = memory.held + memory.reserved  # exactly what plan-a takes: it fits, a second plan's KV does not
    finally:
        probe.close()
    control = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path, memory_cap=cap)
    try:
        control.load(_request(files, "plan-a"))
        with pytest.raises(ShardUnavailable, match="within its --max-memory") as refused:
            control.load(_request(files, "plan-b", leader="leader-b"))  # shares the weights: KV only
        assert refused.value.missing_bytes == _budget(files, 2)
    finally:
        control.close()


def test_a_sequence_never_holds_more_kv_than_the_plans_context(control, files):
    # Caches grow by doubling; they stopped at the model's context, so on a plan whose context is not
    # a power of two a long sequence held up to twice what the plan budgets and the node reserves.
    context = 100
    request = _request(files, "plan-a")
    stage_convert.limits_to_pb(StepLimits(context, 1, 128, BLOCK, 0), request)
    control.load(request)
    stage = control._stages.get("plan-a")
    work = SeqWork(SeqId(1), 0, 70, 1, SamplingParams(temperature=0.0, seed=1))
    stage.runner.run(Step(1, (work,), torch.arange(70)))  # past 64 positions: the cache grows once
    kv = stage.runner.cache.sequences[SeqId(1)]
    assert kv.capacity == context  # not 128
    memory = control._stages.memory()
    assert stage.kv_bytes == stage.kv_budget(1) and memory.reserved == 0


def _renew(control, leader: str) -> None:
    assert control.renew(stage_pb2.RenewRequest(plan_id="plan-a", leader_id=leader)).loaded


def test_a_leader_that_stops_renewing_loses_its_claim_and_the_others_keep_the_plan(control, files):
    changes = []
    control._on_change = lambda: changes.append(control._stages.memory().reserved)
    for leader in ("leader-a", "leader-b"):
        control.load(_request(files, "plan-a", leader=leader))
        _renew(control, leader)
    assert control._stages.memory().reserved == _budget(files, 2, leaders=2)
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")  # only leader-a goes on
    changes.clear()
    assert control.expire(LEASE_S) == []  # the plan stays: leader-a uses it
    assert control._stages.get("plan-a").leaders == {"leader-a"}
    assert control._stages.memory().reserved == _budget(files, 2, leaders=1)
    assert changes == [_budget(files, 2, leaders=1)]  # the card is rebuilt with the smaller reservation at once
    _renew(control, "leader-b")  # back (it was only away): using the plan gives its claim back
    assert control._stages.get("plan-a").leaders == {"leader-a", "leader-b"}
    assert control._stages.memory().reserved == _budget(files, 2, leaders=2)
    assert changes[-1] == _budget(files, 2, leaders=2)  # and the card says so at once
    time.sleep(LEASE_S + 0.1)
    assert control.expire(LEASE_S) == ["plan-a"]  # the last leader is never let go alone: the plan lapses


def test_a_leader_that_loaded_and_never_used_the_plan_loses_its_claim(control, files):
    control.load(_request(files, "plan-a", leader="leader-a"))
    control.load(_request(files, "plan-a", leader="leader-b"))  # then killed before its first step
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")
    control.expire(LEASE_S)
    assert control._stages.get("plan-a").leaders == {"leader-a"}


def test_while_a_plan_is_used_naming_no_leader_no_claim_lapses(control, files):
    """An older leader's steps and Renews name nobody (as do steps an older stage relays): while
    such uses go on, this stage cannot tell whose they are, so every claim stays; once they stop
    for a lease, the claims nobody renewed lapse."""
    control.load(_request(files, "plan-a", leader="leader-a"))
    control.load(_request(files, "plan-a", leader="older-leader"))  # loads naming itself, but its Renews do not
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")
    assert control.renew(stage_pb2.RenewRequest(plan_id="plan-a")).loaded
    assert control.expire(LEASE_S) == []
    assert control._stages.get("plan-a").leaders == {"leader-a", "older-leader"}
    assert control._stages.memory().reserved == _budget(files, 2, leaders=2)
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")  # the older leader went away
    control.expire(LEASE_S)
    assert control._stages.get("plan-a").leaders == {"leader-a"}


def test_a_loaded_stage_keeps_the_prefix_blocks_its_plan_allows(control, files):
    control.load(_request(files, "plan-a"))
    assert control._stages.get("plan-a").runner.prefix.capacity_blocks == BLOCKS


def test_a_renewal_naming_a_leader_the_plan_does_not_have_claims_nothing(control, files):
    control.load(_request(files, "plan-a", leader="leader-a"))
    _renew(control, "leader-a")
    _renew(control, "stranger")  # renews the plan's lease, adds no claim
    assert control._stages.get("plan-a").leaders == {"leader-a"}
    assert control._stages.memory().reserved == _budget(files, 2, leaders=1)


def test_steps_renew_the_claim_of_the_leader_that_sends_them_on_every_stage(aidreams_path, files):
    """Three leaders share a 2-stage plan on stage services with a short lease: leader-a only
    steps, leader-b renews once and goes quiet, leader-c only renews. After some leases, leader-b's
    claim is gone from both stages and leader-a's stays: its steps named it, and stage 0 passed its
    name on to stage 1 (had they not, its claim would lapse too)."""
    key = auth.generate_key()
    channels = ChannelPool(ChannelConfig("leader", key))
    services, servers, stream = [], [], None
    try:
        for i in range(2):
            services.append(StageService(lambda model_id, fingerprint: aidreams_path, channels, plan_lease_s=LEASE_S))
            servers.append(NodeServer(ServerConfig("127.0.0.1", 0, key, node_id=f"stage-{i}")))
            servers[i].add(stage_pb2_grpc.add_StageServicer_to_server, services[i])
            servers[i].start()
            services[i].start()  # its sweeper expires plans and lapses claims every quarter lease
        n = files.config.num_hidden_layers
        plan = Plan(files.model_id, files.source.fingerprint(), n, 64, 4, 4, 4,
                    (StageAssignment("stage-0", servers[0].address, 0, n // 2, 0, 0, 0),
                     StageAssignment("stage-1", servers[1].address, n // 2, n, 0, 0, 0)), 0.0, False)
        plan_ids = {deploy(plan, channels, "float32", limits=LIMITS, leader_id=leader)
                    for leader in ("leader-a", "leader-b", "leader-c")}
        assert len(plan_ids) == 1
        plan_id = plan_ids.pop()
        stubs = [stage_pb2_grpc.StageStub(channels.get(server.address, f"stage-{i}"))
                 for i, server in enumerate(servers)]

        def renew(leader: str) -> None:
            for stub in stubs:
                assert stub.Renew(stage_pb2.RenewRequest(plan_id=plan_id, leader_id=leader), timeout=10).loaded

        for leader in ("leader-a", "leader-b", "leader-c"):
            renew(leader)
        stream = RemotePipeline(channels.get(servers[0].address, "stage-0"), plan_id, 2, leader_id="leader-a")
        deadline = time.monotonic() + 4 * LEASE_S
        position = 0
        while time.monotonic() < deadline:
            start = position % 32  # back to 0 now and then (a rollback): within the plan's context
            token = torch.tensor([start + 1])
            assert stream.submit(Step(next_step_id(), (SeqWork(7, start, 1),), token)).result(timeout=30).ok
            renew("leader-c")
            position += 1
            time.sleep(0.02)
        assert [service.control._stages.get(plan_id).leaders for service in services] == [{"leader-a", "leader-c"}] * 2
    finally:
        if stream is not None:
            stream.close()
        for service in services:
            service.stop()
        channels.close()
        for server in servers:
            server.stop(0)


def _lapse_leader_b(control, files) -> None:
    """plan-a loaded by leader-a and leader-b, then leader-b quiet for a lease: its claim lapsed."""
    for leader in ("leader-a", "leader-b"):
        control.load(_request(files, "plan-a", leader=leader))
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")
    control.expire(LEASE_S)
    assert control._stages.get("plan-a").leaders == {"leader-a"}


def test_a_lapsed_leader_that_loads_again_joins_through_the_memory_check(control, files, monkeypatch):
    _lapse_leader_b(control, files)
    checked, changes = [], []
    check = control._check_added_kv
    monkeypatch.setattr(control, "_check_added_kv", lambda *a, **k: (checked.append(a[2]), check(*a, **k))[1])
    control._on_change = lambda: changes.append(control._stages.memory().reserved)
    control.load(_request(files, "plan-a", leader="leader-b"))
    assert checked == [{"leader-a", "leader-b"}]  # its KV counted against free memory again
    assert changes == [_budget(files, 2, leaders=2)]


def test_a_lapsed_leaders_unload_ends_its_claim_for_good(control, files):
    _lapse_leader_b(control, files)
    reply = control.unload(stage_pb2.UnloadRequest(plan_id="plan-a", leader_id="leader-b"))
    assert reply.was_loaded and reply.held_by_other_leaders
    _renew(control, "leader-b")  # a late Renew (or a step in flight) of the leader that let go
    assert control._stages.get("plan-a").leaders == {"leader-a"}


def test_a_release_renews_the_plan_but_keeps_no_claim_from_lapsing(control, files):
    """A Release (or an Adopt) carries no leader: it renews the plan, and is not a use naming no
    leader, which would keep every claim for a lease."""
    for leader in ("leader-a", "leader-b"):
        control.load(_request(files, "plan-a", leader=leader))
    time.sleep(LEASE_S + 0.1)
    _renew(control, "leader-a")
    control.release(stage_pb2.ReleaseRequest(plan_id="plan-a"))
    control.expire(LEASE_S)
    assert control._stages.get("plan-a").leaders == {"leader-a"}
