"""Quantized GGUF models stay quantized on real stage processes and give one-process output.

For each GGUF quant type meshllm keeps quantized, a tiny random Llama of that type runs through
a 2-stage pipeline of real `meshllm node` processes on loopback and, greedy, yields exactly the
tokens the whole model gives in one process (the default fast path, not batch-invariant mode).
"""

from __future__ import annotations

import pytest
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_stage import GGMLStage
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import SchedulerConfig
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.source import open_model
from meshllm.pipeline.cluster import ServingOptions, local_leader
from meshllm.pipeline.local_cluster import LocalCluster
from tests.pipeline.conftest import Cluster
from tests.quantized_gguf import write_quantized_llama

pytestmark = pytest.mark.slow

TYPES = [GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K, GGML.Q3_K, GGML.IQ3_S, GGML.IQ2_XXS]
# Other families, as llama.cpp writes them, on ggml's path: Phi-3 (fused q/k/v and gate/up) as
# Phi-4-mini (no window, 48 of each head's 64 dims turned) and with a window the prompts and
# replies cross; Gemma 3's windowed and full
# layers split across the two stages (3 layers: 0, 1 windowed, 2 full); mixtures of experts;
# SmolLM3's layer without rotary in the second stage.
FAMILIES = {
    "phi4mini-Q4_K": dict(ggml_type=GGML.Q4_K, arch="phi3", rope_dims=48),
    "phi3-window-Q8_0": dict(ggml_type=GGML.Q8_0, arch="phi3", sliding_window=5),
    "gemma3-Q4_K": dict(ggml_type=GGML.Q4_K, arch="gemma3", sliding_window=4),
    "qwen3moe-Q4_K": dict(ggml_type=GGML.Q4_K, arch="qwen3moe", experts=4),
    "mixtral-Q8_0": dict(ggml_type=GGML.Q8_0, arch="llama", experts=4),
    "smollm3-Q4_0": dict(ggml_type=GGML.Q4_0, arch="smollm3", num_layers=4),  # layer 3 without rotary
}
OPTIONS = ServingOptions(context_length=256, max_batch=4, dtype="float32",
                         scheduler=SchedulerConfig(max_batched_tokens=64, prefill_chunk=32))
PROMPTS = ["Once upon a time", "The capital of France is"]


@pytest.fixture(scope="module")
def models(smollm2_gguf_path, tmp_path_factory):
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it); quantized weights are dequantized instead")
    folder = tmp_path_factory.mktemp("quantized")
    # An LM head of its own: tied to the embedding, a random model repeats the prompt's last token
    # whatever its layers compute, and equal tokens would prove nothing.
    models = {t: write_quantized_llama(rt, smollm2_gguf_path, folder / f"tiny-{t.name}.gguf", t, head_type=GGML.Q8_0)
              for t in TYPES}
    for name, spec in FAMILIES.items():
        models[name] = write_quantized_llama(rt, smollm2_gguf_path, folder / f"tiny-{name}.gguf", head_type=GGML.Q8_0,
                                             **spec)
    return models


@pytest.fixture(scope="module")
def two_nodes(models, tmp_path_factory):
    local = LocalCluster(2, list(models.values()), tmp_path_factory.mktemp("cluster"),
                         extra_args=("--gossip-interval", "0.3"), threads_per_node=1)
    local.start(timeout_s=120)
    try:
        yield Cluster(local)
    finally:
        local.stop()


def _tokens(leader, ids, params) -> list[int]:
    try:
        return [e.token_id for e in leader.generate(ids, params) if e.token_id is not None]
    finally:
        leader.close()


@pytest.mark.parametrize("model", [*TYPES, *FAMILIES], ids=lambda t: getattr(t, "name", t))
def test_two_stage_pipeline_matches_one_process(two_nodes, models, model):
    files = open_model(models[model])
    ggml_type = FAMILIES[model]["ggml_type"] if model in FAMILIES else model
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    decoder = load_stage_decoder(files.source, files.config)
    assert decoder.layers[0].mlp.down_proj.weight_types == [ggml_type.name]  # held quantized, not dequantized
    assert decoder.layers[0].self_attn.qkv_proj.weight_types == [ggml_type.name]
    assert isinstance(decoder.fast_path, GGMLStage)
    for prompt in PROMPTS:
        ids = files.tokenizer.encode(prompt)
        expected = _tokens(local_leader(files, OPTIONS), ids, params)
        assert len(set(expected)) > 2, expected  # tokens that depend on what the layers computed
        got = _tokens(two_nodes.leader(files, [(0, 1), (1, files.config.num_hidden_layers)], OPTIONS), ids, params)
        assert got == expected, (model, prompt)
