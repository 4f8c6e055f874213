"""The model families beyond Llama on `--device cuda`: windows, LongRoPE, Gemma 3's per-layer
windows and norms, mixtures of experts, as folders and as quantized GGUF files.

Each runs on the GPU (CUDA graphs where the family takes them) and on the CPU in float32, and
greedy decoding of a batch of prompts longer than the window must give the same tokens. No GPU
is lent to CI here: these skip with the reason, and bench/gpu_checks.sh runs them on a GPU host.
The quantized files are written by the gguf package's quantizer (bitwise ggml's), since a GPU host
may have no ggml build.
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine import cuda_graphs
from meshllm.engine.device_weights import BlockLinear
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.model.decoder import MoE
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.model.weights import SafetensorsSource
from meshllm.pipeline.local_generate import generate_many
from tests.quantized_gguf import write_quantized_llama

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason=f"no CUDA device on this machine (torch {torch.__version__}); run on a GPU host")

# Longer than the tiny models' window (5), of different lengths, in one batch; 12 + 18 tokens fit
# phi3-longrope's context (its original 32 positions).
PROMPTS = [[5, 9, 2, 7, 11, 3, 8], list(range(20, 32)), [7, 3, 9, 40, 41, 42]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True, logprobs=5)


def _assert_same_decoding(gpu, cpu, tokenizer, prompts: list[list[int]]) -> None:
    """Greedy tokens equal, and every decode step's top-5 log-probabilities within 1e-3 of the
    logits' spread (float32 on both: kernels' rounding alone; a misread cache moves them by
    about the spread). A random model may repeat one token, so the tokens alone prove little."""
    ids = torch.tensor(prompts[1])
    want_logits = cpu.forward_full(ids)
    spread = (want_logits.max() - want_logits.min()).item()
    assert (gpu.forward_full(ids).cpu() - want_logits).abs().max().item() < 1e-3 * spread
    got = generate_many(gpu, tokenizer, prompts, GREEDY)
    want = generate_many(cpu, tokenizer, prompts, GREEDY)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    for g, w in zip(got, want):
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.top_ids == b.top_ids
            assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) < 1e-3 * spread


def _graphs(decoder):
    return decoder.fast_path if isinstance(decoder.fast_path, cuda_graphs.GraphedDecode) else None


@pytest.mark.parametrize("variant", ["mistral", "phi3", "phi3-longrope", "phi3-partial", "smollm3", "granite",
                                     "qwen3-yarn", "glm4", "gemma2", "gemma3", "qwen3-moe", "mixtral", "gpt-oss",
                                     "glm4-moe", "minimax-m2", "qwen2-moe"])
def test_a_family_on_the_gpu_decodes_the_cpus_greedy_tokens(tiny_model_dir, aidreams_path, variant):
    source = SafetensorsSource(tiny_model_dir(variant))
    config = source.config()
    gpu = load_stage_decoder(source, config, dtype=torch.float32, device="cuda")
    cpu = load_stage_decoder(source, config, dtype=torch.float32, batch_invariant=True)
    tokenizer = open_model(aidreams_path).tokenizer  # any vocabulary past the tiny models' 96 ids
    _assert_same_decoding(gpu, cpu, tokenizer, PROMPTS)
    graphs = _graphs(gpu)
    if config.sliding_layers is None and not config.num_experts:
        assert graphs.enabled and graphs.replays > 0  # windowed decode steps replayed as graphs
    else:
        # per-layer windows (Gemma 3), experts picked on the host: eager steps
        assert graphs is not None and not graphs.enabled and graphs.replays == 0


@pytest.mark.parametrize("arch, ggml_type, extra", [
    ("phi3", GGML.Q4_0, dict(sliding_window=5)),
    ("gemma3", GGML.Q8_0, dict(sliding_window=5)),
    ("qwen3moe", GGML.Q4_1, dict(experts=4)),
    ("llama", GGML.Q4_0, dict(experts=4)),  # Mixtral
], ids=["phi3-Q4_0", "gemma3-Q8_0", "qwen3moe-Q4_1", "mixtral-Q4_0"])
def test_a_quantized_family_stays_blocks_on_the_gpu_and_decodes_as_on_the_cpu(smollm2_gguf_path, tmp_path,
                                                                              arch, ggml_type, extra):
    path = write_quantized_llama(None, smollm2_gguf_path, tmp_path / f"{arch}.gguf", ggml_type, arch=arch,
                                 **extra)
    files = open_model(path)
    gpu = load_stage_decoder(files.source, files.config, dtype=torch.float32, device="cuda")
    mlp = gpu.layers[0].mlp
    held = mlp.gate_proj if isinstance(mlp, MoE) else mlp.gate_up_proj
    assert isinstance(held, BlockLinear) and held.fusable and held.blocks()[0][0].device.type == "cuda"
    cpu = load_decoder(files.source, files.config)  # dequantized at load, fp32, torch path
    prompts = [files.tokenizer.encode(p) for p in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    _assert_same_decoding(gpu, cpu, files.tokenizer, prompts)
