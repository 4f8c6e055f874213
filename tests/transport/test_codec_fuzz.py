"""Property-based fuzzing of the tensor codec (bounded: few examples, no deadline on a loaded machine).

Whatever a peer puts in a Tensor message (any dtype name, any shape, any bytes), decoding either
gives a tensor of exactly that dtype and shape or raises MalformedTensor; and every tensor we can
send comes back bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshllm.errors import MalformedTensor
from meshllm.transport import codec
from meshllm.transport.protos import common_pb2

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

dtype_names = st.one_of(st.sampled_from(sorted(codec.DTYPES)), st.sampled_from(["float64", "uint8", "bool", ""]),
                        st.text(max_size=12))
dims = st.one_of(st.integers(0, 6), st.integers(-(1 << 63), (1 << 63) - 1))
shapes = st.lists(dims, max_size=10)


@st.composite
def wire_tensors(draw) -> common_pb2.Tensor:
    dtype, shape = draw(dtype_names), draw(shapes)
    itemsize = codec.DTYPES[dtype].itemsize if dtype in codec.DTYPES else 4
    numel = math.prod(shape) if all(0 <= d < 64 for d in shape) else 0
    # Mostly the right length for the layout (the decoder's deeper checks), sometimes any length.
    length = draw(st.one_of(st.just(max(0, numel * itemsize)), st.integers(0, 256)))
    return common_pb2.Tensor(dtype=dtype, shape=shape, data=draw(st.binary(min_size=length, max_size=length)))


@FUZZ
@given(wire_tensors())
def test_any_wire_tensor_decodes_to_its_declared_layout_or_is_refused_by_name(message):
    message = common_pb2.Tensor.FromString(message.SerializeToString())
    try:
        tensor = codec.from_pb(message)
    except MalformedTensor as e:
        assert str(e)  # a message that says what is wrong
        return
    assert tensor.dtype == codec.DTYPES[message.dtype]
    assert tuple(tensor.shape) == tuple(message.shape)
    assert tensor.numel() * tensor.element_size() == len(message.data)


@st.composite
def tensors(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(sorted(codec.DTYPES.values(), key=str)))
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    tensor = torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)
    return tensor.transpose(0, -1) if draw(st.booleans()) and tensor.dim() > 1 else tensor  # non-contiguous too


@FUZZ
@given(tensors())
def test_every_sendable_tensor_round_trips_bit_for_bit(tensor):
    back = codec.from_pb(common_pb2.Tensor.FromString(codec.to_pb(tensor).SerializeToString()))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert back.reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist()
