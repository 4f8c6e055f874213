"""A Backend whose leader runs the model across the fleet's stage nodes, through the plan
owner that re-plans when a stage fails (pipeline/plan_owner.py)."""

from __future__ import annotations

from collections.abc import Callable

from meshllm.api.backend import Backend
from meshllm.api.metrics import MetricsObserver
from meshllm.cluster.card import Card
from meshllm.cluster.gossip import fetch_view
from meshllm.model.source import ModelFiles
from meshllm.pipeline.cluster import ServingOptions, context_of, wait_for_fleet
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.plan_owner import PlanOwner
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool


def build_cluster_backend(files: ModelFiles, fleet_view: Callable[[], list[Card]], channels: ChannelPool,
                          options: ServingOptions) -> tuple[Backend, PlanOwner]:
    """Plan the model on the current fleet and load its stages. When no plan fits, the leader
    still starts (requests get shard_unavailable, /health says why) and plans as soon as the
    fleet allows."""
    metrics = MetricsObserver()
    owner = PlanOwner(files, fleet_view, channels, options, observer=metrics)
    leader = owner.start()
    backend = Backend(files.model_id, files.tokenizer, context_of(files, options), leader, metrics, fleet_view,
                      owner.health)
    return backend, owner


def local_cluster_backend(cluster: LocalCluster, files: ModelFiles, options: ServingOptions,
                          leader_id: str) -> tuple[Backend, PlanOwner, ChannelPool]:
    """A Backend over a LocalCluster's nodes (the demo, benchmarks, tests), planned once every
    node advertises the model. Returns the channels too: callers may ask the stages directly.
    The fleet view asks the first live node (a killed node must not blind the leader)."""
    key = load_key(cluster.key_file)
    view = lambda: fetch_view(cluster.live_addresses()[0], key)  # noqa: E731
    wait_for_fleet(view, files.source.fingerprint(), cluster.num_nodes)
    channels = ChannelPool(ChannelConfig(leader_id, key))
    backend, owner = build_cluster_backend(files, view, channels, options)
    return backend, owner, channels
