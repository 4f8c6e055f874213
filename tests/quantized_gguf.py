"""Tiny random Llama (and Phi-3) models written as GGUF files of one quant type, for quantized-path tests.

The vocabulary (and the tokenizer metadata, copied verbatim) is the SmolLM2 demo GGUF's, so
`open_model` reads the file like any real one; the layers are random and small, 256 wide so
every type's blocks (256 for the K-quants) tile the rows. Weights are quantized by ggml's own
quantizer (what llama-quantize runs) and q/k rows permuted the way llama.cpp's converter does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFWriter
from gguf.constants import GGMLQuantizationType as GGML

from meshllm.engine.ggml_lib import Runtime
from meshllm.engine.ggml_weights import quantize
from meshllm.model.gguf import GGUFFile

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py LlamaModel.permute: HF half-rotated rows -> ggml interleaved pairs
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def copy_tokenizer(meta: dict, writer: GGUFWriter) -> None:
    """The `tokenizer.*` keys of a GGUF's metadata, written into another GGUF (a random model
    that speaks the real model's vocabulary)."""
    for key, value in meta.items():
        if key.startswith("tokenizer."):
            if isinstance(value, np.ndarray):
                writer.add_array(key, value.tolist())
            elif isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, bool):
                writer.add_bool(key, value)
            else:
                writer.add_uint32(key, int(value))


def write_quantized_llama(rt: Runtime | None, tokenizer_gguf: Path, out: Path, ggml_type: GGML, num_layers: int = 3,
                          seed: int = 0, embedding_type: GGML = GGML.Q8_0, head_type: GGML | None = None,
                          arch: str = "llama", sliding_window: int = 0, experts: int = 0,
                          rope_dims: int = HEAD_DIM) -> Path:
    """`embedding_type` Q8_0 or BF16; `head_type` given: an LM head of its own (output.weight) in
    that type, else the head is tied to the embedding. `arch` "phi3": the same computation as
    llama.cpp writes Phi-3 and Phi-4 (fused attn_qkv and gate-up ffn_up, rows not permuted), with
    `sliding_window` (0: none, as Phi-4), and `rope_dims` below HEAD_DIM a partial rotary
    (Phi-4-mini). "gemma3": Gemma 3's layers (four norms stored as 1 + w, q/k norms, GELU), every third a full-attention layer, the others windowed by `sliding_window`.
    `experts` > 0: each MLP a mixture of that many experts, 2 a token, stored as llama.cpp stores
    them ([experts, rows, cols] per projection; F32 router): Mixtral as "llama", Qwen3-MoE as
    "qwen3moe" (with q/k norms). "smollm3": Llama's layers, every fourth without rotary. `rt` None (no ggml build, as on a GPU host): the plain types
    only (engine/ggml_weights.quantize)."""
    assert arch in ("llama", "phi3", "gemma3", "qwen3moe", "smollm3")
    assert arch in ("phi3", "gemma3") or not sliding_window
    assert rope_dims == HEAD_DIM or arch == "phi3"
    assert (arch == "qwen3moe") <= (experts > 0)
    meta = GGUFFile.open(tokenizer_gguf).metadata
    vocab = len(meta["tokenizer.ggml.tokens"])
    w = GGUFWriter(out, arch)
    w.add_block_count(num_layers)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_rope_dimension_count(rope_dims)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(1e6 if arch == "gemma3" else 10000.0)  # Gemma 3's full layers'; its windowed ones 10000
    if arch == "phi3":
        w.add_sliding_window(sliding_window)
    if arch == "gemma3":
        w.add_sliding_window(sliding_window)
        w.add_sliding_window_pattern(3)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
        if arch == "qwen3moe":
            w.add_expert_feed_forward_length(INTERMEDIATE)
    copy_tokenizer(meta, w)
    g = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=g) / cols ** 0.5

    def blocks_of(weight: torch.Tensor, kind: GGML) -> np.ndarray:
        return quantize(rt, weight, kind).data.numpy()

    def add_blocks(name: str, weight: torch.Tensor, kind: GGML) -> None:
        blocks = blocks_of(weight, kind)
        w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    def add(name: str, weight: torch.Tensor, kind: GGML) -> None:
        if kind == GGML.BF16:
            raw = weight.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=kind)
        else:
            add_blocks(name, weight, kind)

    # The embedding is Q8_0 as llama.cpp's converters keep it for most types (tied to the head).
    add("token_embd.weight", torch.randn(vocab, HIDDEN, generator=g), embedding_type)
    if head_type is not None:
        add("output.weight", matrix(vocab, HIDDEN), head_type)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(num_layers):
        q, k = matrix(HEADS * HEAD_DIM, HIDDEN), matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        v = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        if arch == "phi3":
            add_blocks(f"blk.{i}.attn_qkv.weight", torch.cat([q, k, v]), ggml_type)
        elif arch in ("gemma3", "qwen3moe"):
            for name, weight in (("attn_q", q), ("attn_k", k), ("attn_v", v)):
                add_blocks(f"blk.{i}.{name}.weight", weight, ggml_type)
            norms = [("attn_q_norm", HEAD_DIM), ("attn_k_norm", HEAD_DIM)]
            if arch == "gemma3":
                norms += [("post_attention_norm", HIDDEN), ("post_ffw_norm", HIDDEN)]
            for name, size in norms:
                w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * torch.randn(size, generator=g)).numpy())
        else:
            add_blocks(f"blk.{i}.attn_q.weight", torch.from_numpy(_permute(q.numpy(), HEADS)), ggml_type)
            add_blocks(f"blk.{i}.attn_k.weight", torch.from_numpy(_permute(k.numpy(), KV_HEADS)), ggml_type)
            add_blocks(f"blk.{i}.attn_v.weight", v, ggml_type)
        add_blocks(f"blk.{i}.attn_output.weight", matrix(HIDDEN, HEADS * HEAD_DIM), ggml_type)
        gate, up = matrix(INTERMEDIATE, HIDDEN), matrix(INTERMEDIATE, HIDDEN)
        if experts:
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", matrix(experts, HIDDEN).numpy())
            for name, rows, cols in (("gate", INTERMEDIATE, HIDDEN), ("up", INTERMEDIATE, HIDDEN),
                                     ("down", HIDDEN, INTERMEDIATE)):
                data = blocks_of(torch.cat([matrix(rows, cols) for _ in range(experts)]), ggml_type)
                data = data.reshape(experts, rows, -1)
                w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", data, raw_shape=data.shape, raw_dtype=ggml_type)
        elif arch == "phi3":
            add_blocks(f"blk.{i}.ffn_up.weight", torch.cat([gate, up]), ggml_type)
        else:
            add_blocks(f"blk.{i}.ffn_gate.weight", gate, ggml_type)
            add_blocks(f"blk.{i}.ffn_up.weight", up, ggml_type)
        if not experts:
            add_blocks(f"blk.{i}.ffn_down.weight", matrix(HIDDEN, INTERMEDIATE), ggml_type)
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * torch.randn(HIDDEN, generator=g)).numpy())
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * torch.randn(HIDDEN, generator=g)).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
