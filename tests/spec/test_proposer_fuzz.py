"""Property-based fuzzing of every message the Proposer service accepts (Propose, Info), sent over
real gRPC (the node server, its authentication included) to a service holding the n-gram proposer
and the real aidreams weights as a draft model (what `meshllm node --draft-model` serves). Every
input gets a reply or a gRPC status that names the problem (never UNKNOWN: an uncaught exception),
within a bound, and the next good request on the same service succeeds. Bounded: 40 examples."""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.spec.factory import served_proposers
from meshllm.spec.service import ProposerService
from meshllm.transport.auth import generate_key
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.protos import proposer_pb2, proposer_pb2_grpc
from meshllm.transport.server import NodeServer, ServerConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CALL_TIMEOUT_S = 30.0  # a hang fails here
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}
int32 = st.integers(-(1 << 31), (1 << 31) - 1)
int64 = st.integers(-(1 << 63), (1 << 63) - 1)
uint64 = st.integers(0, (1 << 64) - 1)
floats = st.floats(allow_nan=True, allow_infinity=True)


def mostly(valid, wild):
    """Plausible values 4 times in 5, so examples get past the first check to the deeper ones."""
    return st.sampled_from([True, True, True, True, False]).flatmap(lambda plausible: valid if plausible else wild)


@pytest.fixture(scope="module")
def proposer(aidreams_path):
    key = generate_key()
    service = ProposerService(served_proposers([aidreams_path], 10.0))
    server = NodeServer(ServerConfig("127.0.0.1", 0, key, node_id="proposer-node"))
    server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, service)
    server.start()
    channels = ChannelPool(ChannelConfig("fuzz-leader", key))
    try:
        yield proposer_pb2_grpc.ProposerStub(channels.get(server.address, "proposer-node")), sorted(service.served)
    finally:
        channels.close()
        server.stop()


@st.composite
def propose_requests(draw, names: list[str]) -> proposer_pb2.ProposeRequest:
    msg = proposer_pb2.ProposeRequest(model_id=draw(mostly(st.sampled_from(names), st.sampled_from(["", "x", "ngram "]))),
                                      release=draw(st.lists(mostly(st.integers(1, 6), uint64), max_size=3)))
    for _ in range(draw(st.integers(0, 3))):
        entry = msg.entries.add(
            seq_id=draw(mostly(st.integers(1, 6), uint64)),
            position=draw(mostly(st.sampled_from([0, 0, 3, 10, 120]), int32)),
            tokens=draw(mostly(st.lists(st.integers(0, 511), max_size=40),
                               # or past the draft model's 128 positions (found hanging the node before)
                               st.one_of(st.lists(st.one_of(int64, st.sampled_from([512, -1, 1 << 40])), max_size=5),
                                         st.integers(100, 20000).map(lambda n: [i % 500 for i in range(n)])))),
            k=draw(mostly(st.integers(0, 8), st.one_of(st.integers(0, 64), int32))))
        if draw(st.booleans()):
            entry.sampling.CopyFrom(proposer_pb2.DraftSampling(
                temperature=draw(mostly(st.sampled_from([0.5, 1.0]), floats)), seed=draw(uint64),
                support=draw(mostly(st.integers(1, 16), int32))))
    return proposer_pb2.ProposeRequest.FromString(msg.SerializeToString())


_good_ids = itertools.count(1 << 40)


def test_any_propose_or_info_gets_a_reply_or_a_named_error_and_the_next_good_one_succeeds(proposer):
    stub, names = proposer
    assert len(names) == 2 and "ngram" in names  # n-gram and the draft model
    good_tokens = (1, 5, 9, 13, 1, 5, 9)

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(propose_requests(names))
    def answers(request):
        try:
            reply = stub.Propose(request, timeout=CALL_TIMEOUT_S)
            assert [d.seq_id for d in reply.drafts] == [e.seq_id for e in request.entries]
            for d, e in zip(reply.drafts, request.entries):
                assert len(d.tokens) <= e.k
        except grpc.RpcError as e:
            assert e.code() in CLEAR and e.details(), (e.code(), e.details())
        # Info with whatever fields (here the ProposeRequest's, unknown to it) is answered.
        info = stub.Info(proposer_pb2.ProposerInfoRequest.FromString(request.SerializeToString()),
                         timeout=CALL_TIMEOUT_S)
        assert sorted(o.model_id for o in info.offers) == names
        for name in names:  # the next good request, on every proposer
            seq_id = next(_good_ids)
            good = proposer_pb2.ProposeRequest(model_id=name, entries=[proposer_pb2.ProposeEntry(
                seq_id=seq_id, position=0, tokens=good_tokens, k=2)], release=[seq_id - 1])
            (draft,) = stub.Propose(good, timeout=CALL_TIMEOUT_S).drafts
            assert draft.seq_id == seq_id and not draft.HasField("resync_from") and len(draft.tokens) <= 2
            if name == "ngram":
                assert list(draft.tokens) == [13, 1]  # the repeat continues

    answers()
