"""How a served model runs: its options, the leader over a transport, the in-process
pipeline, and the placement request for the fleet. plan_owner.py composes these into the
leader every cluster path (`meshllm generate --peer`, `serve`, `demo`) uses.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field


from meshllm.cluster.card import Card, WeightForm
from meshllm.cluster.placement import Plan, PlacementRequest, plan_placement
from meshllm.engine.dtypes import AUTO, DTYPE_BYTES, DTYPES, dtype_name
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.stage_weights import held_weight_bytes, load_stage_decoder
from meshllm.engine.step_limits import StepLimits
from meshllm.engine.weight_forms import QUANTIZATIONS as TP_QUANTIZATIONS  # what tensor-parallel ranks load (tp/load.py)
from meshllm.errors import BadRequest, PeerUnreachable, ShardUnavailable
from meshllm.model.source import ModelFiles
from meshllm.pipeline.deploy import deploy
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.failover import FailoverConfig, Replanner
from meshllm.pipeline.leader import Leader
from meshllm.pipeline.transport import LocalPipeline, RemotePipeline
from meshllm.spec.drafter import SpecConfig
from meshllm.spec.factory import SpeculativeChoice, build_proposer
from meshllm.spec.proposer import Proposer
from meshllm.transport.channels import ChannelPool

log = logging.getLogger(__name__)

TORCH_DTYPES = DTYPES  # the names tests and older callers import from here


@dataclass(frozen=True, slots=True)
class ServingOptions:
    context_length: int = 4096  # tokens per sequence the plan reserves KV for
    max_batch: int = 16  # sequences decoding at once
    num_stages: int | None = None  # None: the fewest stages that fit
    tensor_parallel: int | None = None  # nodes per stage: None decides by link speed, 1 never groups (--tp)
    dtype: str = AUTO  # dense weights, KV and activations on every stage; "auto" resolved (engine/dtypes.py)
    batch_invariant: bool = False  # same bits for a sequence whatever shares its batch (slower)
    quantization: str | None = None  # "int8" / "int4": quantize a 16/32-bit model's linears at load
    # No reply for this long is a stalled pipeline even if every stage answers health checks (the
    # cap of the deadline measured from step times, deadline.py).
    step_timeout_s: float = 30.0
    failover: FailoverConfig = field(default_factory=FailoverConfig)
    fallback_local: bool = False  # when no plan fits the fleet, run on the leader alone if the model fits here
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)  # speculative decoding, when a proposer is given
    device: str = "cpu"  # where the leader's own in-process stage runs (cpu, cuda[:N], mps)
    speculative: str | None = None  # "ngram" | "draft:MODEL" | "remote[:NODE]" (spec/factory.py); None: off

    def __post_init__(self):
        try:
            # aliases (bf16, fp32, ...) accepted; "auto" is the default for the mode
            object.__setattr__(self, "dtype", dtype_name(self.dtype, self.batch_invariant))
            groups_allowed(self.tensor_parallel, self.quantization)
        except BadRequest as error:
            raise ValueError(str(error)) from None

    def step_limits(self, max_context: int) -> StepLimits:
        """What the stages accept per step from a leader with these options (sent when loading)."""
        s = self.scheduler
        return StepLimits(max_context=max_context, max_seqs=self.max_batch, max_step_tokens=s.max_batched_tokens,
                          prefix_block_size=s.prefix_block_size, max_prefix_blocks=s.prefix_cache_blocks)

    def scheduler_config(self, max_context: int) -> SchedulerConfig:
        s = self.scheduler
        return SchedulerConfig(max_num_seqs=self.max_batch, max_batched_tokens=s.max_batched_tokens,
                               prefill_chunk=s.prefill_chunk, kv_budget_tokens=max_context * self.max_batch,
                               max_waiting=s.max_waiting, prefix_block_size=s.prefix_block_size,
                               prefix_cache_blocks=s.prefix_cache_blocks)


def context_of(files: ModelFiles, options: ServingOptions) -> int:
    return min(files.config.max_position_embeddings, options.context_length)


def new_leader(files: ModelFiles, transport, options: ServingOptions, observer: LeaderObserver | None = None,
               proposer: Proposer | None = None, replanner: Replanner | None = None) -> Leader:
    """A leader over `transport` (None: none yet, `replanner` finds one); with `proposer`, it decodes
    speculatively (spec/drafter.py)."""
    max_context = context_of(files, options)
    eos = set(files.tokenizer.eos_token_ids) | set(files.config.eos_token_ids)
    return Leader(transport, eos_token_ids=eos,
                  new_detokenizer=lambda context: files.tokenizer.decode_stream(context=context).step,
                  max_context=max_context, config=options.scheduler_config(max_context), observer=observer,
                  step_timeout_s=options.step_timeout_s, proposer=proposer, spec_config=options.spec,
                  vocab_size=files.config.vocab_size, replanner=replanner, failover=options.failover)


def local_transport(files: ModelFiles, options: ServingOptions) -> LocalPipeline:
    """The whole model as one in-process stage."""
    decoder = load_stage_decoder(files.source, files.config, dtype=TORCH_DTYPES[options.dtype],
                                 quantization=options.quantization, batch_invariant=options.batch_invariant,
                                 device=options.device)
    return LocalPipeline([StageRunner(decoder, prefix_capacity_blocks=options.scheduler.prefix_cache_blocks)])


def local_leader(files: ModelFiles, options: ServingOptions, observer: LeaderObserver | None = None,
                 proposer: Proposer | None = None) -> Leader:
    """The whole model in this process: the single-process reference and the no-peer mode."""
    if proposer is None and options.speculative is not None:
        proposer = build_proposer(SpeculativeChoice.parse(options.speculative), files)
    return new_leader(files, local_transport(files, options), options, observer, proposer)


def groups_allowed(tensor_parallel: int | None, quantization: str | None) -> int | None:
    """The --tp the planner may use. Tensor-parallel ranks load only TP_QUANTIZATIONS (tp/load.py):
    with another quantization it never groups nodes on its own, and an explicit --tp > 1 is refused
    (found by the ranks refusing their load, it read as a fleet without collective nodes and kept
    a healthy node out of plans for a minute)."""
    if quantization in (None, *TP_QUANTIZATIONS):
        return tensor_parallel
    if (tensor_parallel or 1) > 1:
        raise BadRequest(f"--quantize {quantization} does not run on tensor-parallel stages (they take "
                         f"{', '.join(TP_QUANTIZATIONS)} or none): use one of those, or --tp 1")
    return 1


def placement_request(files: ModelFiles, options: ServingOptions, leader_id: str = "") -> PlacementRequest:
    """`leader_id`: the planning leader's, as it names itself to the stages (PlacementRequest.leader_id)."""
    return PlacementRequest(model_id=files.model_id, fingerprint=files.source.fingerprint(),
                            config=files.config, context_length=context_of(files, options),
                            max_batch=options.max_batch, weight_dtype_bytes=DTYPE_BYTES[options.dtype],
                            kv_dtype_bytes=DTYPE_BYTES[options.dtype], num_stages=options.num_stages,
                            weight_bytes=held_weight_bytes(files.source, files.config, DTYPE_BYTES[options.dtype],
                                                           options.quantization, options.batch_invariant),
                            form=WeightForm(options.dtype, options.quantization or "", options.batch_invariant),
                            prefix_cache_tokens=options.scheduler.prefix_cache_blocks
                            * options.scheduler.prefix_block_size,
                            tensor_parallel=groups_allowed(options.tensor_parallel, options.quantization),
                            leader_id=leader_id)


def plan_for(files: ModelFiles, fleet: list[Card], options: ServingOptions, leader_id: str = "") -> Plan:
    return plan_placement(placement_request(files, options, leader_id), fleet)


def deploy_plan(files: ModelFiles, plan: Plan, channels: ChannelPool, options: ServingOptions) -> RemotePipeline:
    """Load `plan`'s stages, limited to what a leader with `options` sends, and open the stream to them."""
    plan_id = deploy(plan, channels, options.dtype, options.batch_invariant, options.quantization,
                     options.step_limits(context_of(files, options)), leader_id=channels.config.node_id)
    first = plan.stages[0]
    return RemotePipeline(channels.get(first.address, first.node_id), plan_id, len(plan.stages),
                          stage_names_of(plan), leader_id=channels.config.node_id)


def leader_for_plan(files: ModelFiles, plan: Plan, channels: ChannelPool, options: ServingOptions,
                    observer: LeaderObserver | None = None) -> Leader:
    """A leader on exactly `plan` (no re-planning): tests and benches that place stages by hand."""
    return new_leader(files, deploy_plan(files, plan, channels, options), options, observer)


def stage_names_of(plan: Plan) -> tuple[str, ...]:
    """How errors name each stage of `plan`: its node and address."""
    return tuple(f"{s.node_id} ({s.address})" for s in plan.stages)


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
