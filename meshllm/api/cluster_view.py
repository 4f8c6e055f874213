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


class ServedModelView(BaseModel):
    model_id: str
    ready: bool
    plan_error: str | None
    max_context: int
    queue_depth: int
    running_sequences: int
    tokens_per_second: float
    generated_tokens: int


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
    error = backend.plan_error
    served = ServedModelView(
        model_id=backend.model_id, ready=backend.leader is not None,
        plan_error=None if error is None else f"[{error.code}] {error}", max_context=backend.max_context,
        queue_depth=metrics.num_waiting, running_sequences=metrics.num_running,
        tokens_per_second=round(metrics.recent_tokens_per_second(), 2),
        generated_tokens=metrics.num_generated_tokens)
    nodes = sorted((node_view(c, now) for c in backend.fleet_view()), key=lambda n: n.node_id)
    return ClusterView(served=served, nodes=nodes, generated_at=now)
