"""Fused q/k/v and gate/up tensors (Phi-3's checkpoints, llama.cpp's attn_qkv) read as their parts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshllm.errors import ModelLoadError
from meshllm.model.config import ModelConfig
from meshllm.model.fused import FusedPart, split_fused, visible_names
from meshllm.model.tensor_slice import TensorSlice
from meshllm.model.weights import SafetensorsSource


def test_parts_are_row_ranges_in_stored_order(tiny_model_dir):
    config = ModelConfig.from_folder(tiny_model_dir("phi3"))  # 4 heads, 2 KV heads of 16; MLP 112
    parts = split_fused(config, {"model.layers.1.self_attn.qkv_proj.weight": (128, 64),
                                 "model.layers.1.mlp.gate_up_proj.weight": (224, 64),
                                 "model.layers.1.mlp.down_proj.weight": (64, 112)})
    attn, mlp = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    assert parts == {"model.layers.1.self_attn.q_proj.weight": FusedPart(attn, 0, 64),
                     "model.layers.1.self_attn.k_proj.weight": FusedPart(attn, 64, 96),
                     "model.layers.1.self_attn.v_proj.weight": FusedPart(attn, 96, 128),
                     "model.layers.1.mlp.gate_proj.weight": FusedPart(mlp, 0, 112),
                     "model.layers.1.mlp.up_proj.weight": FusedPart(mlp, 112, 224)}
    assert visible_names([attn, mlp, "model.layers.1.mlp.down_proj.weight"], parts) == sorted(
        ["model.layers.1.mlp.down_proj.weight", *parts])


def test_a_fused_tensor_of_the_wrong_size_is_refused_by_name(tiny_model_dir):
    config = ModelConfig.from_folder(tiny_model_dir("phi3"))
    with pytest.raises(ModelLoadError, match=r"qkv_proj.weight.*\[120, 64\].*128 rows \(64 \+ 32 \+ 32\)"):
        split_fused(config, {"model.layers.0.self_attn.qkv_proj.weight": (120, 64)})


def test_safetensors_parts_and_their_slices_read_only_their_rows(tiny_model_dir):
    folder = tiny_model_dir("phi3")
    stored = load_file(folder / "model.safetensors")
    qkv, gate_up = stored["model.layers.2.self_attn.qkv_proj.weight"], stored["model.layers.2.mlp.gate_up_proj.weight"]
    source = SafetensorsSource(folder)
    names = source.tensor_names()
    assert "model.layers.2.self_attn.k_proj.weight" in names and not any("qkv_proj" in n for n in names)
    got = source.read(["model.layers.2.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight"], torch.float32)
    assert torch.equal(got["model.layers.2.self_attn.k_proj.weight"], qkv[64:96])
    assert torch.equal(got["model.layers.2.mlp.up_proj.weight"], gate_up[112:])
    assert source.num_bytes_read() == (32 + 112) * 64 * 4  # those rows' bytes, not the fused tensors'
    # A tensor-parallel rank's rows and columns of a part
    sliced = SafetensorsSource(folder).read_slices({
        "model.layers.2.self_attn.v_proj.weight": TensorSlice(0, 16, 32),
        "model.layers.2.mlp.gate_proj.weight": TensorSlice(1, 32, 64)}, torch.float32)
    assert torch.equal(sliced["model.layers.2.self_attn.v_proj.weight"], qkv[112:128])
    assert torch.equal(sliced["model.layers.2.mlp.gate_proj.weight"], gate_up[:112, 32:64])
    assert source.tensor_shapes()["model.layers.2.mlp.gate_proj.weight"] == (112, 64)


def test_a_checkpoint_whose_fused_tensor_does_not_match_its_config_names_both(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("phi3")
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.gate_up_proj.weight"] = tensors["model.layers.0.mlp.gate_up_proj.weight"][:200]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(json.loads((folder / "config.json").read_text())))
    with pytest.raises(ModelLoadError, match=rf"{tmp_path}.*gate_up_proj.weight.*\[200, 64\].*224 rows"):
        SafetensorsSource(tmp_path)
