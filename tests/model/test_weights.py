"""SafetensorsSource: reading by name, sharded folders, named errors for broken files, fingerprints."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from meshllm.errors import CorruptWeights, ModelLoadError
from meshllm.model import gpt_oss_experts, weights
from meshllm.model.weights import SafetensorsSource, fingerprint


def header_sizes(file) -> dict[str, int]:
    """Bytes of each tensor, from the file's own header (independent of the code under test)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    """A writable copy of the tiny llama folder, for tests that break it."""
    return shutil.copytree(tiny_model_dir("llama"), tmp_path / "model")


def test_reads_only_the_named_tensors_exactly(tiny_model_dir):
    folder = tiny_model_dir("llama")
    stored = load_file(folder / "model.safetensors")
    source = SafetensorsSource(folder)
    assert source.tensor_names() == sorted(stored)
    assert source.num_bytes_read() == 0
    names = ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    got = source.read(names, torch.float32)
    assert set(got) == set(names)
    for name in names:
        assert torch.equal(got[name], stored[name])
    sizes = header_sizes(folder / "model.safetensors")
    assert source.num_bytes_read() == sum(sizes[n] for n in names)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_read_converts_to_the_requested_dtype(tiny_model_dir, dtype):
    source = SafetensorsSource(tiny_model_dir("llama"))
    got = source.read(["model.embed_tokens.weight"], dtype)["model.embed_tokens.weight"]
    fp32 = source.read(["model.embed_tokens.weight"], torch.float32)["model.embed_tokens.weight"]
    assert got.dtype == dtype and torch.equal(got, fp32.to(dtype))


def test_sharded_folder_with_index_reads_the_same_tensors(tiny_model_dir):
    sharded = tiny_model_dir("llama", max_shard_size="40KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    whole = SafetensorsSource(tiny_model_dir("llama"))  # same seed, one file
    source = SafetensorsSource(sharded)
    assert source.tensor_names() == whole.tensor_names() == sorted(index["weight_map"])
    got = source.read(source.tensor_names(), torch.float32)
    want = whole.read(whole.tensor_names(), torch.float32)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert source.num_bytes_read() == sum(sum(header_sizes(sharded / s).values()) for s in shards)
    assert source.fingerprint() == whole.fingerprint()  # contents, not file layout


def test_model_safetensors_wins_over_stray_files(model_copy):
    save_file({"tok_embeddings.weight": torch.zeros(2, 2)}, model_copy / "consolidated.safetensors")
    assert "tok_embeddings.weight" not in SafetensorsSource(model_copy).tensor_names()


def test_a_tensor_in_two_files_is_refused(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "part-a.safetensors")
    save_file({"model.norm.weight": torch.ones(64)}, model_copy / "part-b.safetensors")
    with pytest.raises(CorruptWeights, match="'model.norm.weight' is in both .*part-a.safetensors"):
        SafetensorsSource(model_copy)


def test_missing_folder_and_missing_files(tmp_path, model_copy):
    with pytest.raises(ModelLoadError, match=f"{tmp_path / 'nope'} does not exist"):
        SafetensorsSource(tmp_path / "nope")
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors files in .*model"):
        SafetensorsSource(model_copy)
    (model_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        SafetensorsSource(model_copy)


def test_index_naming_a_missing_shard(tiny_model_dir, tmp_path):
    folder = shutil.copytree(tiny_model_dir("llama", max_shard_size="40KB"), tmp_path / "sharded")
    shard = sorted(folder.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=f"{shard} is listed in .*index.json but missing"):
        SafetensorsSource(folder)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": [1, 2]}', "[]"])
def test_corrupt_index(model_copy, text):
    index = model_copy / "model.safetensors.index.json"
    index.write_text(text)
    with pytest.raises(CorruptWeights, match=f"{index} is not a valid safetensors index"):
        SafetensorsSource(model_copy)


def _rewrite(file, header: dict | bytes, data: bytes, header_len: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)


def _parts(file) -> tuple[dict, bytes]:
    blob = file.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def test_truncated_file(model_copy):
    file = model_copy / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(CorruptWeights, match=f"{file}: tensor .* points past the end of the file"):
        SafetensorsSource(model_copy)
    file.write_bytes(b"\x01\x02\x03")
    with pytest.raises(CorruptWeights, match=f"{file} is too short"):
        SafetensorsSource(model_copy)


@pytest.mark.parametrize("breakage, words", [
    ("huge_length", "claims"),
    ("garbage", "corrupt safetensors header"),
    ("not_object", "not a JSON object"),
    ("no_dtype", "header entry for 'model.norm.weight' is malformed"),
    ("wrong_size", "'model.norm.weight' \\(F32 \\[64\\]\\) spans 128 bytes, not 256"),
])
def test_corrupt_header(model_copy, breakage, words):
    file = model_copy / "model.safetensors"
    header, data = _parts(file)
    if breakage == "huge_length":
        _rewrite(file, header, data, header_len=2 ** 40)
    elif breakage == "garbage":
        _rewrite(file, b"\x00\xff" * 40, data)
    elif breakage == "not_object":
        _rewrite(file, b"[1, 2, 3]", data)
    elif breakage == "no_dtype":
        del header["model.norm.weight"]["dtype"]
        _rewrite(file, header, data)
    else:
        begin, _ = header["model.norm.weight"]["data_offsets"]
        header["model.norm.weight"]["data_offsets"] = [begin, begin + 128]
        _rewrite(file, header, data)
    with pytest.raises(CorruptWeights, match=f"{file}.*{words}"):
        SafetensorsSource(model_copy)


def test_file_safetensors_itself_rejects_is_a_named_error(model_copy):
    file = model_copy / "model.safetensors"
    with open(file, "ab") as f:
        f.write(b"\x00" * 16)  # bytes after the last tensor: every offset is in range, safetensors refuses
    source = SafetensorsSource(model_copy)
    with pytest.raises(CorruptWeights, match=f"{file} cannot be read as safetensors"):
        source.read(["model.norm.weight"], torch.float32)


def test_fingerprint_is_stable_and_content_addressed(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    first = SafetensorsSource(folder).fingerprint()
    assert len(first) == 64 and int(first, 16) >= 0
    assert SafetensorsSource(folder).fingerprint() == first == fingerprint(folder)
    copy = shutil.copytree(folder, tmp_path / "copy")  # another path: hashed afresh, same contents
    assert SafetensorsSource(copy).fingerprint() == first
    assert tiny_model_dir("qwen2", seed=1) != folder
    assert SafetensorsSource(tiny_model_dir("qwen2", seed=1)).fingerprint() != first


def test_fingerprint_changes_when_one_weight_or_name_changes(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    original = SafetensorsSource(folder).fingerprint()
    changed = shutil.copytree(folder, tmp_path / "changed")
    tensors = load_file(changed / "model.safetensors")
    tensors["model.layers.2.mlp.down_proj.weight"][3, 5] += 1e-3
    save_file(tensors, changed / "model.safetensors", metadata={"format": "pt"})
    assert SafetensorsSource(changed).fingerprint() != original
    renamed = shutil.copytree(folder, tmp_path / "renamed")
    tensors = load_file(renamed / "model.safetensors")
    tensors["lm_head.weight_"] = tensors.pop("lm_head.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    assert SafetensorsSource(renamed).fingerprint() != original


def test_second_fingerprint_is_served_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    cache_dir = tmp_path / "cache"
    monkeypatch.setenv("MESHLLM_CACHE_DIR", str(cache_dir))
    folder = tiny_model_dir("llama")
    value = SafetensorsSource(folder).fingerprint()
    assert value in (cache_dir / "fingerprints.json").read_text()

    class NoHashing:
        @staticmethod
        def sha256():
            raise AssertionError("rehashed the weights although the cache had them")

    monkeypatch.setattr(weights, "hashlib", NoHashing)
    assert SafetensorsSource(folder).fingerprint() == value  # a restart: new source, same cache


def test_unwritable_cache_only_costs_a_rehash(tiny_model_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("MESHLLM_CACHE_DIR", str(blocker / "cache"))
    folder = tiny_model_dir("llama")
    assert SafetensorsSource(folder).fingerprint() == SafetensorsSource(folder).fingerprint()


def _break(folder, breakage: str) -> str:
    """Break a copy of a model folder; returns the error code the CLI should report."""
    file = folder / "model.safetensors"
    if breakage == "corrupt_header":
        header, data = _parts(file)
        _rewrite(file, b"{" + b"\x00" * 40, data)
        return "corrupt_weights"
    if breakage == "truncated":
        file.write_bytes(file.read_bytes()[:100_000])
        return "corrupt_weights"
    if breakage == "missing_weights":
        file.unlink()
        return "model_load_failed"
    config = json.loads((folder / "config.json").read_text())
    config |= {"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(config))
    return "unsupported_architecture"


@pytest.mark.parametrize("breakage", ["corrupt_header", "truncated", "missing_weights", "unsupported"])
def test_cli_reports_a_broken_model_in_one_line(aidreams_path, tmp_path, capsys, breakage):
    from meshllm.cli import main

    folder = shutil.copytree(aidreams_path, tmp_path / "model")
    code = _break(folder, breakage)
    rc = main(["plan", "--model", str(folder)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.count("\n") == 1 and err.startswith(f"meshllm plan: error [{code}]: ") and str(folder) in err


@pytest.mark.slow
def test_cli_process_exits_2_without_a_traceback(aidreams_path, tmp_path):
    import subprocess
    import sys

    folder = shutil.copytree(aidreams_path, tmp_path / "model")
    _break(folder, "corrupt_header")
    done = subprocess.run([sys.executable, "-m", "meshllm.cli", "plan", "--model", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert "corrupt safetensors header" in done.stderr and done.stdout == ""


def test_gpt_oss_experts_read_one_expert_at_a_time_as_linear_weights(tiny_model_dir):
    # GPT-OSS stores each layer's experts fused ([experts, hidden, 2 * width], gate and up
    # interleaved by column) and transposed: the source shows them per expert and projection, as
    # nn.Linear weights, and hides the stored tensors
    folder = tiny_model_dir("gpt-oss")
    source = SafetensorsSource(folder)
    stored = load_file(folder / "model.safetensors")
    gate_up, bias = stored["model.layers.1.mlp.experts.gate_up_proj"], stored["model.layers.1.mlp.experts.down_proj_bias"]
    names = ["model.layers.1.mlp.experts.2.gate_proj.weight", "model.layers.1.mlp.experts.2.up_proj.weight",
             "model.layers.1.mlp.experts.2.down_proj.bias"]
    got = source.read(names, torch.float32)
    assert torch.equal(got[names[0]], gate_up[2][:, 0::2].T) and torch.equal(got[names[1]], gate_up[2][:, 1::2].T)
    assert torch.equal(got[names[2]], bias[2])
    assert source.tensor_shapes()[names[0]] == (64, 64) and "model.layers.1.mlp.experts.gate_up_proj" not in \
        source.tensor_names()


def released_gpt_oss_folder(dense_folder, out):
    """`dense_folder` (a tiny GPT-OSS) as OpenAI releases GPT-OSS: each experts tensor as MXFP4
    codes and exponents (`*_blocks`, `*_scales`; gguf's MXFP4 quantizer, then OpenAI's nibble
    order), everything else as it was."""
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as GGML

    out = shutil.copytree(dense_folder, out)
    tensors = load_file(out / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name).transpose(1, 2).contiguous()  # [experts, out, in], as OpenAI stores them
        ggml_blocks = torch.from_numpy(quants.quantize(rows.numpy(), GGML.MXFP4)).view(*rows.shape[:2], -1, 17)
        codes = torch.cat((ggml_blocks[..., 1:] & 0xF, ggml_blocks[..., 1:] >> 4), dim=-1)  # values 0..31 in order
        tensors[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        tensors[f"{name}_scales"] = ggml_blocks[..., 0].contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mxfp4_codes_repack_to_ggml_blocks_of_the_same_values(tmp_path):
    # any bytes: ggml's reference dequantization of the repacked blocks is, bit for bit,
    # transformers' of OpenAI's layout (exponents kept where both stay normal floats)
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as GGML
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=g)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [experts, in, out]
    for e in range(3):
        repacked = gpt_oss_experts.repack(blocks[e], scales[e])
        assert repacked.shape == (5, 4 * 17)
        assert torch.equal(torch.from_numpy(quants.dequantize(repacked.numpy(), GGML.MXFP4)), want[e].T)


def test_a_released_gpt_oss_folder_shows_its_experts_as_mxfp4_blocks(tiny_model_dir, tmp_path):
    from gguf.constants import GGMLQuantizationType as GGML
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    folder = released_gpt_oss_folder(tiny_model_dir("gpt-oss"), tmp_path / "gpt-oss")
    source = SafetensorsSource(folder)
    stored = load_file(folder / "model.safetensors")
    gate, up, down = (f"model.layers.1.mlp.experts.2.{p}_proj.weight" for p in ("gate", "up", "down"))
    assert source.is_block_quantized(gate) and source.block_type(down) == GGML.MXFP4
    assert not source.is_block_quantized("model.layers.1.mlp.experts.2.down_proj.bias")
    assert source.tensor_shapes()[gate] == (64, 64) and source.block_bytes(gate) == 64 * 2 * 17
    assert not any(n.endswith(("_blocks", "_scales")) for n in source.tensor_names())
    blocks = source.read_blocks(gate)
    assert blocks.ggml_type == GGML.MXFP4 and blocks.shape == (64, 64)
    assert source.num_bytes_read() == blocks.num_bytes  # that expert's gate rows, not the layer's experts
    # dequantized, each projection is transformers' dequantization of the release, de-interleaved
    gate_up = convert_moe_packed_tensors(stored["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                         stored["model.layers.1.mlp.experts.gate_up_proj_scales"], dtype=torch.float32)
    got = source.read([gate, up, down], torch.float32)
    assert torch.equal(got[gate], gate_up[2][:, 0::2].T) and torch.equal(got[up], gate_up[2][:, 1::2].T)
    assert torch.equal(got[gate], blocks.dequantize())
