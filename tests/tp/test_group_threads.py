"""Group mechanics with both ranks as threads of this process (each its own gloo process group,
real sockets on loopback): framed commands over real broadcasts, heartbeats, the worker's
timeout on a silent rank 0, and teardown without leaks. Process deaths are in
test_group_lifecycle.py."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from meshllm.engine.kv_cache import Owner, SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import SeqWork, Step
from meshllm.errors import TensorParallelFailed
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder
from meshllm.tp.channel import CommandChannel
from meshllm.tp.command import Release, RunStep, worker_view
from meshllm.tp.group import GroupSpec, RankRole, StoreHost, join_group
from meshllm.tp.load_gate import LoadGate
from meshllm.tp.runner import TensorParallelRunner
from meshllm.tp.worker import TensorParallelWorker

TIMEOUT_S = 2.0
MARGIN_S = 5.0  # scheduling delays on a loaded 2-core machine
CONFIG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


def _pair(store: StoreHost, group_id: str, timeout_s: float = TIMEOUT_S):
    """Both ranks' collectives, joined concurrently (joining blocks until all ranks are in)."""
    specs = [GroupSpec(group_id, r, 2, store.endpoint, "127.0.0.1", timeout_s=timeout_s) for r in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda s: join_group(s, store if s.rank == 0 else None), specs))


def _runner(samples: bool) -> StageRunner:
    # Not tensor-parallel arithmetic (tests/tp/test_tp_equality.py covers that): a stand-in the
    # worker applies commands to; a 1-layer random decoder, the same on both "ranks".
    torch.manual_seed(0)
    return StageRunner(Decoder(CONFIG), samples=samples)


def test_commands_larger_than_a_frame_cross_real_broadcasts(store):
    c0, c1 = _pair(store, "frames")
    send, receive = CommandChannel(c0, frame_words=1024), CommandChannel(c1, frame_words=1024)
    x = torch.randn(300, 96)  # 115 KB of hidden states: 29 frames of 8 KiB
    step = Step(3, (SeqWork(SeqId(2**64 - 2), 0, 300, 1, SamplingParams(temperature=0.0, seed=9)),), x)
    commands = [RunStep(step), Release((SeqId(1), SeqId(2))), RunStep(Step(4, (), torch.empty(0)))]
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(lambda: [receive.receive(TIMEOUT_S) for _ in commands])
        for command in commands:
            send.send(command)
        received = got.result(timeout=30)
    assert torch.equal(received[0].step.input, x) and received[0].step.seqs == worker_view(step).seqs
    assert received[1] == commands[1] and received[2].step.seqs == ()
    c0.close()
    c1.close()


def test_a_silent_rank0_ends_its_worker_after_the_timeout(store):
    c0, c1 = _pair(store, "silent")
    exits = []
    worker = TensorParallelWorker(_runner(False), CommandChannel(c1), on_exit=exits.append)
    started = time.monotonic()
    worker.start()  # rank 0 never sends: no steps, no heartbeats
    assert worker.join(TIMEOUT_S + MARGIN_S)
    assert TIMEOUT_S - 0.5 <= time.monotonic() - started
    assert len(exits) == 1 and "rank 0 is gone" in exits[0] and "Timed out" in exits[0]
    c0.close()


def test_heartbeats_keep_an_idle_worker_then_shutdown_ends_it(store):
    c0, c1 = _pair(store, "beats")
    worker = TensorParallelWorker(_runner(False), CommandChannel(c1))
    worker.start()
    tp = TensorParallelRunner(_runner(True), CommandChannel(c0))
    time.sleep(3 * TIMEOUT_S)  # three timeouts without a step
    assert worker.running
    step = Step(1, (SeqWork(SeqId(5), 0, 3, 1, SamplingParams(temperature=0.0, seed=1)),),
                torch.tensor([1, 2, 3]))
    assert len(tp.run(step)) == 1
    tp.close()
    assert worker.join(MARGIN_S) and worker.exit_reason == "shutdown" and worker.num_steps == 1
    with pytest.raises(TensorParallelFailed, match="unloaded"):
        tp.run(step)


def test_a_group_closed_under_its_waiting_worker_is_a_quiet_shutdown(store, caplog):
    """What a rank-1 node's clean stop does: it closes its groups while their workers wait for
    rank 0. That is no failure: no error, no traceback (each group logged one)."""
    c0, c1 = _pair(store, "closed-under")
    worker = TensorParallelWorker(_runner(False), CommandChannel(c1))
    worker.start()
    time.sleep(0.3)  # waiting in receive
    c1.close()
    assert worker.join(MARGIN_S) and worker.exit_reason == "shutdown"
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text
    c0.close()


def test_forming_and_closing_groups_leaks_no_threads_or_sockets(store):
    def cycle(i: int) -> None:
        c0, c1 = _pair(store, f"cycle-{i}")
        worker = TensorParallelWorker(_runner(False), CommandChannel(c1))
        worker.start()
        tp = TensorParallelRunner(_runner(True), CommandChannel(c0))
        tp.release([SeqId(1)])
        tp.close()
        assert worker.join(MARGIN_S)
        tp._heartbeat.join(MARGIN_S)

    cycle(0)
    time.sleep(0.3)
    before = (len(os.listdir("/proc/self/fd")), threading.active_count())
    for i in range(1, 6):
        cycle(i)
    time.sleep(0.3)
    after = (len(os.listdir("/proc/self/fd")), threading.active_count())
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)


def test_a_rendezvous_waiting_for_a_stopped_rank_holds_up_no_other_use_of_the_store(store):
    # Rank 0's node hosts one store for every group it leads and every link probe it runs. A link
    # probe (or a group) whose peer was just SIGSTOPped waits out its whole rendezvous timeout (30 s
    # for a probe) inside the backend's constructor. A re-planned group forming on the same node
    # meanwhile (its load gate, its rendezvous) must not queue behind that wait: a TCPStore client
    # runs one operation at a time, so each user has its own connection (StoreHost.client).
    stuck_s = 8.0
    stuck = threading.Thread(target=_join_quietly, daemon=True, args=(
        GroupSpec("probe/stopped-peer", 0, 2, store.endpoint, "127.0.0.1", rendezvous_timeout_s=stuck_s), store))
    stuck.start()
    time.sleep(0.5)  # inside the rendezvous, waiting for rank 1's address
    assert stuck.is_alive()
    started = time.monotonic()
    gates = [LoadGate(role, store) for role in (RankRole(r, 2, store.endpoint, "replanned") for r in (0, 1))]
    for gate in gates:
        gate.loaded()
    gates[0].wait_for_all(5)
    c0, c1 = _pair(store, "replanned")
    formed_s = time.monotonic() - started
    with ThreadPoolExecutor(2) as pool:
        sums = list(pool.map(lambda c: c.all_reduce(torch.ones(4)), (c0, c1)))
    assert all(torch.equal(t, torch.full((4,), 2.0)) for t in sums)
    c0.close()
    c1.close()
    assert formed_s < 2.0, f"the new group formed {formed_s:.1f}s after the stuck rendezvous began"
    stuck.join(stuck_s + MARGIN_S)


def _join_quietly(spec: GroupSpec, store: StoreHost) -> None:
    try:
        join_group(spec, store).close()
    except TensorParallelFailed:
        pass  # the rendezvous timed out: the silent peer never came


def test_after_its_group_failed_rank0_frees_its_own_state_without_raising(store):
    # A Forward stream that ends (or an Unload) after the group failed releases rank 0's KV: the
    # workers left with the group, so nothing is sent and nothing raises (the stream's pump must
    # still end its gRPC call, the Unload must answer).
    c0, c1 = _pair(store, "failed-then-freed")
    failures = []
    tp = TensorParallelRunner(_runner(True), CommandChannel(c0), on_failed=failures.append)
    step = Step(1, (SeqWork(SeqId(5), 0, 3, 1, SamplingParams(temperature=0.0, seed=1)),), torch.tensor([1, 2, 3]))
    c1.close()  # the worker rank is gone
    with pytest.raises(TensorParallelFailed):
        tp.run(step)
    assert tp.failed and len(failures) == 1
    assert tp.release([SeqId(5)]) == 0
    assert tp.release_owner(Owner(7)) == (0, 0)
    tp.close()
    assert tp.release_owner(Owner(7)) == (0, 0)
