"""A GGUF rewritten with its matrices in another type, by the gguf package and ggml's quantizer
(no llama.cpp build needed): `SmolLM2 Q4_1 -> BF16` is the shipped model as a 16-bit file (every
value the Q4_1 blocks hold, rounded to bf16), the target a 4-bit draft of itself verifies.

    python bench/gguf_variant.py SOURCE.gguf BF16|F32|Q8_0|Q4_0 [OUT.gguf]

Metadata is copied key by key; 1-D tensors (norms) stay as they are; the others are
dequantized to fp32 (gguf's reference dequantization) and written in the new type. Cached in
bench/llama_cpp.CACHE/bench as `<stem>.<TYPE>.gguf` when no OUT is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_variant(source: Path, kind: str, out: Path) -> Path:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, quants
    from gguf.constants import GGMLQuantizationType as GGML

    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.ggml_weights import quantize

    target = GGML[kind]
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]  # rows first
        if len(shape) == 1:
            writer.add_tensor(t.name, np.asarray(t.data))
            continue
        # [rows, cols], or [experts, rows, cols] (a mixture of experts' stacked matrices) as rows of cols
        dense = torch.from_numpy(np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type),
                                                      dtype=np.float32)).reshape(-1, shape[-1])
        if target == GGML.F32:
            writer.add_tensor(t.name, dense.reshape(shape).numpy())
        elif target == GGML.BF16:
            raw = dense.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
            writer.add_tensor(t.name, raw, raw_shape=(*shape[:-1], shape[-1] * 2), raw_dtype=GGML.BF16)
        else:
            blocks = quantize(runtime(), dense, target).data.numpy()
            writer.add_tensor(t.name, blocks, raw_shape=(*shape[:-1], blocks.shape[-1]), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    return out


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
    src, kind = Path(sys.argv[1]), sys.argv[2]
    print(write_variant(src, kind, Path(sys.argv[3])) if len(sys.argv) > 3 else variant(src, kind))
