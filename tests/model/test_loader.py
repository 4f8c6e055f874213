"""load_decoder: layer ranges read only their tensors, sharded folders, dtypes, named errors."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshllm.errors import ModelLoadError
from meshllm.model.loader import load_decoder
from meshllm.model.weights import SafetensorsSource


def header_sizes(folder) -> dict[str, int]:
    """Bytes of every tensor in the folder's safetensors files, read from their headers directly."""
    sizes = {}
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        sizes |= {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    return sizes


def expected_tensors(sizes: dict[str, int], first: int, last: int, num_layers: int, tied: bool) -> set[str]:
    """The HF tensors a stage holding layers [first, last) needs, spelled out by hand."""
    names = {n for n in sizes if any(n.startswith(f"model.layers.{i}.") for i in range(first, last))}
    if first == 0:
        names.add("model.embed_tokens.weight")
    if last == num_layers:
        names |= {"model.norm.weight", "model.embed_tokens.weight" if tied else "lm_head.weight"}
    return names


@pytest.mark.parametrize("variant", ["llama", "qwen2"])  # untied; tied (the last stage reads the embedding)
@pytest.mark.parametrize("first, last", [(0, 1), (0, 2), (1, 3), (2, 4), (3, 4), (0, 4)])
def test_a_layer_range_reads_exactly_its_tensors(tiny_model_dir, variant, first, last):
    folder = tiny_model_dir(variant)
    sizes = header_sizes(folder)
    source = SafetensorsSource(folder)
    config = source.config()
    decoder = load_decoder(source, config, first, last)
    want = expected_tensors(sizes, first, last, config.num_hidden_layers, config.tie_word_embeddings)
    assert source.num_bytes_read() == sum(sizes[n] for n in want)  # each read once, nothing else
    assert source.num_bytes_read() < sum(sizes.values()) or (first, last) == (0, 4)
    assert len(decoder.layers) == last - first
    assert (decoder.embed_tokens is not None) == (first == 0)
    assert (decoder.lm_head is not None) == (last == 4)


def test_tied_head_shares_the_embedding(tiny_model_dir):
    decoder = load_decoder(SafetensorsSource(folder := tiny_model_dir("qwen2")), SafetensorsSource(folder).config())
    assert decoder.lm_head.weight.data_ptr() == decoder.embed_tokens.weight.data_ptr()
    tail = load_decoder(SafetensorsSource(folder), SafetensorsSource(folder).config(), 2, 4)
    assert torch.equal(tail.lm_head.weight, load_file(folder / "model.safetensors")["model.embed_tokens.weight"])


def test_loaded_parameters_are_the_stored_tensors_fused(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    stored = load_file(folder / "model.safetensors")
    decoder = load_decoder(SafetensorsSource(folder), SafetensorsSource(folder).config(), 1, 3)
    attn = "model.layers.2.self_attn"
    layer = decoder.layers[1]  # local index 1 is model layer 2
    assert torch.equal(layer.self_attn.qkv_proj.weight,
                       torch.cat([stored[f"{attn}.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([stored[f"{attn}.{p}_proj.bias"] for p in "qkv"]))
    assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat(
        [stored["model.layers.2.mlp.gate_proj.weight"], stored["model.layers.2.mlp.up_proj.weight"]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_is_selectable(tiny_model_dir, dtype):
    source = SafetensorsSource(tiny_model_dir("qwen3"))
    decoder = load_decoder(source, source.config(), dtype=dtype)
    assert {p.dtype for p in decoder.parameters()} == {dtype}
    assert decoder.kv_layout().dtype == dtype


def test_sharded_model_gives_the_same_logits(tiny_model_dir):
    sharded, whole = tiny_model_dir("llama", max_shard_size="40KB"), tiny_model_dir("llama")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = torch.arange(10) * 7 % 96
    logits = [load_decoder(SafetensorsSource(f), SafetensorsSource(f).config()).forward_full(ids)
              for f in (sharded, whole)]
    assert torch.equal(*logits)
    tail = SafetensorsSource(sharded)
    load_decoder(tail, tail.config(), 2, 4)
    sizes = header_sizes(sharded)
    assert tail.num_bytes_read() == sum(sizes[n] for n in expected_tensors(sizes, 2, 4, 4, tied=False))


def test_progress_is_reported(tiny_model_dir):
    source = SafetensorsSource(tiny_model_dir("llama"))
    calls = []
    load_decoder(source, source.config(), 0, 1, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1][0] == calls[-1][1] == len(calls) and [d for d, _ in calls] == list(range(1, len(calls) + 1))


def _edit_weights(folder, edit) -> None:
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    return shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")


def test_missing_tensor_is_named(model_copy):
    _edit_weights(model_copy, lambda t: t.pop("model.layers.2.self_attn.v_proj.weight"))
    source = SafetensorsSource(model_copy)
    load_decoder(source, source.config(), 0, 2)  # a stage that does not need it still loads
    with pytest.raises(ModelLoadError, match=f"{model_copy}: tensor 'model.layers.2.self_attn.v_proj.weight' "
                                             f"is missing"):
        load_decoder(source, source.config(), 2, 4)


def test_misshaped_tensor_is_named_with_the_expected_shape(model_copy):
    _edit_weights(model_copy, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(32, 48)}))
    source = SafetensorsSource(model_copy)
    with pytest.raises(ModelLoadError, match=r"'model.layers.1.self_attn.k_proj.weight' has shape \(32, 48\), "
                                             r"expected \(32, 64\)"):
        load_decoder(source, source.config())


def test_tensor_the_decoder_would_ignore_is_refused(model_copy):
    # e.g. an o_proj bias: loading without it would give silently wrong logits.
    _edit_weights(model_copy, lambda t: t.update({"model.layers.3.self_attn.o_proj.bias": torch.zeros(64)}))
    source = SafetensorsSource(model_copy)
    load_decoder(source, source.config(), 0, 3)  # not this stage's layer
    with pytest.raises(ModelLoadError, match="'model.layers.3.self_attn.o_proj.bias' is not used"):
        load_decoder(source, source.config(), 3, 4)


@pytest.mark.parametrize("first, last", [(0, 5), (2, 2), (-1, 2)])
def test_layer_range_outside_the_model(tiny_model_dir, first, last):
    source = SafetensorsSource(tiny_model_dir("llama"))
    with pytest.raises(ModelLoadError, match=rf"layer range \[{first}, {last}\) is not inside the model's 4 layers"):
        load_decoder(source, source.config(), first, last)


def test_bf16_checkpoint_loads_in_any_dtype(model_copy, tiny_model_dir):
    # Real checkpoints are mostly stored in bf16; loading upcasts or keeps them as asked.
    _edit_weights(model_copy, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    stored = load_file(model_copy / "model.safetensors")
    source = SafetensorsSource(model_copy)
    fp32 = load_decoder(source, source.config(), dtype=torch.float32)
    assert torch.equal(fp32.norm.weight, stored["model.norm.weight"].float())
    assert source.num_bytes_read() == sum(header_sizes(model_copy).values())  # 2 bytes a weight
    bf16 = load_decoder(SafetensorsSource(model_copy), source.config(), dtype=torch.bfloat16)
    assert torch.equal(bf16.embed_tokens.weight, stored["model.embed_tokens.weight"])
    original = SafetensorsSource(tiny_model_dir("llama"))
    ids = torch.arange(12) * 5 % 96
    want = load_decoder(original, original.config()).forward_full(ids)
    assert (fp32.forward_full(ids) - want).abs().max() < 0.05 * want.abs().max()
