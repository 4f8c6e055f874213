"""A 3-node cluster of real `meshllm node` processes on loopback, shared by the package's tests,
and helpers to run a hand-placed plan on it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from meshllm.cluster.gossip import fetch_view
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.model.source import ModelFiles, open_model
from meshllm.pipeline.cluster import ServingOptions, leader_for_plan, wait_for_fleet
from meshllm.pipeline.leader import Leader
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.transport.auth import load_key
from meshllm.transport.channels import ChannelConfig, ChannelPool

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
OPTIONS = ServingOptions(context_length=128, max_batch=16, dtype="float32", batch_invariant=True,
                         scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk=32, prefix_block_size=16))


@pytest.fixture(scope="package")
def pipeline_models(aidreams_path, tiny_model_dir) -> dict[str, Path]:
    """aidreams (real) and two random-weight models sharing its 512-token tokenizer."""
    models = {"aidreams": aidreams_path}
    for name, variant, layers in (("qwen2", "qwen2", 4), ("llama-gqa", "llama", 5)):
        folder = tiny_model_dir(variant, seed=7, vocab_size=512, num_hidden_layers=layers)
        for f in TOKENIZER_FILES:
            shutil.copy(aidreams_path / f, folder / f)
        models[name] = folder
    return models


class Cluster:
    def __init__(self, local: LocalCluster):
        self.local = local
        self.key = load_key(local.key_file)
        self.channels = ChannelPool(ChannelConfig("test-leader", self.key))

    def leader(self, files: ModelFiles, ranges: list[tuple[int, int]],
               options: ServingOptions = OPTIONS) -> Leader:
        """A leader over a plan with exactly these stage ranges, stage i on node i."""
        wait_for_fleet(lambda: fetch_view(self.local.addresses[0], self.key), files.source.fingerprint(),
                       len(ranges), timeout_s=60)
        stages = tuple(StageAssignment(self.local.node_ids[i], self.local.addresses[i], a, b, 0, 0, 0)
                       for i, (a, b) in enumerate(ranges))
        plan = Plan(files.model_id, files.source.fingerprint(), files.config.num_hidden_layers,
                    options.context_length, options.max_batch, 4, 4, stages, 0.0, False)
        return leader_for_plan(files, plan, self.channels, options)


@pytest.fixture(scope="package")
def cluster(pipeline_models, tmp_path_factory):
    local = LocalCluster(3, list(pipeline_models.values()), tmp_path_factory.mktemp("cluster"),
                         extra_args=("--gossip-interval", "0.3"), threads_per_node=1)
    local.start(timeout_s=120)
    try:
        yield Cluster(local)
    finally:
        local.stop()


@pytest.fixture(scope="package")
def model_files(pipeline_models) -> dict[str, ModelFiles]:
    return {name: open_model(path) for name, path in pipeline_models.items()}
