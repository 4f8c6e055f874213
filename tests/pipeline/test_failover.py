"""A request survives a dead or hung stage node: real `meshllm node` processes on loopback, the
HTTP API, and the official `openai` client streaming a chat completion while a stage is
killed (kill -9), stopped (SIGSTOP) or sends corrupt activations (fault injection).

The text must equal the single-process run's (same batch-invariant fp32 arithmetic, served
by the same API code in this process). One pool of node processes serves the whole module;
each test takes live idle nodes from it (starting more when needed) and shows its leader only
the nodes it uses, through the fleet view it plans on: the other processes of the pool are not
part of that test's fleet. A node started for one test's purpose (fault injection, a memory
cap) stays that test's: `take` never hands it to a later test, whose leader would plan on it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshllm.api.backend import build_local_backend
from meshllm.api.cluster_backend import build_cluster_backend
from meshllm.cluster.gossip import fetch_view
from meshllm.errors import PeerUnreachable
from meshllm.pipeline.failover import FailoverConfig, StageFailure
from meshllm.pipeline.health import HealthReport
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.api.conftest import LiveServer, serve
from tests.cluster_fixtures import wait_until
from tests.pipeline.conftest import OPTIONS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MESSAGES = [{"role": "user", "content": "Tell me a story about a robot who learns to paint."}]
MAX_TOKENS = 40
KILL_AFTER = 8  # streamed tokens before the fault: mid-stream, every time
# Per-node memory offered to plans in the no-fit test: two such nodes hold aidreams (2 layers
# each with OPTIONS' KV and prefix-cache blocks, both budgeted), one cannot (it needs 4 layers
# plus embedding and head): two fit from 14 MB, one from 26 MB.
SMALL_NODE = "18MB"
FAULT_ENV = "MESHLLM_FAULT_INJECTION"
NODE_FAULTS = ("stage_unreachable", "pipeline_stalled", "shard_corrupt", "invalid_reply")  # failover codes


class Pool:
    """The module's node processes, by node id (node-<index>)."""

    def __init__(self, local: LocalCluster, model_fingerprint: str):
        self.local = local
        self.key = load_key(local.key_file)
        self.fingerprint = model_fingerprint
        self.channels = ChannelPool(ChannelConfig("failover-test-leader", self.key))
        # Started with an environment or arguments of their own: a corrupt@3 node corrupts every step
        # after its third for the rest of its life, and a leader that only read its card cannot know.
        self.special: set[str] = set()

    def live(self) -> list[str]:
        return [f"node-{i}" for i, p in enumerate(self.local.processes) if p.poll() is None]

    def process(self, node_id: str):
        return self.local.processes[int(node_id.removeprefix("node-"))]

    def view(self) -> list:
        for address in self.local.live_addresses():
            try:
                return fetch_view(address, self.key)
            except PeerUnreachable:
                continue  # a stopped node does not answer: ask the next
        raise PeerUnreachable("no live node answers")

    def spawn(self, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> str:
        node_id = f"node-{self.local.add_node(env=env, args=args)}"
        if env or args:
            self.special.add(node_id)
        wait_until(lambda: any(c.node_id == node_id and any(m.fingerprint == self.fingerprint for m in c.models)
                               for c in self.view()), timeout=60, message=f"{node_id} in the fleet view")
        return node_id

    def take(self, count: int, avoid: set[str] = frozenset()) -> list[str]:
        """`count` live plain nodes (lowest ids first), starting new ones when too few are left."""
        nodes = [n for n in self.live() if n not in avoid and n not in self.special][:count]
        while len(nodes) < count:
            nodes.append(self.spawn())
        return nodes

    def answers_health_check(self, node_id: str) -> bool:
        address = self.local.addresses[int(node_id.removeprefix("node-"))]
        try:
            cluster_pb2_grpc.HealthStub(self.channels.get(address)).Check(cluster_pb2.HealthRequest(), timeout=2)
            return True
        except grpc.RpcError:
            return False


@pytest.fixture(scope="module")
def files(model_files):
    return model_files["aidreams"]


@pytest.fixture(scope="module")
def pool(pipeline_models, files, tmp_path_factory) -> Iterator[Pool]:
    # llama-gqa too (random weights: near-ties everywhere) for the default kernels' failover test.
    local = LocalCluster(4, [pipeline_models["aidreams"], pipeline_models["llama-gqa"]], tmp_path_factory.mktemp("failover"),
                         extra_args=("--gossip-interval", "0.3"), threads_per_node=1)
    local.start(timeout_s=120)
    try:
        pool = Pool(local, files.source.fingerprint())
        wait_until(lambda: len(pool.view()) == 4, timeout=60, message="4 nodes in the view")
        yield pool
    finally:
        local.stop()


@pytest.fixture(scope="module")
def reference(pipeline_models) -> Iterator[Callable[..., str]]:
    """The single-process run (whole model in this process) behind the same HTTP API."""
    backend = build_local_backend(pipeline_models["aidreams"], OPTIONS)
    cache: dict = {}
    with serve(backend) as live:
        def text(**sampling) -> str:
            key = tuple(sorted(sampling.items()))
            if key not in cache:
                cache[key], _ = stream_chat(live, **sampling)
            return cache[key]

        yield text
    backend.close()


@contextlib.contextmanager
def leader_over(pool: Pool, files, visible: set[str], **options) -> Iterator[LiveServer]:
    """An API server whose leader plans over the nodes in `visible` (the test may add to it)."""
    def view():
        return [c for c in pool.view() if c.node_id in visible]

    # Every visible node's card, with the model, before the first plan. A 3-stage plan over 4 nodes
    # came out with 2 stages in whole-suite runs (never alone): plan_owner falls back to fewer
    # stages when fewer nodes qualify, and the likeliest reason is a card the view lacked while
    # gossip lagged under the suite's load.
    wait_until(lambda: {c.node_id for c in view() if any(m.fingerprint == pool.fingerprint for m in c.models)}
               >= visible, timeout=60, message=f"{sorted(visible)} in the fleet view")
    channels = options.pop("channels", pool.channels)  # another pool: the nodes see another leader
    backend, owner = build_cluster_backend(files, view, channels, replace(OPTIONS, **options))
    try:
        with serve(backend) as live:
            live.owner = owner
            yield live
    finally:
        backend.close()


def stream_chat(live: LiveServer, on_token: Callable[[int], None] = lambda n: None, **sampling) -> tuple[str, int]:
    """Stream a chat completion with the openai client; `on_token(n)` after the n-th token.
    Returns the text and the number of content chunks; an error event raises openai.APIError."""
    sampling = {"temperature": 0.0, **sampling}
    stream = live.client(timeout=120).chat.completions.create(
        model=live.backend.model_id, messages=MESSAGES, max_tokens=MAX_TOKENS, stream=True,
        extra_body={"ignore_eos": True}, **sampling)
    text, n = "", 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            n += 1
            on_token(n)
    return text, n


def failovers(live: LiveServer) -> float:
    """Failovers blamed on a node, from one scrape: a sum over one scrape per code could miss a
    failover that comes between two of them (and count 1 where there were 2)."""
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshllm_failovers_total" and sample.labels.get("code") in NODE_FAULTS)


def health(live: LiveServer) -> tuple[int, dict]:
    reply = httpx.get(f"{live.url}/health", timeout=10)
    return reply.status_code, reply.json()


def at_token(n: int, action: Callable[[], None]) -> Callable[[int], None]:
    def on_token(i: int) -> None:
        if i == n:
            action()
    return on_token


def all_failovers(live: LiveServer) -> float:
    """Every re-plan the leader made, whatever its cause (failovers() counts node faults only)."""
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "meshllm_failovers_total")


def stage_nodes(live: LiveServer) -> list[str]:
    return [s.node_id for s in live.owner.plan.stages]


def kill(pool: Pool, node_id: str) -> None:
    os.kill(pool.process(node_id).pid, signal.SIGKILL)
    # Reaped at once, so `live()` never hands it out: its sockets close before it can be reaped.
    pool.process(node_id).wait(timeout=10)


def shard_rows(pool: Pool) -> dict[tuple[str, str], tuple[int, int]]:
    """(rows computed, rows skipped as carried over) of every plan on every live node, as the node
    says, by (node, plan). A plan's counts are cumulative: the same plan may serve several tests."""
    rows = {}
    for node in pool.live():
        address = pool.local.addresses[int(node.removeprefix("node-"))]
        stub = stage_pb2_grpc.StageStub(pool.channels.get(address, node))
        for shard in stub.Info(stage_pb2.StageInfoRequest(), timeout=10).shards:
            rows[node, shard.plan_id] = (shard.rows_computed, shard.rows_skipped)
    return rows


def last_recovery(live: LiveServer) -> dict:
    return httpx.get(f"{live.url}/v1/cluster", timeout=10).json()["served"]["recent_failovers"][-1]


def assert_carried_over_to(pool: Pool, live: LiveServer, adopters: set[int], before: dict) -> None:
    """The stages in `adopters` kept the KV they held through the failover and did not compute
    those positions again; the others re-prefilled every row the leader sent (counts since `before`)."""
    now, carried = shard_rows(pool), last_recovery(live)["carried_positions"]
    rows = []
    for stage in live.owner.plan.stages:
        key = (stage.node_id, live.owner.plan_id)
        rows.append(tuple(a - b for a, b in zip(now[key], before.get(key, (0, 0)))))
    sent = rows[0][0] + rows[0][1]  # stage 0 sees every row the leader sends
    if adopters:
        assert carried >= KILL_AFTER  # the prompt and the tokens streamed before the fault
    else:
        assert carried == 0
    for i, (computed, skipped) in enumerate(rows):
        assert (computed, skipped) == ((sent - carried, carried) if i in adopters else (sent, 0)), (i, rows, carried)


@pytest.mark.parametrize("position", ["middle", "last"])
def test_kill_9_of_a_stage_with_a_spare_keeps_the_stream_identical(pool, files, reference, position):
    nodes = pool.take(4)
    with leader_over(pool, files, set(nodes), num_stages=3) as live:
        stages = stage_nodes(live)
        ranges = [(s.first_layer, s.last_layer) for s in live.owner.plan.stages]
        [spare] = set(nodes) - set(stages)
        victim = stages[1 if position == "middle" else 2]
        before, rows_before = failovers(live), shard_rows(pool)
        text, n = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, victim)))
        assert text == reference() and n == MAX_TOKENS
        assert failovers(live) == before + 1
        # The last stage kept its range and node through a middle stage's death: it adopted the KV
        # it held and computed only the positions it lacked; nothing is carried past a dead last stage.
        assert_carried_over_to(pool, live, {2} if position == "middle" else set(), rows_before)
        after = stage_nodes(live)
        assert victim not in after and spare in after
        # Only the failed range moved: the survivors kept theirs, and reused their weights.
        assert [(s.first_layer, s.last_layer) for s in live.owner.plan.stages] == ranges
        assert after == [spare if n == victim else n for n in stages]
        status, body = health(live)
        assert status == 200 and body["status"] == "ok" and body["num_failovers"] == 1
        wait_until(lambda: pool.process(victim).poll() is not None, timeout=10, message="the killed node reaped")


def test_kill_9_without_a_spare_redistributes_onto_the_survivors(pool, files, reference):
    nodes = pool.take(3)
    with leader_over(pool, files, set(nodes), num_stages=3) as live:
        victim = stage_nodes(live)[0]  # the first stage: embedding and layers move too
        replaced = live.owner.plan_id
        text, n = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, victim)))
        assert text == reference() and failovers(live) == 1
        after = stage_nodes(live)
        assert victim not in after and set(after) <= set(nodes)
        assert live.owner.plan.stages[0].first_layer == 0 and live.owner.plan.stages[-1].last_layer == 4
        # The leader unloads the replaced plan from the survivors (its lease is minutes): its Unload
        # names the leader its Load named, so the plan, held by no other leader, goes at once.
        wait_until(lambda: all(plan != replaced for _, plan in shard_rows(pool)), timeout=15,
                   message="the replaced plan unloaded from the survivors")


def test_a_leader_replanning_leaves_the_plan_another_leader_shares(pool, files, reference, monkeypatch):
    """Leaders behind two APIs that choose the same plan share its stages. Leader A alone sees a
    stage fail (only its own link broke, say) and re-plans onto a spare; its Unload of the old
    plan must leave that plan to leader B: B's next answer needs no failover and no reload.
    (Leader B is handed A's plan: two leaders choose the same one when their views agree, and
    here the nodes' measured speeds drift between the two starts. A's re-plan is started by the
    test, as its leader does on a failed step.)"""
    nodes = pool.take(4)
    shared, spare = set(nodes[:3]), nodes[3]
    seen_by_a = set(shared)
    with leader_over(pool, files, seen_by_a, num_stages=2) as a, contextlib.ExitStack() as later:
        b_channels = ChannelPool(ChannelConfig("leader-b", pool.key))  # another caller: another leader
        later.callback(b_channels.close)
        with monkeypatch.context() as pinned:
            pinned.setattr(PlanOwner, "_choose_plan", lambda owner, previous, failed: a.owner.plan)
            b = later.enter_context(leader_over(pool, files, set(shared), num_stages=2, channels=b_channels))
        plan_id = b.owner.plan_id
        assert a.owner.plan_id == plan_id
        assert stream_chat(b)[0] == reference()
        replans_before, rows_before = all_failovers(b), shard_rows(pool)
        seen_by_a.add(spare)
        a.owner.recover(StageFailure(1, "stage_unreachable", "test: only leader A lost its link to stage 1"))
        assert a.owner.plan_id != plan_id
        wait_until(lambda: not a.owner._stale, timeout=15, message="leader A's Unloads of its old plan")
        assert {node for node, plan in shard_rows(pool) if plan == plan_id} >= set(stage_nodes(b))
        assert stream_chat(b)[0] == reference()
        assert all_failovers(b) == replans_before and b.owner.plan_id == plan_id
        rows_after = shard_rows(pool)  # the same stages served it: a reloaded one counts from 0
        for node in stage_nodes(b):
            assert rows_after[node, plan_id][0] > rows_before[node, plan_id][0]


def test_sigstop_is_detected_fails_over_and_the_node_serves_later_plans(pool, files, reference):
    nodes = pool.take(3)
    with leader_over(pool, files, set(nodes), num_stages=2, step_timeout_s=10.0) as live:
        stages = stage_nodes(live)
        [spare] = set(nodes) - set(stages)
        stopped = stages[1]
        stopped_at: list[float] = []

        def stop() -> None:
            os.kill(pool.process(stopped).pid, signal.SIGSTOP)
            stopped_at.append(time.monotonic())

        try:
            text, _ = stream_chat(live, on_token=at_token(KILL_AFTER, stop))
            assert text == reference()
            [recovery] = httpx.get(f"{live.url}/v1/cluster", timeout=10).json()["served"]["recent_failovers"]
            assert recovery["code"] == "pipeline_stalled" and recovery["stage_index"] == 1
            assert recovery["detect_s"] < 10.0  # within the configured deadline (its cap), in fact ~1.5 s
            assert live.metric("meshllm_stalls_total") == 1
            assert stage_nodes(live) == [stages[0], spare]
        finally:
            os.kill(pool.process(stopped).pid, signal.SIGCONT)
        wait_until(lambda: pool.answers_health_check(stopped), timeout=10, message="the node answers again")
        # Later plans may use it again: lose the spare, and the resumed node takes its place.
        text, _ = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, spare)))
        assert text == reference()
        assert stage_nodes(live) == [stages[0], stopped]
        assert health(live)[1]["num_failovers"] == 2


def test_seeded_sampling_across_a_failover_equals_the_undisturbed_run(pool, files, reference):
    nodes = pool.take(3)
    sampling = {"temperature": 0.8, "seed": 1234}
    with leader_over(pool, files, set(nodes), num_stages=2) as live:
        victim, rows_before = stage_nodes(live)[0], shard_rows(pool)
        text, _ = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, victim)), **sampling)
        assert text == reference(**sampling) and text != reference()
        assert failovers(live) == 1
        assert_carried_over_to(pool, live, {1}, rows_before)  # the stage after the dead first one kept its KV


@pytest.mark.parametrize("position, code", [("middle", "shard_corrupt"), ("last", "invalid_reply")])
def test_corrupt_activations_are_caught_and_the_sender_excluded(pool, files, reference, position, code):
    # Stages are ordered by node id, so the corrupt node (started now: the highest id so far)
    # lands where wanted: between two older nodes, or last.
    older = pool.take(2)
    corrupt = pool.spawn(env={FAULT_ENV: "corrupt@3"})
    stages = [older[0], corrupt] + ([pool.spawn()] if position == "middle" else [])
    visible = set(stages)
    with leader_over(pool, files, visible, num_stages=len(stages)) as live:
        assert stage_nodes(live) == stages
        visible.add(older[1])  # a spare joins the view
        rows_before = shard_rows(pool)
        text, _ = stream_chat(live)  # the fault comes on the 4th step: 3 tokens into the stream
        assert text == reference()
        assert live.metric("meshllm_failovers_total", {"code": code}) == 1
        assert live.metric("meshllm_shard_corruption_detected_total") == 1
        # The leader asked every stage to park what it held; the one after the excluded sender adopted it.
        assert_carried_over_to(pool, live, {2} if position == "middle" else set(), rows_before)
        assert corrupt not in stage_nodes(live) and older[1] in stage_nodes(live)
        assert pool.answers_health_check(corrupt)  # alive and well, yet excluded: it corrupts data
        assert stream_chat(live)[0] == reference()  # and stays excluded for the next request


def test_no_spare_and_no_fit_fails_clearly_until_a_node_joins(pool, files, reference):
    small = [pool.spawn(args=("--max-memory", SMALL_NODE)) for _ in range(2)]
    visible = set(small)
    with leader_over(pool, files, visible) as live:
        assert set(stage_nodes(live)) == set(small)  # two small nodes: the fewest that fit
        small = stage_nodes(live)  # in stage order: by node id as text ("node-10" before "node-9")
        with pytest.raises(openai.APIError) as error:
            stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, small[1])))
        assert "shard_unavailable" in str(error.value.body) and "missing" in str(error.value.body)
        status, body = health(live)
        assert status == 503 and body["status"] == "unavailable" and body["failed_node"] == small[1]
        assert body["missing_bytes"] > 0 and body["missing"].startswith("layers")
        assert live.metric("meshllm_serving_status", {"status": "unavailable"}) == 1
        with pytest.raises(openai.APIStatusError) as refused:  # a new request: a clear 503 at once
            live.client().chat.completions.create(model=live.backend.model_id, messages=MESSAGES, max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "shard_unavailable"
        visible.add(pool.spawn(args=("--max-memory", SMALL_NODE)))  # a node joins
        text, _ = stream_chat(live)
        assert text == reference()
        status, body = health(live)
        assert status == 200 and body["status"] == "ok" and set(s["node_id"] for s in body["stages"]) <= visible


def test_a_first_plan_keeps_to_num_stages(pool, files, reference):
    """Fewer nodes than --stages: no plan, and /health and requests say why (a clear 503), not a
    plan of fewer stages: that fallback is for the survivors of a failure (above)."""
    nodes = pool.take(2)
    with leader_over(pool, files, set(nodes), num_stages=3) as live:
        assert live.owner.plan is None
        status, body = health(live)
        assert status == 503 and "--stages 3 asks for more stages" in body["reason"], body
        with pytest.raises(openai.APIStatusError) as refused:
            live.client().chat.completions.create(model=live.backend.model_id, messages=MESSAGES, max_tokens=4)
        assert refused.value.status_code == 503 and refused.value.code == "shard_unavailable"


def test_fallback_local_serves_on_the_leader_when_no_plan_fits(pool, files, reference):
    """--fallback-local (the spec's fallback_to_local): the fleet loses the capacity for the model
    mid-stream, the model fits in the leader's own memory, so the leader runs it alone and the
    stream goes on, identical, with /health saying how it is served."""
    small = [pool.spawn(args=("--max-memory", SMALL_NODE)) for _ in range(2)]
    with leader_over(pool, files, set(small), fallback_local=True) as live:
        assert set(stage_nodes(live)) == set(small)
        small = stage_nodes(live)  # in stage order (see above)
        text, n = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, small[1])))
        assert text == reference() and n == MAX_TOKENS
        assert live.metric("meshllm_fallback_to_local_total") == 1
        assert live.owner.plan is None  # the whole model in the leader's process
        status, body = health(live)
        assert status == 200 and body["status"] == "ok" and "leader alone" in body["reason"]
        assert stream_chat(live)[0] == reference()  # later requests are served the same way


def test_a_stage_killed_between_requests_is_replaced_before_the_next_request(pool, files, reference):
    nodes = pool.take(3)
    with leader_over(pool, files, set(nodes), num_stages=2) as live:
        assert stream_chat(live)[0] == reference()
        assert failovers(live) == 0, "a failover before the kill: is a faulty node in the plan?"
        victim = stage_nodes(live)[1]
        kill(pool, victim)  # nothing in flight: only the leader's routine health checks can notice
        wait_until(lambda: failovers(live) == 1 and health(live)[0] == 200 and victim not in stage_nodes(live),
                   timeout=30, message="the idle leader re-planned around the dead stage")
        assert live.metric("meshllm_failovers_total", {"code": "stage_unreachable"}) == 1
        assert stream_chat(live)[0] == reference()


@pytest.mark.parametrize("position", ["last", "first"])
def test_an_idle_stage_killed_turns_health_degraded_at_once_and_is_replaced(pool, files, reference, position):
    """Idle, nothing in flight: the dead last stage breaks the chain of streams (stage 1's stream
    to it, then stage 0's to the leader, which stage 0 closes); a dead first stage breaks the
    leader's stream itself. That stream's end, not the next routine health check, must start the
    leader's failover, so the routine checks are set far apart here (10 s): only the stream's end
    can explain a detection within a second. Before that was wired up, health said ok for ~9 s
    here after the last stage's kill (with the default 2 s checks: up to ~3 s; ~20 ms now)."""
    nodes = pool.take(4)
    with leader_over(pool, files, set(nodes), num_stages=3,
                     failover=FailoverConfig(idle_probe_interval_s=10.0)) as live:
        assert stream_chat(live)[0] == reference()
        assert failovers(live) == 0, "a failover before the kill: is a faulty node in the plan?"
        stages = stage_nodes(live)
        victim = stages[-1 if position == "last" else 0]
        # Every change of health as it happens: a poll of /health could miss a degraded spell
        # shorter than its interval (with a spare holding the weights, a re-plan takes ~50 ms).
        reports: list[tuple[float, HealthReport]] = []
        live.owner.health.subscribe(lambda r: reports.append((time.monotonic(), r)))
        time.sleep(0.5)  # the request's streams settle: the leader is idle
        kill(pool, victim)
        killed_at = time.monotonic()
        wait_until(lambda: any(r.ok and victim not in {s.node_id for s in r.stages} for _, r in reports),
                   timeout=15, interval=0.02, message="a new plan without the dead stage")
        flipped_at, flipped = next((t, r) for t, r in reports if not r.ok)
        replanned_at = next(t for t, r in reports if r.ok and victim not in {s.node_id for s in r.stages})
        flipped_s, replanned_s = flipped_at - killed_at, replanned_at - killed_at
        print(f"idle kill of the {position} stage: health {flipped.status.value} after {flipped_s:.3f} s "
              f"({flipped.reason}), ok on a new plan after {replanned_s:.3f} s")
        assert flipped.status.value == "degraded" and flipped.failed_node == victim, flipped
        assert flipped_s < 1.0, f"health said ok for {flipped_s:.2f} s after the kill"
        assert replanned_s < 5.0, f"no new plan {replanned_s:.2f} s after the kill"
        assert live.metric("meshllm_failovers_total", {"code": "stage_unreachable"}) == 1
        served_at = time.monotonic()
        assert stream_chat(live)[0] == reference()
        print(f"the next request took {time.monotonic() - served_at:.2f} s")
        assert stage_nodes(live) == [n if n != victim else (set(nodes) - set(stages)).pop() for n in stages]


def test_kill_9_with_a_spare_keeps_the_stream_identical_in_the_default_kernels(pool, model_files):
    """Last in this module: the node it kills makes later spawns take ids past node-9, which sort
    before the others as text (the corrupt-activations test orders stages by them).

    Not batch-invariant (the default): the re-prefill computes the prompt in the chunks it first
    took and the generated tokens in decode-sized pieces, so the few-row kernels give the KV the
    bits it had (tests/engine/test_ggml_stage.py checks those bits; here, the stream). The
    reference is the same plan undisturbed, without a prefix cache (a hit computes the prompt's
    tail in other kernels). Random weights: near-ties everywhere."""
    nodes = pool.take(4)
    scheduler = replace(OPTIONS.scheduler, prefix_cache_blocks=0)
    with leader_over(pool, model_files["llama-gqa"], set(nodes), num_stages=3, dtype="auto", batch_invariant=False,
                     scheduler=scheduler) as live:
        undisturbed, n = stream_chat(live)
        assert n > KILL_AFTER + 8
        victim = stage_nodes(live)[1]
        text, _ = stream_chat(live, on_token=at_token(KILL_AFTER, lambda: kill(pool, victim)))
        assert failovers(live) == 1
        assert text == undisturbed
