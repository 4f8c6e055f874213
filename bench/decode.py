"""Single-process decode and prefill speed against transformers on the same weights and threads.

Two models: SmolLM2-135M-Instruct (the demo GGUF, dequantized) and a random-weight model of
TinyLlama-1.1B shape built in memory. For each weight variant (fp16, oneDNN-prepacked bf16,
weight-only int8; see meshllm/engine/cpu_weights.py): decode tok/s at batch 1 (32-token
prompt, 128 new tokens, greedy, through engine/generate.py), prefill tok/s (512-token prompt),
and the fraction of the memory-bandwidth bound (weight bytes read per token / measured read
bandwidth). transformers `generate` runs on the first variant's weights. Prints one JSON object.

    python bench/decode.py [--variants fp16,bf16,int8] [--threads 2] [--models smollm2,tinyllama]

Peer figures (llama.cpp, 2 threads, on the machine these targets were set on): SmolLM2-135M
BF16 decode 79-95 tok/s, prefill(512) 680-900; TinyLlama-1.1B shape BF16 decode 14.5-15.8,
prefill 115-126. The target is 0.8x of them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshllm.commands.generate import AUTO_DTYPE  # noqa: E402
from meshllm.engine.cpu_weights import Int8Linear, PackedBF16Linear  # noqa: E402
from meshllm.engine.generate import stream_many  # noqa: E402
from meshllm.engine.kv_cache import SequenceKV  # noqa: E402
from meshllm.engine.sampler import SamplingParams  # noqa: E402
from meshllm.engine.weight_forms import prepare_for_cpu  # noqa: E402
from meshllm.model.config import ModelConfig  # noqa: E402
from meshllm.model.decoder import Decoder, RMSNorm, SeqSlice  # noqa: E402
from meshllm.model.loader import load_decoder  # noqa: E402
from meshllm.model.source import open_model  # noqa: E402

PROMPT_TOKENS, NEW_TOKENS, PREFILL_TOKENS = 32, 128, 512
TINYLLAMA = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4, head_dim=64,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_ids=(2,))
# variant -> (dtype, int8 weights); see meshllm/engine/cpu_weights.py
VARIANTS = {"fp16": (torch.float16, False), "bf16": (torch.bfloat16, False), "fp32": (torch.float32, False),
            "int8": (torch.float16, True)}
LLAMA_CPP_BF16 = {  # tok/s ranges measured with 2 threads (the brief of issue #2)
    "smollm2": {"decode": [79, 95], "prefill": [680, 900]},
    "tinyllama": {"decode": [14.5, 15.8], "prefill": [115, 126]},
}


class _NoTokenizer:
    """The loop only needs EOS ids and a detokenizer; benchmarks ignore the text."""

    eos_token_ids = ()

    @staticmethod
    def decode_stream():
        return _NoTokenizer

    @staticmethod
    def step(token_id: int) -> str:
        return ""


def read_bandwidth_gbs(repeats: int = 5) -> float:
    """Read bandwidth of a sum over 512 MiB (far larger than any cache), best of `repeats`."""
    buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best / 1e9


def weight_bytes_per_token(decoder: Decoder) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once; the embedding one row."""
    total = 0
    for module in decoder.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, PackedBF16Linear):
            total += module.in_features * module.out_features * 2
        elif isinstance(module, Int8Linear):
            total += module.weight_int8.numel() + module.scale_bf16.numel() * 2
        elif isinstance(module, RMSNorm):
            total += module.weight.numel() * module.weight.element_size()
    return total


def ours(decoder: Decoder, vocab: int, repeats: int) -> dict:
    prompt = torch.randint(3, vocab, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    decode = []
    for _ in range(repeats):
        stream = stream_many(decoder, _NoTokenizer, [prompt], [params])
        next(stream)  # prefill and the first token
        t = time.perf_counter()
        n = sum(1 for _ in stream)
        decode.append(n / (time.perf_counter() - t))
    long_prompt = torch.randint(3, vocab, (PREFILL_TOKENS,), generator=torch.Generator().manual_seed(1)).tolist()
    prefill = []
    for _ in range(repeats):
        t = time.perf_counter()
        list(stream_many(decoder, _NoTokenizer, [long_prompt], [SamplingParams(temperature=0.0, max_tokens=1)]))
        prefill.append(PREFILL_TOKENS / (time.perf_counter() - t))
    return {"decode_tok_s": round(max(decode), 2), "prefill_tok_s": round(max(prefill), 1)}


def non_matmul_ms(decoder: Decoder, steps: int = 32) -> float:
    """Median ms of a decode step with every linear layer answering instantly: the time a
    step spends outside the matrix products (norms, rotary, attention, dispatch, Python)."""
    linears = [m for m in decoder.modules() if isinstance(m, (nn.Linear, PackedBF16Linear, Int8Linear))]
    outputs: dict[tuple, torch.Tensor] = {}

    def instant(module):
        def forward(x):
            key = (x.shape[0], module.out_features, x.dtype)
            if key not in outputs:
                outputs[key] = torch.full((x.shape[0], module.out_features), 0.01, dtype=x.dtype)
            return outputs[key]
        return forward

    for m in linears:
        m.forward = instant(m)
    try:
        kv = SequenceKV(decoder.kv_layout(), capacity=PROMPT_TOKENS + steps)
        decoder(torch.arange(PROMPT_TOKENS), torch.arange(PROMPT_TOKENS), [SeqSlice(kv, 0, PROMPT_TOKENS)])
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            decoder(torch.tensor([5]), torch.tensor([kv.length]), [SeqSlice(kv, 0, 1)])
            times.append(time.perf_counter() - t)
    finally:
        for m in linears:
            del m.forward
    return statistics.median(times) * 1000


def to_transformers(decoder: Decoder):
    """A LlamaForCausalLM holding the same weights (q/k/v and gate/up split back apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = decoder.config
    hf_config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                            num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                            num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                            max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                            rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    state = {"model.embed_tokens.weight": decoder.embed_tokens.weight, "model.norm.weight": decoder.norm.weight,
             "lm_head.weight": decoder.lm_head.weight}
    for i, layer in enumerate(decoder.layers):
        p = f"model.layers.{i}"
        wq, wk, wv = layer.self_attn.qkv_proj.weight.split([q, kv, kv])
        gate, up = layer.mlp.gate_up_proj.weight.split(c.intermediate_size)
        state.update({f"{p}.self_attn.q_proj.weight": wq, f"{p}.self_attn.k_proj.weight": wk,
                      f"{p}.self_attn.v_proj.weight": wv, f"{p}.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
                      f"{p}.mlp.gate_proj.weight": gate, f"{p}.mlp.up_proj.weight": up,
                      f"{p}.mlp.down_proj.weight": layer.mlp.down_proj.weight,
                      f"{p}.input_layernorm.weight": layer.input_layernorm.weight,
                      f"{p}.post_attention_layernorm.weight": layer.post_attention_layernorm.weight})
    model.load_state_dict({k: v.contiguous() for k, v in state.items()}, assign=True, strict=False)
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_config)  # its buffers were built on meta
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


@torch.inference_mode()
def theirs(model, vocab: int, repeats: int) -> dict:
    def timed_generate(num_prompt: int, num_new: int, seed: int) -> float:
        ids = torch.randint(3, vocab, (1, num_prompt), generator=torch.Generator().manual_seed(seed))
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new, min_new_tokens=num_new,
                       do_sample=False, pad_token_id=0)
        return time.perf_counter() - t

    decode, prefill = [], []
    for _ in range(repeats):
        first = timed_generate(PROMPT_TOKENS, 1, 0)
        whole = timed_generate(PROMPT_TOKENS, NEW_TOKENS, 0)
        decode.append((NEW_TOKENS - 1) / max(whole - first, 1e-9))
        prefill.append(PREFILL_TOKENS / timed_generate(PREFILL_TOKENS, 1, 1))
    return {"decode_tok_s": round(max(decode), 2), "prefill_tok_s": round(max(prefill), 1)}


def random_decoder(config: ModelConfig, dtype: torch.dtype) -> Decoder:
    """Random weights (std 0.02, norms 1), the same for every dtype: drawn in fp32 per tensor."""
    with torch.device("meta"):
        decoder = Decoder(config, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    state = {name: (torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=g) * 0.02).to(dtype)
             for name, p in decoder.named_parameters()}
    decoder.load_state_dict(state, assign=True, strict=True)
    decoder.rotary = type(decoder.rotary)(config, dtype)  # built on meta above
    return decoder


def load_variant(name: str, variant: str) -> Decoder:
    """Model `name` in one of VARIANTS: a dtype, with its linear layers prepared for the CPU."""
    dtype, int8 = VARIANTS[variant]
    if name == "smollm2":
        files = open_model(None)
        decoder = load_decoder(files.source, files.config, dtype=dtype)
    else:
        decoder = random_decoder(TINYLLAMA, dtype)
    return prepare_for_cpu(decoder, "int8" if int8 else None, batch_invariant=False)


def bench_model(name: str, variants: list[str], bandwidth: float, args) -> dict:
    result: dict = {"ours": {}}
    peer = LLAMA_CPP_BF16[name]
    for variant in variants:
        t = time.perf_counter()
        decoder = load_variant(name, variant)
        load_s = time.perf_counter() - t
        vocab = decoder.config.vocab_size
        figures = ours(decoder, vocab, args.repeats)
        step_ms = 1000 / figures["decode_tok_s"]
        outside = non_matmul_ms(decoder)
        figures["decode_step_ms"] = {"total": round(step_ms, 2), "matmuls": round(step_ms - outside, 2),
                                     "outside_matmuls": round(outside, 2)}
        weight_bytes = weight_bytes_per_token(decoder)
        bound = bandwidth * 1e9 / weight_bytes
        figures.update(load_s=round(load_s, 1), weight_mb_per_token=round(weight_bytes / 1e6, 1),
                       bandwidth_bound_tok_s=round(bound, 1), fraction_of_bound=round(figures["decode_tok_s"] / bound, 3),
                       vs_llama_cpp_bf16={  # ours / llama.cpp's low and high figures
                           "decode": [round(figures["decode_tok_s"] / x, 2) for x in peer["decode"]],
                           "prefill": [round(figures["prefill_tok_s"] / x, 1 if x > 200 else 2) for x in peer["prefill"]]})
        result["ours"][variant] = figures
        if variant == variants[0] and not args.skip_transformers:
            # transformers on the first variant's weights (a plain dtype: its own nn.Linear layers).
            model = to_transformers(decoder)
            theirs_figures = theirs(model, vocab, args.repeats)
            theirs_figures["dtype"] = variant
            theirs_figures["fraction_of_bound"] = round(theirs_figures["decode_tok_s"] / bound, 3)
            result["transformers"] = theirs_figures
            del model
        del decoder
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="fp16,bf16,int8",
                        help=f"comma-separated, the first also runs transformers: {', '.join(VARIANTS)} "
                             f"(bf16 is oneDNN-prepacked, int8 is weight-only int8 with fp16 activations)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--models", default="smollm2,tinyllama", help="comma-separated: smollm2, tinyllama")
    parser.add_argument("--repeats", type=int, default=1, help="runs per figure; the best is reported")
    parser.add_argument("--skip-transformers", action="store_true", help="only our figures")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    bandwidth = read_bandwidth_gbs()
    out = {"torch": torch.__version__, "cpu": _cpu_name(), "threads": torch.get_num_threads(),
           "read_bandwidth_gb_s": round(bandwidth, 1), "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
           "prefill_tokens": PREFILL_TOKENS, "auto_dtype": AUTO_DTYPE["cpu"], "models": {}}
    for name in args.models.split(","):
        out["models"][name] = bench_model(name, variants, bandwidth, args)
    print(json.dumps(out, indent=2))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
