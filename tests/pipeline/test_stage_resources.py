"""Stage nodes (real `meshllm node` processes on loopback) own and bound what leaders leave
on them: a leader's stream that ends, however it ends, frees its KV and prefix blocks on every
stage; steps beyond the plan's limits are refused; the prefix store keeps the plan's budget;
streams beyond the advertised maximum are refused while gossip and health still answer."""

from __future__ import annotations

import json
import queue
import signal
import time
from dataclasses import replace

import grpc
import pytest
import torch

from meshllm.cluster.gossip import fetch_view
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.step import SeqWork, Step
from meshllm.pipeline.cluster import local_leader
from meshllm.pipeline.transport import RemotePipeline, next_step_id
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from tests.cluster_fixtures import wait_until
from tests.pipeline.conftest import OPTIONS
from tests.pipeline import leader_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

THREE = [(0, 1), (1, 3), (3, 4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def infos(cluster) -> list[stage_pb2.StageInfoReply]:
    """Every live stage node's answer."""
    local = cluster.local
    return [stage_pb2_grpc.StageStub(cluster.channels.get(a, n)).Info(stage_pb2.StageInfoRequest(), timeout=10)
            for a, n, p in zip(local.addresses, local.node_ids, local.processes) if p.poll() is None]


def held(cluster, plan_id: str | None = None) -> tuple[int, int]:
    """(sequences, prefix blocks) the stages hold, for one plan or all."""
    shards = [s for info in infos(cluster) for s in info.shards if plan_id in (None, s.plan_id)]
    return sum(len(s.seq_ids) for s in shards), sum(s.num_prefix_blocks for s in shards)


def test_closing_a_leader_frees_its_kv_and_prefix_blocks_on_every_stage_before_close_returns(cluster, model_files):
    files = model_files["aidreams"]
    leader = cluster.leader(files, THREE)
    plan_id = leader.transport.plan_id
    prefix = files.tokenizer.encode("In the quiet hum of the machine, a robot dreamed of electric sheep " * 2)
    assert len(prefix) > 2 * OPTIONS.scheduler.prefix_block_size
    events: queue.Queue = queue.Queue()
    for suffix in ([5], [6], [7]):
        list(leader.generate(prefix + suffix, GREEDY))
    leader.submit([8, 9, 10], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), events.put)
    while events.get(timeout=30).token_id is None:
        pass
    num_seqs, num_blocks = held(cluster, plan_id)
    assert num_seqs == 3 and num_blocks >= 3 * 2  # one running sequence and the prompt's blocks on each stage
    started = time.monotonic()
    leader.close()
    closed_s = time.monotonic() - started
    assert held(cluster, plan_id) == (0, 0)  # at once: no polling
    assert closed_s < 5
    last = None
    while not events.empty():
        last = events.get()
    assert last is not None and last.finish_reason == "error"  # the running request was told, not left hanging


def test_a_killed_leader_process_leaves_no_kv_behind(cluster, pipeline_models):
    """A leader in its own process, kill -9 mid-stream: the stages see its stream break and free it."""
    addresses = cluster.local.addresses
    process = leader_process.spawn(pipeline_models["qwen2"], cluster.local.key_file, 200, 3, addresses)
    try:
        line = json.loads(process.stdout.readline())
        assert line["generating"], line
        plan_id = line["plan_id"]
        assert held(cluster, plan_id)[0] == 3 * 3  # three sequences on each of three stages, mid-stream
        process.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        process.wait(timeout=10)
        wait_until(lambda: held(cluster, plan_id) == (0, 0), timeout=10, interval=0.02,
                   message="the stages to free a killed leader's KV")
        print(f"KV freed {time.monotonic() - killed_at:.3f} s after kill -9")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


def test_steps_beyond_the_plans_limits_are_refused_and_the_stream_goes_on(cluster, model_files):
    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    try:
        to_stage_0 = RemotePipeline(cluster.channels.get(cluster.local.addresses[0], cluster.local.node_ids[0]),
                                    leader.transport.plan_id, 1)
        context = OPTIONS.context_length
        too_far = Step(next_step_id(), (SeqWork(991, context - 2, 3),), torch.zeros(3, dtype=torch.int64))
        too_many = Step(next_step_id(), tuple(SeqWork(900 + i, 0, 1) for i in range(OPTIONS.max_batch + 1)),
                        torch.zeros(OPTIONS.max_batch + 1, dtype=torch.int64))
        too_long = Step(next_step_id(), (SeqWork(992, 0, 65),), torch.zeros(65, dtype=torch.int64))
        for step, match in ((too_far, "plan's context of 128"), (too_many, "plan's batch is 16"),
                            (too_long, "64 tokens, the plan's step limit")):
            result = to_stage_0.submit(step).result(timeout=30)
            assert result.error_code == "plan_limit_exceeded" and match in result.error_message, result
        ok = to_stage_0.submit(Step(next_step_id(), (SeqWork(993, 0, 3),), torch.tensor([1, 2, 3])))
        assert ok.result(timeout=30).ok  # the same stream keeps serving
        to_stage_0.close()
        assert held(cluster, leader.transport.plan_id)[0] == 0  # and its sequence went with it
        assert len([e for e in leader.generate(files.tokenizer.encode("Hi"), GREEDY) if e.token_id is not None]) == 6
    finally:
        leader.close()


def test_a_step_that_fails_on_one_stage_still_frees_what_it_releases_on_every_stage(cluster, model_files):
    """The leader counts a failed step's releases done: the stages after the one that failed it get
    them anyway, and the failed stage applies them even when the step failed before they ran."""
    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    plan_id = leader.transport.plan_id
    stream = RemotePipeline(cluster.channels.get(cluster.local.addresses[0], cluster.local.node_ids[0]), plan_id, 2)

    def step(*works, release=()):
        ids = torch.ones(sum(w.num_tokens for w in works), dtype=torch.int64)
        return stream.submit(Step(next_step_id(), works, ids, release)).result(timeout=30)

    def holding(seq_id):
        return [seq_id in s.seq_ids for info in infos(cluster) for s in info.shards if s.plan_id == plan_id]

    try:
        assert step(SeqWork(994, 0, 3), SeqWork(995, 0, 3)).ok
        assert holding(994) == holding(995) == [True, True]
        # Fails on stage 0 after its chores ran there (continues a sequence stage 0 never saw).
        failed = step(SeqWork(996, 5, 1), release=(994,))
        assert failed.error_code == "kv_missing" and failed.failed_stage == 0, failed
        assert step(SeqWork(997, 0, 1)).ok  # same stream, in order: stage 1 has had the chores by now
        assert holding(994) == [False, False]
        # Fails on stage 0 before anything ran (beyond the plan's context): chores applied anyway.
        too_far = step(SeqWork(998, OPTIONS.context_length - 1, 2), release=(995,))
        assert too_far.error_code == "plan_limit_exceeded", too_far
        assert step(SeqWork(999, 0, 1)).ok
        assert holding(995) == [False, False]
        stream.close()
        assert held(cluster, plan_id)[0] == 0
    finally:
        stream.close()
        leader.close()


def test_the_prefix_store_keeps_the_plans_block_budget(cluster, model_files):
    files = model_files["aidreams"]
    options = replace(OPTIONS, scheduler=replace(OPTIONS.scheduler, prefix_cache_blocks=4))
    leader = cluster.leader(files, [(0, 2), (2, 4)], options)
    try:
        for i in range(6):  # six distinct 2-block prompts: twelve blocks offered, four kept
            prompt = [3 + (i * 41 + j * 7) % 500 for j in range(2 * 16 + 1)]
            list(leader.generate(prompt, GREEDY))
        shards = [s for info in infos(cluster) for s in info.shards if s.plan_id == leader.transport.plan_id]
        assert [s.num_prefix_blocks for s in shards] == [4, 4]
        assert all(s.prefix_bytes > 0 for s in shards)
    finally:
        leader.close()


def test_streams_beyond_the_advertised_maximum_are_refused_while_gossip_and_health_answer(cluster, model_files):
    address = cluster.local.addresses[2]
    stub = stage_pb2_grpc.StageStub(cluster.channels.get(address, cluster.local.node_ids[2]))
    maximum = stub.Info(stage_pb2.StageInfoRequest(), timeout=10).max_streams
    assert maximum >= 8
    wait_until(lambda: stub.Info(stage_pb2.StageInfoRequest(), timeout=10).num_streams == 0, timeout=20,
               message="the earlier tests' streams to end")
    requests = [queue.Queue() for _ in range(maximum + 1)]
    calls = [stub.Forward(iter(q.get, None)) for q in requests[:maximum]]
    try:
        wait_until(lambda: stub.Info(stage_pb2.StageInfoRequest(), timeout=10).num_streams == maximum, timeout=20,
                   message="every idle stream to be accepted")
        extra = stub.Forward(iter(requests[-1].get, None))
        with pytest.raises(grpc.RpcError) as caught:
            next(extra)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"already serves {maximum} Forward streams" in caught.value.details()
        started = time.monotonic()
        view = fetch_view(address, cluster.key, timeout=5)  # gossip is not starved of threads
        assert time.monotonic() - started < 2 and view
        own = next(c for c in view if c.grpc_address == address)
        assert all(s.max_streams == maximum for s in own.shards)  # the card advertises what is accepted
        requests[0].put(None)  # one leader goes away: its slot frees
        wait_until(lambda: stub.Info(stage_pb2.StageInfoRequest(), timeout=10).num_streams == maximum - 1,
                   timeout=20, message="the closed stream's slot to free")
        again = queue.Queue()
        call = stub.Forward(iter(again.get, None))
        wait_until(lambda: stub.Info(stage_pb2.StageInfoRequest(), timeout=10).num_streams == maximum, timeout=20,
                   message="a new stream to be accepted")
        again.put(None)
        assert list(call) == []
    finally:
        for q in requests:
            q.put(None)
        for c in calls:
            c.cancel()


def test_after_the_stream_is_rebuilt_the_leader_forgets_the_freed_prefix_blocks(cluster, model_files):
    """The stages free a stream's prefix blocks when it ends (here: closed while idle, as a
    connection dropped by the network would be); the leader's next request must not attach them."""
    files = model_files["aidreams"]
    leader = cluster.leader(files, [(0, 2), (2, 4)])
    prompt = files.tokenizer.encode("In the quiet hum of the machine, a robot dreamed of electric sheep " * 2)
    try:
        list(leader.generate(prompt + [5], GREEDY))
        assert held(cluster, leader.transport.plan_id)[1] > 0  # its prompt blocks are on the stages
        leader.transport.close()  # the stream ends; the next step opens another
        assert held(cluster, leader.transport.plan_id) == (0, 0)
        events = list(leader.generate(prompt + [6], GREEDY))
        assert events[-1].finish_reason == "length", events[-1].error
        reference = local_leader(files, OPTIONS)
        try:
            expected = [e.token_id for e in reference.generate(prompt + [6], GREEDY) if e.token_id is not None]
        finally:
            reference.close()
        assert [e.token_id for e in events if e.token_id is not None] == expected
        assert events[-1].num_cached_tokens == 0  # recomputed, not attached
    finally:
        leader.close()


def test_a_broken_hop_ends_the_whole_chain_so_no_stage_keeps_half_of_it(model_files, pipeline_models, tmp_path):
    """kill -9 the last stage of three: stage 1 answers stage_unreachable naming stage 2 and ends its
    stream; stage 0 ends its own; the leader's requests fail at once and nothing stays on stages 0-1."""
    from meshllm.pipeline.local_cluster import LocalCluster
    from tests.pipeline.conftest import Cluster

    local = LocalCluster(3, [pipeline_models["aidreams"]], tmp_path, extra_args=("--gossip-interval", "0.3"),
                         threads_per_node=1)
    local.start(timeout_s=120)
    try:
        chain = Cluster(local)
        files = model_files["aidreams"]
        leader = chain.leader(files, THREE, replace(OPTIONS, step_timeout_s=60))
        events: queue.Queue = queue.Queue()
        leader.submit([8, 9, 10], SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True), events.put)
        while events.get(timeout=30).token_id is None:
            pass
        local.processes[2].kill()
        started = time.monotonic()
        # Reaped before `held` asks the live nodes: its sockets close before the process can be reaped.
        local.processes[2].wait(timeout=10)
        while (last := events.get(timeout=30)).finish_reason is None:
            pass
        assert last.finish_reason == "error" and "stage 2" in str(last.error) and "node-2" in str(last.error)
        assert time.monotonic() - started < 10  # not the 60 s step timeout
        wait_until(lambda: held(chain, leader.transport.plan_id) == (0, 0), timeout=10,
                   message="stages 0 and 1 to free the broken chain")
        leader.close()
    finally:
        local.stop()
