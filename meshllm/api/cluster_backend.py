"""A Backend whose leader runs the model across the fleet's stage nodes."""

from __future__ import annotations

from collections.abc import Callable

from meshllm.api.backend import Backend
from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import Card
from meshllm.cluster.placement import Plan
from meshllm.errors import ShardUnavailable
from meshllm.model.source import ModelFiles
from meshllm.pipeline.cluster import ServingOptions, cluster_leader, context_of
from meshllm.transport.channels import ChannelPool


def build_cluster_backend(files: ModelFiles, fleet_view: Callable[[], list[Card]], channels: ChannelPool,
                          options: ServingOptions) -> tuple[Backend, Plan | None]:
    """Plan the model on the current fleet and load its stages. When no plan fits, the
    Backend carries the error instead of a leader, and the API answers 503."""
    metrics = MetricsObserver()
    try:
        leader, plan = cluster_leader(files, fleet_view(), channels, options, observer=metrics)
    except ShardUnavailable as e:
        return Backend(files.model_id, files.tokenizer, context_of(files, options), None, metrics, fleet_view,
                       plan_error=e), None
    return Backend(files.model_id, files.tokenizer, context_of(files, options), leader, metrics, fleet_view), plan
