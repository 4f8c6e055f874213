"""Pipelines of real node processes on loopback give the single-process output, token for token."""

from __future__ import annotations

import queue

import pytest
import torch

from meshllm.engine.sampler import SamplingParams
from meshllm.pipeline.cluster import local_leader
from tests.pipeline.conftest import OPTIONS

pytestmark = pytest.mark.slow

PROMPTS = ["Once upon a time", "The robot dreamed of", "In the quiet hum of the machine, a"]


def tokens(leader, prompt_ids, params) -> list[int]:
    return [e.token_id for e in leader.generate(prompt_ids, params) if e.token_id is not None]


@pytest.fixture(scope="module")
def references(model_files):
    """Single-process outputs (same options: batch-invariant fp32), computed once per model."""
    cache: dict = {}

    def get(name: str, prompt_ids: tuple[int, ...], params: SamplingParams) -> list[int]:
        key = (name, prompt_ids, params)
        if key not in cache:
            leader = local_leader(model_files[name], OPTIONS)
            try:
                cache[key] = tokens(leader, list(prompt_ids), params)
            finally:
                leader.close()
        return cache[key]

    return get


@pytest.mark.parametrize("name, ranges", [
    ("aidreams", [(0, 1), (1, 4)]),  # split after the first layer
    ("aidreams", [(0, 3), (3, 4)]),  # the last stage holds only the last layer
    ("aidreams", [(0, 2), (2, 4)]),
    ("aidreams", [(0, 1), (1, 3), (3, 4)]),
    ("qwen2", [(0, 2), (2, 4)]),
    ("qwen2", [(0, 1), (1, 2), (2, 4)]),
    ("llama-gqa", [(0, 4), (4, 5)]),
    ("llama-gqa", [(0, 1), (1, 3), (3, 5)]),
])
def test_greedy_output_matches_single_process(cluster, model_files, references, name, ranges):
    files = model_files[name]
    leader = cluster.leader(files, ranges)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    try:
        for prompt in PROMPTS:
            ids = files.tokenizer.encode(prompt)
            assert tokens(leader, ids, params) == references(name, tuple(ids), params), (name, ranges, prompt)
    finally:
        leader.close()


def test_seeded_sampling_matches_single_process(cluster, model_files, references):
    # Each draw is seeded by (seed, position), so sampling too is independent of where it runs.
    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    try:
        ids = files.tokenizer.encode(PROMPTS[0])
        assert tokens(leader, ids, params) == references("aidreams", tuple(ids), params)
    finally:
        leader.close()


def test_eight_concurrent_sequences_match_solo_runs(cluster, model_files, references):
    files = model_files["qwen2"]
    leader = cluster.leader(files, [(0, 1), (1, 3), (3, 4)])
    base = files.tokenizer.encode(" ".join(PROMPTS * 3))
    jobs = [(base[: 3 + 7 * i], 6 + 3 * i) for i in range(8)]  # prompts of 3..52 tokens, 6..27 new tokens
    try:
        streams = []
        for ids, max_tokens in jobs:  # all submitted before any finishes: they share micro-batches
            events: queue.Queue = queue.Queue()
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            leader.submit(ids, params, events.put)
            streams.append((ids, params, events))
        for ids, params, events in streams:
            out = []
            while True:
                event = events.get(timeout=120)
                if event.token_id is not None:
                    out.append(event.token_id)
                if event.finish_reason:
                    assert event.finish_reason == "length"
                    break
            assert out == references("qwen2", tuple(ids), params)
    finally:
        leader.close()


def test_stage_reports_what_it_holds_and_frees_released_sequences(cluster, model_files):
    from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    try:
        ids = files.tokenizer.encode(PROMPTS[1])
        tokens(leader, ids, SamplingParams(temperature=0.0, max_tokens=5))
        stubs = [stage_pb2_grpc.StageStub(cluster.channels.get(a, n))
                 for a, n in zip(cluster.local.addresses[:2], cluster.local.node_ids)]

        def held() -> int:
            return sum(len(s.seq_ids) for stub in stubs for s in stub.Info(stage_pb2.StageInfoRequest()).shards)

        from tests.cluster_fixtures import wait_until

        wait_until(lambda: held() == 0, timeout=10, message="finished sequences are released on every stage")
    finally:
        leader.close()


def test_corrupt_activations_are_refused_by_the_stage(cluster, model_files):
    """A stage receiving NaN hidden states answers shard_corrupt and keeps serving."""
    from meshllm.engine.step import SeqWork, Step
    from meshllm.pipeline.transport import next_step_id, RemotePipeline

    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    try:
        plan_id = leader.transport.plan_id
        to_stage_1 = RemotePipeline(cluster.channels.get(cluster.local.addresses[1], cluster.local.node_ids[1]),
                                    plan_id, 1)
        hidden = torch.full((3, files.config.hidden_size), float("nan"))
        bad = Step(next_step_id(), (SeqWork(999, 0, 3),), hidden)
        result = to_stage_1.submit(bad).result(timeout=30)
        assert result.error_code == "shard_corrupt" and "NaN" in result.error_message
        wrong_shape = Step(next_step_id(), (SeqWork(998, 0, 3),), torch.zeros(3, 7))
        assert to_stage_1.submit(wrong_shape).result(timeout=30).error_code == "shard_corrupt"
        to_stage_1.close()
        ids = files.tokenizer.encode(PROMPTS[0])
        assert len(tokens(leader, ids, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))) == 4
    finally:
        leader.close()


def test_load_refuses_other_weights_and_unknown_models(cluster, model_files):
    from dataclasses import replace

    from meshllm.cluster.placement import Plan, StageAssignment
    from meshllm.errors import ModelLoadError, WeightsMismatch
    from meshllm.pipeline.deploy import deploy

    files = model_files["aidreams"]
    stages = (StageAssignment("node-0", cluster.local.addresses[0], 0, 4, 0, 0, 0),)
    plan = Plan(files.model_id, "0" * 64, 4, 128, 1, 4, 4, stages, 0.0, False)
    with pytest.raises(WeightsMismatch, match="fingerprint"):
        deploy(plan, cluster.channels)  # a model of that name, but not those weights
    with pytest.raises(ModelLoadError, match="no model"):
        deploy(replace(plan, model_id="no-such-model"), cluster.channels)


def test_a_stalled_stage_fails_its_requests_clearly_and_the_pipeline_recovers(cluster, model_files):
    """SIGSTOP a real stage process: in-flight requests end with pipeline_stalled after the
    step timeout instead of hanging; after SIGCONT the same leader serves again."""
    import os
    import signal
    import time
    from dataclasses import replace

    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)], replace(OPTIONS, step_timeout_s=2.0))
    stage_1 = cluster.local.processes[1]
    ids = files.tokenizer.encode(PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    try:
        assert len(tokens(leader, ids, params)) == 8
        os.kill(stage_1.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            events = list(leader.generate(ids, params))
            assert events[-1].finish_reason == "error" and events[-1].error.code == "pipeline_stalled"
            assert time.monotonic() - started < 10
        finally:
            os.kill(stage_1.pid, signal.SIGCONT)
        assert len(tokens(leader, ids, params)) == 8
    finally:
        leader.close()


def test_a_prompt_outside_the_vocabulary_is_refused_and_the_leader_serves_on(cluster, model_files, references):
    """Token ids the model has no embedding for are the caller's error: refused at submit, before any
    stage sees them. They used to reach the first stage, which refused the step as corrupt input
    from its peer, and the request ended as a pipeline stall."""
    from meshllm.errors import BadRequest

    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)], OPTIONS)
    ids = files.tokenizer.encode(PROMPTS[0])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    vocab = files.config.vocab_size
    try:
        for bad in (vocab, -1):
            with pytest.raises(BadRequest, match=f"token id {bad} in the prompt is outside .* \\[0, {vocab}\\)"):
                list(leader.generate(ids + [bad], params))
        assert tokens(leader, ids, params) == references("aidreams", tuple(ids), params)
    finally:
        leader.close()


def test_plans_on_the_same_node_share_weights_and_unload_frees_them_last(cluster, model_files):
    """A re-plan gives a surviving node a new plan id for the layers it holds: it must reuse them."""
    from meshllm.cluster.placement import Plan, StageAssignment
    from meshllm.pipeline.deploy import load_requests
    from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

    files = model_files["llama-gqa"]
    stub = stage_pb2_grpc.StageStub(cluster.channels.get(cluster.local.addresses[2], "node-2"))

    def plan(next_node: str) -> Plan:  # the same range on node 2, followed by different nodes
        stages = (StageAssignment("node-2", cluster.local.addresses[2], 0, 3, 0, 0, 0),
                  StageAssignment(next_node, cluster.local.addresses[int(next_node[-1])], 3, 5, 0, 0, 0))
        return Plan(files.model_id, files.source.fingerprint(), 5, 128, 1, 4, 4, stages, 0.0, False)

    first, second = (load_requests(plan(n), "float32", True)[0].request for n in ("node-0", "node-1"))
    assert first.plan_id != second.plan_id
    assert not stub.Load(first, timeout=60).reused_weights
    reply = stub.Load(second, timeout=60)
    assert reply.reused_weights and reply.num_bytes_read == 0
    mine = [s for s in stub.Info(stage_pb2.StageInfoRequest()).shards if s.plan_id in (first.plan_id, second.plan_id)]
    assert len(mine) == 2 and mine[0].weight_bytes == mine[1].weight_bytes > 0
    assert stub.Unload(stage_pb2.UnloadRequest(plan_id=first.plan_id)).weight_bytes_freed == 0  # still shared
    unloaded = stub.Unload(stage_pb2.UnloadRequest(plan_id=second.plan_id))
    assert unloaded.was_loaded and unloaded.weight_bytes_freed == mine[0].weight_bytes
    assert not stub.Unload(stage_pb2.UnloadRequest(plan_id=second.plan_id)).was_loaded
    assert {s.plan_id for s in stub.Info(stage_pb2.StageInfoRequest()).shards}.isdisjoint(
        {first.plan_id, second.plan_id})
