"""Tensors and config from a GGUF file (llama.cpp's format), read by Hugging Face name.

`GGUFFile` parses the header itself: gguf's GGUFReader builds a numpy view per
vocabulary string and takes seconds on a 49k-token vocabulary, we take tens of
milliseconds. Tensor data stays in a read-only memory map, so a stage that loads
layers 10-19 never touches the pages of the others. `GGUFSource` maps GGUF names
to HF names, dequantizes with `gguf.quants` per tensor on request, and undoes the
q/k row permutation llama.cpp applies to llama-architecture models.
"""

from __future__ import annotations

import hashlib
import dataclasses
import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType as GGML

from meshllm.errors import CorruptWeights, ModelLoadError, TensorParallelUnsplittable, UnsupportedArchitecture
from meshllm.model import moe
from meshllm.model.config import ModelConfig, RopeScaling, yarn_mscale
from meshllm.model.fused import split_fused
from meshllm.model.rope_rows import is_qk, rope_rows_to_half, trained_in_pairs
from meshllm.model.tensor_slice import TensorSlice
from meshllm.model.weights import _fingerprint_cache_get, _fingerprint_cache_put

_FLOAT_TYPES = {GGML.F32: torch.float32, GGML.F16: torch.float16, GGML.BF16: torch.bfloat16}
# Block-quantized types gguf.quants dequantizes (the brief's list plus their common siblings, and
# the 1-3 bit i-quants of llama.cpp's imatrix quantizations, which big mixtures of experts ship in).
_BLOCK_TYPES = {GGML.Q4_0, GGML.Q4_1, GGML.Q5_0, GGML.Q5_1, GGML.Q8_0, GGML.Q2_K, GGML.Q3_K,
                GGML.Q4_K, GGML.Q5_K, GGML.Q6_K, GGML.IQ4_NL, GGML.IQ4_XS, GGML.MXFP4,
                GGML.IQ3_S, GGML.IQ3_XXS, GGML.IQ2_S, GGML.IQ2_XS, GGML.IQ2_XXS, GGML.IQ1_M, GGML.IQ1_S}
# general.architecture -> our model_type. llama.cpp writes Mistral models as "llama".
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                  "gemma3": "gemma3_text",
                  "qwen3moe": "qwen3_moe", "smollm3": "smollm3", "granite": "granite", "glm4": "glm4",
                  "gpt-oss": "gpt_oss", "glm4moe": "glm4_moe", "minimax-m2": "minimax_m2", "qwen2moe": "qwen2_moe"}
# Mixtures of experts, by general.architecture (Mixtral is written as "llama")
_MOE_ARCHITECTURES = {"llama": "mixtral", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "glm4moe": "glm4_moe",
                      "minimax-m2": "minimax_m2", "qwen2moe": "qwen2_moe"}
# rotate part of each head (Phi-4-mini 96 of 128, GLM and MiniMax-M2 half)
_PARTIAL_ROTARY_ARCHITECTURES = ("phi3", "glm4", "glm4moe", "minimax-m2")
# its converter interleaves q/k rows for ggml's rope (Mixtral is written as "llama" too; SmolLM3's
# and Granite's converters are Llama's)
_PERMUTED_QK_ARCHITECTURES = {"llama", "mixtral", "smollm3", "granite"}

# metadata value type id -> struct format of one scalar
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    name: str  # GGUF name, e.g. blk.3.attn_q.weight
    shape: tuple[int, ...]  # torch order: [rows, cols]
    ggml_type: GGML
    offset: int  # absolute byte offset in the file
    num_bytes: int


class _Cursor:
    """Bounds-checked reads over the mapped header, so a truncated file is a clear error."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise CorruptWeights(f"{self.path}: GGUF header ends early at byte {self.pos} (truncated download?)")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("<Q")
        if self.pos + length > len(self.buf):
            raise CorruptWeights(f"{self.path}: GGUF string of {length} bytes at byte {self.pos} runs past the "
                                 f"end of the file (corrupt header or truncated download)")
        raw = bytes(self.buf[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptWeights(f"{self.path}: GGUF string at byte {self.pos - length} is not UTF-8") from None

    def value(self, value_type: int):
        if value_type in _SCALAR_FORMATS:
            return self.take(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.take("<IQ")
            if item_type in _SCALAR_FORMATS:  # token types, scores: one numpy read, not a loop
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise CorruptWeights(f"{self.path}: GGUF array of {count} items runs past the end of the file")
                array = np.frombuffer(self.buf[self.pos:end], dtype=dtype)
                self.pos = end
                return array
            return [self.value(item_type) for _ in range(count)]
        raise CorruptWeights(f"{self.path}: unknown GGUF metadata value type {value_type} at byte {self.pos}")


_RELEASE_WINDOW = 2 << 20  # the largest page-cache folio with 4 KiB pages (a PMD); a multiple of every page size


@dataclass(frozen=True, eq=False)  # identity equality: the metadata holds numpy arrays
class GGUFFile:
    """A parsed GGUF header (metadata + tensor table) and a memory map of the data."""

    path: Path
    metadata: dict
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray  # uint8 over `mapping`
    mapping: mmap.mmap
    identity: tuple[int, int, int, int] = (0, 0, 0, 0)  # device, inode, size, mtime: the file opened

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {path} does not exist")
        size = path.stat().st_size
        if size < 24:
            raise CorruptWeights(f"{path} is {size} bytes, too short to be a GGUF file")
        with open(path, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            identity = _identity(os.fstat(f.fileno()))
        data = np.frombuffer(mapping, dtype=np.uint8)
        cur = _Cursor(memoryview(data), path)
        magic, version, num_tensors, num_kv = cur.take("<4sIQQ")
        if magic != b"GGUF":
            raise CorruptWeights(f"{path} does not start with the GGUF magic bytes (found {magic!r}): "
                                 f"not a GGUF file, or a corrupt one")
        if version not in (2, 3) and int.from_bytes(version.to_bytes(4, "little"), "big") in (2, 3):
            raise UnsupportedArchitecture(f"{path} is a big-endian GGUF (for s390x and the like); meshllm "
                                          f"reads little-endian GGUF files, as llama.cpp writes them by default")
        if version not in (2, 3):
            raise CorruptWeights(f"{path} is GGUF version {version}; meshllm reads versions 2 and 3")
        if num_tensors > size or num_kv > size:  # each entry takes at least a byte: the counts are garbage
            raise CorruptWeights(f"{path}: GGUF header claims {num_tensors} tensors and {num_kv} metadata "
                                 f"entries in a {size}-byte file; the header is corrupt")
        metadata = {}
        for _ in range(num_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.take("<I"))
        table = []
        for _ in range(num_tensors):
            name = cur.string()
            num_dims = cur.take("<I")
            if num_dims > 4:
                raise CorruptWeights(f"{path}: tensor {name!r} claims {num_dims} dimensions; the header is corrupt")
            dims = [cur.take("<Q") for _ in range(num_dims)]
            if not all(dims):
                raise CorruptWeights(f"{path}: tensor {name!r} has a zero dimension {dims}; the header is corrupt")
            type_id, offset = cur.take("<IQ")
            # ggml lists the fastest-moving dimension first; torch the other way round
            table.append((name, tuple(reversed(dims)), type_id, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise CorruptWeights(f"{path}: general.alignment is {alignment!r}; the header is corrupt")
        data_start = -(-cur.pos // alignment) * alignment
        tensors = {entry[0]: _tensor_info(path, size, data_start, *entry) for entry in table}
        return cls(path, metadata, tensors, data, mapping, identity)

    def drop_vocabulary(self) -> None:
        """Forget the tokenizer's arrays (tokens, merges, scores, types) once the config is read: a stage
        never tokenizes, and SmolLM2's 49k tokens and 49k merges hold ~7 MiB of Python strings."""
        for key in [k for k, v in self.metadata.items()
                    if k.startswith("tokenizer.ggml.") and isinstance(v, list | np.ndarray)]:
            del self.metadata[key]

    def raw(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only view of the map: [rows, bytes per row]."""
        # A plain ndarray view: numpy's memmap subclass adds per-view overhead that doubles dequant time.
        flat = self.data[info.offset:info.offset + info.num_bytes].view(np.ndarray)
        return flat.reshape(math.prod(info.shape[:-1]), -1)

    def rows_reader(self, info: GGUFTensorInfo) -> "FileRows":
        """The tensor's rows, read from the file when a lookup asks for them (FileRows)."""
        f = open(self.path, "rb")
        try:
            if _identity(os.fstat(f.fileno())) != self.identity:  # its offsets are the header's we parsed
                raise ModelLoadError(f"{self.path} changed on disk while it was loading; load it again")
        except BaseException:
            f.close()
            raise
        rows = math.prod(info.shape[:-1])
        return FileRows(f, self.path, info.offset, rows, info.num_bytes // rows)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop a tensor's pages, once copied out, from this process's resident memory (they stay in
        the OS page cache; reading them again maps them again). Without it every page a load read
        stayed mapped until the file closed: loading a 1.2 GB Q8_0 model peaked at 2.9 GB of RSS."""
        dont_need = getattr(mmap, "MADV_DONTNEED", None)
        if dont_need is None or not hasattr(self.mapping, "madvise"):
            return
        # Whole 2 MiB windows around the tensor: a read fault maps the whole page-cache folio it hits
        # (up to 2 MiB where the file system caches in large folios), so reading one tensor also maps
        # pieces of its neighbours, some already released. Re-reading a dropped page is a minor fault.
        start = info.offset // _RELEASE_WINDOW * _RELEASE_WINDOW
        stop = min(len(self.mapping), -(-(info.offset + info.num_bytes) // _RELEASE_WINDOW) * _RELEASE_WINDOW)
        self.mapping.madvise(dont_need, start, stop - start)


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


class FileRows:
    """A table's rows [rows, row_bytes] read from the model file at each lookup (pread), for an
    embedding table no LM head shares: a step reads a few rows of it (one per token).

    Neither copied nor mapped. A copy keeps all of the table resident (1.1B Llama shapes with
    SmolLM2's 49152-token vocabulary: 102 MiB in Q8_0, 192 in BF16; a 128k vocabulary several
    times that). A map of the file made the pages around each row read resident, however the map
    was advised: a read fault maps up to 64 KiB of cached neighbours, and the whole page-cache
    folio it hits (up to 2 MiB for a file just written), so 2100 random rows of a 102 MiB Q8_0
    table held 46-73 MiB of it. Read rows come from the OS page cache (as mapped pages did) into a
    step's own buffer, so nothing of the table stays in this process; a row costs a system call
    (~2 us). A file truncated under a running stage (a network mount, a rewrite) fails the lookup
    with a clear error, where a mapped page of it faulted the process (SIGBUS)."""

    def __init__(self, file, path: Path, offset: int, rows: int, row_bytes: int):
        self.path, self.offset, self.rows, self.row_bytes = path, offset, rows, row_bytes
        self._file = file
        self._fd = file.fileno()
        self._closer = weakref.finalize(self, file.close)

    def read(self, ids: Sequence[int], out: np.ndarray) -> None:
        """Rows `ids` into `out` ([len(ids), row_bytes] uint8, C-contiguous), in order."""
        if out.shape != (len(ids), self.row_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
            raise ValueError(f"rows go into a C-contiguous uint8 array of {(len(ids), self.row_bytes)}, "
                             f"not {out.dtype} {out.shape}")
        if not self._closer.alive:
            raise ValueError(f"the rows of {self.path} were closed")  # its descriptor may be another file's now
        for i, row in enumerate(ids):
            if not 0 <= row < self.rows:
                raise IndexError(f"token id {row} is outside the table's {self.rows} rows ({self.path})")
            self._read_row(row, memoryview(out[i]))

    def _read_row(self, row: int, into: memoryview) -> None:
        at, done = self.offset + row * self.row_bytes, 0
        while done < self.row_bytes:  # a read may come back short (a signal, a network file system)
            try:
                got = os.preadv(self._fd, [into[done:]], at + done)
            except OSError as e:
                raise ModelLoadError(f"reading row {row} of the embedding table in {self.path} failed: {e}") from e
            if got == 0:
                raise ModelLoadError(f"{self.path} is shorter than its header says (changed on disk?): "
                                     f"row {row} of the embedding table cannot be read; load it again")
            done += got

    def close(self) -> None:
        self._closer()


def _tensor_info(path: Path, file_size: int, data_start: int, name: str, shape: tuple[int, ...],
                 type_id: int, offset: int) -> GGUFTensorInfo:
    try:
        ggml_type = GGML(type_id)
    except ValueError:
        raise UnsupportedArchitecture(f"{path}: tensor {name!r} has unknown ggml type id {type_id}; "
                                      f"the file may need a newer meshllm, or its header is corrupt") from None
    if ggml_type not in _FLOAT_TYPES and ggml_type not in _BLOCK_TYPES:
        supported = sorted(t.name for t in (*_FLOAT_TYPES, *_BLOCK_TYPES))
        raise UnsupportedArchitecture(f"{path}: tensor {name!r} is stored as {ggml_type.name}, which meshllm "
                                      f"cannot dequantize (supported: {', '.join(supported)}); "
                                      f"use a GGUF quantized to one of those")
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if not shape or shape[-1] % block_size:
        raise CorruptWeights(f"{path}: tensor {name!r} has shape {shape}, whose rows are not whole "
                             f"{ggml_type.name} blocks of {block_size}")
    num_bytes = math.prod(shape) // block_size * block_bytes
    begin = data_start + offset
    if begin + num_bytes > file_size:
        raise CorruptWeights(f"{path}: tensor {name!r} ends at byte {begin + num_bytes} but the file has "
                             f"{file_size} bytes (truncated download?)")
    return GGUFTensorInfo(name, shape, ggml_type, begin, num_bytes)


def dequantize(file: GGUFFile, info: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    """One tensor as `dtype`, shape `info.shape`. Float types convert exactly; blocks go through f32."""
    return _dequantize_raw(file.raw(info), info.ggml_type, info.shape, dtype)


def _dequantize_raw(raw: np.ndarray, ggml_type: GGML, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if ggml_type in _FLOAT_TYPES:
        # copy: the map is read-only and torch wants writable memory
        tensor = torch.from_numpy(raw.copy()).view(_FLOAT_TYPES[ggml_type])
    else:
        tensor = torch.from_numpy(quants.dequantize(raw, ggml_type))
    return tensor.reshape(shape).to(dtype)


# GGUF name pieces -> HF name pieces; the loader asks for HF names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q/k/v (model/fused.py splits it)
}
# Gemma 2 and 3 have a norm on each side of attention and of the MLP: llama.cpp's ffn_norm is the one
# before the MLP, which transformers names pre_feedforward_layernorm for Gemma.
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
# GLM-4's norms after attention and after the MLP, by transformers' names for them
_GLM4_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_self_attn_layernorm",
                     "post_ffw_norm": "post_mlp_layernorm"}
# GPT-OSS's norm before the MLP is llama.cpp's post_attention_norm (transformers' name for it)
_GPT_OSS_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm"}
# GLM-4.5's the same, and its shared expert (its router and experts: _expert_tensors)
_GLM4_MOE_LAYER_NAMES = {**_GPT_OSS_LAYER_NAMES, "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
                         "ffn_up_shexp": "mlp.shared_experts.up_proj", "ffn_down_shexp": "mlp.shared_experts.down_proj"}
# Qwen2-MoE's shared expert and the gate on it
_QWEN2_MOE_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                          "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                          "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors we do not use."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    layer_names = {"gemma2": _GEMMA_LAYER_NAMES, "gemma3": _GEMMA_LAYER_NAMES, "glm4": _GLM4_LAYER_NAMES,
                   "gpt-oss": _GPT_OSS_LAYER_NAMES, "glm4moe": _GLM4_MOE_LAYER_NAMES,
                   "qwen2moe": _QWEN2_MOE_LAYER_NAMES}.get(arch, _LAYER_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] == "attn_sinks" and arch == "gpt-oss":
        return f"model.layers.{parts[1]}.self_attn.sinks"  # a parameter of its own in transformers
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    return None


class GGUFSource:
    """TensorSource over one .gguf file: HF tensor names, config from the metadata."""

    def __init__(self, path: str | Path | GGUFFile):
        self.file = path if isinstance(path, GGUFFile) else GGUFFile.open(path)
        self.path = self.file.path
        try:
            self._config = ModelConfig.from_dict(config_dict(self.file))
        except (TypeError, ValueError) as e:  # a metadata value of the wrong type
            raise CorruptWeights(f"{self.path} has malformed GGUF metadata: {e}") from None
        arch = self.file.metadata.get("general.architecture")
        by_hf_name = {hf: info for info in self.file.tensors.values() if (hf := hf_name(info.name, arch)) is not None}
        for hf, info in by_hf_name.items():  # Qwen2-MoE's shared gate, stored as a vector: HF's [1, hidden]
            if hf.endswith(".mlp.shared_expert_gate.weight") and len(info.shape) == 1:
                by_hf_name[hf] = dataclasses.replace(info, shape=(1, *info.shape))
        if self._config.num_experts:
            by_hf_name.update(_expert_tensors(self.file, self._config))
        self._by_hf_name = _split_fused(self.path, self._config, by_hf_name)
        self._bytes_read = 0

    def config(self) -> ModelConfig:
        return self._config

    def tensor_names(self) -> list[str]:
        return sorted(self._by_hf_name)

    def num_bytes_read(self) -> int:
        return self._bytes_read

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        out = {}
        for name in names:
            info = self._by_hf_name.get(name)
            if info is None:
                raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
            tensor = dequantize(self.file, info, dtype)
            self.file.release(info)
            out[name] = self._in_half_rope_order(name, tensor)
            self._bytes_read += info.num_bytes
        return out

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: info.shape for name, info in self._by_hf_name.items()}

    def block_bytes(self, name: str) -> int:
        return self._by_hf_name[name].num_bytes

    def block_type(self, name: str) -> GGML | None:
        """The ggml type a tensor is stored in, or None for a name the file lacks."""
        info = self._by_hf_name.get(name)
        return None if info is None else info.ggml_type

    def is_block_quantized(self, name: str) -> bool:
        info = self._by_hf_name.get(name)
        return info is not None and info.ggml_type in _BLOCK_TYPES

    def read_blocks(self, name: str):
        """One block-quantized tensor as stored (a BlockMatrix: ggml blocks, HF row order), not dequantized."""
        from meshllm.engine.ggml_weights import BlockMatrix  # the engine's weight form; loaded on demand

        info = self._by_hf_name.get(name)
        if info is None:
            raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
        assert info.ggml_type in _BLOCK_TYPES and len(info.shape) == 2, (name, info.ggml_type, info.shape)
        rows = torch.from_numpy(self.file.raw(info).copy())  # [rows, bytes per row]; off the read-only map
        self.file.release(info)
        rows = self._in_half_rope_order(name, rows)  # whole rows move: exact on the blocks too
        self._bytes_read += info.num_bytes
        return BlockMatrix(rows.contiguous(), info.ggml_type, info.shape[1])

    def file_rows(self, name: str, dtype: torch.dtype) -> tuple[FileRows, GGML, tuple[int, int]] | None:
        """A 2-d tensor's rows read from the file at each lookup (FileRows), its type and shape; None
        where a lookup could not use its stored bytes as they are: llama's q/k (stored in another
        row order), a type that is neither block-quantized nor `dtype` (converting copies anyway)."""
        info = self._by_hf_name.get(name)
        if info is None:
            raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
        if _interleaved_rope_rows(self._config, name) or len(info.shape) != 2 or not (
                info.ggml_type in _BLOCK_TYPES or _FLOAT_TYPES.get(info.ggml_type) == dtype):
            return None
        self._bytes_read += info.num_bytes
        return self.file.rows_reader(info), info.ggml_type, tuple(info.shape)

    def read_slices(self, slices: Mapping[str, TensorSlice], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Only the asked rows or columns of each tensor, cut from the stored blocks before dequantizing.

        Rows are whole blocks in every GGUF type, so any row range is exact; a column range must
        start and end on a block boundary of the tensor's type (32 or 256 columns), else this
        raises TensorParallelUnsplittable naming the tensor, its type and the cut.
        """
        out = {}
        for name, s in slices.items():
            info = self._by_hf_name.get(name)
            if info is None:
                raise ModelLoadError(f"tensor {name!r} is missing from {self.path}")
            if s.dim >= len(info.shape) or s.stop > info.shape[s.dim]:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has shape {list(info.shape)}; cannot take "
                                     f"[{s.start}, {s.stop}) of dimension {s.dim}")
            raw = self.file.raw(info)  # [rows, bytes per row], a view of the map: nothing read yet
            block_size, block_bytes = GGML_QUANT_SIZES[info.ggml_type]
            if s.dim == 0 and len(info.shape) > 1:
                part, shape = raw[s.start:s.stop], (s.stop - s.start, *info.shape[1:])
            else:
                if s.start % block_size or s.stop % block_size:
                    raise TensorParallelUnsplittable(
                        f"{self.path}: tensor {name!r} is stored as {info.ggml_type.name} in blocks of {block_size} "
                        f"columns; its tensor-parallel slice [{s.start}, {s.stop}) cuts a block. Use a group size "
                        f"whose slices are whole blocks, or a GGUF of another type")
                part = raw[..., s.start // block_size * block_bytes:s.stop // block_size * block_bytes]
                shape = (*info.shape[:-1], s.stop - s.start)
            tensor = _dequantize_raw(np.ascontiguousarray(part), info.ggml_type, shape, dtype)
            self.file.release(info)
            if _interleaved_rope_rows(self._config, name):
                # Tensor-parallel row slices hold whole heads, and the reordering stays inside a head.
                assert s.dim == 0 and (s.stop - s.start) % self._config.head_dim == 0, (name, s)
            out[name] = self._in_half_rope_order(name, tensor)
            self._bytes_read += part.nbytes
        return out

    def _in_half_rope_order(self, name: str, rows: torch.Tensor) -> torch.Tensor:
        """q/k rows (of whole heads) as meshllm's rotary turns them (model/rope_rows.py)."""
        rotated = _interleaved_rope_rows(self._config, name)
        return rows if rotated is None else rope_rows_to_half(rows, self._config.head_dim, rotated)

    def fingerprint(self) -> str:
        """sha256 over every tensor's GGUF name, type, shape and raw (still quantized) bytes."""
        stat = self.path.stat()
        key = f"{self.path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
        cached = _fingerprint_cache_get(key)
        if cached:
            return cached
        digest = hashlib.sha256()
        for name in sorted(self.file.tensors):
            info = self.file.tensors[name]
            digest.update(f"{name}|{info.ggml_type.name}|{list(info.shape)}|".encode())
            digest.update(self.file.data[info.offset:info.offset + info.num_bytes])
            self.file.release(info)  # hashing a 40 GB file must not make it resident
        value = digest.hexdigest()
        _fingerprint_cache_put(key, value)
        return value


def _expert_tensors(file: GGUFFile, config: ModelConfig) -> dict[str, GGUFTensorInfo]:
    """The routers and each expert's weights, by HF name: llama.cpp stores a layer's experts as one
    [experts, rows, cols] tensor per projection, so one expert's weight is a row range of it."""
    out = {}
    for layer in range(config.num_hidden_layers):
        router = file.tensors.get(f"blk.{layer}.ffn_gate_inp.weight")
        if router is not None:
            out[moe.router_name(config.model_type, layer)] = router
        router_bias = file.tensors.get(f"blk.{layer}.ffn_gate_inp.bias")
        if router_bias is not None:  # GPT-OSS
            out[moe.router_bias_name(layer)] = router_bias
        selection_bias = file.tensors.get(f"blk.{layer}.exp_probs_b.bias")
        if selection_bias is not None:  # GLM-4.5, MiniMax-M2
            out[moe.selection_bias_name(config.model_type, layer)] = selection_bias
        for index, projection in enumerate(("gate", "up", "down")):
            for kind in ("weight", "bias"):  # GPT-OSS's biases: [experts, rows]
                info = file.tensors.get(f"blk.{layer}.ffn_{projection}_exps.{kind}")
                if info is None:
                    continue
                if len(info.shape) != (3 if kind == "weight" else 2) or info.shape[0] != config.num_experts:
                    raise CorruptWeights(f"{file.path}: {info.name} has shape {list(info.shape)}, not "
                                         f"[{config.num_experts}, rows{', cols' if kind == 'weight' else ''}] for "
                                         f"{config.num_experts} experts")
                expert_bytes = info.num_bytes // config.num_experts
                names = moe.expert_names if kind == "weight" else (lambda _, i, e: moe.expert_bias_names(i, e))
                for e in range(config.num_experts):
                    out[names(config.model_type, layer, e)[index]] = GGUFTensorInfo(
                        f"{info.name}[{e}]", info.shape[1:], info.ggml_type, info.offset + e * expert_bytes,
                        expert_bytes)
    return out


def _split_fused(path: Path, config: ModelConfig, by_hf_name: dict[str, GGUFTensorInfo]) -> dict[str, GGUFTensorInfo]:
    """Fused tensors replaced by a tensor info per part: its rows' bytes, where they lie in the file."""
    for name in [n for n in by_hf_name if n.endswith(".mlp.up_proj.weight")]:
        # llama.cpp writes Phi-3's gate_up_proj as ffn_up with no ffn_gate; its swiglu halves it.
        if name.replace(".up_proj.", ".gate_proj.") not in by_hf_name:
            by_hf_name[name.replace(".up_proj.", ".gate_up_proj.")] = by_hf_name.pop(name)
    try:
        parts = split_fused(config, {name: info.shape for name, info in by_hf_name.items()})
    except ModelLoadError as e:
        raise CorruptWeights(f"{path}: {e}") from None
    for name, part in parts.items():
        info = by_hf_name[part.fused]
        row_bytes = info.num_bytes // info.shape[0]
        by_hf_name[name] = GGUFTensorInfo(f"{info.name}[{part.start}:{part.stop}]", (part.stop - part.start,
                                          *info.shape[1:]), info.ggml_type, info.offset + part.start * row_bytes,
                                          (part.stop - part.start) * row_bytes)
    for fused in {part.fused for part in parts.values()}:
        del by_hf_name[fused]
    return by_hf_name


def _interleaved_rope_rows(config: ModelConfig, name: str) -> int | None:
    """How many of each head's rows a q/k tensor of this file stores in interleaved rotary pairs
    (model/rope_rows.py): llama.cpp's converter permutes Llama's whole heads (transformers'
    reverse_permute_weights undoes it too); GLM-4 is trained so, on its turned dims. None for
    other tensors and families."""
    if config.model_type in _PERMUTED_QK_ARCHITECTURES and is_qk(name):
        return config.head_dim
    return trained_in_pairs(config, name)


def config_dict(file: GGUFFile) -> dict:
    """An HF config.json-style dict from the GGUF metadata (what ModelConfig.from_dict reads)."""
    meta = file.metadata
    arch = meta.get("general.architecture")
    # Before the architecture: a split GGUF's later parts carry no general metadata at all.
    if int(meta.get("split.count", 1)) > 1:
        raise ModelLoadError(f"{file.path} is one part of a split GGUF; merge the parts first with "
                             f"`llama-gguf-split --merge <its first part> merged.gguf`")
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitecture(f"{file.path} is a GGUF of architecture {arch!r}; meshllm runs GGUF "
                                      f"architectures {sorted(_ARCHITECTURES)}")
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if experts and arch not in _MOE_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{file.path} is a mixture-of-experts {arch} model; meshllm runs the "
                                      f"experts of Mixtral (llama), Qwen3-MoE (qwen3moe), Qwen2-MoE (qwen2moe), "
                                      f"GPT-OSS (gpt-oss), GLM-4.5 (glm4moe) and MiniMax-M2 (minimax-m2) files")
    if int(meta.get(f"{arch}.expert_shared_count", 0) or 0) and arch != "glm4moe":
        raise UnsupportedArchitecture(f"{file.path} has shared experts ({arch}.expert_shared_count), which "
                                      f"meshllm runs for GLM-4.5 (glm4moe) only")

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise CorruptWeights(f"{file.path} lacks GGUF metadata key {arch}.{name}")
        return value

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, np.ndarray):  # per-layer counts; fine only when all layers agree
        if len(set(kv_heads.tolist())) != 1:
            raise UnsupportedArchitecture(f"{file.path} has per-layer KV head counts {kv_heads.tolist()}")
        kv_heads = kv_heads[0]
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim and arch not in _PARTIAL_ROTARY_ARCHITECTURES:
        raise UnsupportedArchitecture(f"{file.path} rotates {rope_dims} of {head_dim} head dims (partial rotary); "
                                      f"meshllm runs that for {', '.join(_PARTIAL_ROTARY_ARCHITECTURES)} only")
    sections = meta.get(f"{arch}.rope.dimension_sections")
    if sections is not None and any(int(x) for x in np.asarray(sections).ravel()):
        # GLM-4V's text model: multimodal rope sections, its q/k already in halves for them
        raise UnsupportedArchitecture(f"{file.path} uses multimodal rope sections (M-RoPE, a vision model's text "
                                      f"part); meshllm runs text models' rope only")
    embed = file.tensors.get("token_embd.weight")
    if embed is None:
        raise CorruptWeights(f"{file.path} has no token_embd.weight tensor")
    tokens_meta = {k: meta[f"tokenizer.ggml.{k}"] for k in ("bos_token_id", "eos_token_id", "eot_token_id",
                                                            "eom_token_id") if f"tokenizer.ggml.{k}" in meta}
    rope_theta = float(key("rope.freq_base", 10000.0))
    config = {
        "model_type": _ARCHITECTURES[arch],
        "vocab_size": int(meta.get(f"{arch}.vocab_size", embed.shape[0])),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        # GLM-4.5's and GLM-OCR's files carry their multi-token-prediction layers as the last
        # blocks; llama.cpp skips them, and so does the decoder (their tensors are never read)
        "num_hidden_layers": int(key("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(file, arch, head_dim, rope_theta),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "attention_bias": "blk.0.attn_q.bias" in file.tensors or "blk.0.attn_qkv.bias" in file.tensors,
        # Of these architectures only Phi-3 records one (0 for none: Phi-4). llama.cpp runs Phi-3
        # with full attention, transformers with the window; we follow transformers.
        "use_sliding_window": bool(meta.get(f"{arch}.attention.sliding_window", 0)) and arch == "phi3",
        "sliding_window": int(meta.get(f"{arch}.attention.sliding_window", 0) or 0) or None,
        "partial_rotary_factor": rope_dims / head_dim,
        "_rotated_dims": rope_dims,  # exact: the factor times head_dim may round below it
        "bos_token_id": int(tokens_meta["bos_token_id"]) if "bos_token_id" in tokens_meta else None,
        "eos_token_id": without_harmony_end(sorted({int(v) for k, v in tokens_meta.items() if k != "bos_token_id"}),
                                            meta.get("tokenizer.ggml.tokens") or []),
    }
    if experts:  # Mixtral is written as "llama"; llama.cpp renormalizes the chosen experts of both
        config.update(model_type=_MOE_ARCHITECTURES[arch], num_experts=experts,
                      num_local_experts=experts,
                      num_experts_per_tok=int(key("expert_used_count")), norm_topk_prob=True,
                      moe_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length",
                                                         config["intermediate_size"])))
    if arch == "glm4moe":
        config.update(_glm4_moe(file, config))
    if arch == "minimax-m2":
        config.update(_minimax_m2(file, config))
    if arch == "qwen2moe":  # as llama.cpp reads it (src/models/qwen2moe.cpp): the chosen weights never
        # renormalized; files converted before June 2024 name no expert width (llama.cpp then takes
        # feed_forward_length / experts per token: Qwen1.5-MoE-A2.7B's 5632 / 4 = 1408)
        width = meta.get("qwen2moe.expert_feed_forward_length")
        config.update(norm_topk_prob=False, shared_expert_intermediate_size=int(
            meta.get("qwen2moe.expert_shared_feed_forward_length", config["intermediate_size"])),
            moe_intermediate_size=int(width) if width is not None else
            config["intermediate_size"] // config["num_experts_per_tok"])
    if arch == "smollm3":  # not in the file: llama.cpp runs every fourth layer without rope (as transformers)
        config["no_rope_layer_interval"] = 4
    if arch == "granite":  # its converter writes the multipliers as scales
        for key_name, field in (("attention.scale", "attention_multiplier"),
                                ("embedding_scale", "embedding_multiplier"),
                                ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling")):
            if f"{arch}.{key_name}" in meta:
                config[field] = float(meta[f"{arch}.{key_name}"])
        # a file without one: llama.cpp scales attention the usual way (src/models/granite.cpp)
        config.setdefault("attention_multiplier", head_dim ** -0.5)
    if arch == "gpt-oss":  # as llama.cpp reads it (src/models/openai-moe.cpp): every other layer windowed
        window = int(key("attention.sliding_window"))
        _check_one_rope_base(file, arch, rope_theta)
        config.update(sliding_window=window, intermediate_size=config["moe_intermediate_size"],
                      layer_types=_layer_types(meta.get("gpt-oss.attention.sliding_window_pattern", 2),
                                               config["num_hidden_layers"], window))
    if arch in ("gemma2", "gemma3"):
        config.update(_gemma(file, arch, heads, hidden, head_dim, rope_theta, config["num_hidden_layers"],
                             config["rope_scaling"]))
    return config


_SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _glm4_moe(file: GGUFFile, config: dict) -> dict:
    """GLM-4.5's config.json fields, as its converter writes them (conversion/glm.py Glm4MoeModel)
    and llama.cpp reads them (src/models/glm4-moe.cpp)."""
    meta = file.metadata
    _check_sigmoid_gating(file, "glm4moe", int(meta.get("glm4moe.expert_gating_func", 0)) or _SIGMOID_GATING)
    return dict(n_routed_experts=config["num_experts"],
                n_shared_experts=int(meta.get("glm4moe.expert_shared_count", 0) or 0),
                first_k_dense_replace=int(meta.get("glm4moe.leading_dense_block_count", 0) or 0),
                routed_scaling_factor=float(meta.get("glm4moe.expert_weights_scale", 1.0)),
                norm_topk_prob=bool(meta.get("glm4moe.expert_weights_norm", False)),
                use_qk_norm="blk.0.attn_q_norm.weight" in file.tensors)


def _minimax_m2(file: GGUFFile, config: dict) -> dict:
    """MiniMax-M2's config.json fields, as its converter writes them (conversion/minimax.py) and
    llama.cpp reads them (src/models/minimax-m2.cpp: the chosen experts' weights always
    renormalized, never scaled; q/k norms across all heads; no gating func is an abort there)."""
    _check_sigmoid_gating(file, "minimax-m2", int(file.metadata.get("minimax-m2.expert_gating_func", 0)))
    return dict(intermediate_size=config["moe_intermediate_size"], scoring_func="sigmoid", use_routing_bias=True,
                use_qk_norm=True, qk_norm_type="per_layer")


def _check_sigmoid_gating(file: GGUFFile, arch: str, gating: int) -> None:
    if gating != _SIGMOID_GATING:
        raise UnsupportedArchitecture(f"{file.path}: {arch}.expert_gating_func {gating}; this family's experts "
                                      f"are picked by sigmoid scores ({_SIGMOID_GATING})")


def _layer_types(pattern, layers: int, window: int) -> list[str]:
    """config.json's layer_types from a GGUF's sliding_window_pattern: one flag per layer, or n
    (every n-th layer attends to everything; 0: none does), as llama.cpp's set_swa_pattern reads
    it. Without a window every layer attends to everything."""
    if isinstance(pattern, (list, np.ndarray)):
        sliding = [bool(p) for p in pattern]
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return ["sliding_attention" if window and s else "full_attention" for s in sliding]


def _check_one_rope_base(file: GGUFFile, arch: str, rope_theta: float) -> None:
    """Gemma 2 and GPT-OSS windowed layers share the full layers' rope base (as all their files
    do); a file giving them another is refused rather than run wrong."""
    local = float(file.metadata.get(f"{arch}.rope.freq_base_swa", rope_theta))
    if local != rope_theta:
        raise UnsupportedArchitecture(f"{file.path}: {arch}.rope.freq_base_swa {local} differs from rope.freq_base "
                                      f"{rope_theta}; meshllm runs {arch} with one rope base")


# Per family, as llama.cpp reads its files (src/models/gemma2.cpp, gemma3.cpp): the layer
# pattern (every n-th layer attends to everything), the window, the layer count of the 27B
# model (whose queries scale by hidden / heads, the others' by head_dim), and the soft caps
# where the file names none (Gemma 2's are always on; Gemma 3 has a final one only if named).
_GEMMA_DEFAULTS = {"gemma2": dict(pattern=2, window=4096, layers_27b=46, attn_softcap=50.0, final_softcap=30.0),
                   "gemma3": dict(pattern=6, window=0, layers_27b=62, attn_softcap=None, final_softcap=None)}


def _gemma(file: GGUFFile, arch: str, heads: int, hidden: int, head_dim: int, rope_theta: float, layers: int,
           scaling: dict | None) -> dict:
    """Gemma 2's or 3's config.json fields from its GGUF metadata, as llama.cpp reads them."""
    meta, defaults = file.metadata, _GEMMA_DEFAULTS[arch]
    window = int(meta.get(f"{arch}.attention.sliding_window", defaults["window"]) or 0)
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window or None,
        "layer_types": _layer_types(meta.get(f"{arch}.attention.sliding_window_pattern", defaults["pattern"]),
                                    layers, window),
        # Not in the file: llama.cpp scales queries by the 27B model's hidden / heads, others' head_dim
        "query_pre_attn_scalar": hidden // heads if layers == defaults["layers_27b"] else head_dim,
        "final_logit_softcapping": meta.get(f"{arch}.final_logit_softcapping", defaults["final_softcap"]) or None,
        "norm_weights_include_one": True,  # llama.cpp's converter adds Gemma's 1 to every norm weight
    }
    if arch == "gemma2":
        _check_one_rope_base(file, arch, rope_theta)
        return {**fields, "rope_theta": rope_theta,
                "attn_logit_softcapping": meta.get("gemma2.attn_logit_softcapping", defaults["attn_softcap"]) or None}
    linear = scaling is not None and scaling.get("rope_type") == "linear"
    return {**fields, "rope_parameters": {
        "full_attention": {"rope_type": "linear" if linear else "default", "rope_theta": rope_theta,
                           **({"factor": float(scaling["factor"])} if linear else {})},
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": float(meta.get("gemma3.rope.freq_base_swa", 10000.0))}}}


def _yarn(meta: dict, arch: str) -> dict:
    """A yarn rope config from GGUF metadata, as llama.cpp reads it (src/llama-context.cpp): the
    original context defaults to the trained one; its cos/sin scale is transformers' default,
    times rope.scaling.attn_factor, or DeepSeek's ratio where a log multiplier is given. The
    betas are read for every family, as transformers reads them from the source config
    (llama.cpp 0.3.36 reads them only for Grok and Mistral 3, and 32 / 1 otherwise)."""
    key = lambda name: meta.get(f"{arch}.rope.scaling.{name}")  # noqa: E731
    if key("factor") is None:
        raise CorruptWeights(f"{arch}.rope.scaling.type is yarn but {arch}.rope.scaling.factor is missing")
    factor = float(key("factor"))
    config = {"rope_type": "yarn", "factor": factor,
              "original_max_position_embeddings": int(key("original_context_length") or meta[f"{arch}.context_length"]),
              "beta_fast": key("yarn_beta_fast"), "beta_slow": key("yarn_beta_slow"),
              # GPT-OSS was trained with the ramp's ends where they fall (OpenAI's reference and
              # transformers); llama.cpp rounds them out to whole dims for every model
              "truncate": arch != "gpt-oss"}
    log_multiplier = float(key("yarn_log_multiplier") or 0.0)
    attention = yarn_mscale(factor) / yarn_mscale(factor, log_multiplier) if log_multiplier else yarn_mscale(factor)
    config["attention_factor"] = attention * float(key("attn_factor") or 1.0)
    return config


def _rope_scaling(file: GGUFFile, arch: str, head_dim: int, rope_theta: float) -> dict | None:
    short = file.tensors.get("rope_factors_short.weight")
    if short is not None:
        # LongRoPE (Phi-3.5, Phi-3 128k): llama.cpp's converter stores both factor sets, the
        # original context and the attention factor it computed as transformers does.
        meta = file.metadata
        if f"{arch}.rope.scaling.original_context_length" not in meta:
            raise CorruptWeights(f"{file.path} has rope_factors_short but no "
                                 f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "longrope", "short_factor": dequantize(file, short, torch.float64).tolist(),
                "original_max_position_embeddings": int(meta[f"{arch}.rope.scaling.original_context_length"]),
                "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}  # None: computed
    scaling_type = file.metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type == "yarn":
        return _yarn(file.metadata, arch)
    if scaling_type not in (None, "none"):
        # ModelConfig rejects what the decoder cannot run, with a message naming the type.
        return {"rope_type": scaling_type, "factor": file.metadata.get(f"{arch}.rope.scaling.factor")}
    freqs = file.tensors.get("rope_freqs.weight")
    if freqs is None:
        return None
    # Llama 3.1+ GGUFs store the per-frequency divisors instead of the rope_scaling parameters.
    # Every Llama 3.x uses low/high factors 1 and 4 over an 8192 original context; check the
    # stored divisors are exactly those, so any other scheme fails loudly instead of running wrong.
    stored = dequantize(file, freqs, torch.float64)
    candidate = RopeScaling(factor=float(stored.max()), low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=8192)
    expected = _llama3_divisors(candidate, head_dim, rope_theta)
    if stored.shape != expected.shape or not torch.allclose(stored, expected, rtol=1e-3, atol=1e-4):
        raise UnsupportedArchitecture(f"{file.path}: its rope_freqs tensor is not Llama 3 rope scaling with "
                                      f"the standard parameters; meshllm cannot reproduce it")
    return {"rope_type": "llama3", "factor": candidate.factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama3_divisors(s: RopeScaling, head_dim: int, rope_theta: float) -> torch.Tensor:
    # The divisor llama.cpp's converter writes per rotary frequency (convert_hf_to_gguf.py, LlamaModel).
    freqs = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    mid = 1 / ((1 - smooth) / s.factor + smooth)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    return torch.where(wavelen < high_wavelen, torch.ones_like(freqs),
                       torch.where(wavelen > low_wavelen, torch.full_like(freqs, s.factor), mid))


def without_harmony_end(ids: list[int], tokens: Sequence[str]) -> list[int]:
    """Stop ids without <|end|> in an o200k_harmony vocabulary (GPT-OSS's): there <|end|> closes a
    message, the reasoning's among them, and the reply goes on to <|return|> or <|call|>
    (llama.cpp drops it from its end-of-generation ids so too, whatever the metadata names)."""
    if "<|return|>" not in tokens or "<|call|>" not in tokens:
        return ids
    return [i for i in ids if not (0 <= i < len(tokens) and tokens[i] == "<|end|>")]
