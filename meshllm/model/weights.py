"""Tensors from a Hugging Face folder of safetensors files, read by name.

`SafetensorsSource` reads only the tensors asked for (a pipeline stage asks for
its layer range), counts the bytes it read, and fingerprints the weights: a
sha256 over every tensor's name, dtype, shape and bytes, cached on disk by
file path, size and mtime so a restart does not rehash gigabytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML
from safetensors import SafetensorError, safe_open

from meshllm.errors import CorruptWeights, ModelLoadError, UnsupportedArchitecture
from meshllm.model import fp8_blocks, gpt_oss_experts
from meshllm.model.config import ModelConfig
from meshllm.model.fused import split_fused, visible_names
from meshllm.model.rope_rows import rope_rows_to_half, trained_in_pairs
from meshllm.model.tensor_slice import TensorSlice

_MAX_HEADER_BYTES = 100 * 1024 * 1024
# Bumped when the hashed content changes, so cached fingerprints of an older scheme are not reused.
_FINGERPRINT_VERSION = "v1"
# Bytes per element of the safetensors dtypes we check sizes for; others are left to safe_open.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "U16": 2, "U32": 4, "U64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


class TensorSource(Protocol):
    """Where a model's tensors come from (safetensors folder, GGUF file); HF tensor names."""

    path: Path

    def config(self) -> ModelConfig: ...

    def tensor_names(self) -> list[str]: ...

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    def read_slices(self, slices: Mapping[str, TensorSlice], dtype: torch.dtype) -> dict[str, torch.Tensor]: ...

    def fingerprint(self) -> str: ...

    def num_bytes_read(self) -> int: ...

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]: ...


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
        self._fp8_block = _fp8_block(self.path, self._entries)
        try:
            self._parts = split_fused(self._config, {n: e.shape for n, e in self._entries.items()})
        except ModelLoadError as e:
            raise ModelLoadError(f"{self.path}: {e}") from None
        shapes = {name: entry.shape for name, entry in self._entries.items()}
        for name, part in self._parts.items():
            shapes[name] = (part.stop - part.start, *shapes[part.fused][1:])
        # GPT-OSS's experts, stored fused and transposed (or as MXFP4 blocks): shown one per
        # expert and projection
        self._expert_views = {} if self._config.model_type != "gpt_oss" else gpt_oss_experts.expert_views(
            self._config.num_hidden_layers, self._config.num_experts, shapes)
        stored_experts = {name for view in self._expert_views.values() for name in (view.stored, view.scales)}
        lacking = sorted({view.scales for view in self._expert_views.values()
                          if view.scales is not None and view.stored in shapes and view.scales not in shapes})
        if lacking:
            raise ModelLoadError(f"{self.path}: MXFP4 experts without their exponents ({', '.join(lacking[:2])} "
                                 f"missing); the checkpoint is incomplete")
        for name, view in self._expert_views.items():
            if view.stored in shapes:
                shapes[name] = gpt_oss_experts.view_shape(view, shapes[view.stored])
        hidden = stored_experts | {n for n in self._entries if self._fp8_block and n.endswith(fp8_blocks.SCALE_SUFFIX)}
        shown = [n for n in visible_names(self._entries.keys(), self._parts) if n not in hidden]
        shown += [n for n, view in self._expert_views.items() if view.stored in shapes]
        # The names it shows, once: a mixture of experts has tens of thousands (Qwen3-30B-A3B: 18k)
        self._shapes = {name: shapes[name] for name in shown}
        self._bytes_read = 0

    def config(self) -> ModelConfig:
        return self._config

    def tensor_names(self) -> list[str]:
        return list(self._shapes)

    def num_bytes_read(self) -> int:
        return self._bytes_read

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return self._read({name: None for name in names}, dtype)

    # MXFP4 experts (GPT-OSS's released checkpoints) are blocks, as a GGUF's quantized tensors:
    # the engine keeps them so (engine/stage_weights.py), and read() gives them dequantized.
    def is_block_quantized(self, name: str) -> bool:
        view = self._expert_views.get(name)
        return view is not None and view.scales is not None

    def block_type(self, name: str) -> GGML | None:
        return GGML.MXFP4 if self.is_block_quantized(name) else None

    def block_bytes(self, name: str) -> int:
        rows, cols = self._shapes[name]
        return rows * cols // gpt_oss_experts.MXFP4_BLOCK * GGML_QUANT_SIZES[GGML.MXFP4][1]

    def read_blocks(self, name: str):
        """One MXFP4 expert projection as ggml blocks (a BlockMatrix), not dequantized."""
        from meshllm.engine.ggml_weights import BlockMatrix  # the engine's weight form; loaded on demand

        assert self.is_block_quantized(name), name
        return BlockMatrix(self._mxfp4_rows(name), GGML.MXFP4, self._shapes[name][1])

    def _mxfp4_rows(self, name: str) -> torch.Tensor:
        view = self._expert_views[name]
        codes, scales = (self._expert_slice(stored, view.expert) for stored in (view.stored, view.scales))
        rows = gpt_oss_experts.take_blocks(view, codes, scales)
        self._bytes_read += rows.numel()
        return rows

    def _expert_slice(self, stored: str, expert: int) -> torch.Tensor:
        file = self._entries[stored].file
        try:
            with safe_open(file, framework="pt") as f:
                return f.get_slice(stored)[expert]
        except SafetensorError as e:
            raise CorruptWeights(f"{file} cannot be read as safetensors ({e}); re-download the file") from None

    def read_slices(self, slices: Mapping[str, TensorSlice], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Only the asked rows or columns of each tensor: safetensors reads just those bytes."""
        return self._read(slices, dtype)

    def _read(self, parts: Mapping[str, TensorSlice | None], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Each named tensor whole (None) or its slice, one open per file."""
        shapes = self._shapes
        out = {}
        by_file: dict[Path, list[str]] = {}
        for name, s in parts.items():
            if name not in shapes:
                raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
            if s is not None and (s.dim >= len(shapes[name]) or s.stop > shapes[name][s.dim]):
                raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {list(shapes[name])}; cannot take "
                                     f"[{s.start}, {s.stop}) of dimension {s.dim} (the checkpoint does not match "
                                     f"its config)")
            if self.is_block_quantized(name):  # dequantized as a GGUF's blocks are (gguf's reference)
                assert s is None, "a GPT-OSS expert is read whole (no TP for experts)"
                out[name] = torch.from_numpy(quants.dequantize(self._mxfp4_rows(name).numpy(), GGML.MXFP4)).to(dtype)
            else:
                by_file.setdefault(self._entries[self._stored(name)].file, []).append(name)
        for file, file_names in by_file.items():
            try:
                with safe_open(file, framework="pt") as f:
                    for name in file_names:
                        stored, rows, cols = self._region(name, parts[name])
                        entry = self._entries[stored]
                        view = self._expert_views.get(name)
                        if entry.dtype == fp8_blocks.FP8_DTYPE:  # codes times their tiles' factors
                            out[name] = self._fp8_values(f, file, stored, rows, cols, dtype)
                        elif view is not None:  # one expert's slice of the stored experts, as read
                            assert parts[name] is None, "a GPT-OSS expert is read whole (no TP for experts)"
                            out[name] = gpt_oss_experts.take(view, f.get_slice(stored)[view.expert]).to(dtype)
                        elif rows is None and cols is None:
                            out[name] = f.get_tensor(stored).to(dtype)
                        else:
                            view = f.get_slice(stored)
                            rows = rows or (0, entry.shape[0])
                            out[name] = (view[rows[0]:rows[1]] if cols is None else
                                         view[rows[0]:rows[1], cols[0]:cols[1]]).to(dtype)
                        self._bytes_read += (entry.end - entry.begin) * out[name].numel() // math.prod(entry.shape)
                        pairs = trained_in_pairs(self._config, name)
                        if pairs:  # GLM-4's q/k: put as meshllm turns them (whole heads, a TP slice's too)
                            out[name] = rope_rows_to_half(out[name], self._config.head_dim, pairs)
            except SafetensorError as e:
                raise CorruptWeights(f"{file} cannot be read as safetensors ({e}); re-download the file") from None
        return out

    def _fp8_values(self, f, file: Path, stored: str, rows: tuple[int, int] | None, cols: tuple[int, int] | None,
                    dtype: torch.dtype) -> torch.Tensor:
        """Rows and columns (None: all) of a block-scaled FP8 weight, dequantized (model/fp8_blocks.py)."""
        shape = self._entries[stored].shape
        rows, cols = rows or (0, shape[0]), cols or (0, shape[1])
        codes = f.get_slice(stored)[rows[0]:rows[1], cols[0]:cols[1]]
        scale_name = stored + fp8_blocks.SCALE_SUFFIX
        (s0, s1), (t0, t1) = fp8_blocks.scale_region(rows, cols, self._fp8_block)
        scale_entry = self._entries[scale_name]
        if scale_entry.file == file:
            scales = f.get_slice(scale_name)[s0:s1, t0:t1]
        else:  # a shard may hold a weight without its factors
            with safe_open(scale_entry.file, framework="pt") as other:
                scales = other.get_slice(scale_name)[s0:s1, t0:t1]
        self._bytes_read += scales.numel() * scales.element_size()
        return fp8_blocks.dequantize(codes, scales, rows, cols, self._fp8_block, dtype)

    def _stored(self, name: str) -> str:
        view = self._expert_views.get(name)
        if view is not None:
            return view.stored
        part = self._parts.get(name)
        return name if part is None else part.fused

    def _region(self, name: str, s: TensorSlice | None) -> tuple[str, tuple[int, int] | None, tuple[int, int] | None]:
        """The stored tensor a read of `name` (or its slice) takes, and its (rows, cols) ranges; None for all."""
        part = self._parts.get(name)
        if part is None:
            if s is None:
                return self._stored(name), None, None
            return (name, (s.start, s.stop), None) if s.dim == 0 else (name, None, (s.start, s.stop))
        if s is None:
            return part.fused, (part.start, part.stop), None
        if s.dim == 0:
            return part.fused, (part.start + s.start, part.start + s.stop), None
        return part.fused, (part.start, part.stop), (s.start, s.stop)

    def fingerprint(self) -> str:
        files = sorted({e.file for e in self._entries.values()})
        # Path, size and mtime of every file: rewriting any weight file invalidates the entry.
        key = _FINGERPRINT_VERSION + "|" + "|".join(
            f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
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
    files = _weight_files(folder)
    entries: dict[str, _TensorEntry] = {}
    for file in files:
        if not file.is_file():
            raise ModelLoadError(f"{file} is listed in {folder / 'model.safetensors.index.json'} but missing")
        for name, entry in _read_header(file).items():
            if name in entries:
                raise CorruptWeights(f"tensor {name!r} is in both {entries[name].file} and {file}; "
                                     f"remove the stray file from {folder}")
            entries[name] = entry
    return entries


def _fp8_block(folder: Path, entries: dict[str, _TensorEntry]) -> tuple[int, int] | None:
    """The tile of a block-scaled FP8 folder (model/fp8_blocks.py), each FP8 weight checked to
    have its factors; None for a folder without FP8 weights."""
    origin = folder / "config.json"
    block = fp8_blocks.block_shape(json.loads(origin.read_text()), str(origin))
    other = next((name for name, e in entries.items() if e.dtype.startswith("F8_") and e.dtype != fp8_blocks.FP8_DTYPE),
                 None)
    if other is not None:
        raise UnsupportedArchitecture(f"{folder}: tensor {other!r} is {entries[other].dtype}; meshllm reads FP8 "
                                      f"weights in float8_e4m3fn ({fp8_blocks.FP8_DTYPE}) only")
    quantized = [name for name, e in entries.items() if e.dtype == fp8_blocks.FP8_DTYPE]
    if quantized and block is None:
        raise ModelLoadError(f"{folder}: {quantized[0]!r} and {len(quantized) - 1} more tensors are FP8 but "
                             f"config.json names no block-scaled quantization_config to scale them by")
    for name in quantized:
        if len(entries[name].shape) != 2:  # experts stacked in one tensor, say: not a layout read here
            raise UnsupportedArchitecture(f"{folder}: FP8 tensor {name!r} has shape {list(entries[name].shape)}; "
                                          f"meshllm reads block-scaled FP8 matrices (2-d) only")
        scales, want = entries.get(name + fp8_blocks.SCALE_SUFFIX), fp8_blocks.scale_shape(entries[name].shape, block)
        if scales is None or scales.shape != want:
            raise CorruptWeights(f"{folder}: FP8 tensor {name!r} {list(entries[name].shape)} needs "
                                 f"{name + fp8_blocks.SCALE_SUFFIX!r} of shape {list(want)}, found "
                                 f"{None if scales is None else list(scales.shape)}; the checkpoint is incomplete")
    return block if quantized else None


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model: the index's shards, else model.safetensors, else every *.safetensors."""
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            return sorted({folder / str(f) for f in weight_map.values()})
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CorruptWeights(f"{index_file} is not a valid safetensors index ({type(e).__name__}: {e}); "
                                 f"it needs a \"weight_map\" object of tensor name -> file") from None
    # Some repositories also ship consolidated.safetensors with other tensor names; model.safetensors wins.
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {folder}: expected model.safetensors "
                             f"or shards listed in model.safetensors.index.json")
    return files


def _read_header(file: Path) -> dict[str, _TensorEntry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise CorruptWeights(f"{file} is too short to be a safetensors file ({size} bytes); re-download it")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise CorruptWeights(f"{file} has a corrupt safetensors header (claims {header_len} header bytes "
                                 f"in a {size}-byte file); re-download the file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptWeights(f"{file} has a corrupt safetensors header: {e}; re-download the file") from None
    if not isinstance(header, dict):
        raise CorruptWeights(f"{file} has a corrupt safetensors header (not a JSON object); re-download the file")
    data_start = 8 + header_len
    entries = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (int(o) for o in meta["data_offsets"])
            entry = _TensorEntry(file, str(meta["dtype"]), tuple(int(d) for d in meta["shape"]),
                                 data_start + begin, data_start + end)
        except (KeyError, TypeError, ValueError):
            raise CorruptWeights(f"{file}: header entry for {name!r} is malformed; re-download the file") from None
        if entry.end > size or entry.begin > entry.end:
            raise CorruptWeights(f"{file}: tensor {name!r} points past the end of the file (truncated download?)")
        itemsize = _DTYPE_BYTES.get(entry.dtype)
        if itemsize is not None and math.prod(entry.shape) * itemsize != entry.end - entry.begin:
            raise CorruptWeights(f"{file}: tensor {name!r} ({entry.dtype} {list(entry.shape)}) spans "
                                 f"{entry.end - entry.begin} bytes, not {math.prod(entry.shape) * itemsize}; "
                                 f"re-download the file")
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
