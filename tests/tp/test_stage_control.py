"""A node's control plane (StageControl, in this process) while a tensor-parallel group forms or
hangs: one group waiting for a rank never stalls the node's other plans (their Load, Unload and
lease expiry), an Unload during a plan's own rendezvous leaves nothing behind, concurrent Loads
never pass the memory check for the same bytes, and an Unload answers while a step is stuck in a
collective on a silent rank. Rank 0's real store on loopback; the missing ranks simply never come."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import PrefixStore

import meshllm.pipeline.stage_control as stage_control
import meshllm.tp.stage as tp_stage
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.stage_weights import decoder_bytes
from meshllm.engine.step import SeqWork, Step
from meshllm.engine.step_limits import StepLimits
from meshllm.errors import ShardUnavailable, TensorParallelFailed
from meshllm.model.source import open_model
from meshllm.pipeline.loaded_stages import LoadedStages, SharedWeights, WeightKey
from meshllm.pipeline.stage_control import StageControl
from meshllm.tp.channel import CommandChannel
from meshllm.tp.group import GroupSpec, RankRole, join_group
from meshllm.tp.load import load_rank_decoder
from meshllm.tp.runner import TensorParallelRunner
from meshllm.tp.shard import ShardLayout
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2

RENDEZVOUS_S = 20.0  # the groups here never form; before the fix every other call waited this long
PROMPT_S = 2.0  # "at once", on a loaded 2-core machine


@pytest.fixture
def files(aidreams_path):
    return open_model(aidreams_path)


@pytest.fixture
def control(store, files, monkeypatch):
    monkeypatch.setattr(tp_stage, "TP_RENDEZVOUS_TIMEOUT_S", RENDEZVOUS_S)
    node = SimpleNamespace(store=store, bind_host="127.0.0.1", prober=SimpleNamespace(node_id="node-0"))
    control = StageControl(LoadedStages(), lambda model_id, fingerprint: files.path, collective=node)
    yield control
    control.close()


def _request(files, plan_id: str, first: int = 0, last: int = 4, role: RankRole | None = None):
    request = stage_pb2.LoadRequest(plan_id=plan_id, model_id=files.model_id, fingerprint=files.source.fingerprint(),
                                    num_layers=files.config.num_hidden_layers, first_layer=first, last_layer=last,
                                    dtype="float32")
    stage_convert.limits_to_pb(StepLimits(64, 4, 32, None, 8), request)
    if role is not None:
        request.tp.CopyFrom(stage_convert.rank_role_to_pb(role))
    return request


def _load_outcome(control: StageControl, request) -> dict:
    """Run a Load on its own thread; the dict gets its reply or error once it ends."""
    outcome: dict = {}

    def run():
        try:
            outcome["reply"] = control.load(request)
        except Exception as e:  # noqa: BLE001 - the test reads it
            outcome["error"] = e
        outcome["ended_at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    outcome["thread"] = thread
    return outcome


def _wait_in_rendezvous(store, group_id: str) -> None:
    """Until rank 0 said it loaded its slices: it is now waiting for rank 1."""
    gate = PrefixStore(f"meshllm/tp-load/{group_id}", store.client(5))
    deadline = time.monotonic() + 60
    while not gate.check(["0"]):
        assert time.monotonic() < deadline, "rank 0 never finished reading its slices"
        time.sleep(0.02)


def test_a_group_waiting_for_a_rank_holds_up_no_other_plan_on_the_node(control, files, store):
    # Rank 0 of a group whose rank 1 never loads: its Load waits in the rendezvous (minutes in
    # production). Meanwhile the node's other plans must load, unload and expire as usual.
    forming = _load_outcome(control, _request(files, "forming", role=RankRole(0, 2, store.endpoint, "slow")))
    _wait_in_rendezvous(store, "slow")
    started = time.monotonic()
    other = _load_outcome(control, _request(files, "other", 0, 2))
    other["thread"].join(RENDEZVOUS_S / 2)
    assert "reply" in other, other.get("error", "the other plan's Load waited for the forming group")
    loaded_s = time.monotonic() - started
    started = time.monotonic()
    assert control.unload(stage_pb2.UnloadRequest(plan_id="other")).was_loaded
    control.load(_request(files, "other", 0, 2))
    assert control.expire(0.0) == ["other"]  # the plan-lease sweep: "forming" is not loaded yet
    others_s = time.monotonic() - started
    assert forming["thread"].is_alive(), forming  # still waiting for rank 1 all along
    control.unload(stage_pb2.UnloadRequest(plan_id="forming"))
    forming["thread"].join(PROMPT_S)
    assert loaded_s < RENDEZVOUS_S / 2 and others_s < PROMPT_S, (loaded_s, others_s)


def test_an_unload_during_its_plans_rendezvous_ends_the_load_and_leaves_nothing(control, files, store):
    forming = _load_outcome(control, _request(files, "forming", role=RankRole(0, 2, store.endpoint, "unloaded")))
    _wait_in_rendezvous(store, "unloaded")
    started = time.monotonic()
    reply = control.unload(stage_pb2.UnloadRequest(plan_id="forming"))
    unload_s = time.monotonic() - started
    forming["thread"].join(PROMPT_S + 1)
    assert not forming["thread"].is_alive(), "the Load went on waiting for its group after the Unload"
    assert not reply.was_loaded and unload_s < PROMPT_S
    assert isinstance(forming.get("error"), TensorParallelFailed) and "unloaded" in str(forming["error"])
    assert forming["ended_at"] - started < PROMPT_S
    assert control.loaded() == [] and control.info().shards == []  # no half-loaded stage
    # Rank 1, were it still loading, is told at once (the load gate): its Load aborts, not waits.
    reason = PrefixStore("meshllm/tp-load/unloaded", store.client(5)).get("0").decode()
    assert "unloaded" in reason


def test_a_leaders_unload_leaves_a_plan_another_leader_loaded(control, files):
    """Leaders with the same plan share its stages. One leader re-planning (say it alone lost a
    link) unloads its old plan everywhere: the plan must stay for the other leader's streams,
    and go once every leader that loaded it has let it go."""
    def load(leader: str):
        request = _request(files, "shared", 0, 2)
        request.leader_id = leader
        return control.load(request)

    assert not load("a").reused_weights
    assert load("b").reused_weights  # the second leader's Load: the same stage
    kept = control.unload(stage_pb2.UnloadRequest(plan_id="shared", leader_id="a"))
    assert kept.was_loaded and kept.held_by_other_leaders and kept.weight_bytes_freed == 0
    assert [r.plan_id for r in control.loaded()] == ["shared"]
    assert control.unload(stage_pb2.UnloadRequest(plan_id="shared", leader_id="a")).held_by_other_leaders
    last = control.unload(stage_pb2.UnloadRequest(plan_id="shared", leader_id="b"))
    assert last.was_loaded and not last.held_by_other_leaders and last.weight_bytes_freed > 0
    assert control.loaded() == []
    # An Unload naming no leader is for every leader (and what a leader without an id sends).
    load("a"), load("b")
    assert control.unload(stage_pb2.UnloadRequest(plan_id="shared")).weight_bytes_freed > 0
    assert control.loaded() == []


def test_another_leaders_unload_does_not_end_a_load_of_the_plan(control, files, store):
    """A Load under way is dropped by its own leader's Unload, not by another leader's."""
    request = _request(files, "forming", role=RankRole(0, 2, store.endpoint, "two-leaders"))
    request.leader_id = "b"
    forming = _load_outcome(control, request)
    _wait_in_rendezvous(store, "two-leaders")
    assert not control.unload(stage_pb2.UnloadRequest(plan_id="forming", leader_id="a")).was_loaded
    forming["thread"].join(PROMPT_S)
    assert forming["thread"].is_alive(), forming  # still waiting for its rank 1
    control.unload(stage_pb2.UnloadRequest(plan_id="forming", leader_id="b"))
    forming["thread"].join(PROMPT_S + 1)
    assert not forming["thread"].is_alive() and "unloaded" in str(forming.get("error"))


def test_concurrent_loads_never_pass_the_memory_check_for_the_same_bytes(control, files, store, monkeypatch):
    # The node's free memory, as psutil would report it, and loads that take it as they read.
    needs = {}
    for plan_id, request in (("tp", _request(files, "tp", role=RankRole(0, 2, store.endpoint, "budget"))),
                             ("plain", _request(files, "plain", 0, 4))):
        monkeypatch.setattr(stage_control.psutil, "virtual_memory", lambda: SimpleNamespace(available=0))
        with pytest.raises(ShardUnavailable) as refused:
            stage_control._check_memory(files, request, 4, 0)
        needs[plan_id] = refused.value.missing_bytes
    free = [needs["tp"] + needs["plain"] - 1]  # room for either, not both
    monkeypatch.setattr(stage_control.psutil, "virtual_memory", lambda: SimpleNamespace(available=free[0]))
    read_rank, reading = tp_stage.load_rank_weights, threading.Event()

    def slow_read_rank(*args, **kwargs):
        reading.set()
        time.sleep(0.5)  # the read takes a while, and the bytes are in use once it is done
        free[0] -= needs["tp"]
        return read_rank(*args, **kwargs)

    monkeypatch.setattr(tp_stage, "load_rank_weights", slow_read_rank)
    forming = _load_outcome(control, _request(files, "tp", role=RankRole(0, 2, store.endpoint, "budget")))
    assert reading.wait(30)  # the rank passed its memory check and reads
    plain = _load_outcome(control, _request(files, "plain", 0, 4))
    plain["thread"].join(RENDEZVOUS_S / 2)
    assert isinstance(plain.get("error"), ShardUnavailable), plain  # it saw the rank's bytes in use
    assert forming["thread"].is_alive()  # the rank read first, and waits for its group
    control.unload(stage_pb2.UnloadRequest(plan_id="tp"))
    forming["thread"].join(PROMPT_S)


STEP_GROUP_TIMEOUT_S = 5.0  # the stuck step's collective fails after this


def test_an_unload_answers_while_a_step_is_stuck_in_its_groups_collective(store, files, aidreams_path):
    # Rank 0 of a group whose worker rank went silent (SIGSTOP): a step sits in its first
    # collective (the broadcast of its command), holding the stage's lock, until the group's timeout. The leader's Unload must
    # answer before that (it gives up after plan_owner.UNLOAD_TIMEOUT_S = 5 s), and the stage must
    # still be freed and its group closed once the step lets go.
    layout = ShardLayout.of(files.config, 0, 2)
    specs = [GroupSpec("stuck", r, 2, store.endpoint, "127.0.0.1", timeout_s=STEP_GROUP_TIMEOUT_S) for r in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        c0, c1 = pool.map(lambda s: join_group(s, store if s.rank == 0 else None), specs)
    decoder = load_rank_decoder(files.source, files.config, layout, c0)
    tp = TensorParallelRunner(StageRunner(decoder, samples=True), CommandChannel(c0))
    stages = LoadedStages()
    control = StageControl(stages, lambda *_: aidreams_path)
    request = _request(files, "stuck", role=RankRole(0, 2, store.endpoint, "stuck"))
    stages.put("stuck", request, SharedWeights(WeightKey.of(request), decoder, decoder_bytes(decoder)), tp)
    stage = stages.get("stuck")
    failed = []

    def step():  # as the stage's Forward stream runs one (stage_forward.py)
        work = SeqWork(SeqId(1), 0, 3, 1, SamplingParams(temperature=0.0, seed=1))
        with stage.lock:
            try:
                stage.runner.run(Step(1, (work,), torch.tensor([1, 2, 3])))
            except TensorParallelFailed as e:
                failed.append(e)

    stuck = threading.Thread(target=step, daemon=True)
    stuck.start()
    time.sleep(0.5)  # rank 1 never answers: the step waits in the collective
    started = time.monotonic()
    reply = control.unload(stage_pb2.UnloadRequest(plan_id="stuck"))
    unload_s = time.monotonic() - started
    assert reply.was_loaded and control.loaded() == []
    stuck.join(STEP_GROUP_TIMEOUT_S + 5)
    deadline = time.monotonic() + 5
    while not tp._closed.is_set() or tp.held_sequences():
        assert time.monotonic() < deadline, "the stage was not freed once its stuck step let go"
        time.sleep(0.05)
    assert failed and c0.closed
    c1.close()
    assert unload_s < PROMPT_S, f"the Unload waited {unload_s:.1f}s for the stuck step"
