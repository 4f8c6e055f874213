"""Live API servers for the tests: a real uvicorn server on a free loopback port (background
thread), the real `openai` client, aidreams-260k behind a real leader, and the single-process
generate loop as the reference."""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI

from meshllm.api.app import create_app
from meshllm.api.backend import Backend, build_local_backend
from meshllm.api.cluster_backend import local_cluster_backend
from meshllm.api.config import APIConfig
from meshllm.api.metrics import MetricsObserver
from meshllm.api.server import APIServer
from meshllm.engine.batch_invariant import make_batch_invariant
from meshllm.engine.generate import Completion
from meshllm.pipeline.local_generate import generate_many
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import Step, StepResult
from meshllm.model.loader import load_decoder
from meshllm.model.source import ModelFiles, open_model
from meshllm.pipeline.cluster import ServingOptions, context_of, new_leader
from meshllm.pipeline.local_cluster import LocalCluster
from meshllm.pipeline.transport import LocalPipeline

MODEL = "aidreams-260k"
# Batch-invariant, so a sequence's output does not depend on what else is running.
OPTIONS = ServingOptions(context_length=128, max_batch=16, batch_invariant=True)


@pytest.fixture(scope="package", autouse=True)
def _one_torch_thread():
    # Tiny models on a shared 2-core machine: one intra-op thread per process is far faster
    # than two threads spinning against the server's other threads and other processes.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@dataclass
class LiveServer:
    backend: Backend
    url: str
    api_key: str | None = None
    stage_addresses: tuple[tuple[str, str], ...] = ()  # (address, node id) of a cluster backend's stage nodes
    channels: object = None  # ChannelPool to them

    def client(self, api_key: str | None = None, timeout: float = 60.0) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key or self.api_key or "unused", max_retries=0,
                      timeout=timeout)

    def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample from /metrics, read over HTTP as Prometheus would (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or all(sample.labels.get(k) == v
                                                                   for k, v in labels.items())):
                    return sample.value
        return 0.0

    def wait_for(self, condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.05)

    def stage_sequences(self) -> list:
        """Sequences whose KV any stage still holds: in-process runners, or every stage node
        of a cluster backend asked over gRPC (Stage.Info)."""
        transport = self.backend.leader.transport
        if isinstance(transport, LocalPipeline):
            return [s for r in transport.runners for s in r.held_sequences()]
        return [s for info in self.stage_infos() for shard in info.shards if shard.plan_id == transport.plan_id
                for s in shard.seq_ids]

    def stage_infos(self) -> list:
        from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

        return [stage_pb2_grpc.StageStub(self.channels.get(a, n)).Info(stage_pb2.StageInfoRequest(), timeout=10)
                for a, n in self.stage_addresses]


@contextlib.contextmanager
def serve(backend: Backend, config: APIConfig | None = None,
          stage_addresses: tuple[tuple[str, str], ...] = (), channels=None) -> Iterator[LiveServer]:
    config = config or APIConfig(port=0)
    server = APIServer(create_app(backend, config), "127.0.0.1", 0)
    server.start()
    try:
        yield LiveServer(backend, server.url, config.api_key, stage_addresses, channels)
    finally:
        server.stop()


@pytest.fixture(scope="package")
def aidreams_files(aidreams_path) -> ModelFiles:
    return open_model(aidreams_path)


@pytest.fixture(scope="package")
def backend(aidreams_path) -> Iterator[Backend]:
    b = build_local_backend(aidreams_path, OPTIONS)
    yield b
    b.close()


@pytest.fixture(scope="package")
def long_model_path(aidreams_path, tiny_model_dir) -> Path:
    """A random-weight 2-layer Llama with a 2048-token context (aidreams' 512-token tokenizer):
    long enough prompts for the prefix cache and long generations to disconnect from."""
    folder = tiny_model_dir("llama", seed=11, vocab_size=512, num_hidden_layers=2, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(aidreams_path / name, folder / name)
    return folder


@pytest.fixture(scope="package")
def two_node_cluster(aidreams_path, long_model_path, tmp_path_factory) -> Iterator[LocalCluster]:
    """Two real `meshllm node` processes on loopback holding aidreams and the long-context model."""
    cluster = LocalCluster(2, [aidreams_path, long_model_path], tmp_path_factory.mktemp("api-cluster"),
                           extra_args=("--gossip-interval", "0.3"), threads_per_node=1)
    cluster.start(timeout_s=120)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="package")
def cluster_server(two_node_cluster, aidreams_files) -> Iterator[LiveServer]:
    """The API backed by a 2-stage pipeline of node processes (aidreams layers 0-1 | 2-3)."""
    b, owner, channels = local_cluster_backend(two_node_cluster, aidreams_files, replace(OPTIONS, num_stages=2),
                                               "api-test-leader")
    assert owner.plan is not None and len(owner.plan.stages) == 2, b.health.report()
    stages = tuple(zip(two_node_cluster.addresses, two_node_cluster.node_ids))
    with serve(b, stage_addresses=stages, channels=channels) as live:
        yield live
    b.close()


@pytest.fixture(scope="package")
def long_cluster_server(two_node_cluster, long_model_path) -> Iterator[LiveServer]:
    """The long-context model across the same two stage nodes (layer 0 | layer 1)."""
    files = open_model(long_model_path)
    b, owner, channels = local_cluster_backend(two_node_cluster, files,
                                               replace(OPTIONS, context_length=2048, num_stages=2),
                                               "api-test-long-leader")
    assert owner.plan is not None and len(owner.plan.stages) == 2, b.health.report()
    stages = tuple(zip(two_node_cluster.addresses, two_node_cluster.node_ids))
    with serve(b, stage_addresses=stages, channels=channels) as live:
        yield live
    b.close()


@pytest.fixture(scope="package")
def smollm2_server(smollm2_gguf_path) -> Iterator[LiveServer]:
    """SmolLM2-135M-Instruct (Q4_1 GGUF, byte-level BPE, its own ChatML template) in this process."""
    b = build_local_backend(smollm2_gguf_path, ServingOptions(context_length=1024, max_batch=16,
                                                              batch_invariant=True))
    with serve(b) as live:
        yield live
    b.close()


@pytest.fixture(scope="package")
def smollm2_fast_server(smollm2_gguf_path) -> Iterator[LiveServer]:
    """The same model as `meshllm serve` runs it by default (ggml, its blocks kept): for tests of
    what the API does with the tokens (tool calls, JSON, logprob bytes), not of exact tokens.
    Several times faster than `smollm2_server`'s batch-invariant float32 path."""
    b = build_local_backend(smollm2_gguf_path, ServingOptions(context_length=1024, max_batch=16))
    with serve(b) as live:
        yield live
    b.close()


@pytest.fixture(scope="package", params=["local", "cluster"])
def server(request, backend) -> Iterator[LiveServer]:
    """Every test using `server` runs against the single-process backend and against the
    2-stage pipeline of node processes."""
    if request.param == "cluster":
        yield request.getfixturevalue("cluster_server")
        return
    with serve(backend) as live:
        yield live


@pytest.fixture(scope="package")
def long_local_backend(long_model_path) -> Iterator[Backend]:
    b = build_local_backend(long_model_path, replace(OPTIONS, context_length=2048))
    yield b
    b.close()


@pytest.fixture(scope="package", params=["local", "cluster"])
def long_server(request) -> Iterator[LiveServer]:
    """The 2048-token random model (aidreams' tokenizer) in process and across the two stage nodes,
    for prompts that do not fit aidreams' 128 tokens (tool definitions)."""
    if request.param == "cluster":
        yield request.getfixturevalue("long_cluster_server")
        return
    with serve(request.getfixturevalue("long_local_backend")) as live:
        yield live


class SlowPipeline(LocalPipeline):
    """The real in-process stage, with a pause per step: long enough generations to time out,
    queue up and disconnect from, without depending on how fast this machine is."""

    def __init__(self, runners: list[StageRunner], step_delay_s: float):
        super().__init__(runners)
        self.step_delay_s = step_delay_s

    def run_now(self, step: Step) -> StepResult:
        time.sleep(self.step_delay_s)
        return super().run_now(step)


@pytest.fixture(scope="package")
def slow_backend(aidreams_files) -> Iterator[Backend]:
    """One sequence runs at a time, one may wait; every step takes at least 20 ms."""
    files = aidreams_files
    options = ServingOptions(context_length=128, max_batch=1, scheduler=SchedulerConfig(max_waiting=1))
    decoder = load_decoder(files.source, files.config)
    metrics = MetricsObserver()
    leader = new_leader(files, SlowPipeline([StageRunner(decoder)], 0.02), options, observer=metrics)
    b = Backend(files.model_id, files.tokenizer, context_of(files, options), leader, metrics)
    yield b
    b.close()


@pytest.fixture(scope="package")
def reference(aidreams_files) -> Callable[[list[int], SamplingParams], Completion]:
    """Single-process generation (the leader loop over one in-process stage) with the same
    batch-invariant arithmetic as the served model."""
    files = aidreams_files
    decoder = make_batch_invariant(load_decoder(files.source, files.config))

    def run(prompt_ids: list[int], params: SamplingParams) -> Completion:
        return generate_many(decoder, files.tokenizer, [prompt_ids], params)[0]

    return run
