"""Property-based fuzzing of every message a stage accepts, sent to real `meshllm node` processes
holding real aidreams layers (a 2-stage plan loaded by a real leader): StepRequests through a
long-lived Forward stream into stage 0 (token ids) and stage 1 (hidden states), and Load,
Release, Unload and Info calls. Every input gets one clear answer in bounded time (a reply with an error
code and message, or a gRPC status that names the problem, never UNKNOWN), the stream survives,
the next good request succeeds, and closing the stream leaves nothing behind on the stages.
Bounded: a few dozen examples each, no deadline."""

from __future__ import annotations

import itertools
import queue
import threading

import grpc
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.engine.sampler import SamplingParams
from meshllm.transport import codec, stage_convert
from meshllm.transport.protos import common_pb2, stage_pb2, stage_pb2_grpc
from meshllm.transport.token_mask import mask_to_bytes
from tests.cluster_fixtures import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.filterwarnings(
    "ignore:The given buffer is not writable")]

FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.function_scoped_fixture])
REPLY_TIMEOUT_S = 60.0
GOOD = SamplingParams(temperature=0.0, seed=1)
int32 = st.integers(-(1 << 31), (1 << 31) - 1)
uint64 = st.integers(0, (1 << 64) - 1)
small = st.integers(-2, 20)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)


def mostly(valid, wild):
    """Plausible values 4 times in 5, so examples get past the first check to the deeper ones."""
    return st.sampled_from([True, True, True, True, False]).flatmap(lambda plausible: valid if plausible else wild)


class RawStream:
    """One Forward stream to a stage, spoken to message by message."""

    def __init__(self, channel: grpc.Channel):
        self._requests: queue.Queue = queue.Queue()
        self._replies: queue.Queue = queue.Queue()
        self._call = stage_pb2_grpc.StageStub(channel).Forward(iter(self._requests.get, None))
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for reply in self._call:
                self._replies.put(reply)
        except grpc.RpcError as e:
            self._replies.put(e)
        self._replies.put(None)

    def ask(self, request: stage_pb2.StepRequest) -> stage_pb2.StepReply:
        self._requests.put(request)
        reply = self._replies.get(timeout=REPLY_TIMEOUT_S)  # a hang fails here
        assert isinstance(reply, stage_pb2.StepReply), f"the stream ended: {reply}"
        assert reply.step_id == request.step_id
        return reply

    def close(self) -> None:
        self._requests.put(None)
        while self._replies.get(timeout=REPLY_TIMEOUT_S) is not None:
            pass


@pytest.fixture(scope="module")
def target(cluster, model_files):
    """A real leader's 2-stage aidreams plan: stage 0 on node 0, stage 1 (the last) on node 1."""
    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    yield leader, files
    leader.close()


def tensors(stage: int, hidden: int):
    """Inputs a stage might get: consistent with the rows (token ids / finite hidden states), the
    wrong kind, non-finite, or any wire tensor at all."""

    @st.composite
    def draw_for(draw, rows: int) -> common_pb2.Tensor:
        kind = draw(st.sampled_from(["right", "right", "nan", "other", "any"]))
        if kind == "right" or kind == "nan":
            x = (torch.randint(0, 512, (rows,)) if stage == 0 else torch.randn(rows, hidden))
            if kind == "nan" and stage == 1 and rows:
                x[0, 0] = float("nan")
            if kind == "nan" and stage == 0 and rows:
                x[0] = draw(st.sampled_from([-1, 512, 1 << 40]))
            return codec.to_pb(x)
        if kind == "other":
            return codec.to_pb(torch.randn(rows, hidden) if stage == 0 else torch.randint(0, 512, (rows,)))
        shape = draw(st.lists(st.integers(-1, 70), max_size=3))
        dtype = draw(st.sampled_from(["float32", "float16", "bfloat16", "int64", "int32", "float64", "x"]))
        return common_pb2.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(max_size=512)))

    return draw_for


@st.composite
def step_requests(draw, plan_id: str, stage: int, hidden: int) -> stage_pb2.StepRequest:
    msg = stage_pb2.StepRequest(
        plan_id=draw(mostly(st.just(plan_id), st.sampled_from(["", "no-such-plan"]))), step_id=draw(uint64),
        block_size=draw(mostly(st.just(16), st.one_of(st.just(0), int32))))
    for _ in range(draw(st.integers(0, 3))):
        num_tokens = draw(mostly(st.integers(1, 8), st.one_of(st.integers(0, 70), int32)))
        draft = draw(mostly(st.lists(st.integers(0, 600), max_size=min(3, max(0, num_tokens - 1))),
                            st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=3)))
        scored = len(draft) + 1 if draft else draw(st.integers(0, 1))
        entry = msg.seqs.add(seq_id=draw(mostly(st.integers(1, 4), uint64)),
                             start=draw(mostly(st.sampled_from([0, 0, 4, 16, 32]), st.one_of(small, int32))),
                             num_tokens=num_tokens,
                             num_scored=draw(mostly(st.just(scored), st.one_of(st.integers(0, 3), int32))),
                             attach=draw(mostly(st.just([]), st.lists(st.one_of(st.integers(0, 3), uint64),
                                                                       max_size=2))),
                             draft=draft)
        if draw(mostly(st.just(entry.num_scored > 0), st.booleans())):
            entry.sampling.CopyFrom(stage_pb2.SamplingParams(
                temperature=draw(mostly(st.sampled_from([0.0, 0.7]), floats)),
                top_p=draw(mostly(st.just(1.0), floats)), seed=draw(uint64)))
            if draw(st.booleans()):
                entry.sampling.top_k = draw(mostly(st.integers(1, 600), int32))
            if draw(st.booleans()):
                entry.sampling.logprobs = draw(mostly(st.integers(0, 3), int32))
            if draw(st.booleans()):  # penalties, min_p and logit_bias (agent features)
                entry.sampling.min_p = draw(mostly(st.sampled_from([0.0, 0.1]), floats))
                entry.sampling.frequency_penalty = draw(mostly(st.sampled_from([0.0, 0.5]), floats))
                entry.sampling.repetition_penalty = draw(mostly(st.sampled_from([1.0, 1.3]), floats))
                bias = draw(st.lists(st.tuples(mostly(st.integers(0, 511), int32), floats), max_size=3))
                entry.sampling.bias_ids.extend(i for i, _ in bias)
                entry.sampling.bias_values.extend(v for _, v in bias)
        if draw(st.booleans()):
            ids = draw(st.lists(mostly(st.integers(0, 511), int32), max_size=4))
            entry.penalty_ids.extend(ids)
            entry.penalty_counts.extend(draw(st.lists(mostly(st.integers(0, 3), int32), min_size=len(ids),
                                                      max_size=len(ids) + draw(st.integers(0, 1)))))
        if draw(st.booleans()):
            masks = [mask_to_bytes(np.array(draw(st.lists(st.integers(-(1 << 31), (1 << 31) - 1), min_size=1,
                                                           max_size=20)), dtype=np.int32))
                     for _ in range(draw(mostly(st.just(entry.num_scored), st.integers(0, 3))) if entry.num_scored >= 0
                     else 0)]
            entry.allowed.extend(draw(mostly(st.just(masks), st.lists(st.binary(max_size=40), max_size=2))))
    rows = sum(max(0, e.num_tokens) for e in msg.seqs)
    msg.input.CopyFrom(draw(tensors(stage, hidden)(draw(mostly(st.just(min(rows, 80)), small.map(abs))))))
    msg.release.extend(draw(st.lists(st.one_of(st.integers(1, 4), uint64), max_size=3)))
    msg.evict.extend(draw(st.lists(uint64, max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        msg.publish.add(seq_id=draw(mostly(st.integers(1, 4), uint64)), first_block=draw(mostly(small, int32)),
                        hashes=draw(st.lists(uint64, max_size=3)))
    for _ in range(draw(st.integers(0, 2))):
        msg.timings.add(stage_index=draw(int32), compute_s=draw(floats), received_at=draw(floats),
                        sent_at=draw(floats))
    return stage_pb2.StepRequest.FromString(msg.SerializeToString())


_good_ids = itertools.count(1 << 40)


def good_step(plan_id: str, stage: int, hidden: int, previous: int | None) -> tuple[stage_pb2.StepRequest, int]:
    """A valid prefill of a fresh sequence (releasing the previous one), scored on the last stage."""
    seq_id = next(_good_ids)
    x = torch.tensor([1, 5, 9, 13]) if stage == 0 else torch.randn(4, hidden)
    msg = stage_pb2.StepRequest(plan_id=plan_id, step_id=seq_id, input=codec.to_pb(x), block_size=16,
                                release=[] if previous is None else [previous])
    msg.seqs.add(seq_id=seq_id, start=0, num_tokens=4, num_scored=1, sampling=stage_convert.sampling_to_pb(GOOD))
    return msg, seq_id


def shards_of(cluster, plan_id: str) -> list[stage_pb2.ShardState]:
    return [s for a, n in zip(cluster.local.addresses[:2], cluster.local.node_ids)
            for s in stage_pb2_grpc.StageStub(cluster.channels.get(a, n)).Info(stage_pb2.StageInfoRequest(),
                                                                              timeout=10).shards
            if s.plan_id == plan_id]


@pytest.mark.parametrize("stage", [0, 1])
def test_any_step_gets_one_clear_answer_the_stream_survives_and_leaves_nothing_behind(cluster, target, stage):
    leader, files = target
    plan_id, hidden = leader.transport.plan_id, files.config.hidden_size
    stream = RawStream(cluster.channels.get(cluster.local.addresses[stage], cluster.local.node_ids[stage]))
    previous: list[int | None] = [None]

    @FUZZ
    @given(step_requests(plan_id, stage, hidden))
    def answers_clearly(request):
        reply = stream.ask(request)
        if reply.error_code:
            assert reply.error_message and len(reply.error_code) < 40
            assert reply.error_code != "internal", reply.error_message  # a named error, not a crash
        good, previous[0] = good_step(plan_id, stage, hidden, previous[0])
        answer = stream.ask(good)
        assert not answer.error_code, answer.error_message
        assert [(t.seq_id, t.position) for t in answer.tokens] == [(previous[0], 4)]

    try:
        answers_clearly()
    finally:
        stream.close()
    # Everything the fuzzed and good steps left on the stages went with the stream (on stage 1 within
    # half a second: a stream from "the previous stage" ending with no word could be that stage's death).
    wait_until(lambda: [list(s.seq_ids) for s in shards_of(cluster, plan_id)] == [[], []], timeout=10,
               message="the stream's sequences to be freed")
    assert sum(s.num_prefix_blocks for s in shards_of(cluster, plan_id)) == 0
    tokens = [e.token_id for e in leader.generate(files.tokenizer.encode("Hello"), SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True)) if e.token_id is not None]
    assert len(tokens) == 3


CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION}


texts_or_node = st.sampled_from(["", "node-1", "nobody"])


@st.composite
def load_requests(draw, model_id: str, fingerprint: str) -> stage_pb2.LoadRequest:
    layer = mostly(st.integers(0, 4), st.one_of(st.just(-1), int32))
    return stage_pb2.LoadRequest(
        plan_id="fuzz-" + draw(st.text(max_size=10)),  # never the live plan's id: a Load replaces a plan
        model_id=draw(mostly(st.just(model_id), st.sampled_from(["", "x"]))),
        fingerprint=draw(mostly(st.just(fingerprint), st.just("0"))),
        num_layers=draw(mostly(st.just(4), layer)), first_layer=draw(layer), last_layer=draw(layer),
        dtype=draw(mostly(st.sampled_from(["float32", "bfloat16", "float16"]), st.sampled_from(["int8", ""]))),
        next_address=draw(st.sampled_from(["", "127.0.0.1:1", "nowhere"])), next_node_id=draw(texts_or_node),
        stage_index=draw(mostly(small, int32)),
        batch_invariant=draw(st.booleans()), quantization=draw(mostly(st.just(""), st.sampled_from(["int8", "int4"]))),
        **draw(mostly(st.just(dict(max_context=128, max_seqs=16, max_step_tokens=64, prefix_block_size=16,
                                   max_prefix_blocks=8)),
                      st.fixed_dictionaries({k: int32 for k in ("max_context", "max_seqs", "max_step_tokens",
                                                                "prefix_block_size", "max_prefix_blocks")}))))


def test_any_load_release_or_info_gets_an_answer_or_a_named_error(cluster, target):
    leader, files = target
    stub = stage_pb2_grpc.StageStub(cluster.channels.get(cluster.local.addresses[2], cluster.local.node_ids[2]))
    fingerprint = files.source.fingerprint()

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(load_requests(files.model_id, fingerprint), st.text(max_size=8), st.lists(uint64, max_size=4))
    def answers(load, plan_id, seq_ids):
        try:
            stub.Load(load, timeout=120)
        except grpc.RpcError as e:
            assert e.code() in CLEAR and e.details(), (e.code(), e.details())
        assert stub.Release(stage_pb2.ReleaseRequest(plan_id=plan_id, seq_ids=seq_ids), timeout=10).num_released == 0
        assert not stub.Unload(stage_pb2.UnloadRequest(plan_id="fuzz-unknown-" + plan_id), timeout=10).was_loaded
        stub.Unload(stage_pb2.UnloadRequest(plan_id=load.plan_id), timeout=10)  # whatever the Load left
        # An Info request carrying whatever fields (here the LoadRequest's, unknown to it) is answered.
        info_request = stage_pb2.StageInfoRequest.FromString(load.SerializeToString())
        assert stub.Info(info_request, timeout=10).max_streams > 0

    answers()
    # Every fuzzed plan was unloaded; the live plan's stage is untouched and still serves.
    assert not [s.plan_id for s in stub.Info(stage_pb2.StageInfoRequest(), timeout=10).shards
                if s.plan_id.startswith("fuzz-")]
    tokens = [e.token_id for e in leader.generate(files.tokenizer.encode("Hello"), SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True)) if e.token_id is not None]
    assert len(tokens) == 3
