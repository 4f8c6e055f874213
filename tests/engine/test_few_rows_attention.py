"""meshllm's causal attention of a few query rows over a bf16 KV cache (engine/kernels/few_rows_attention.c).

Against float64 attention of the same values (K and V exactly their bf16 values, queries f32), and
the property speculative decoding relies on: the t rows of a verify pass get bitwise what t
one-row steps get, each seeing the keys up to its own position.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

from meshllm.engine.ggml_lib import runtime
from meshllm.engine.ggml_weights import GraphScope
from meshllm.engine.kernels.custom_ops import attention_op


@pytest.fixture(scope="module")
def rt():
    rt = runtime()
    if rt is None:
        pytest.skip("ggml is not built here (install.sh builds it)")
    if attention_op() is None:
        pytest.skip("the attention op was not built, or this CPU lacks AVX-512")
    return rt


def _attend(rt, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [t, heads, hd] f32, k and v [kv_heads, end, hd] bf16 -> [t, heads, hd] through the op."""
    g = rt.lib
    t, heads, hd = q.shape
    out = torch.empty(t, heads, hd)
    with GraphScope(rt) as s:
        args = (ctypes.POINTER(g.ggml_tensor) * 3)(s.wrap(q.contiguous()), s.wrap(k.contiguous()), s.wrap(v.contiguous()))
        y = g.ggml_custom_4d(s.ctx, 0, hd, heads, t, 1, args, 3, g.ggml_custom_op_t(attention_op()), -1, None)
        s.point(y, out)
        s.compute(y)
    return out


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    t, heads, hd = q.shape
    kv_heads, end, _ = k.shape
    group = heads // kv_heads
    out = torch.empty(t, heads, hd, dtype=torch.float64)
    for r in range(t):
        visible = end - t + r + 1
        for h in range(heads):
            keys, values = k[h // group, :visible].double(), v[h // group, :visible].double()
            weights = torch.softmax(keys @ q[r, h].double() / math.sqrt(hd), dim=0)
            out[r, h] = weights @ values
    return out


def _inputs(t: int, heads: int, kv_heads: int, end: int, hd: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(t, heads, hd, generator=g) * 2
    k = (torch.randn(kv_heads, end, hd, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(kv_heads, end, hd, generator=g).to(torch.bfloat16)
    return q, k, v


# hd 64 and 128 run specialized code, 32 the generic one; 9 heads over 3 KV heads do not split
# evenly over two threads; end 1 and 17 leave masked tails in the softmax (and keys scored 16 at a
# time leave padding in the last block), end 32 none.
@pytest.mark.parametrize("t,heads,kv_heads,end,hd", [(1, 9, 3, 1, 64), (1, 9, 3, 200, 64), (5, 9, 3, 17, 64),
                                                     (16, 4, 1, 300, 128), (3, 8, 8, 40, 32), (9, 6, 2, 9, 64),
                                                     (2, 9, 3, 32, 64), (100, 9, 3, 130, 64), (70, 32, 4, 70, 64)])
def test_matches_float64_attention(rt, t, heads, kv_heads, end, hd):
    q, k, v = _inputs(t, heads, kv_heads, end, hd, seed=t * 100 + end)
    torch.testing.assert_close(_attend(rt, q, k, v).double(), _reference(q, k, v), rtol=0, atol=2e-5)


def test_a_verify_pass_of_t_rows_equals_t_one_row_steps(rt):
    t, end = 9, 120
    q, k, v = _inputs(t, 9, 3, end, 64, seed=5)
    together = _attend(rt, q, k, v)
    for r in range(t):
        visible = end - t + r + 1  # a one-row step at that position sees exactly these keys
        alone = _attend(rt, q[r:r + 1], k[:, :visible], v[:, :visible])
        assert torch.equal(together[r:r + 1], alone), r


def test_a_prefill_chunk_scores_each_row_as_a_one_row_step(rt):
    """ggml_stage runs prefill chunks of any size through the op (without a sliding window): each
    row of a chunk comes out as a one-row step at its position would (so chunk sizes do not change
    a sequence's KV), with the scores of 4 query rows at a time in the thread's scratch."""
    t, end = 150, 400
    q, k, v = _inputs(t, 9, 3, end, 64, seed=11)
    together = _attend(rt, q, k, v)
    for r in (0, 1, 3, 4, 77, 148, 149):  # around the 4-row blocks, and the chunk's last
        visible = end - t + r + 1
        assert torch.equal(together[r:r + 1], _attend(rt, q[r:r + 1], k[:, :visible], v[:, :visible])), r


def test_large_scores_do_not_overflow(rt):
    q, k, v = _inputs(4, 2, 1, 50, 64, seed=6)
    q *= 40  # scores in the thousands: softmax must subtract its max first
    out = _attend(rt, q, k, v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k, v), rtol=0, atol=2e-5)
