"""Put a plan on the fleet: every stage loads its layer range, in parallel.

Called by the leader when it (re)plans. Loading is idempotent per plan id, so
two leaders that derive the same plan from the same view share the stages. Every
rank of a tensor-parallel stage gets the stage's request with its own rank and a
group id fresh for this deploy (the rendezvous' key prefix in rank 0's store). A rank whose
Load fails fails its whole group's in seconds (tp/load_gate.py): its node tells the other
ranks, and so does this leader when the node did not answer at all; deploy then raises
that rank's error (RankLoadFailed, naming the node), not the others' aborts.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import grpc

from meshllm.cluster.placement import Plan
from meshllm.engine.step_limits import (DEFAULT_PREFIX_BLOCKS, WIRE_MAX_CONTEXT, WIRE_MAX_SEQS,
                                         WIRE_MAX_STEP_TOKENS, StepLimits)
from meshllm.errors import (BadRequest, MeshError, ModelLoadError, PeerUnreachable, ShardUnavailable,
                            TensorParallelAborted, TensorParallelFailed, WeightsMismatch)
from meshllm.tp.group import RankRole
from meshllm.tp.load_gate import report_failure
from meshllm.transport import stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.stage_convert import rank_role_to_pb
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

LOAD_TIMEOUT_S = 600.0  # loading gigabytes from a slow disk takes minutes


class StageUnreachable(PeerUnreachable):
    """A node of the plan did not answer its Load: the planner should leave it out."""

    def __init__(self, message: str, node_id: str):
        super().__init__(message)
        self.node_id = node_id


class LoadRefused(ShardUnavailable):
    """A node refused its Load for memory (its card said more was free than its own check found: a
    card older than a Load elsewhere, or KV other leaders' plans reserve there): the planner should
    leave it out for a while."""

    def __init__(self, message: str, node_id: str, *, missing_bytes: int | None = None, part: str | None = None):
        super().__init__(message, missing_bytes=missing_bytes, part=part)
        self.node_id = node_id


class RankLoadFailed(TensorParallelFailed):
    """One rank of a tensor-parallel stage failed its Load (its node answered): the group cannot
    form with it; the planner should leave that node out."""

    def __init__(self, message: str, node_id: str, cause: MeshError):
        super().__init__(message)
        self.node_id = node_id
        self.cause = cause


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """One node's Load of a plan: a stage, or one rank of a tensor-parallel stage."""

    node_id: str
    address: str
    request: stage_pb2.LoadRequest


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
        f"{'+'.join(s.node_ids)}@{s.address}:{s.first_layer}-{s.last_layer}" for s in plan.stages]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def load_requests(plan: Plan, dtype: str, batch_invariant: bool, quantization: str | None = None,
                  limits: StepLimits | None = None, leader_id: str = "") -> list[NodeLoad]:
    limits = limits or default_limits(plan)
    plan_id = plan_id_of(plan, dtype, batch_invariant, quantization, limits)
    loads = []
    for i, s in enumerate(plan.stages):
        request = stage_pb2.LoadRequest(
            plan_id=plan_id, model_id=plan.model_id, fingerprint=plan.fingerprint, num_layers=plan.num_layers,
            first_layer=s.first_layer, last_layer=s.last_layer, dtype=dtype,
            next_address=plan.stages[i + 1].address if i + 1 < len(plan.stages) else "",
            next_node_id=plan.stages[i + 1].node_id if i + 1 < len(plan.stages) else "",
            stage_index=i, batch_invariant=batch_invariant, quantization=quantization or "", leader_id=leader_id)
        stage_convert.limits_to_pb(limits, request)
        loads.append(NodeLoad(s.node_id, s.address, request))
        if s.workers:
            role = RankRole(0, s.tp_size, s.collective_endpoint, f"{plan_id}/{i}/{secrets.token_hex(6)}")
            request.tp.CopyFrom(rank_role_to_pb(role))
            for rank, worker in enumerate(s.workers, start=1):
                rank_request = stage_pb2.LoadRequest()
                rank_request.CopyFrom(request)
                rank_request.tp.rank = rank
                loads.append(NodeLoad(worker.node_id, worker.address, rank_request))
    return loads


def deploy(plan: Plan, channels: ChannelPool, dtype: str = "float32", batch_invariant: bool = False,
           quantization: str | None = None, limits: StepLimits | None = None, leader_id: str = "") -> str:
    """Load every stage of `plan` (every rank of a group at once: they meet while loading);
    returns the plan id. Raises a failed node's error once every Load has ended (a rank's
    failure ends its group's other Loads in seconds).

    `limits` are what the stages accept per step (the leader's scheduler within the plan); the
    default suits a leader with the default scheduler settings. `leader_id` names the leader to
    the stages, so its Unload leaves the plan to other leaders that loaded it too."""
    loads = load_requests(plan, dtype, batch_invariant, quantization, limits, leader_id)

    def load(item: NodeLoad) -> None:
        stub = stage_pb2_grpc.StageStub(channels.get(item.address, item.node_id))
        for attempt in range(2):  # a connection the peer just closed (GOAWAY) reconnects on a retry
            try:
                stub.Load(item.request, timeout=LOAD_TIMEOUT_S)
                return
            except grpc.RpcError as e:
                if attempt or e.code() != grpc.StatusCode.UNAVAILABLE:
                    error = _load_error(item.node_id, item.address, e)
                    if item.request.HasField("tp"):
                        raise _rank_error(item, error) from None
                    raise error from None
                time.sleep(0.2)

    errors: list[MeshError] = []
    with ThreadPoolExecutor(max_workers=len(loads)) as pool:
        for future in as_completed([pool.submit(load, item) for item in loads]):
            error = future.exception()
            if error is not None and not isinstance(error, MeshError):
                raise error
            if error is not None:
                errors.append(error)
    if errors:  # the cause, not the aborts it caused in the rest of its group
        raise next((e for e in errors if not isinstance(e, TensorParallelAborted)), errors[0])
    return loads[0].request.plan_id


def _rank_error(item: NodeLoad, error: MeshError) -> MeshError:
    """A rank's failed Load, told to the rest of its group (its node may not have: it may be down)."""
    tp = item.request.tp
    what = f"rank {tp.rank} of {tp.size} of tensor-parallel stage {item.request.stage_index}"
    if isinstance(error, TensorParallelAborted):
        return error
    report_failure(tp.store_address, tp.group_id, tp.rank, f"node {item.node_id}: [{error.code}] {error}")
    if isinstance(error, StageUnreachable):
        return StageUnreachable(f"{what}: {error}", item.node_id)
    return RankLoadFailed(f"{what}: [{error.code}] {error}", item.node_id, error)


def _load_error(node_id: str, address: str, e: grpc.RpcError) -> MeshError:
    details = e.details() or ""
    if e.code() == grpc.StatusCode.ABORTED:
        return TensorParallelAborted(f"node {node_id} ({address}): {details}")
    if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return WeightsMismatch(f"node {node_id} ({address}): {details}")
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return BadRequest(f"node {node_id} ({address}) refused the load: {details}")
    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if details.startswith(f"[{ShardUnavailable.code}]"):  # its memory check (not, e.g., its auth's rate limit)
            missing, part = stage_convert.shortfall_from_metadata(e.trailing_metadata())
            return LoadRefused(f"node {node_id} ({address}): {details}", node_id, missing_bytes=missing, part=part)
        return ShardUnavailable(f"node {node_id} ({address}): {details}")
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return StageUnreachable(f"node {node_id} at {address} is unreachable: {details}", node_id)
    return ModelLoadError(f"node {node_id} ({address}) could not load its layers: {details}")
