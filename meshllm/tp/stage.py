"""A node's rank of a tensor-parallel stage, built when the leader loads the group.

Every rank gets the same LoadRequest but its own `tp.rank`. Each reads only its slices
(load_rank), then (join_rank) says so in the store rank 0's node hosts (tp/load_gate.py: a
rank whose Load failed fails the others' at once instead of leaving them in the rendezvous),
then joins the group; rank 0 becomes the stage the pipeline talks to (TensorParallelRunner),
the others mirror it (WorkerStage). Two calls, because only the first is memory-heavy: the
node serialises reads, not the (possibly minutes-long) wait for the other ranks.
`on_gone` runs once when the rank's group ends without an Unload (a rank failed, or
rank 0 went away): the node then drops the stage, so no rank outlives its group.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import Step
from meshllm.errors import BadRequest
from meshllm.model.decoder import Decoder
from meshllm.model.source import ModelFiles
from meshllm.tp.channel import CommandChannel
from meshllm.tp.group import GroupSpec, RankRole, join_group
from meshllm.tp.layers import shard_decoder
from meshllm.tp.load import load_rank_weights
from meshllm.tp.load_gate import LoadGate
from meshllm.tp.node_collective import NodeCollective
from meshllm.tp.runner import RankStage, TensorParallelRunner
from meshllm.tp.shard import ShardLayout
from meshllm.tp.worker import TensorParallelWorker

TP_RENDEZVOUS_TIMEOUT_S = 120.0  # after loading: how long ranks wait for the slowest to join


class WorkerStage(RankStage):
    """A non-zero rank as a loaded stage: the node reports its state, steps come only from rank 0."""

    def __init__(self, worker: TensorParallelWorker):
        self.worker = worker
        self.runner = worker.runner
        self.group_size = worker.collective.size

    def held_sequences(self) -> list[SeqId]:
        with self.worker.lock:
            return self.runner.held_sequences()

    def run(self, step: Step, owner=None, max_held=None):
        raise BadRequest(f"this node is rank {self.worker.collective.rank} of tensor-parallel group "
                         f"{self.worker.collective.name}: send its steps to rank 0")

    def release(self, seq_ids, owner=None) -> int:
        return 0  # rank 0 mirrors every release to its workers

    def release_owner(self, owner) -> tuple[int, int]:
        return 0, 0  # likewise when a stream ends

    def close(self) -> None:
        self.worker.collective.close()  # rank 0 sees the group fail at its next step or heartbeat
        self.worker.join(5)


@dataclass
class RankSlices:
    """A rank's slices in memory, its group not formed yet (see load_rank and join_rank)."""

    role: RankRole
    layout: ShardLayout
    decoder: Decoder
    gate: LoadGate


def load_rank(files: ModelFiles, role: RankRole, node: NodeCollective | None, first_layer: int, last_layer: int,
              dtype: torch.dtype, quantization: str | None, batch_invariant: bool,
              after_load: Callable[[], None] = lambda: None) -> RankSlices:
    """Read this rank's slices (nothing waits on other nodes here: the node runs this under its
    one-read-at-a-time lock, and join_rank, which waits for the slowest rank, outside it).

    `after_load` runs once the slices are in memory (fault injection may fail the Load there)."""
    if node is None:
        raise BadRequest("this node takes no part in tensor parallelism (no collective endpoint): start it with "
                         "--collective-port")
    layout = ShardLayout.of(files.config, role.rank, role.size)
    gate = LoadGate(role, node.store)  # first: a rank that cannot reach rank 0's store fails before loading
    decoder = load_rank_weights(files.source, files.config, layout, first_layer, last_layer, dtype, quantization,
                                batch_invariant)
    after_load()
    return RankSlices(role, layout, decoder, gate)


def join_rank(slices: RankSlices, node: NodeCollective, on_gone: Callable[[str], None],
              cancelled: Callable[[], bool] = lambda: False) -> TensorParallelRunner | WorkerStage:
    """Say this rank loaded, wait for every rank (up to TP_RENDEZVOUS_TIMEOUT_S), join the group and
    start it. `cancelled` ends the wait for the other ranks' loads early (the plan was unloaded)."""
    role = slices.role
    slices.gate.loaded()
    slices.gate.wait_for_all(TP_RENDEZVOUS_TIMEOUT_S, cancelled)
    spec = GroupSpec(role.group_id, role.rank, role.size, role.store_address, node.bind_host,
                     timeout_s=role.timeout_s, rendezvous_timeout_s=TP_RENDEZVOUS_TIMEOUT_S)
    collective = join_group(spec, node.store if role.rank == 0 else None)
    shard_decoder(slices.decoder, slices.layout, collective)
    runner = StageRunner(slices.decoder, samples=role.rank == 0)
    channel = CommandChannel(collective)
    if role.rank == 0:
        return TensorParallelRunner(runner, channel, on_failed=lambda e: on_gone(str(e)))
    worker = TensorParallelWorker(runner, channel, on_exit=on_gone, lock=threading.Lock())
    worker.start()
    return WorkerStage(worker)
