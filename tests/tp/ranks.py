"""Run the ranks of a tensor-parallel group as real processes (spawned, gloo on loopback).

`spawn_group` starts one process per rank running `target(rank, size, store_address, *args)`
and returns every rank's result; it bounds the time and kills leftover processes by pid.
The rank targets used by several tests live here too (spawned processes import them by name).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import torch

from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.weight_forms import prepare_for_cpu
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, new_leader
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.transport import LocalPipeline
from meshllm.spec.drafter import SpecConfig
from meshllm.spec.ngram import NgramProposer
from meshllm.tp.channel import DEFAULT_FRAME_WORDS, CommandChannel
from meshllm.tp.group import GroupSpec, StoreHost, join_group
from meshllm.tp.load import load_rank_decoder
from meshllm.tp.runner import TensorParallelRunner
from meshllm.tp.shard import ShardLayout
from meshllm.tp.worker import TensorParallelWorker

# Small chunks and blocks: prompts prefill in several chunks, share prefix blocks, and many
# sequences decode together, so the test covers what serving does.
OPTIONS = ServingOptions(context_length=128, max_batch=8, dtype="float32",
                         scheduler=SchedulerConfig(max_batched_tokens=48, prefill_chunk=16, prefix_block_size=8))
LOGIT_TOKENS = 24


def _entry(target: Callable, rank: int, size: int, address: str, args: tuple, pipe) -> None:
    torch.set_num_threads(1)

    def report(what: str, value: object = None) -> None:
        # Plain pickle: tensors sent as-is would be shared by file descriptor, gone once we exit.
        pipe.send((what, pickle.dumps(value)))

    try:
        takes_report = "report" in target.__code__.co_varnames
        report("ok", target(rank, size, address, *args, report=report) if takes_report
               else target(rank, size, address, *args))
    except BaseException as e:  # noqa: BLE001 - reported to the test process, which fails with it
        pipe.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class RankProcesses:
    """The ranks of one group as spawned processes around a store hosted in the test process.

    Each rank reports through its own pipe (no lock shared between ranks, so killing one rank
    cannot block another's reports)."""

    def __init__(self, size: int, target: Callable, args: tuple = ()):
        ctx = multiprocessing.get_context("spawn")
        # The store every rank meets at, hosted here as rank 0's node would host it: up before any rank.
        self.store = StoreHost("127.0.0.1")
        self.store.start()
        pipes = [ctx.Pipe(duplex=False) for _ in range(size)]
        self._readers = {reader: rank for rank, (reader, _) in enumerate(pipes)}
        self.processes = [ctx.Process(target=_entry, args=(target, r, size, self.store.endpoint, args, writer),
                                      daemon=True) for r, (_, writer) in enumerate(pipes)]
        self._early: list[tuple[int, str, object]] = []

    def __enter__(self) -> RankProcesses:
        for p in self.processes:
            p.start()
        return self

    def next(self, timeout_s: float) -> tuple[int, str, object]:
        """The next (rank, what, value) any rank reported; raises if a rank failed."""
        ready = multiprocessing.connection.wait(list(self._readers), timeout_s)
        if not ready:
            raise TimeoutError(f"no report from the ranks within {timeout_s:.0f}s")
        reader = ready[0]
        rank = self._readers[reader]
        try:
            what, value = reader.recv()
        except EOFError:  # the rank exited (or was killed) without a word more
            del self._readers[reader]
            return rank, "eof", None
        if what == "error":
            raise AssertionError(f"rank {rank}: {value}")
        return rank, what, pickle.loads(value)

    @property
    def pending(self) -> list[tuple[int, str, object]]:
        """Reports that arrived while waiting for another one."""
        return list(self._early)

    def expect(self, rank: int, what: str, timeout_s: float) -> object:
        for i, (got_rank, got_what, value) in enumerate(self._early):
            if (got_rank, got_what) == (rank, what):
                del self._early[i]
                return value
        deadline = time.monotonic() + timeout_s
        while True:
            got_rank, got_what, value = self.next(max(0.1, deadline - time.monotonic()))
            if (got_rank, got_what) == (rank, what):
                return value
            if got_what != "eof":
                self._early.append((got_rank, got_what, value))

    def __exit__(self, *exc) -> None:
        for p in self.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self.store.stop()


def spawn_group(size: int, target: Callable, args: tuple = (), timeout_s: float = 180.0) -> list:
    """Every rank's return value, in rank order; raises if a rank failed or time ran out."""
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    with RankProcesses(size, target, args) as ranks:
        while len(out) < size:
            rank, what, value = ranks.next(max(0.1, deadline - time.monotonic()))
            if what == "ok":
                out[rank] = value
            elif what == "eof" and rank not in out:
                raise AssertionError(f"rank {rank} exited without a result (exit code "
                                     f"{ranks.processes[rank].exitcode})")
    return [out[r] for r in range(size)]


def greedy_tokens(leader, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Submit every prompt at once (continuous batching) and collect each one's greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    tokens: list[list[int]] = [[] for _ in prompts]
    done = [queue.Queue() for _ in prompts]

    def on_event(i):
        def handle(event):
            if event.token_id is not None:
                tokens[i].append(event.token_id)
            if event.finish_reason is not None:
                done[i].put(event)
        return handle

    for i, prompt in enumerate(prompts):
        leader.submit(prompt, params, on_event(i))
    cached = 0
    for i, q in enumerate(done):
        event = q.get(timeout=120)
        assert event.finish_reason == "length", (i, event)
        cached += event.num_cached_tokens
    return tokens, cached


def reference_run(model_dir: str, prompts: list[list[int]], max_tokens: int, dtype: str = "float32",
                  quantization: str | None = None, batch_invariant: bool = False) -> dict:
    """The same checks in one process, without speculation: the single-process reference."""
    files = open_model(model_dir)
    torch_dtype = getattr(torch, dtype)
    decoder = prepare_for_cpu(load_decoder(files.source, files.config, dtype=torch_dtype), quantization,
                              batch_invariant)
    logits = decoder.forward_full(_logit_ids(files.config.vocab_size))
    options = replace(OPTIONS, batch_invariant=batch_invariant)
    leader = new_leader(files, LocalPipeline([StageRunner(decoder)]), options)
    try:
        tokens, cached = waves(leader, prompts, max_tokens)
    finally:
        leader.close()
    return {"logits": logits, "tokens": tokens, "cached": cached}


def waves(leader, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[list[int]]], list[int]]:
    """The prompts twice: the second wave reuses the prompt blocks the first one published.
    Returns each wave's tokens and its number of prompt tokens served from the prefix cache."""
    out = [greedy_tokens(leader, prompts, max_tokens) for _ in range(2)]
    return [tokens for tokens, _ in out], [cached for _, cached in out]


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except RuntimeError:  # a dict changed size under us: the loop thread is busy, try again
            pass
        time.sleep(0.02)
    raise TimeoutError("condition not met in time")


def _logit_ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (LOGIT_TOKENS,), generator=torch.Generator().manual_seed(3))


class VerifiedCount(LeaderObserver):
    def __init__(self):
        self.drafted = self.accepted = 0

    def on_verified(self, num_drafted: int, num_accepted: int) -> None:
        self.drafted += num_drafted
        self.accepted += num_accepted


def equality_rank(rank: int, size: int, address: str, cases: list[dict]) -> list[dict]:
    """Run every case in its own freshly formed group (one rendezvous each, on one store)."""
    return [equality_case(rank, size, address, f"case-{i}", **case) for i, case in enumerate(cases)]


def equality_case(rank: int, size: int, address: str, group_id: str, model_dir: str,
                  prompts: list[list[int]], max_tokens: int, split_at: int | None = None,
                  frame_words: int = DEFAULT_FRAME_WORDS,
                  dtype: str = "float32", quantization: str | None = None, speculative: bool = False) -> dict:
    """One rank: full-model logits in lockstep, then greedy generation through a Leader.

    With `split_at`, rank 0 also holds layers [0, split_at) as an ordinary first stage and the
    group is the second stage (hidden states cross the command channel). With `speculative`,
    the leader decodes with the n-gram proposer in batch-invariant mode: every verification step
    scores k+1 positions on every rank, and each rank rolls back its own KV of the rejected ones.
    """
    files = open_model(model_dir)
    config, torch_dtype = files.config, getattr(torch, dtype)
    layout = ShardLayout.of(config, rank, size)
    collective = join_group(GroupSpec(group_id, rank, size, address, "127.0.0.1"))
    whole = load_rank_decoder(files.source, config, layout, collective, dtype=torch_dtype,
                              quantization=quantization, batch_invariant=speculative)
    logits = whole.forward_full(_logit_ids(config.vocab_size))  # every rank in lockstep; rank 0 gets logits
    decoder = whole if split_at is None else load_rank_decoder(files.source, config, layout, collective, split_at,
                                                               dtype=torch_dtype, quantization=quantization,
                                                               batch_invariant=speculative)
    runner = StageRunner(decoder, samples=rank == 0)
    channel = CommandChannel(collective, frame_words)
    if rank == 0:
        tp = TensorParallelRunner(runner, channel)
        first = None if split_at is None else prepare_for_cpu(
            load_decoder(files.source, config, 0, split_at, torch_dtype), quantization, speculative)
        stages = [tp] if first is None else [StageRunner(first), tp]
        verified = VerifiedCount()
        # Drafts sent whenever the proposer has one (wait_for_drafts), not when the cost model
        # says they pay: fp32 rows are dear on a CPU, and the test is of the rollback they cause.
        options = replace(OPTIONS, batch_invariant=speculative,
                          spec=SpecConfig(wait_for_drafts=True) if speculative else OPTIONS.spec)
        leader = new_leader(files, LocalPipeline(stages), options,
                            observer=verified, proposer=NgramProposer() if speculative else None)
        try:
            tokens, cached = waves(leader, prompts, max_tokens)
            wait_until(lambda: not tp.held_sequences())  # the leader releases finished sequences in a step
        finally:
            leader.close()
            tp.close()
        layer = decoder.layers[0]
        forms = [type(layer.self_attn.qkv_proj).__name__, type(layer.self_attn.o_proj.inner).__name__]
        return {"logits": logits, "tokens": tokens, "cached": cached, "forms": forms,
                "drafted": verified.drafted, "accepted": verified.accepted,
                "held_after": (len(tp.held_sequences()), len(tp.prefix)),
                "bytes_read": files.source.num_bytes_read(), "all_reduces": collective.stats.num_all_reduce}
    worker = TensorParallelWorker(runner, channel)
    worker.start()
    assert worker.join(150), "worker did not stop after rank 0's shutdown"
    return {"exit": worker.exit_reason, "steps": worker.num_steps,
            "held_after": (len(runner.held_sequences()), len(runner.prefix)),
            "bytes_read": files.source.num_bytes_read()}
