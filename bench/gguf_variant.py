"""A GGUF rewritten with its matrices in another type, by the gguf package and ggml's quantizer
(no llama.cpp build needed): `SmolLM2 Q4_1 -> BF16` is the shipped model as a 16-bit file (every
value the Q4_1 blocks hold, rounded to bf16), the target a 4-bit draft of itself verifies.

    python bench/gguf_variant.py SOURCE.gguf BF16|F32|Q8_0|Q4_0 [OUT.gguf]
    python bench/gguf_variant.py --skeleton SOURCE.gguf OUT.gguf
    python bench/gguf_variant.py --random SKELETON.gguf OUT.gguf

A skeleton is a GGUF's metadata and tensor list without the tensors (SmolLM2's: ~2 MB); from
it `--random` writes a file of the same shapes, types and vocabulary with random weights (plain
block types where ggml is not built). Speed does not depend on the weights' values: a GPU host,
which can be sent 64 MiB and no registry, measures the 98 MB demo model that way.

Metadata is copied key by key; 1-D tensors (norms) stay as they are; the others are
dequantized to fp32 (gguf's reference dequantization) and written in the new type. Cached in
bench/llama_cpp.CACHE/bench as `<stem>.<TYPE>.gguf` when no OUT is given.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_variant(source: Path, kind: str, out: Path) -> Path:
    from gguf import quants
    from gguf.constants import GGMLQuantizationType as GGML

    target = GGML[kind]
    reader, writer, tmp = _copy_metadata(source, out)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # rows first
        if len(shape) == 1:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        dense = torch.from_numpy(np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        _add_matrix(writer, t.name, dense, shape, target)
    return _finish(writer, tmp, out)


def _add_matrix(writer, name: str, dense: torch.Tensor, shape: list[int], target) -> None:
    """A float matrix of `shape` ([rows, cols], or [experts, rows, cols]: a mixture of experts'
    stacked matrices, as rows of cols) written as `target` (F32, BF16, or blocks by ggml's
    quantizer, or gguf's port of it where ggml is not built: the same bytes)."""
    from gguf.constants import GGMLQuantizationType as GGML

    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.ggml_weights import quantize

    dense = dense.reshape(-1, shape[-1])
    if target == GGML.F32:
        writer.add_tensor(name, dense.reshape(shape).numpy())
    elif target == GGML.BF16:
        raw = dense.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
        writer.add_tensor(name, raw, raw_shape=(*shape[:-1], shape[-1] * 2), raw_dtype=GGML.BF16)
    else:
        blocks = quantize(runtime(), dense, target).data.numpy()
        writer.add_tensor(name, blocks, raw_shape=(*shape[:-1], blocks.shape[-1]), raw_dtype=target)


SKELETON_KEY = "meshllm.skeleton.tensors"


def _copy_metadata(source: Path, out: Path, skip: tuple[str, ...] = ()):
    """A reader of `source` and a writer (to a temporary beside `out`) holding its metadata."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in skip:
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    return reader, writer, tmp


def _finish(writer, tmp: Path, out: Path) -> Path:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


def write_skeleton(source: Path, out: Path) -> Path:
    """`source`'s metadata, and its tensors' names, shapes (rows first) and types as one key."""
    reader, writer, tmp = _copy_metadata(source, out)
    tensors = [[t.name, [int(d) for d in reversed(t.shape)], t.tensor_type.name] for t in reader.tensors]
    writer.add_string(SKELETON_KEY, json.dumps(tensors))
    return _finish(writer, tmp, out)


def write_random(skeleton: Path, out: Path, seed: int = 0) -> Path:
    """A GGUF of the skeleton's metadata, shapes and types with random weights: matrices drawn
    at unit scale over their width, 1-D tensors (norms) ones."""
    from gguf import GGUFReader
    from gguf.constants import GGMLQuantizationType as GGML

    tensors = json.loads(GGUFReader(skeleton).fields[SKELETON_KEY].contents())
    _, writer, tmp = _copy_metadata(skeleton, out, skip=(SKELETON_KEY,))
    rng = np.random.default_rng(seed)
    for name, shape, kind in tensors:
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            continue
        dense = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) / np.float32(shape[-1] ** 0.5))
        _add_matrix(writer, name, dense, shape, GGML[kind])
    return _finish(writer, tmp, out)


def variant(source: Path, kind: str) -> Path:
    """`source` in `kind`, written once into the bench cache."""
    from llama_cpp import CACHE

    out = CACHE / "bench" / f"{source.stem}.{kind}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        write_variant(source, kind, out)
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1] in ("--skeleton", "--random"):
        write = write_skeleton if sys.argv[1] == "--skeleton" else write_random
        sys.exit(print(write(Path(sys.argv[2]), Path(sys.argv[3]))))
    src, kind = Path(sys.argv[1]), sys.argv[2]
    print(write_variant(src, kind, Path(sys.argv[3])) if len(sys.argv) > 3 else variant(src, kind))
