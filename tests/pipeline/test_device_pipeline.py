"""A pipeline of real node processes serving from a GPU (`meshllm node --device cuda`) gives the
single-process GPU output token for token: activations leave one stage's GPU, cross gRPC and
land on the next one's. With --quantize int4 every linear is Q4_0 blocks held as planes (quantized by ggml, or by
the gguf package's port where the host has no ggml build), and decode runs the fused Triton kernel in each stage process, whose tiles are picked by timing in
each process separately. No GPU is lent to CI here: these skip with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from meshllm.engine.sampler import SamplingParams
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import local_leader
from meshllm.pipeline.local_cluster import LocalCluster
from tests.pipeline.conftest import OPTIONS, Cluster

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason=f"no CUDA device on this machine (torch {torch.__version__}); run on a GPU host")]

PROMPTS = ["Once upon a time", "The robot dreamed of"]


@pytest.fixture(scope="module")
def gpu_cluster(aidreams_path, tmp_path_factory):
    local = LocalCluster(2, [aidreams_path], tmp_path_factory.mktemp("gpu-cluster"),
                         extra_args=("--gossip-interval", "0.3", "--device", "cuda"), threads_per_node=1)
    local.start(timeout_s=180)
    try:
        yield Cluster(local)
    finally:
        local.stop()


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_a_gpu_pipeline_gives_the_single_process_gpu_tokens(gpu_cluster, aidreams_path, quantization):
    # float32; not batch-invariant (that mode holds every weight dense): one sequence at a time, so
    # the pipeline and the single process run the same shapes through the same kernels
    options = dataclasses.replace(OPTIONS, device="cuda", quantization=quantization, batch_invariant=False)
    files = open_model(aidreams_path)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [files.tokenizer.encode(p) for p in PROMPTS]
    reference = local_leader(files, options)
    try:
        want = [[e.token_id for e in reference.generate(ids, params) if e.token_id is not None] for ids in prompts]
    finally:
        reference.close()
    leader = gpu_cluster.leader(files, [(0, 2), (2, 4)], options)
    try:
        got = [[e.token_id for e in leader.generate(ids, params) if e.token_id is not None] for ids in prompts]
    finally:
        leader.close()
    assert got == want
    assert all(len(tokens) == 24 for tokens in got)
