"""Repair a plan that lost a stage: the failed stage's layers move to a spare node.

Pure, like placement.py. Every other stage keeps its node and layer range, so the
survivors reuse the weights they hold and only the spare loads anything. When no spare
can hold the range, the caller re-plans from scratch without the failed node
(`plan_placement` with `exclude`), which spreads the layers over the survivors when
their memory allows.

A tensor-parallel stage that lost a rank fails as a whole (its group is gone), but only
the failed rank needs a replacement: a spare that takes part in tensor parallelism
(it advertises a collective endpoint) takes the failed rank's place and slice, and the
group forms again on the next deploy. When the failed rank was rank 0, the spare's
store is the group's new rendezvous point. The stage keeps its cost-model prediction,
measured on the old member's links: a prediction, not the plan's correctness.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from meshllm.cluster.card import Card, NodeId, Role
from meshllm.cluster.placement import GroupMember, Plan, PlacementRequest, StageAssignment
from meshllm.cluster.stage_budget import Footprint, usable_bytes


def replace_failed_stage(plan: Plan, failed: NodeId, request: PlacementRequest, fleet: Sequence[Card]) -> Plan | None:
    """`plan` with `failed`'s stage (or its rank of a group) on the spare with the most free
    memory that can hold it (ties: node_id), or None when `failed` is not in the plan or no
    spare fits."""
    index = next((i for i, s in enumerate(plan.stages) if failed in s.node_ids), None)
    if index is None:
        return None
    stage = plan.stages[index]
    in_plan = {n for s in plan.stages for n in s.node_ids}
    candidates = [c for c in fleet if Role.STAGE in c.roles and c.node_id not in in_plan
                  and c.node_id not in request.exclude and c.node_id != failed
                  and any(m.fingerprint == request.fingerprint and m.num_layers == plan.num_layers for m in c.models)
                  and (not stage.workers or c.collective_endpoint is not None)]
    charge = _embedding_charge(plan, index, next((c for c in fleet if c.node_id == failed), None), request)
    spares = [c for c in candidates
              if usable_bytes(c, request.safety_margin_fraction) >= stage.budget_bytes + charge(c)]
    if not spares:
        return None
    spare = min(spares, key=lambda c: (-usable_bytes(c, request.safety_margin_fraction), c.node_id))
    stages = list(plan.stages)
    stages[index] = replace(_with_member_replaced(stage, failed, spare), weight_bytes=stage.weight_bytes + charge(spare))
    return replace(plan, stages=tuple(stages), reused_shards=False)


def _embedding_charge(plan: Plan, index: int, failed: Card | None, request: PlacementRequest
                      ) -> Callable[[Card], int]:
    """Bytes a spare needs beyond the stage's budget: the embedding table a first stage planned on a
    CPU node reads from the file (stage_budget.embedding_held) but a device spare holds. A failed
    node no longer in the fleet counts as a CPU one (the safe side)."""
    if index != 0 or plan.stages[index].workers:
        return lambda spare: 0
    footprint, num_stages = Footprint.of(request), len(plan.stages)
    planned = footprint.fixed_weights(0, num_stages, failed.device if failed is not None else "cpu")
    return lambda spare: max(0, footprint.fixed_weights(0, num_stages, spare.device) - planned)


def _with_member_replaced(stage: StageAssignment, failed: NodeId, spare: Card) -> StageAssignment:
    if failed == stage.node_id:
        endpoint = spare.collective_endpoint if stage.workers else None
        return replace(stage, node_id=spare.node_id, address=spare.grpc_address, collective_endpoint=endpoint)
    workers = tuple(GroupMember(spare.node_id, spare.grpc_address) if w.node_id == failed else w
                    for w in stage.workers)
    return replace(stage, workers=workers)
