"""Block-scaled FP8 folders (DeepSeek-V3's format: Qwen3-*-FP8, MiniMax-M2, GLM-4.5-FP8, Kimi K2)
dequantized at load: against transformers' own dequantization of the same folder, tiles cut short
at the edges, slices, and named refusals of what meshllm does not read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshllm.errors import CorruptWeights, ModelLoadError, UnsupportedArchitecture
from meshllm.model import fp8_blocks
from meshllm.model.tensor_slice import TensorSlice
from meshllm.model.weights import SafetensorsSource
from tests.model.test_decoder import _load, _reference, _tokens

FP8_MAX = 448.0  # float8_e4m3fn's largest value
# as the released configs name them (MiniMax-M2's; Qwen3-FP8's list "lm_head" and norms alike)
NOT_CONVERTED = ("gate", "e_score_correction_bias", "lm_head")


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale_inv) as DeepSeek's and Qwen's FP8 releases make them: each tile's largest
    magnitude to 448, the factor stored per tile."""
    br, bc = block
    grid = fp8_blocks.scale_shape(weight.shape, block)
    scales = torch.empty(grid)
    codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = weight[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / FP8_MAX
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (tile / scales[i, j]).to(torch.float8_e4m3fn)
    return codes, scales


def fp8_folder(dense, out, block: tuple[int, int] = (16, 16), fmt: str = "e4m3"):
    """A copy of a tiny model folder with every linear weight (the released configs' exceptions
    aside) stored block-scaled FP8, and config.json saying so (`fmt` as Qwen's and DeepSeek's
    configs name it; MiniMax's say "float8_e4m3fn")."""
    shutil.copytree(dense, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n, t in tensors.items() if t.dim() == 2 and "embed_tokens" not in n]:
        if not any(f".{m}." in name or name.startswith(f"{m}.") for m in NOT_CONVERTED):
            tensors[name], tensors[name + fp8_blocks.SCALE_SUFFIX] = quantize(tensors[name], block)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": fmt, "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(NOT_CONVERTED)}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("variant", ["qwen3", "minimax-m2"])
def test_an_fp8_folder_gives_transformers_logits_for_it(tiny_model_dir, tmp_path, variant):
    # transformers dequantizes a pre-quantized FP8 folder on a machine without a GPU (its own code;
    # it infers the tile from the grid, so only tiles that divide every matrix compare: 16 x 16 here)
    from transformers import FineGrainedFP8Config

    dense = tiny_model_dir(variant)
    folder = fp8_folder(dense, tmp_path / variant, fmt="float8_e4m3fn" if variant == "minimax-m2" else "e4m3")
    ids = _tokens(24, seed=1)
    with torch.no_grad():
        want = _reference(folder, quantization_config=FineGrainedFP8Config(dequantize=True))(ids[None]).logits[0]
        unquantized = _reference(dense)(ids[None]).logits[0]
    assert (want - unquantized).abs().max() > 0.02  # the codes' rounding shows: these are FP8's values
    got = _load(folder).forward_full(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_tiles_cut_short_at_the_edges_and_slices_of_them(tiny_model_dir, tmp_path):
    # 112 x 64 weights in 48 x 40 tiles: the last row and column of tiles are partial; each value
    # is its code times its own tile's factor, also when a TP rank or a fused part reads a slice
    folder = fp8_folder(tiny_model_dir("llama"), tmp_path / "llama", block=(48, 40))
    stored = load_file(folder / "model.safetensors")
    source = SafetensorsSource(folder)
    name = "model.layers.0.mlp.gate_proj.weight"
    codes, scales = stored[name], stored[name + fp8_blocks.SCALE_SUFFIX]
    assert codes.shape == (112, 64) and scales.shape == (3, 2)
    want = torch.empty(codes.shape)
    for r in range(112):
        for c in range(64):
            want[r, c] = codes[r, c].float() * scales[r // 48, c // 40]
    assert torch.equal(source.read([name], torch.float32)[name], want)
    for s in (TensorSlice(0, 37, 101), TensorSlice(1, 13, 59), TensorSlice(0, 48, 96)):
        got = source.read_slices({name: s}, torch.float32)[name]
        assert torch.equal(got, want[s.start:s.stop] if s.dim == 0 else want[:, s.start:s.stop])
    # bf16: multiplied in float32, rounded once
    assert torch.equal(source.read([name], torch.bfloat16)[name], want.to(torch.bfloat16))
    # the factors are not tensors of the model: not listed, not counted as layer weights
    assert not any(n.endswith(fp8_blocks.SCALE_SUFFIX) for n in source.tensor_names())
    assert set(source.tensor_names()) == set(SafetensorsSource(tiny_model_dir("llama")).tensor_names())


@pytest.mark.parametrize("quantization, error, words", [
    ({"quant_method": "gptq", "bits": 4}, UnsupportedArchitecture, ["quantized by 'gptq'", "GGUF"]),
    ({"quant_method": "fp8", "activation_scheme": "static"}, UnsupportedArchitecture,
     ["without a weight_block_size", "per-tensor"]),
    ("fp8", ModelLoadError, ["quantization_config must be an object"]),
])
def test_quantizations_meshllm_does_not_read_are_refused_by_name(tiny_model_dir, tmp_path, quantization, error,
                                                                   words):
    folder = shutil.copytree(tiny_model_dir("llama"), tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    with pytest.raises(error) as info:
        SafetensorsSource(folder)
    for word in words:
        assert word in str(info.value)


def test_fp8_tensors_of_another_kind_or_shape_are_refused(tiny_model_dir, tmp_path):
    folder = fp8_folder(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({**tensors, name: tensors[name].float().to(torch.float8_e5m2)}, folder / "model.safetensors")
    with pytest.raises(UnsupportedArchitecture, match=f"'{name}' is F8_E5M2; .*float8_e4m3fn"):
        SafetensorsSource(folder)
    save_file({**tensors, name: tensors[name][None]}, folder / "model.safetensors")
    with pytest.raises(UnsupportedArchitecture, match=r"has shape \[1, 112, 64\]; .*\(2-d\) only"):
        SafetensorsSource(folder)


def test_fp8_weights_without_their_factors_or_their_config_are_refused(tiny_model_dir, tmp_path):
    folder = fp8_folder(tiny_model_dir("llama"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    scale = "model.layers.1.self_attn.o_proj.weight" + fp8_blocks.SCALE_SUFFIX
    save_file({n: t for n, t in tensors.items() if n != scale}, folder / "model.safetensors")
    with pytest.raises(CorruptWeights, match=f"needs '{scale}' of shape \\[4, 4\\], found None"):
        SafetensorsSource(folder)
    config = json.loads((folder / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="are FP8 but config.json names no block-scaled quantization_config"):
        SafetensorsSource(folder)
