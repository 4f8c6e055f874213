"""Repair a plan that lost a stage: the failed stage's layers move to a spare node.

Pure, like placement.py. Every other stage keeps its node and layer range, so the
survivors reuse the weights they hold and only the spare loads anything. When no spare
can hold the range, the caller re-plans from scratch without the failed node
(`plan_placement` with `exclude`), which spreads the layers over the survivors when
their memory allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from meshllm.cluster.card import Card, NodeId, Role
from meshllm.cluster.placement import Plan, PlacementRequest
from meshllm.cluster.stage_budget import usable_bytes


def replace_failed_stage(plan: Plan, failed: NodeId, request: PlacementRequest, fleet: Sequence[Card]) -> Plan | None:
    """`plan` with `failed`'s stage on the spare with the most free memory that can hold it
    (ties: node_id), or None when `failed` is not in the plan or no spare fits."""
    index = next((i for i, s in enumerate(plan.stages) if s.node_id == failed), None)
    if index is None:
        return None
    stage = plan.stages[index]
    in_plan = {s.node_id for s in plan.stages}
    spares = [c for c in fleet if Role.STAGE in c.roles and c.node_id not in in_plan
              and c.node_id not in request.exclude and c.node_id != failed
              and any(m.fingerprint == request.fingerprint and m.num_layers == plan.num_layers for m in c.models)
              and usable_bytes(c, request.safety_margin_fraction) >= stage.budget_bytes]
    if not spares:
        return None
    spare = min(spares, key=lambda c: (-usable_bytes(c, request.safety_margin_fraction), c.node_id))
    stages = list(plan.stages)
    stages[index] = replace(stage, node_id=spare.node_id, address=spare.grpc_address)
    return replace(plan, stages=tuple(stages), reused_shards=False)
