"""Which slice each rank holds (pure), and that sources read exactly those slices."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGML, GGUFWriter, quants

from meshllm.errors import TensorParallelUnsplittable
from meshllm.model.config import ModelConfig
from meshllm.model.gguf import GGUFSource
from meshllm.model.tensor_slice import TensorSlice
from meshllm.model.weights import SafetensorsSource
from meshllm.tp.shard import ShardLayout, check_splittable
from meshllm.tp.sharded_source import ShardedSource
from tests.model.test_gguf import _encode_q6_k, write_model_gguf

BASE = ModelConfig(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("heads,kv_heads,size", [(8, 2, 2), (8, 8, 4), (8, 2, 4), (8, 1, 8), (8, 2, 8), (4, 4, 1)])
def test_every_query_head_once_and_beside_its_kv_head(heads, kv_heads, size):
    config = replace(BASE, num_attention_heads=heads, num_key_value_heads=kv_heads)
    layouts = [ShardLayout.of(config, r, size) for r in range(size)]
    assert sorted(h for lay in layouts for h in lay.q_heads) == list(range(heads))
    group = heads // kv_heads
    for lay in layouts:
        # Each rank's query heads attend only to the KV heads it holds, in the same grouping.
        assert {h // group for h in lay.q_heads} == set(lay.kv_heads)
        local = lay.local_config()
        assert local.num_attention_heads // local.num_key_value_heads == len(lay.q_heads) // len(lay.kv_heads)
    held = [h for lay in layouts for h in lay.kv_heads]
    if kv_heads >= size:
        assert sorted(held) == list(range(kv_heads))  # split, none twice
    else:
        assert sorted(set(held)) == list(range(kv_heads)) and len(held) == size  # replicated, size // kv times
    assert sorted(r for lay in layouts for r in lay.mlp_rows) == list(range(config.intermediate_size))
    assert sorted(r for lay in layouts for r in lay.vocab_rows) == list(range(config.vocab_size))


def test_the_vocabulary_splits_unevenly_with_padded_logits():
    config = replace(BASE, vocab_size=101)
    layouts = [ShardLayout.of(config, r, 4) for r in range(4)]
    assert [len(lay.vocab_rows) for lay in layouts] == [26, 26, 26, 23]
    assert {lay.vocab_rows_per_rank for lay in layouts} == {26}


@pytest.mark.parametrize("heads,kv_heads,inter,size,named", [
    (9, 3, 96, 2, "9 attention heads do not divide by 2"),
    (6, 3, 96, 2, "3 KV heads neither divide by 2 nor divide 2"),
    (8, 2, 90, 4, "intermediate_size 90) does not divide by 4"),
    (8, 4, 96, 3, "8 attention heads do not divide by 3"),
])
def test_unsplittable_counts_are_named(heads, kv_heads, inter, size, named):
    config = replace(BASE, num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter)
    with pytest.raises(TensorParallelUnsplittable) as e:
        ShardLayout.of(config, 0, size)
    assert named in str(e.value)
    assert f"group of {size}" in str(e.value) and "split it" in str(e.value)


def test_the_error_suggests_sizes_that_split():
    config = replace(BASE, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536)
    # 9 heads split 3 or 9 ways, but 1536 MLP rows not 9 ways: only 3 is offered.
    with pytest.raises(TensorParallelUnsplittable, match=r"Group sizes that split it: 3\."):
        check_splittable(config, 2)


def test_safetensors_slices_equal_the_whole_tensor_sliced(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    full, sliced = SafetensorsSource(folder), SafetensorsSource(folder)
    name = "model.layers.1.self_attn.o_proj.weight"
    whole = full.read([name], torch.float32)[name]
    got = sliced.read_slices({name: TensorSlice(1, 16, 48), "model.layers.1.self_attn.q_proj.bias":
                              TensorSlice(0, 32, 64)}, torch.float32)
    torch.testing.assert_close(got[name], whole[:, 16:48], atol=0, rtol=0)
    assert sliced.num_bytes_read() < full.num_bytes_read()


def test_sharded_source_hands_each_rank_the_fused_parts_it_needs(tiny_model_dir):
    source = SafetensorsSource(tiny_model_dir("llama"))  # 4 heads, 2 KV heads, head_dim 16
    layout = ShardLayout.of(source.config(), 1, 2)
    sharded = ShardedSource(source, layout)
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight"]
    got = sharded.read(names, torch.float32)
    whole = SafetensorsSource(tiny_model_dir("llama")).read(names, torch.float32)
    torch.testing.assert_close(got[names[0]], whole[names[0]][32:64], atol=0, rtol=0)  # heads 2, 3
    torch.testing.assert_close(got[names[1]], whole[names[1]][16:32], atol=0, rtol=0)  # KV head 1
    torch.testing.assert_close(got[names[2]], whole[names[2]][:, 56:112], atol=0, rtol=0)
    torch.testing.assert_close(got[names[3]], whole[names[3]], atol=0, rtol=0)  # norms whole
    assert sharded.config() == layout.local_config()


def test_gguf_rows_slice_exactly_and_permuted_qk_rows_unpermute_per_head(tiny_model_dir, tmp_path):
    # llama GGUFs store q/k rows permuted per head for ggml's rope: a slice of whole heads
    # unpermutes on its own to the same rows as the whole tensor.
    path = write_model_gguf(tiny_model_dir("llama"), tmp_path / "m.gguf", "llama")
    full, sliced = GGUFSource(path), GGUFSource(path)
    for name, s in {"model.layers.0.self_attn.q_proj.weight": TensorSlice(0, 32, 64),
                    "model.layers.0.self_attn.k_proj.weight": TensorSlice(0, 16, 32),
                    "model.layers.0.mlp.down_proj.weight": TensorSlice(1, 56, 112),
                    "model.embed_tokens.weight": TensorSlice(0, 48, 96)}.items():
        whole = full.read([name], torch.float32)[name]
        want = whole[s.start:s.stop] if s.dim == 0 else whole[:, s.start:s.stop]
        torch.testing.assert_close(sliced.read_slices({name: s}, torch.float32)[name], want, atol=0, rtol=0)
    assert sliced.num_bytes_read() < full.num_bytes_read()


def _block_gguf(path, ggml_type, rows=8, cols=512):
    values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    # gguf has no Q6_K quantizer; test_gguf.py has a plain encoder
    data = _encode_q6_k(values)[0] if ggml_type == GGML.Q6_K else quants.quantize(values, ggml_type)
    w = GGUFWriter(path, "llama")
    w.add_tensor("blk.0.ffn_down.weight", data, raw_dtype=ggml_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("ggml_type", [GGML.Q4_1, GGML.Q8_0, GGML.Q6_K])
def test_gguf_block_columns_slice_on_block_boundaries_else_refuse(tmp_path, ggml_type):
    from meshllm.model.gguf import GGUFFile, dequantize

    file = GGUFFile.open(_block_gguf(tmp_path / "b.gguf", ggml_type))
    source = object.__new__(GGUFSource)  # tensors only: this file has no model metadata
    source.file, source.path, source._bytes_read = file, file.path, 0
    source._by_hf_name = {"model.layers.0.mlp.down_proj.weight": file.tensors["blk.0.ffn_down.weight"]}
    source._config = BASE
    name = "model.layers.0.mlp.down_proj.weight"
    whole = dequantize(file, file.tensors["blk.0.ffn_down.weight"], torch.float32)
    block = 256 if ggml_type == GGML.Q6_K else 32
    start, stop = (256, 512) if block == 256 else (block, 4 * block)
    got = source.read_slices({name: TensorSlice(1, start, stop)}, torch.float32)[name]
    torch.testing.assert_close(got, whole[:, start:stop], atol=0, rtol=0)
    with pytest.raises(TensorParallelUnsplittable, match=f"{ggml_type.name} in blocks of {block} columns"):
        source.read_slices({name: TensorSlice(1, 0, 128 + 16)}, torch.float32)
    rows = source.read_slices({name: TensorSlice(0, 2, 6)}, torch.float32)[name]
    torch.testing.assert_close(rows, whole[2:6], atol=0, rtol=0)
