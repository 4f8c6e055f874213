"""Tensors on the wire: raw little-endian bytes + dtype name + shape.

The format is framework-neutral (an MLX stage could read it), so dtypes travel
as names, never as torch enum values. Decoding is zero-copy: the tensor views
the message's bytes (see `from_pb`).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from meshllm.errors import MalformedTensor
from meshllm.transport.protos import common_pb2

# Decoding views the message's immutable bytes on purpose (see from_bytes); torch warns about that
# once per process, in every stage's log. Only here: elsewhere the warning may point at a real bug.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
MAX_NDIM = 8

# The wire is little-endian; every platform we target (x86-64, arm64) is too,
# so bytes are copied as they are and a big-endian host is refused up front.
if sys.byteorder != "little":  # pragma: no cover
    raise ImportError("meshllm's tensor codec needs a little-endian host")


def to_bytes(tensor: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of `tensor`; one copy into a bytes object."""
    name = DTYPE_NAMES.get(tensor.dtype)
    if name is None:
        raise MalformedTensor(
            f"cannot send a tensor of dtype {tensor.dtype}; supported: {sorted(DTYPES)}. "
            f"Convert it with .to(torch.float32) (or another supported dtype) first.")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    # Bytes through a uint8 view, because numpy has no bfloat16.
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return name, tuple(tensor.shape), data


def from_bytes(dtype: str, shape: tuple[int, ...] | list[int], data: bytes, *, copy: bool = False) -> torch.Tensor:
    """Tensor of `dtype` and `shape` over `data`, after checking they agree.

    With copy=False the tensor shares memory with `data` (an immutable bytes
    object): callers must not write into it in place. Pass copy=True when they do.
    """
    torch_dtype = DTYPES.get(dtype)
    if torch_dtype is None:
        raise MalformedTensor(f"unknown tensor dtype {dtype!r} on the wire; supported: {sorted(DTYPES)}")
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape):
        raise MalformedTensor(f"tensor shape {shape} is invalid: at most {MAX_NDIM} dims, none negative")
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    expected = math.prod(shape) * itemsize
    if expected != len(data):
        raise MalformedTensor(
            f"tensor of dtype {dtype} and shape {list(shape)} needs {expected} bytes but the message "
            f"carries {len(data)}; the sender and receiver disagree on the tensor layout")
    if expected == 0:
        # No bytes bound the dims here (a non-empty tensor's are bounded by its data): a zero dim
        # beside huge ones would overflow torch's stride computation.
        if math.prod(max(d, 1) for d in shape) >= 1 << 62:
            raise MalformedTensor(f"tensor shape {shape} is invalid: its dims multiply past 2**62")
        return torch.empty(shape, dtype=torch_dtype)
    tensor = torch.frombuffer(data, dtype=torch_dtype).reshape(shape)
    return tensor.clone() if copy else tensor


def to_pb(tensor: torch.Tensor) -> common_pb2.Tensor:
    dtype, shape, data = to_bytes(tensor)
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=data)


def from_pb(message: common_pb2.Tensor, *, copy: bool = False) -> torch.Tensor:
    """Decode a wire Tensor; zero-copy unless copy=True (see `from_bytes`)."""
    return from_bytes(message.dtype, list(message.shape), message.data, copy=copy)
