"""Tensors from a Hugging Face folder of safetensors files, read by name.

`SafetensorsSource` reads only the tensors asked for (a pipeline stage asks for
its layer range), counts the bytes it read, and fingerprints the weights: a
sha256 over every tensor's name, dtype, shape and bytes, cached on disk by
file path, size and mtime so a restart does not rehash gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from meshllm.errors import CorruptWeights, ModelLoadError
from meshllm.model.config import ModelConfig

_MAX_HEADER_BYTES = 100 * 1024 * 1024


class TensorSource(Protocol):
    """Where a model's tensors come from (safetensors folder, GGUF file); HF tensor names."""

    path: Path

    def config(self) -> ModelConfig: ...

    def tensor_names(self) -> list[str]: ...

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    def fingerprint(self) -> str: ...

    def num_bytes_read(self) -> int: ...


@dataclass(frozen=True, slots=True)
class _TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsSource:
    def __init__(self, folder: str | Path):
        self.path = Path(folder)
        if not self.path.is_dir():
            raise ModelLoadError(f"model folder {self.path} does not exist")
        self._config = ModelConfig.from_folder(self.path)
        self._entries = _index(self.path)
        self._bytes_read = 0

    def config(self) -> ModelConfig:
        return self._config

    def tensor_names(self) -> list[str]:
        return sorted(self._entries)

    def num_bytes_read(self) -> int:
        return self._bytes_read

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            entry = self._entries.get(name)
            if entry is None:
                raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
            by_file.setdefault(entry.file, []).append(name)
        out = {}
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in file_names:
                    out[name] = f.get_tensor(name).to(dtype)
                    self._bytes_read += self._entries[name].end - self._entries[name].begin
        return out

    def fingerprint(self) -> str:
        files = sorted({e.file for e in self._entries.values()})
        key = "|".join(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
        cached = _fingerprint_cache_get(key)
        if cached:
            return cached
        digest = hashlib.sha256()
        for name in sorted(self._entries):
            e = self._entries[name]
            digest.update(f"{name}|{e.dtype}|{list(e.shape)}|".encode())
            with open(e.file, "rb") as f:
                f.seek(e.begin)
                remaining = e.end - e.begin
                while remaining:
                    chunk = f.read(min(remaining, 1 << 24))
                    digest.update(chunk)
                    remaining -= len(chunk)
        value = digest.hexdigest()
        _fingerprint_cache_put(key, value)
        return value


def _index(folder: Path) -> dict[str, _TensorEntry]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CorruptWeights(f"{index_file} is not a valid safetensors index: {e}") from None
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}: expected model.safetensors "
                             f"or shards listed in model.safetensors.index.json")
    entries = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file} is listed in the index but missing")
        entries.update(_read_header(file))
    return entries


def _read_header(file: Path) -> dict[str, _TensorEntry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CorruptWeights(f"{file} is too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptWeights(f"{file} has a corrupt safetensors header (claims {header_len} header bytes "
                                 f"in a {size}-byte file); re-download the file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptWeights(f"{file} has a corrupt safetensors header: {e}; re-download the file") from None
    data_start = 8 + header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = meta["data_offsets"]
            entry = _TensorEntry(file, meta["dtype"], tuple(meta["shape"]), data_start + begin, data_start + end)
        except (KeyError, TypeError, ValueError):
            raise CorruptWeights(f"{file}: header entry for {name!r} is malformed") from None
        if entry.end > size or entry.begin > entry.end:
            raise CorruptWeights(f"{file}: tensor {name!r} points past the end of the file (truncated download?)")
        entries[name] = entry
    return entries


def _cache_file() -> Path:
    root = Path(os.environ.get("MESHLLM_CACHE_DIR", Path.home() / ".cache" / "meshllm"))
    return root / "fingerprints.json"


def _fingerprint_cache_get(key: str) -> str | None:
    try:
        return json.loads(_cache_file().read_text()).get(key)
    except (OSError, json.JSONDecodeError):
        return None


def _fingerprint_cache_put(key: str, value: str) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            cache = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
        cache[key] = value
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a rehash next time


def fingerprint(path: str | Path) -> str:
    """Fingerprint of the model at `path` (HF folder or .gguf file)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from meshllm.model.gguf import GGUFSource  # GGUF support loads only when needed

        return GGUFSource(path).fingerprint()
    return SafetensorsSource(path).fingerprint()
