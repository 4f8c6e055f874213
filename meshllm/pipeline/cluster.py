"""Compose a Leader over the live fleet: plan the model, load the stages, open the stream.

Used by `meshllm generate --peer`, `meshllm serve` and `meshllm demo`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from meshllm.cluster.card import Card
from meshllm.cluster.placement import Plan, PlacementRequest, plan_placement
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.stage_weights import held_weight_bytes, load_stage_decoder
from meshllm.errors import PeerUnreachable, ShardUnavailable
from meshllm.model.source import ModelFiles
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.leader import Leader
from meshllm.pipeline.transport import LocalPipeline, RemotePipeline
from meshllm.transport.channels import ChannelPool

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class ServingOptions:
    context_length: int = 4096  # tokens per sequence the plan reserves KV for
    max_batch: int = 16  # sequences decoding at once
    num_stages: int | None = None  # None: the fewest stages that fit
    dtype: str = "float32"  # weights and activations on every stage
    batch_invariant: bool = False  # same bits for a sequence whatever shares its batch (slower)
    quantization: str | None = None  # "int8" / "int4": quantize a 16/32-bit model's linears at load
    step_timeout_s: float = 120.0  # a micro-batch unanswered this long fails its sequences (stalled stage)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")

    def scheduler_config(self, max_context: int) -> SchedulerConfig:
        s = self.scheduler
        return SchedulerConfig(max_num_seqs=self.max_batch, max_batched_tokens=s.max_batched_tokens,
                               prefill_chunk=s.prefill_chunk, kv_budget_tokens=max_context * self.max_batch,
                               max_waiting=s.max_waiting, prefix_block_size=s.prefix_block_size,
                               prefix_cache_blocks=s.prefix_cache_blocks)


def context_of(files: ModelFiles, options: ServingOptions) -> int:
    return min(files.config.max_position_embeddings, options.context_length)


def new_leader(files: ModelFiles, transport, options: ServingOptions,
               observer: LeaderObserver | None = None) -> Leader:
    max_context = context_of(files, options)
    eos = set(files.tokenizer.eos_token_ids) | set(files.config.eos_token_ids)
    return Leader(transport, eos_token_ids=eos, new_detokenizer=lambda: files.tokenizer.decode_stream().step,
                  max_context=max_context, config=options.scheduler_config(max_context), observer=observer,
                  step_timeout_s=options.step_timeout_s)


def local_leader(files: ModelFiles, options: ServingOptions, observer: LeaderObserver | None = None) -> Leader:
    """The whole model in this process: the single-process reference and the no-peer mode."""
    decoder = load_stage_decoder(files.source, files.config, dtype=TORCH_DTYPES[options.dtype],
                                 quantization=options.quantization, batch_invariant=options.batch_invariant)
    return new_leader(files, LocalPipeline([StageRunner(decoder)]), options, observer)


def plan_for(files: ModelFiles, fleet: list[Card], options: ServingOptions) -> Plan:
    request = PlacementRequest(model_id=files.model_id, fingerprint=files.source.fingerprint(),
                               config=files.config, context_length=context_of(files, options),
                               max_batch=options.max_batch, weight_dtype_bytes=DTYPE_BYTES[options.dtype],
                               kv_dtype_bytes=DTYPE_BYTES[options.dtype], num_stages=options.num_stages,
                               weight_bytes=held_weight_bytes(files.source, files.config, DTYPE_BYTES[options.dtype],
                                                              options.quantization))
    return plan_placement(request, fleet)


def cluster_leader(files: ModelFiles, fleet: list[Card], channels: ChannelPool, options: ServingOptions,
                   observer: LeaderObserver | None = None) -> tuple[Leader, Plan]:
    plan = plan_for(files, fleet, options)
    log.info("plan for %s: %s", files.model_id,
             ", ".join(f"{s.node_id}[{s.first_layer},{s.last_layer})" for s in plan.stages))
    plan_id = deploy(plan, channels, options.dtype, options.batch_invariant, options.quantization)
    first = plan.stages[0]
    transport = RemotePipeline(channels.get(first.address, first.node_id), plan_id, len(plan.stages))
    return new_leader(files, transport, options, observer), plan


def wait_for_fleet(fetch: Callable[[], list[Card]], fingerprint: str, min_nodes: int,
                   timeout_s: float = 60.0) -> list[Card]:
    """Poll the fleet view until `min_nodes` nodes advertise the model (gossip and the
    nodes' model scans take a moment after start-up)."""
    deadline = time.monotonic() + timeout_s
    fleet: list[Card] = []
    while True:
        try:
            fleet = fetch()
        except PeerUnreachable:
            fleet = []
        ready = [c for c in fleet if any(m.fingerprint == fingerprint for m in c.models)]
        if len(ready) >= min_nodes:
            return fleet
        if time.monotonic() > deadline:
            raise ShardUnavailable(f"after {timeout_s:.0f}s only {len(ready)} of {min_nodes} nodes advertise "
                                   f"the model (fingerprint {fingerprint[:12]}); are they started with --models?")
        time.sleep(0.2)
