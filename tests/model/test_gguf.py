"""GGUF loading: dequantization per type, name map + q/k unpermutation, config, layer ranges, bad files.

Small GGUF files are written in tmp_path with gguf.GGUFWriter from real tensors (the tiny random
HF models of tests/conftest.py, converted the way llama.cpp's converter does). The golden test
loads the real SmolLM2-135M-Instruct Q4_1 GGUF and compares with transformers on the same file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, quants
from gguf.constants import ExpertGatingFuncType, GGMLQuantizationType as GGML, RopeScalingType
from hypothesis import HealthCheck, given, settings, strategies as st

from meshllm.errors import CorruptWeights, MeshError, ModelLoadError, UnsupportedArchitecture
from meshllm.model import moe
from meshllm.model.gguf import GGUFFile, GGUFSource, dequantize
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource

# HF name pieces -> GGUF (the inverse of meshllm.model.gguf's map, as llama.cpp names them)
_TO_GGUF = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


# Gemma's four norms (llama.cpp's names; its ffn_norm is the one before the MLP)
_GEMMA_TO_GGUF = {**_TO_GGUF, "post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
# GLM-4's norms after attention and the MLP
_GLM4_TO_GGUF = {**_TO_GGUF, "post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm"}
# GPT-OSS's norm before the MLP (llama.cpp's post_attention_norm) and its sinks
_GPT_OSS_TO_GGUF = {**_TO_GGUF, "post_attention_layernorm": "post_attention_norm"}
# GLM-4.5's the same, and its shared expert
_GLM4_MOE_TO_GGUF = {**_GPT_OSS_TO_GGUF, "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
                     "mlp.shared_experts.up_proj": "ffn_up_shexp", "mlp.shared_experts.down_proj": "ffn_down_shexp"}
# Qwen2-MoE's shared expert and its gate
_QWEN2_MOE_TO_GGUF = {**_TO_GGUF, "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
                      "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
                      "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _gguf_name(hf: str, arch: str = "llama") -> str:
    if hf.startswith("model.layers.") and hf.endswith(".self_attn.sinks"):
        return f"blk.{hf.split('.')[2]}.attn_sinks.weight"
    if hf.startswith("model.layers."):
        _, _, index, rest = hf.split(".", 3)
        stem, suffix = rest.rsplit(".", 1)
        names = {"gemma2": _GEMMA_TO_GGUF, "gemma3": _GEMMA_TO_GGUF, "glm4": _GLM4_TO_GGUF,
                 "gpt-oss": _GPT_OSS_TO_GGUF, "glm4moe": _GLM4_MOE_TO_GGUF,
                 "qwen2moe": _QWEN2_MOE_TO_GGUF}.get(arch, _TO_GGUF)
        return f"blk.{index}.{names[stem]}.{suffix}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_model_gguf(folder: Path, out: Path, arch: str, rope_freqs: np.ndarray | None = None,
                     nextn: int = 0, experts_type: GGML | None = None, types: dict[str, GGML] | None = None,
                     expert_width: bool = True) -> Path:
    """Convert a HF safetensors folder to an F32 GGUF as llama.cpp would (metadata, names, q/k
    permutation; for phi3 fused attn_qkv and gate-up ffn_up, the sliding window and LongRoPE).
    `nextn`: that many multi-token-prediction blocks after the model's (GLM-4.5's, GLM-OCR's),
    here copies of its last block's tensors, which a reader must skip. `experts_type`: the
    experts tensors quantized to it (GPT-OSS's files hold them MXFP4). `types`: GGUF name pieces
    ("attn_v") whose tensors are quantized to that type (as llama.cpp's K-quant mixes keep some
    matrices in another type than the rest). `expert_width=False`: a qwen2moe file as converters
    before June 2024 wrote them, without expert_feed_forward_length."""
    source = SafetensorsSource(folder)
    cfg = source.config()
    hf = json.loads((folder / "config.json").read_text())
    w = GGUFWriter(out, arch)
    w.add_block_count(cfg.num_hidden_layers + nextn)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_context_length(int(hf["max_position_embeddings"]))
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotated_dims)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    tensors = source.read(source.tensor_names(), torch.float32)
    if arch == "gemma3":  # conversion/gemma.py Gemma3Model
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(list(cfg.sliding_layers))
        w.add_rope_freq_base_swa(cfg.local_rope_theta)
        if cfg.rope_linear_factor != 1.0:
            w.add_rope_scaling_type(RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(cfg.rope_linear_factor)
    if arch == "gemma2":  # conversion/gemma.py Gemma2Model: the caps and the window, no pattern
        w.add_attn_logit_softcapping(cfg.attn_softcap)
        w.add_final_logit_softcapping(cfg.final_softcap)
        w.add_sliding_window(cfg.sliding_window)
    if arch in ("gemma2", "gemma3"):
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = tensors[name] + 1  # its converter stores Gemma's 1 + w
    if cfg.num_experts:  # conversion: each projection's experts stacked [experts, rows, cols]; F32 router
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if arch in ("qwen3moe", "gpt-oss"):
            w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
        if arch == "gpt-oss":  # conversion/gpt_oss.py GptOssModel (experts not MXFP4: as they are, de-interleaved)
            w.add_sliding_window(cfg.sliding_window)
        if arch == "glm4moe":  # conversion/glm.py Glm4MoeModel
            w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
            w.add_expert_shared_count(cfg.shared_expert_size // cfg.expert_intermediate_size)
            w.add_leading_dense_block_count(cfg.dense_layers)
            w.add_expert_weights_scale(cfg.expert_weights_scale)
            w.add_expert_weights_norm(cfg.normalize_expert_weights)
        if arch == "minimax-m2":  # conversion/minimax.py MiniMaxM2Model
            w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
        if arch == "qwen2moe":  # conversion/qwen.py Qwen2MoeModel: the shared gate a vector [hidden]
            if expert_width:
                w.add_expert_feed_forward_length(cfg.expert_intermediate_size)
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_size)
            for i in range(cfg.num_hidden_layers):
                name = moe.shared_gate_name(i)
                w.add_tensor(_gguf_name(name, arch), tensors.pop(name).reshape(-1).numpy())
        if cfg.sigmoid_router:  # conversion/base.py: scoring_func "sigmoid"; the bias as exp_probs_b
            w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
            for i in range(cfg.dense_layers, cfg.num_hidden_layers):
                bias = tensors.pop(moe.selection_bias_name(cfg.model_type, i))
                w.add_tensor(f"blk.{i}.exp_probs_b.bias", bias.numpy())
        for i in range(cfg.dense_layers, cfg.num_hidden_layers):
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors.pop(moe.router_name(cfg.model_type, i)).numpy())
            names = [moe.expert_names(cfg.model_type, i, e) for e in range(cfg.num_experts)]
            for index, projection in enumerate(("gate", "up", "down")):
                stacked = torch.stack([tensors.pop(expert[index]) for expert in names]).numpy()
                if experts_type is None:
                    w.add_tensor(f"blk.{i}.ffn_{projection}_exps.weight", stacked)
                else:
                    w.add_tensor(f"blk.{i}.ffn_{projection}_exps.weight", quants.quantize(stacked, experts_type),
                                 raw_dtype=experts_type)
            if cfg.expert_biases:
                w.add_tensor(f"blk.{i}.ffn_gate_inp.bias", tensors.pop(moe.router_bias_name(i)).numpy())
                biases = [moe.expert_bias_names(i, e) for e in range(cfg.num_experts)]
                for index, projection in enumerate(("gate", "up", "down")):
                    stacked = torch.stack([tensors.pop(expert[index]) for expert in biases])
                    w.add_tensor(f"blk.{i}.ffn_{projection}_exps.bias", stacked.numpy())
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":  # conversion/base.py: type, factor, original context, betas if named
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":  # conversion/granite.py GraniteModel: the multipliers as scales
        w.add_attention_scale(cfg.attention_scale)
        w.add_embedding_scale(cfg.embedding_scale)
        w.add_residual_scale(cfg.residual_scale)
        w.add_logit_scale(cfg.logit_scale)
    if arch == "glm4":  # conversion/glm.py Glm4Model: gate-up ffn_up
        for i in range(cfg.num_hidden_layers):
            gate_up = [tensors.pop(f"model.layers.{i}.mlp.{p}_proj.weight") for p in ("gate", "up")]
            w.add_tensor(f"blk.{i}.ffn_up.weight", torch.cat(gate_up).numpy())
    if arch == "phi3":  # conversion/phi.py Phi3MiniModel
        w.add_sliding_window(cfg.sliding_window or 0)
        rope = hf.get("rope_parameters") or {}
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(int(hf["original_max_position_embeddings"]))
            w.add_rope_scaling_attn_factors(cfg.rope_attention_factor)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
        for i in range(cfg.num_hidden_layers):
            layer = f"model.layers.{i}"
            qkv = [tensors.pop(f"{layer}.self_attn.{p}_proj.weight") for p in "qkv"]
            gate_up = [tensors.pop(f"{layer}.mlp.{p}_proj.weight") for p in ("gate", "up")]
            w.add_tensor(f"blk.{i}.attn_qkv.weight", torch.cat(qkv).numpy())
            w.add_tensor(f"blk.{i}.ffn_up.weight", torch.cat(gate_up).numpy())
    # q/k rows in pairs: Llama's converter (LlamaModel.permute) turns whole heads so for ggml's rope;
    # GLM-4 is trained so on its turned dims, and its converter writes them as they are
    pairs = {"llama": cfg.head_dim, "smollm3": cfg.head_dim, "granite": cfg.head_dim, "glm4": cfg.rotated_dims}
    for name, tensor in tensors.items():
        if arch in pairs and (".q_proj." in name or ".k_proj." in name):
            tensor = _interleaved(tensor, cfg.head_dim, pairs[arch])
        gguf_name = _gguf_name(name, arch)
        kind = (types or {}).get(gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None)
        if kind is not None and gguf_name.endswith(".weight"):
            w.add_tensor(gguf_name, quants.quantize(tensor.numpy(), kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(tensor.numpy()))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    last = f"blk.{cfg.num_hidden_layers - 1}."
    for extra in range(cfg.num_hidden_layers, cfg.num_hidden_layers + nextn):
        for name, info in list(w.tensors[0].items()):
            if name.startswith(last):
                w.add_tensor(name.replace(last, f"blk.{extra}.", 1), info.tensor)
    _finish(w)
    return out


def _interleaved(w: torch.Tensor, head_dim: int, rotated: int) -> torch.Tensor:
    """The inverse of model/rope_rows.py: each head's first `rotated` rows back in pairs."""
    heads = w.reshape(-1, head_dim, *w.shape[1:])
    halves = heads[:, :rotated].reshape(heads.shape[0], 2, rotated // 2, *w.shape[1:]).transpose(1, 2)
    turned = halves.reshape(heads.shape[0], rotated, *w.shape[1:])
    return torch.cat((turned, heads[:, rotated:]), dim=1).reshape(w.shape)


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_tensors(path: Path, tensors: dict[str, tuple[np.ndarray, GGML]], arch: str = "llama") -> Path:
    w = GGUFWriter(path, arch)
    for name, (data, ggml_type) in tensors.items():
        w.add_tensor(name, data, raw_dtype=ggml_type)
    _finish(w)
    return path


def _logits(source, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_decoder(source, source.config()).forward_full(tokens)


# ---------------------------------------------------------------- dequantization per type

def _values(rows: int, cols: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def test_float_types_load_exactly(tmp_path):
    x = _values(8, 64, 0)
    path = _write_tensors(tmp_path / "f.gguf", {
        "f32": (x, GGML.F32), "f16": (x.astype(np.float16), GGML.F16),
        "bf16": (quants.quantize(x, GGML.BF16), GGML.BF16)})
    file = GGUFFile.open(path)
    assert torch.equal(dequantize(file, file.tensors["f32"], torch.float32), torch.from_numpy(x))
    as_f16 = torch.from_numpy(x).to(torch.float16)
    assert torch.equal(dequantize(file, file.tensors["f16"], torch.float16), as_f16)
    assert torch.equal(dequantize(file, file.tensors["f16"], torch.float32), as_f16.float())
    as_bf16 = torch.from_numpy(x).to(torch.bfloat16)  # both round to nearest even
    assert torch.equal(dequantize(file, file.tensors["bf16"], torch.bfloat16), as_bf16)
    assert dequantize(file, file.tensors["bf16"], torch.float32).shape == (8, 64)


# max error per value, as a fraction of its 32-value block's largest magnitude (or range for Q4_1).
# Q4_0 spans [-8d, 7d] with d = amax/8, so a value opposite the largest one can be clipped by d.
_BLOCK_ERROR = {GGML.Q8_0: 1 / 127 / 2, GGML.Q4_0: 1 / 8, GGML.Q4_1: 1 / 15 / 2}


@pytest.mark.parametrize("ggml_type", list(_BLOCK_ERROR), ids=lambda t: t.name)
def test_block_quants_dequantize_within_their_error(tmp_path, ggml_type):
    x = _values(16, 256, 1)
    file = GGUFFile.open(_write_tensors(tmp_path / "q.gguf", {"w": (quants.quantize(x, ggml_type), ggml_type)}))
    got = dequantize(file, file.tensors["w"], torch.float32).numpy()
    assert got.shape == x.shape
    blocks, err = x.reshape(-1, 32), np.abs(got - x).reshape(-1, 32)
    span = np.ptp(blocks, axis=1) if ggml_type == GGML.Q4_1 else np.abs(blocks).max(axis=1)
    # fp16 scales (and Q4_1's fp16 minimum) add at most a relative 2^-11 of the value on top of the rounding
    fp16_error = (np.abs(blocks) + span[:, None]) * 2.0 ** -10
    assert (err <= (span * _BLOCK_ERROR[ggml_type])[:, None] + fp16_error + 1e-6).all()
    assert err.max() > 0  # it really was quantized


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _encode_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A plain Q6_K encoder (ggml block_q6_K layout), with each value's quantization step."""
    blocks = x.reshape(-1, 256)
    sub = blocks.reshape(-1, 16, 16)
    wanted = np.abs(sub).max(axis=2) / 31  # step per 16 values so that q - 32 spans [-32, 31]
    d = _fp16(wanted.max(axis=1) / 127)
    scales = np.clip(np.ceil(wanted / d[:, None]), 1, 127).astype(np.int8)
    step = d[:, None] * scales
    q = np.clip(np.rint(sub / step[..., None]) + 32, 0, 63).astype(np.uint8).reshape(-1, 2, 4, 32)
    # per 128-value half: ql holds low nibbles of quarters (0,2) and (1,3), qh the 2-bit tops
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    raw = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales.view(np.uint8),
                          d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)
    return raw.reshape(x.shape[0], -1), np.repeat(step, 16, axis=1).reshape(x.shape)


def _encode_q4_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A plain Q4_K encoder (ggml block_q4_K layout), with each value's error bound."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)
    wanted = (sub.max(axis=2) - low) / 15
    d, dmin = _fp16(wanted.max(axis=1) / 63), _fp16(-low.min(axis=1) / 63)
    sc = np.clip(np.ceil(wanted / d[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(-low / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step, offset = d[:, None] * sc, dmin[:, None] * m
    q = np.clip(np.rint((sub + offset[..., None]) / step[..., None]), 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(-1, 128)
    packed = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1)
    raw = np.concatenate([d.astype(np.float16).view(np.uint8).reshape(-1, 2),
                          dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    bound = step / 2 + dmin[:, None] / 2
    return raw.reshape(x.shape[0], -1), np.repeat(bound, 32, axis=1).reshape(x.shape)


def test_k_quants_dequantize_to_what_was_encoded(tmp_path):
    # gguf cannot quantize K types, so blocks come from the plain encoders above.
    x = _values(8, 512, 2)
    q6, q6_step = _encode_q6_k(x)
    q4, q4_bound = _encode_q4_k(x)
    file = GGUFFile.open(_write_tensors(tmp_path / "k.gguf", {"q6": (q6, GGML.Q6_K), "q4": (q4, GGML.Q4_K)}))
    got6 = dequantize(file, file.tensors["q6"], torch.float32).numpy()
    got4 = dequantize(file, file.tensors["q4"], torch.float32).numpy()
    assert got6.shape == got4.shape == x.shape
    assert (np.abs(got6 - x) <= q6_step * 0.501 + 1e-6).all()
    assert (np.abs(got4 - x) <= q4_bound * 1.001 + 1e-6).all()
    assert np.abs(got6 - x).mean() < 0.02 and np.abs(got4 - x).mean() < 0.1


@pytest.mark.parametrize("ggml_type", [GGML.Q8_0, GGML.Q4_0, GGML.Q4_1, GGML.Q4_K, GGML.Q6_K], ids=lambda t: t.name)
def test_dequantize_matches_transformers_on_random_blocks(tmp_path, ggml_type):
    # An independent implementation (transformers' torch dequantizer) on arbitrary bit patterns.
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize as hf_dequantize

    block_values, block_bytes = GGML_BLOCK[ggml_type]
    rows, blocks_per_row = 6, 2
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, (rows * blocks_per_row, block_bytes), dtype=np.uint8)
    halves = _fp16(rng.uniform(-0.1, 0.1, (raw.shape[0], 2))).astype(np.float16).view(np.uint8)
    if ggml_type == GGML.Q6_K:
        raw[:, 208:210] = halves[:, :2]  # d sits at the end of a Q6_K block
    else:  # d (and dmin / m) first
        raw[:, :4] = halves if ggml_type in (GGML.Q4_1, GGML.Q4_K) else np.c_[halves[:, :2], raw[:, 2:4]]
    raw = raw.reshape(rows, -1)
    file = GGUFFile.open(_write_tensors(tmp_path / "r.gguf", {"w": (raw, ggml_type)}))
    ours = dequantize(file, file.tensors["w"], torch.float32)
    reference = hf_dequantize(torch.from_numpy(raw.copy()).reshape(-1), int(ggml_type)).reshape(ours.shape)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- models: names, permutation, config

LLAMA3_STANDARD = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192, rope_theta=500000.0)


def _llama3_rope_freqs(head_dim: int) -> np.ndarray:
    # What llama.cpp's converter writes for Llama 3.1 (convert_hf_to_gguf.py, LlamaModel.generate_extra_tensors)
    import math
    freqs = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(8.0)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / 8 + smooth))
    return np.array(out)


@pytest.mark.parametrize("variant,arch", [("llama", "llama"), ("llama-mha-tied", "llama"), ("qwen2", "qwen2"),
                                          ("qwen3", "qwen3"), ("llama3", "llama"), ("phi3", "phi3"),
                                          ("phi3-longrope", "phi3"), ("phi3-partial", "phi3"), ("gemma3", "gemma3"),
                                          ("gemma2", "gemma2"), ("gpt-oss", "gpt-oss"),
                                          ("qwen3-moe", "qwen3moe"), ("smollm3", "smollm3"), ("granite", "granite"),
                                          ("qwen3-yarn", "qwen3"), ("glm4", "glm4"), ("glm4-moe", "glm4moe"),
                                          ("mixtral", "llama"), ("minimax-m2", "minimax-m2"),
                                          ("qwen2-moe", "qwen2moe")])
def test_gguf_model_matches_its_safetensors_original(tiny_model_dir, tmp_path, variant, arch):
    overrides = {"rope_parameters": LLAMA3_STANDARD} if variant == "llama3" else {}
    if variant in ("gemma2", "gemma3"):  # a GGUF has no query_pre_attn_scalar: llama.cpp takes head_dim (27B aside)
        overrides = {"query_pre_attn_scalar": 16}
    if variant == "gpt-oss":  # a GGUF has no swiglu_limit: llama.cpp takes GPT-OSS's 7
        overrides = {"swiglu_limit": 7.0}
    if variant == "qwen3-moe":  # llama.cpp renormalizes Qwen3-MoE's chosen experts, as its models all say
        overrides = {"norm_topk_prob": True}
    folder = tiny_model_dir(variant, **overrides)
    hf = SafetensorsSource(folder)
    freqs = _llama3_rope_freqs(hf.config().head_dim) if variant == "llama3" else None
    gguf = GGUFSource(write_model_gguf(folder, tmp_path / "m.gguf", arch, rope_freqs=freqs))
    ours, theirs = gguf.config(), hf.config()
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "rotary_dim", "rope_theta", "rope_scaling",
                  "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id", "sliding_window",
                  "max_position_embeddings", "rope_factors", "rope_attention_factor", "hidden_act",
                  "embedding_scale", "sandwich_norms", "attention_scale", "sliding_layers", "local_rope_theta",
                  "rope_linear_factor", "num_experts", "num_experts_per_tok", "expert_intermediate_size",
                  "normalize_expert_weights", "rope_layers", "residual_scale", "logit_scale",
                  "attn_softcap", "final_softcap", "expert_biases", "softmax_after_topk", "swiglu_limit",
                  "o_proj_bias", "attention_sinks", "sigmoid_router", "expert_weights_scale",
                  "shared_expert_size", "dense_layers", "qk_norm_across_heads", "shared_expert_gated"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert set(gguf.tensor_names()) == set(hf.tensor_names())
    names = hf.tensor_names()
    # q/k rows come back in HF order: llama.cpp's permutation is undone exactly
    # Gemma's norm weights are stored as 1 + w, and so its config adds nothing at load
    gemma = arch in ("gemma2", "gemma3")
    assert (ours.norm_weight_offset, theirs.norm_weight_offset) == ((0.0, 1.0) if gemma else (0.0, 0.0))
    for name, tensor in gguf.read(names, torch.float32).items():
        want = hf.read([name], torch.float32)[name]
        assert torch.equal(tensor, want + 1 if gemma and name.endswith("norm.weight") else want), name
    tokens = torch.randint(0, theirs.vocab_size, (12,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(gguf, tokens), _logits(hf, tokens))


def test_a_qwen2moe_file_without_its_expert_width_takes_llama_cpps_default(tiny_model_dir, tmp_path):
    # converters before June 2024 wrote none: llama.cpp takes feed_forward_length / experts per
    # token (Qwen1.5-MoE-A2.7B: 5632 / 4 = 1408), here 128 / 2 (found by review: such files failed)
    folder = tiny_model_dir("qwen2-moe", intermediate_size=128)
    gguf = GGUFSource(write_model_gguf(folder, tmp_path / "m.gguf", "qwen2moe", expert_width=False))
    assert "qwen2moe.expert_feed_forward_length" not in gguf.file.metadata
    assert gguf.config().expert_intermediate_size == 64 == SafetensorsSource(folder).config().expert_intermediate_size
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(gguf, tokens), _logits(SafetensorsSource(folder), tokens))


def test_multi_token_prediction_blocks_are_skipped(tiny_model_dir, tmp_path):
    # GLM-4.5 and GLM-OCR files end with nextn_predict_layers blocks that llama.cpp skips; run as
    # layers they moved logits by ~3 (found by a QA pass)
    folder = tiny_model_dir("glm4")
    hf = SafetensorsSource(folder)
    gguf = GGUFSource(write_model_gguf(folder, tmp_path / "m.gguf", "glm4", nextn=1))
    assert f"blk.{hf.config().num_hidden_layers}.attn_q.weight" in gguf.file.tensors
    assert gguf.config().num_hidden_layers == hf.config().num_hidden_layers
    tokens = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(gguf, tokens), _logits(hf, tokens))


def test_glm4_rows_are_written_as_the_checkpoint_stores_them(tiny_model_dir, tmp_path):
    # the conversion above writes q/k back in GLM's pairs: exactly the checkpoint's own rows
    from safetensors.torch import load_file

    folder = tiny_model_dir("glm4")
    stored = load_file(folder / "model.safetensors")
    gguf = GGUFSource(write_model_gguf(folder, tmp_path / "m.gguf", "glm4"))
    for name in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"):
        info = gguf.file.tensors[f"blk.1.{name}"]
        hf_name = "model.layers.1.self_attn." + {"attn_q": "q_proj", "attn_k": "k_proj"}[name.split(".")[0]] + \
            "." + name.split(".")[1]
        assert np.array_equal(np.asarray(gguf.file.raw(info)).view(np.float32).reshape(stored[hf_name].shape),
                              stored[hf_name].numpy()), name


def test_layer_range_reads_only_its_tensors(tiny_model_dir, tmp_path):
    source = GGUFSource(write_model_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "llama"))
    load_decoder(source, source.config(), first_layer=1, last_layer=3)
    wanted = [i for i in source.file.tensors.values() if i.name.startswith(("blk.1.", "blk.2."))]
    assert source.num_bytes_read() == sum(i.num_bytes for i in wanted)
    assert source.num_bytes_read() < 0.5 * sum(i.num_bytes for i in source.file.tensors.values())


def test_fingerprint_is_stable_cached_and_content_sensitive(tiny_model_dir, tmp_path):
    path = write_model_gguf(tiny_model_dir("llama"), tmp_path / "a.gguf", "llama")
    first = GGUFSource(path).fingerprint()
    assert first == GGUFSource(path).fingerprint()
    cache = json.loads((Path(os.environ["MESHLLM_CACHE_DIR"]) / "fingerprints.json").read_text())
    assert first in cache.values()  # a restart reads it instead of rehashing
    changed = bytearray(path.read_bytes())
    changed[-1] ^= 1  # last byte of the last tensor
    (tmp_path / "b.gguf").write_bytes(bytes(changed))
    assert GGUFSource(tmp_path / "b.gguf").fingerprint() != first


def _resident_mib_of_mapping(start: int) -> float:
    """Resident memory of this process's mapping that begins at address `start` (Linux: /proc/self/smaps).
    Other mappings of the same file (earlier tests' fixtures, transformers' loader) do not count."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's header line: "start-end perms offset dev inode path"
            inside = int(head.split("-")[0], 16) == start
        elif inside and line.startswith("Rss:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no mapping starts at {start:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads resident pages from Linux's /proc")
def test_reading_every_tensor_and_the_fingerprint_leaves_the_file_unmapped(smollm2_gguf_path):
    """A load reads each tensor out of the map once; its pages must not stay in this process's
    resident set (a 40 GB file would otherwise count twice while a stage loads)."""
    path = smollm2_gguf_path.resolve()
    source = GGUFSource(path)  # a fresh mapping: only the header (metadata, vocabulary) read yet
    mapping = source.file.data.ctypes.data  # where the map begins
    before = _resident_mib_of_mapping(mapping)
    names = source.tensor_names()
    for name in names:
        if source.is_block_quantized(name):
            source.read_blocks(name)
        else:
            source.read([name], torch.float32)
    source.fingerprint()  # hashes every byte (this test's cache directory is empty)
    file_mib = path.stat().st_size / 2**20
    assert source.num_bytes_read() > 0.9 * path.stat().st_size
    # Reading one tensor maps pieces of its neighbours too (fault-around; a whole folio where the file
    # system caches in large folios: 40 MiB of this file stayed when only the tensor's own pages were
    # released). Without the release it is the whole file.
    grown = _resident_mib_of_mapping(mapping) - before
    assert grown < 0.1 * file_mib, f"{grown:.1f} MiB of a {file_mib:.1f} MiB file stayed resident"


# ---------------------------------------------------------------- bad files

def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        GGUFSource(tmp_path / "nope.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CorruptWeights, match="GGUF magic"):
        GGUFSource(path)


def test_truncated_file_names_the_tensor(tiny_model_dir, tmp_path):
    path = write_model_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "llama")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CorruptWeights, match=r"tensor '.+' ends at byte \d+ .*truncated"):
        GGUFSource(path)


def test_unsupported_architecture(tmp_path):
    path = _write_tensors(tmp_path / "g.gguf", {"token_embd.weight": (_values(4, 32, 0), GGML.F32)}, arch="gpt2")
    with pytest.raises(UnsupportedArchitecture, match="'gpt2'"):
        GGUFSource(path)


def test_unsupported_quant_type_names_type_and_tensor(tmp_path):
    raw = np.zeros((4, 40), dtype=np.uint8)  # Q8_1: 32 values in 40 bytes; a type ggml keeps in memory only
    path = _write_tensors(tmp_path / "u.gguf", {"blk.0.attn_q.weight": (raw, GGML.Q8_1)})
    with pytest.raises(UnsupportedArchitecture, match=r"'blk.0.attn_q.weight'.*Q8_1"):
        GGUFFile.open(path)


@pytest.fixture(scope="module")
def valid_gguf_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("fuzz") / "v.gguf"
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    w.add_tensor("token_embd.weight", _values(3, 32, 0))
    _finish(w)
    return path.read_bytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_damaged_headers_raise_named_errors_only(tmp_path, valid_gguf_bytes, data):
    blob = bytearray(valid_gguf_bytes)
    if data.draw(st.booleans()):
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(0, len(blob) - 1))] = data.draw(st.integers(0, 255))
    path = tmp_path / "d.gguf"
    path.write_bytes(bytes(blob))
    try:
        file = GGUFFile.open(path)
    except MeshError:
        return  # a named error with a message: what we want
    for info in file.tensors.values():  # opened: every tensor it lists must be readable
        dequantize(file, info, torch.float32)


# ---------------------------------------------------------------- golden: SmolLM2 vs transformers

@pytest.fixture(scope="module")
def smollm2_reference(smollm2_transformers):
    return smollm2_transformers


@pytest.fixture(scope="module")
def smollm2_source(smollm2_gguf_path):
    return GGUFSource(smollm2_gguf_path)


@pytest.mark.slow
def test_smollm2_config_and_tensors_equal_transformers(smollm2_source, smollm2_reference):
    cfg = smollm2_source.config()
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    reference = smollm2_reference.state_dict()
    names = smollm2_source.tensor_names()
    assert set(names) <= set(reference)
    for name, tensor in smollm2_source.read(names, torch.float32).items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_smollm2_logits_and_greedy_tokens_match_transformers(smollm2_source, smollm2_reference):
    decoder = load_decoder(smollm2_source, smollm2_source.config())
    # "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n<|im_start|>assistant\n"
    prompt = [1, 4093, 198, 19161, 253, 1890, 8216, 563, 260, 3426, 30, 2, 198, 1, 520, 9531, 198]
    tokens = torch.tensor(prompt)
    with torch.no_grad():
        ours = decoder.forward_full(tokens)
        theirs = smollm2_reference(tokens[None]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
    eos = 2
    with torch.no_grad():
        expected = smollm2_reference.generate(tokens[None], max_new_tokens=32, do_sample=False, eos_token_id=eos,
                                              pad_token_id=eos)[0, len(prompt):].tolist()
        # Greedy decoding reproduces `expected` exactly iff at every step our argmax, given the same
        # prefix, is the next expected token (induction over steps). One causal forward over
        # prompt + expected gives all 32 of those argmaxes at once, so no 32 separate recomputes.
        logits = decoder.forward_full(torch.tensor(prompt + expected))
    assert len(expected) == 32  # the poem runs past 32 tokens, so all 32 are compared
    ours_next = logits[len(prompt) - 1:-1].argmax(dim=-1).tolist()
    assert ours_next == expected


def test_a_rope_freqs_tensor_of_another_length_is_a_clear_error(tiny_model_dir, tmp_path):
    # Shorter than head_dim / 2: torch.allclose raised RuntimeError, which a node's model scan did
    # not expect (every model left its card); now the file is named as unsupported.
    folder = tiny_model_dir("llama3", rope_parameters=LLAMA3_STANDARD)
    freqs = _llama3_rope_freqs(SafetensorsSource(folder).config().head_dim)[:-1]
    with pytest.raises(UnsupportedArchitecture, match="rope_freqs"):
        GGUFSource(write_model_gguf(folder, tmp_path / "m.gguf", "llama", rope_freqs=freqs)).config()


def test_files_meshllm_cannot_run_say_what_they_are(tmp_path):
    # A split GGUF's later parts (no general metadata: "architecture None" before), a big-endian
    # file ("GGUF version 50331648" before), a Mixtral (llama-architecture MoE: it opened, and
    # failed later naming a missing mlp weight).
    later_part = tmp_path / "m-00002-of-00003.gguf"
    entries = b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<IH", 2, v)
                       for k, v in ((b"split.no", 1), (b"split.count", 3)))
    later_part.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + entries + bytes(64))
    with pytest.raises(ModelLoadError, match="one part of a split GGUF; merge"):
        GGUFSource(later_part)

    embedding = {"token_embd.weight": (_values(4, 32, 0), GGML.F32)}
    big_endian = _write_tensors(tmp_path / "be.gguf", embedding)
    data = bytearray(big_endian.read_bytes())
    data[4:8] = (3).to_bytes(4, "big")
    big_endian.write_bytes(bytes(data))
    with pytest.raises(UnsupportedArchitecture, match="big-endian"):
        GGUFSource(big_endian)

    # Experts meshllm runs: Mixtral's (llama) and Qwen3-MoE's, without shared experts
    w = GGUFWriter(tmp_path / "moe.gguf", "qwen2")
    w.add_expert_count(8)
    w.add_tensor("token_embd.weight", _values(4, 32, 0))
    _finish(w)
    with pytest.raises(UnsupportedArchitecture, match="mixture-of-experts qwen2 model"):
        GGUFSource(tmp_path / "moe.gguf")
    w = GGUFWriter(tmp_path / "shared.gguf", "qwen3moe")
    w.add_expert_count(8)
    w.add_expert_shared_count(1)
    w.add_tensor("token_embd.weight", _values(4, 32, 0))
    _finish(w)
    with pytest.raises(UnsupportedArchitecture, match="shared experts"):
        GGUFSource(tmp_path / "shared.gguf")

    # GLM-4V's text model: M-RoPE sections, its q/k already reordered for them (not GLM-4's pairs)
    w = GGUFWriter(tmp_path / "glm4v.gguf", "glm4")
    w.add_head_count(4)
    w.add_embedding_length(64)
    w.add_rope_dimension_sections([2, 3, 3, 0])
    w.add_tensor("token_embd.weight", _values(4, 32, 0))
    _finish(w)
    with pytest.raises(UnsupportedArchitecture, match="multimodal rope sections"):
        GGUFSource(tmp_path / "glm4v.gguf")
