"""Rank targets for the group lifecycle tests (spawned processes import them by name)."""

from __future__ import annotations

import os
import threading
import time

import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import SeqWork, Step
from meshllm.errors import TensorParallelFailed
from meshllm.model.weights import SafetensorsSource
from meshllm.tp.channel import CommandChannel
from meshllm.tp.group import GroupSpec, join_group
from meshllm.tp.load import load_rank_decoder
from meshllm.tp.runner import TensorParallelRunner
from meshllm.tp.shard import ShardLayout
from meshllm.tp.worker import TensorParallelWorker

GREEDY = SamplingParams(temperature=0.0, seed=1)


def _rank_runner(rank: int, size: int, address: str, model_dir: str, group_id: str, timeout_s: float):
    source = SafetensorsSource(model_dir)
    collective = join_group(GroupSpec(group_id, rank, size, address, "127.0.0.1", timeout_s=timeout_s))
    decoder = load_rank_decoder(source, source.config(), ShardLayout.of(source.config(), rank, size), collective)
    return StageRunner(decoder, samples=rank == 0), CommandChannel(collective)


def decode_steps(runner, seq_id: int = 1):
    """A prefill step, then decode steps feeding back each sampled token, forever."""
    ids = torch.tensor([1, 5, 9, 14, 3], dtype=torch.int64)
    step_id, position = 1, 0
    while True:
        step = Step(step_id, (SeqWork(SeqId(seq_id), position, ids.numel(), 1, GREEDY),), ids)
        [token] = runner.run(step)
        yield token.token_id
        position += ids.numel()
        ids = torch.tensor([token.token_id])
        step_id += 1


def lifecycle_rank(rank: int, size: int, address: str, model_dir: str, mode: str, timeout_s: float, report) -> dict:
    """rank 0: a few steps, "ready", then idle ("idle": the test kills or stops us) or steps until
    its worker is killed ("steps"). Other ranks: mirror until the group ends, report when they exit."""
    runner, channel = _rank_runner(rank, size, address, model_dir, "life", timeout_s)
    if rank != 0:
        worker = TensorParallelWorker(runner, channel)
        worker.start()
        report("ready", os.getpid())
        worker.join()
        report("exited", (time.time(), worker.exit_reason))
        return {"threads": [t.name for t in threading.enumerate()]}
    failures: list[str] = []
    tp = TensorParallelRunner(runner, channel, on_failed=lambda e: failures.append(str(e)))
    steps = decode_steps(tp)
    tokens = [next(steps) for _ in range(3)]
    report("ready", os.getpid())
    if mode == "idle":
        while True:
            time.sleep(1)
    try:
        while True:
            tokens.append(next(steps))
    except TensorParallelFailed as e:
        failed_at, error = time.time(), str(e)
    started = time.perf_counter()
    try:
        tp.run(Step(99, (), torch.empty(0, dtype=torch.int64)))
        again = "no error"
    except TensorParallelFailed as e:
        again = f"{type(e).__name__} after {time.perf_counter() - started:.3f}s: {e}"
    return {"failed_at": failed_at, "error": error, "on_failed": failures, "again": again, "tokens": tokens}
