"""Tensor codec: exact round trips, zero-copy decode, loud failures on bad layouts."""

import numpy as np
import pytest
import torch

from meshllm.errors import MalformedTensor, ShardCorrupt
from meshllm.transport import codec
from meshllm.transport.protos import common_pb2

# Zero-copy decode views an immutable bytes object; torch warns about that once.
pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_round_trip_is_bit_exact(dtype):
    source = (torch.randn(3, 5, 7) * 1000).to(dtype)
    message = common_pb2.Tensor.FromString(codec.to_pb(source).SerializeToString())
    decoded = codec.from_pb(message)
    assert decoded.dtype == dtype and decoded.shape == source.shape
    assert torch.equal(decoded.view(torch.uint8) if dtype.is_floating_point else decoded,
                       source.view(torch.uint8) if dtype.is_floating_point else source)
    assert message.dtype == codec.DTYPE_NAMES[dtype] and list(message.shape) == [3, 5, 7]


def test_decode_shares_memory_with_the_message_bytes():
    message = codec.to_pb(torch.arange(16, dtype=torch.float32))
    data = message.data
    tensor = codec.from_bytes(message.dtype, list(message.shape), data)
    assert tensor.data_ptr() == np.frombuffer(data, dtype=np.uint8).ctypes.data
    copied = codec.from_bytes(message.dtype, list(message.shape), data, copy=True)
    assert copied.data_ptr() != tensor.data_ptr() and torch.equal(copied, tensor)


def test_non_contiguous_and_scalar_and_empty_tensors():
    wide = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert torch.equal(codec.from_pb(codec.to_pb(wide.t())), wide.t())
    assert torch.equal(codec.from_pb(codec.to_pb(torch.tensor(2.5))), torch.tensor(2.5))
    empty = codec.from_pb(codec.to_pb(torch.empty(0, 4, dtype=torch.float16)))
    assert empty.shape == (0, 4) and empty.dtype == torch.float16


def test_length_that_disagrees_with_shape_raises_a_named_error():
    with pytest.raises(MalformedTensor, match="needs 24 bytes but the message carries 20"):
        codec.from_bytes("float32", [2, 3], bytes(20))
    assert issubclass(MalformedTensor, ShardCorrupt)  # the pipeline treats it as a corrupt shard


@pytest.mark.parametrize("dtype,shape", [("float64", [1]), ("complex64", [1]), ("float32", [-1, 4]),
                                         ("float32", [1] * 9)])
def test_unknown_dtype_or_bad_shape_is_refused(dtype, shape):
    with pytest.raises(MalformedTensor):
        codec.from_bytes(dtype, shape, bytes(8))


def test_unsupported_source_dtype_is_refused_with_a_fix():
    with pytest.raises(MalformedTensor, match="float64"):
        codec.to_pb(torch.zeros(2, dtype=torch.float64))


def test_an_empty_tensor_whose_dims_overflow_strides_is_refused_by_name():
    # Found by the codec fuzz: zero elements, so no bytes to disagree with, but torch cannot even
    # compute the strides ("Stride calculation overflowed", a bare RuntimeError).
    with pytest.raises(MalformedTensor, match="multiply past"):
        codec.from_bytes("bfloat16", (0, 45662, 45759, 45852, 96272), b"")
    assert codec.from_bytes("float32", (0, 3), b"").shape == (0, 3)
