"""Put a plan on the fleet: every stage loads its layer range, in parallel.

Called by the leader when it (re)plans. Loading is idempotent per plan id, so
two leaders that derive the same plan from the same view share the stages.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from meshllm.cluster.placement import Plan
from meshllm.engine.step_limits import (DEFAULT_PREFIX_BLOCKS, WIRE_MAX_CONTEXT, WIRE_MAX_SEQS,
                                         WIRE_MAX_STEP_TOKENS, StepLimits)
from meshllm.errors import BadRequest, MeshError, ModelLoadError, PeerUnreachable, ShardUnavailable, WeightsMismatch
from meshllm.transport import stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

LOAD_TIMEOUT_S = 600.0  # loading gigabytes from a slow disk takes minutes


class StageUnreachable(PeerUnreachable):
    """A node of the plan did not answer its Load: the planner should leave it out."""

    def __init__(self, message: str, node_id: str):
        super().__init__(message)
        self.node_id = node_id


def default_limits(plan: Plan) -> StepLimits:
    """Step limits from the plan alone (a caller that does not say what its leader sends): positions
    within its context, its batch of sequences, no step larger than all of them together, any block
    size and the default prefix budget. leader_for_plan sends the leader's exact limits."""
    return StepLimits(min(plan.context_length, WIRE_MAX_CONTEXT), min(plan.max_batch, WIRE_MAX_SEQS),
                      min(plan.context_length * plan.max_batch, WIRE_MAX_STEP_TOKENS), None, DEFAULT_PREFIX_BLOCKS)


def plan_id_of(plan: Plan, dtype: str, batch_invariant: bool, quantization: str | None = None,
               limits: StepLimits | None = None) -> str:
    """Same plan on any node -> same id, so stages recognise a plan they already hold. The limits
    are part of it: leaders with other limits must not share (and so reload) each other's stages."""
    limits = limits or default_limits(plan)
    parts = [plan.fingerprint, dtype, str(batch_invariant), quantization or "", repr(limits)] + [
        f"{s.node_id}@{s.address}:{s.first_layer}-{s.last_layer}" for s in plan.stages]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_requests(plan: Plan, dtype: str, batch_invariant: bool, quantization: str | None = None,
                  limits: StepLimits | None = None) -> list[stage_pb2.LoadRequest]:
    limits = limits or default_limits(plan)
    plan_id = plan_id_of(plan, dtype, batch_invariant, quantization, limits)
    requests = [stage_pb2.LoadRequest(
        plan_id=plan_id, model_id=plan.model_id, fingerprint=plan.fingerprint, num_layers=plan.num_layers,
        first_layer=s.first_layer, last_layer=s.last_layer, dtype=dtype,
        next_address=plan.stages[i + 1].address if i + 1 < len(plan.stages) else "",
        next_node_id=plan.stages[i + 1].node_id if i + 1 < len(plan.stages) else "",
        stage_index=i, batch_invariant=batch_invariant, quantization=quantization or "")
        for i, s in enumerate(plan.stages)]
    for request in requests:
        stage_convert.limits_to_pb(limits, request)
    return requests


def deploy(plan: Plan, channels: ChannelPool, dtype: str = "float32", batch_invariant: bool = False,
           quantization: str | None = None, limits: StepLimits | None = None) -> str:
    """Load every stage of `plan`; returns the plan id. Raises the first stage's error.

    `limits` are what the stages accept per step (the leader's scheduler within the plan); the
    default suits a leader with the default scheduler settings."""
    requests = load_requests(plan, dtype, batch_invariant, quantization, limits)

    def load(index: int) -> None:
        stage = plan.stages[index]
        stub = stage_pb2_grpc.StageStub(channels.get(stage.address, stage.node_id))
        for attempt in range(2):  # a connection the peer just closed (GOAWAY) reconnects on a retry
            try:
                stub.Load(requests[index], timeout=LOAD_TIMEOUT_S)
                return
            except grpc.RpcError as e:
                if attempt or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise _load_error(stage.node_id, stage.address, e) from None
                time.sleep(0.2)

    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        for future in [pool.submit(load, i) for i in range(len(requests))]:
            future.result()
    return requests[0].plan_id


def _load_error(node_id: str, address: str, e: grpc.RpcError) -> MeshError:
    details = e.details() or ""
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return WeightsMismatch(f"node {node_id} ({address}): {details}")
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return BadRequest(f"node {node_id} ({address}) refused the load: {details}")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ShardUnavailable(f"node {node_id} ({address}): {details}")
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StageUnreachable(f"node {node_id} at {address} is unreachable: {details}", node_id)
    return ModelLoadError(f"node {node_id} ({address}) could not load its layers: {details}")
