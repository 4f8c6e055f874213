"""A Backend whose leader runs the model across the fleet's stage nodes."""

from __future__ import annotations

from collections.abc import Callable

from meshllm.api.backend import Backend
from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import Card
from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan
from meshllm.errors import ShardUnavailable
from meshllm.model.source import ModelFiles
from meshllm.pipeline.cluster import ServingOptions, cluster_leader, context_of, wait_for_fleet
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool


def build_cluster_backend(files: ModelFiles, fleet_view: Callable[[], list[Card]], channels: ChannelPool,
                          options: ServingOptions) -> tuple[Backend, Plan | None]:
    """Plan the model on the current fleet and load its stages. When no plan fits, the
    Backend carries the error instead of a leader, and the API answers 503."""
    metrics = MetricsObserver()
    try:
        leader, plan = cluster_leader(files, fleet_view(), channels, options, observer=metrics, fleet_view=fleet_view)
    except ShardUnavailable as e:
        return Backend(files.model_id, files.tokenizer, context_of(files, options), None, metrics, fleet_view,
                       plan_error=e), None
    return Backend(files.model_id, files.tokenizer, context_of(files, options), leader, metrics, fleet_view), plan


def local_cluster_backend(cluster: LocalCluster, files: ModelFiles, options: ServingOptions,
                          leader_id: str) -> tuple[Backend, Plan | None, ChannelPool]:
    """A Backend over a LocalCluster's nodes (the demo, benchmarks, tests), planned once every
    node advertises the model. Returns the channels too: callers may ask the stages directly."""
    key = load_key(cluster.key_file)
    view = lambda: fetch_view(cluster.addresses[0], key)  # noqa: E731
    wait_for_fleet(view, files.source.fingerprint(), cluster.num_nodes)
    channels = ChannelPool(ChannelConfig(leader_id, key))
    backend, plan = build_cluster_backend(files, view, channels, options)
    return backend, plan, channels
