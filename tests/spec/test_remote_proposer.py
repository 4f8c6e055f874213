"""A proposer on another node: over real gRPC (the node server's authentication included), in
separate `meshllm node` processes with 1- and 2-stage verifier plans, late and dead proposers.
Greedy output is always identical to plain decoding."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import pytest

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import local_leader, new_leader, wait_for_fleet
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.transport import RemotePipeline
from meshllm.spec.draft_model import vocab_fingerprint
from meshllm.spec.drafter import SpecConfig
from meshllm.spec.factory import SpeculativeChoice, build_proposer
from meshllm.spec.ngram import NgramProposer
from meshllm.spec.proposer import ProposeRequest, ProposerError
from meshllm.spec.remote import RemoteProposer
from meshllm.spec.service import ProposerService, Served
from meshllm.transport.auth import generate_key, load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import proposer_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig
from tests.spec.conftest import EXACT, PROMPTS, TOKENIZER_FILES, SlowProposer
from tests.spec.test_speculative_identity import Counting, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def proposer_server():
    """A real gRPC server with the Proposer service: an n-gram proposer, and one that sleeps 0.3 s
    (stands in for an overloaded node: the sleep is the only thing not real)."""
    key = generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="proposer-node"))
    server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, ProposerService([
        Served(NgramProposer()), Served(_Renamed(SlowProposer(NgramProposer(), 0.3), "sleepy"))]))
    server.start()
    channels = ChannelPool(ChannelConfig("test-leader", key))
    try:
        yield channels.get(server.address, "proposer-node")
    finally:
        channels.close()
        server.stop()


@pytest.fixture
def proposer_node():
    """The same server as `proposer_server`, as a fleet would see it: a card and a channel pool."""
    from meshllm.cluster.card import Card, NodeId, Role, RoleOffer

    key = generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="proposer-node"))
    server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, ProposerService([
        Served(_Renamed(SlowProposer(NgramProposer(), 0.3), "sleepy"))]))
    server.start()
    card = Card(NodeId("proposer-node"), server.address, "linux-x86_64", "cpu", 1 << 30, 1 << 30, 10.0, 10.0,
                roles=(Role.STAGE, Role.PROPOSER), offers=(RoleOffer(Role.PROPOSER, "sleepy"),))
    channels = ChannelPool(ChannelConfig("test-leader", key))
    try:
        yield card, channels
    finally:
        channels.close()
        server.stop()


class _Renamed:
    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def propose(self, requests, cancelled=None):
        return self.inner.propose(requests)

    def release(self, seq_ids):
        self.inner.release(seq_ids)


def test_remote_ngram_answers_incrementally_and_resyncs(proposer_server):
    remote = RemoteProposer(proposer_server, "ngram", "test-node", deadline_s=5.0)
    s = SeqId(3)
    (draft,) = remote.propose([ProposeRequest(s, 0, (1, 2, 3, 1, 2), 3)])
    assert draft.tokens == (3, 1)  # a 2-token match drafts 2 tokens
    (draft,) = remote.propose([ProposeRequest(s, 6, (9,), 3)])  # rolled back after "3"; only 1 token sent
    assert draft.tokens == ()  # "9" never occurred before
    remote.release([s])
    (draft,) = remote.propose([ProposeRequest(s, 7, (1,), 3)])  # released: the node asks for everything
    assert draft.resync_from == 0


def test_a_sequence_past_the_draft_models_context_gets_no_draft_and_the_others_do():
    # One long sequence made the whole batched call fail (INVALID_ARGUMENT), and the leader then
    # left the proposer out: no drafts for any sequence.
    key = generate_key()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="proposer-node"))
    server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, ProposerService([
        Served(NgramProposer(), max_context=12)]))
    server.start()
    channels = ChannelPool(ChannelConfig("test-leader", key))
    try:
        remote = RemoteProposer(channels.get(server.address, "proposer-node"), "ngram", "test-node", deadline_s=5.0)
        short, long = SeqId(1), SeqId(2)
        drafts = remote.propose([ProposeRequest(long, 0, (1, 2, 3, 1, 2, 3, 1, 2, 3, 1), 3),
                                 ProposeRequest(short, 0, (1, 2, 3, 1, 2), 3)])
        assert [(d.seq_id, d.tokens) for d in drafts] == [(long, ()), (short, (3, 1))]  # in the order asked
    finally:
        channels.close()
        server.stop()


def test_a_late_remote_draft_is_dropped_at_its_deadline(proposer_server):
    remote = RemoteProposer(proposer_server, "sleepy", "test-node", deadline_s=0.05)
    started = time.perf_counter()
    with pytest.raises(ProposerError, match="DEADLINE_EXCEEDED"):
        remote.propose([ProposeRequest(SeqId(1), 0, (1, 2, 1), 2)])
    assert time.perf_counter() - started < 0.25  # not the channel's 10 s default


def test_late_remote_proposer_leaves_output_unchanged(proposer_server, aidreams_path):
    files = open_model(aidreams_path)
    prompts = [files.tokenizer.encode(p) for p in PROMPTS]
    expected = _reference(files, prompts)
    counts = Counting()
    leader = local_leader(files, EXACT, counts, RemoteProposer(proposer_server, "sleepy", "n", deadline_s=0.05))
    try:
        assert run_all(leader, prompts, GREEDY) == expected
    finally:
        leader.close()
    # Block calls miss their 50 ms deadline (the prompts' catch-up calls get deadlines sized for a
    # prefill, and make it): the leader saw them fail.
    assert counts.proposer_failures and all("DEADLINE_EXCEEDED" in e for e in counts.proposer_failures)


def _reference(files, prompts):
    leader = local_leader(files, EXACT)
    try:
        return run_all(leader, prompts, GREEDY)
    finally:
        leader.close()


@pytest.fixture(scope="module")
def long_context_draft(aidreams_path, tiny_model_dir):
    """A random-weight draft model with a 4096-token context and aidreams' tokenizer: aidreams
    holds only 128 tokens, too few for a prompt whose catch-up outlasts a block's deadline."""
    folder = tiny_model_dir("llama", seed=21, vocab_size=512, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096)
    for f in TOKENIZER_FILES:
        if not (folder / f).exists():
            shutil.copy(aidreams_path / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def cluster(aidreams_path, long_context_draft, tmp_path_factory):
    """Three node processes; each serves aidreams' layers and an aidreams draft model (int8), plus
    the long-context draft model (less throughput than aidreams: never placed unless pinned)."""
    local = LocalCluster(3, [aidreams_path], tmp_path_factory.mktemp("spec-cluster"),
                         extra_args=("--gossip-interval", "0.3", "--ttl", "3", "--draft-model", str(aidreams_path),
                                     "--draft-model", str(long_context_draft)),
                         threads_per_node=1)
    local.start(timeout_s=120)
    try:
        yield local
    finally:
        local.stop()


def _cluster_leader(local: LocalCluster, files, ranges, proposer, observer=None):
    key = load_key(local.key_file)
    channels = ChannelPool(ChannelConfig("spec-leader", key))
    stages = tuple(StageAssignment(f"node-{i}", local.addresses[i], a, b, 0, 0, 0) for i, (a, b) in enumerate(ranges))
    plan = Plan(files.model_id, files.source.fingerprint(), files.config.num_hidden_layers, EXACT.context_length,
                EXACT.max_batch, 4, 4, stages, 0.0, False)
    plan_id = deploy(plan, channels, EXACT.dtype, EXACT.batch_invariant)
    options = replace(EXACT, spec=SpecConfig(wait_for_drafts=True, max_wait_s=2.0))
    transport = RemotePipeline(channels.get(stages[0].address, stages[0].node_id), plan_id, len(stages))
    return new_leader(files, transport, options, observer, proposer), channels


@pytest.mark.parametrize("ranges", [[(0, 4)], [(0, 2), (2, 4)]], ids=["1-stage", "2-stage"])
def test_remote_draft_model_in_another_node_process(cluster, aidreams_path, ranges):
    files = open_model(aidreams_path)
    key = load_key(cluster.key_file)
    view = lambda: fetch_view(cluster.addresses[0], key)  # noqa: E731
    wait_for_fleet(view, files.source.fingerprint(), 3)
    prompts = [files.tokenizer.encode(p) for p in PROMPTS]
    expected = _reference(files, prompts)
    verifiers = frozenset(f"node-{i}" for i in range(len(ranges)))
    channels = ChannelPool(ChannelConfig("spec-proposer", key))
    proposer = build_proposer(SpeculativeChoice.parse("remote"), files, fleet_view=view, channels=channels,
                              verifier_nodes=verifiers)
    # Off the verifier's nodes, and the draft model rather than the n-gram proposer beside it.
    assert proposer.placement.node_id not in verifiers and proposer.placement.model_id == files.model_id
    counts = Counting()
    leader, stage_channels = _cluster_leader(cluster, files, ranges, proposer, counts)
    try:
        assert run_all(leader, prompts, GREEDY) == expected
    finally:
        leader.close()
        stage_channels.close()
        channels.close()
    assert counts.accepted > 0.5 * counts.drafted > 0
    # Failed calls only cost speed, so the output above cannot show them: a chained block once shared
    # a call with the block it continues, the node refused every such call, and only speed fell. A
    # block missing its 0.5 s deadline on this loaded machine is allowed; nothing else is.
    assert all("DEADLINE_EXCEEDED" in e for e in counts.proposer_failures), counts.proposer_failures


def test_a_long_prompt_catch_up_gets_a_deadline_sized_for_prefill(cluster, long_context_draft):
    """The first call for a sequence makes the proposer node prefill the whole prompt, which takes
    far longer than a block may: it gets a deadline sized for that prefill, so the draft is not
    dropped and the node not left out; the next block's call is held to the block deadline again."""
    from meshllm.spec.placement import ProposerWant
    from meshllm.spec.remote import CATCH_UP_CAP_S, ReplanningProposer

    files = open_model(long_context_draft)
    key = load_key(cluster.key_file)
    block_deadline_s = 0.05
    channels = ChannelPool(ChannelConfig("spec-catch-up", key))
    try:
        want = ProposerWant(vocab_fingerprint(files.tokenizer), model_id=files.model_id, node_id="node-0")
        proposer = ReplanningProposer(want, lambda: fetch_view(cluster.addresses[0], key), channels, block_deadline_s)
        prompt = tuple(3 + (i * 7919) % 500 for i in range(1000))
        started = time.perf_counter()
        (draft,) = proposer.propose([ProposeRequest(SeqId(1), 0, prompt, 4)])
        catch_up_s = time.perf_counter() - started
        # 1000 tokens through a 4-layer model: ~0.2 s on an idle core, ~1.2 s on this loaded machine.
        assert catch_up_s > block_deadline_s and len(draft.tokens) == 4 and not proposer.excluded, catch_up_s
        remote = proposer._current
        next_block = [ProposeRequest(SeqId(1), len(prompt) + 4, (draft.tokens[0],), 4)]
        assert remote.deadline_for(next_block) == block_deadline_s
        # The next prompt's deadline comes from the prefill rate just measured, with its margin.
        assert catch_up_s < remote.deadline_for([ProposeRequest(SeqId(2), 0, prompt, 4)]) <= CATCH_UP_CAP_S
    finally:
        channels.close()


def test_killed_proposer_node_generation_continues_and_replans(cluster, aidreams_path):
    """Runs last in this module: it kills node-2."""
    files = open_model(aidreams_path)
    key = load_key(cluster.key_file)
    view = lambda: fetch_view(cluster.addresses[0], key)  # noqa: E731
    wait_for_fleet(view, files.source.fingerprint(), 3)
    prompt = files.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)
    leader_ref = local_leader(files, EXACT)
    try:
        expected = [e.token_id for e in leader_ref.generate(prompt, params) if e.token_id is not None]
    finally:
        leader_ref.close()
    channels = ChannelPool(ChannelConfig("spec-proposer", key))
    placed = []
    proposer = build_proposer(SpeculativeChoice.parse("remote"), files, fleet_view=view, channels=channels,
                              verifier_nodes=frozenset({"node-0", "node-1"}), on_placed=placed.append)
    assert placed[-1].node_id == "node-2"
    leader, stage_channels = _cluster_leader(cluster, files, [(0, 2), (2, 4)], proposer)
    tokens = []
    try:
        for event in leader.generate(prompt, params):
            assert event.error is None, event.error
            if event.token_id is not None:
                tokens.append(event.token_id)
            if len(tokens) == 10:
                threading.Thread(target=cluster.processes[2].kill, daemon=True).start()
    finally:
        leader.close()
        stage_channels.close()
        channels.close()
    assert tokens == expected
    assert cluster.processes[2].poll() is not None
    assert len(placed) >= 2 and placed[-1].node_id in ("node-0", "node-1") and placed[-1].colocated


def test_a_proposer_left_out_for_lateness_is_placed_again_after_its_exclusion(proposer_node):
    """Two late calls in a row leave the only proposer out (plain decoding meanwhile), but not for
    good: a slow first call (a long prompt to catch up) must not end speculation for the leader."""
    from meshllm.spec.placement import ProposerWant
    from meshllm.spec.remote import EXCLUSION_S, ReplanningProposer

    card, channels = proposer_node
    now = [0.0]
    replanning = ReplanningProposer(ProposerWant(vocab="", model_id="sleepy"), lambda: [card], channels,
                                    deadline_s=0.05, clock=lambda: now[0])
    request = [ProposeRequest(SeqId(1), 0, (1, 2, 1), 2)]
    for _ in range(2):
        with pytest.raises(ProposerError, match="DEADLINE_EXCEEDED"):
            replanning.propose(request)
    assert "proposer-node" in replanning.excluded
    with pytest.raises(ProposerError, match="no proposer available"):
        replanning.propose(request)  # still left out: nothing else to place
    now[0] += EXCLUSION_S + 1
    replanning.deadline_s = 5.0  # the node is fast again (its catch-up is done)
    (draft,) = replanning.propose(request)
    assert draft.tokens == (2,) and not replanning.excluded  # a 1-token match drafts 1 token


class _CountingSleeper:
    name = "counting"

    def __init__(self):
        self.calls = []

    def propose(self, requests, cancelled=None):
        self.calls.append(tuple(r.seq_id for r in requests))
        time.sleep(0.3)
        return NgramProposer().propose(requests)

    def release(self, seq_ids):
        pass


def test_a_call_cancelled_while_queued_behind_another_is_not_drafted():
    """A leader chains a second call behind the one in flight, and cancels it when the verifier
    goes another way: the node, drafting one call at a time, skips it instead of spending a
    block's drafting on tokens nobody will use."""
    key = generate_key()
    counting = _CountingSleeper()
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="proposer-node"))
    server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, ProposerService([Served(counting)]))
    server.start()
    channels = ChannelPool(ChannelConfig("test-leader", key))
    try:
        remote = RemoteProposer(channels.get(server.address, "proposer-node"), "counting", "n", deadline_s=5.0)
        first = remote.send([ProposeRequest(SeqId(1), 0, (1, 2, 1), 2)])
        time.sleep(0.1)  # the first is being drafted
        queued = remote.send([ProposeRequest(SeqId(2), 0, (1, 2, 1), 2)])
        queued.cancel()
        assert remote.receive(first)[0].tokens == (2,)
        third = remote.send([ProposeRequest(SeqId(3), 0, (1, 2, 1), 2)])
        assert remote.receive(third)[0].tokens == (2,)
        assert counting.calls == [(SeqId(1),), (SeqId(3),)]
    finally:
        channels.close()
        server.stop()
