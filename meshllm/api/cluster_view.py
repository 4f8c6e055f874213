"""GET /v1/cluster: the fleet as this node sees it, plus the served model's load.

The dashboard page polls this; so can scripts. Cards are summarised, not dumped:
no keys or local paths of other machines, only what a person watching the
fleet needs.
"""

from __future__ import annotations

import time

from pydantic import BaseModel

from meshllm.api.backend import Backend
from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import Card
from meshllm.pipeline.health import HealthReport


class ShardView(BaseModel):
    model_id: str
    first_layer: int
    last_layer: int  # exclusive
    queue_depth: int


class NodeView(BaseModel):
    node_id: str
    grpc_address: str
    api_address: str | None
    platform: str
    device: str
    memory_total_bytes: int
    memory_free_bytes: int
    memory_bandwidth_gbps: float
    matmul_gflops: float
    models: list[str]
    shards: list[ShardView]
    roles: list[str]
    age_s: float  # since the card was announced


class StageView(BaseModel):
    node_id: str
    address: str
    first_layer: int
    last_layer: int  # exclusive


class HealthView(BaseModel):
    """GET /health's body, and the `health` of /v1/cluster."""

    status: str  # ok | degraded | unavailable
    reason: str | None  # what failed or what is missing, for a person
    failed_node: str | None  # the node blamed for the last failure, while not ok
    missing: str | None  # what does not fit ("layers 2-3") when unavailable for lack of memory
    missing_bytes: int | None
    stages: list[StageView]  # the plan serving now
    num_failovers: int
    since: float  # unix seconds of the last change of status


def health_view(report: HealthReport) -> HealthView:
    return HealthView(status=report.status.value, reason=report.reason, failed_node=report.failed_node,
                      missing=report.missing, missing_bytes=report.missing_bytes,
                      stages=[StageView(node_id=s.node_id, address=s.address, first_layer=s.first_layer,
                                        last_layer=s.last_layer) for s in report.stages],
                      num_failovers=report.num_failovers, since=report.since)


class RecoveryView(BaseModel):
    """One failover, seconds per part (pipeline/failover.py RecoveryTiming)."""

    code: str
    stage_index: int | None
    detect_s: float
    plan_s: float
    load_s: float
    reprefill_s: float
    total_s: float
    carried_positions: int  # KV positions the new plan's stages kept instead of re-prefilling them


class ServedModelView(BaseModel):
    model_id: str
    ready: bool  # health is ok
    plan_error: str | None  # the reason when no plan serves
    health: HealthView
    max_context: int
    queue_depth: int
    running_sequences: int
    tokens_per_second: float
    generated_tokens: int
    recent_failovers: list[RecoveryView]  # the last 20, oldest first


class ClusterView(BaseModel):
    served: ServedModelView
    nodes: list[NodeView]
    generated_at: float


def node_view(card: Card, now: float) -> NodeView:
    return NodeView(
        node_id=card.node_id, grpc_address=card.grpc_address, api_address=card.api_address,
        platform=card.platform, device=card.device, memory_total_bytes=card.memory_total_bytes,
        memory_free_bytes=card.memory_free_bytes, memory_bandwidth_gbps=card.memory_bandwidth_gbps,
        matmul_gflops=card.matmul_gflops, models=[m.model_id for m in card.models],
        shards=[ShardView(model_id=s.model_id, first_layer=s.first_layer, last_layer=s.last_layer,
                          queue_depth=s.queue_depth) for s in card.shards],
        roles=[r.value for r in card.roles], age_s=round(max(now - card.announced_at, 0.0), 3))


def cluster_view(backend: Backend, metrics: MetricsObserver) -> ClusterView:
    now = time.time()
    report = backend.health_report()
    served = ServedModelView(
        model_id=backend.model_id, ready=report.ok, plan_error=None if report.ok else report.reason,
        health=health_view(report), max_context=backend.max_context,
        queue_depth=metrics.num_waiting, running_sequences=metrics.num_running,
        tokens_per_second=round(metrics.recent_tokens_per_second(), 2),
        generated_tokens=metrics.num_generated_tokens,
        recent_failovers=[RecoveryView(code=t.code, stage_index=t.stage_index, detect_s=round(t.detect_s, 4),
                                       plan_s=round(t.plan_s, 4), load_s=round(t.load_s, 4),
                                       reprefill_s=round(t.reprefill_s, 4), total_s=round(t.total_s, 4),
                                       carried_positions=t.carried_positions)
                          for t in metrics.recent_recoveries()])
    nodes = sorted((node_view(c, now) for c in backend.fleet_view()), key=lambda n: n.node_id)
    return ClusterView(served=served, nodes=nodes, generated_at=now)
