"""A stage's whole layer range as one ggml graph per step: the fast path of Decoder.forward.

Decoding a small model spends more time dispatching torch ops (norms, rotary, attention, adds:
~25 per layer) than multiplying; llama.cpp runs the whole step as one ggml graph. So does this:
each step builds one graph over all the stage's layers (norms, q/k/v products, rotary, the KV
writes, flash attention per sequence, SwiGLU MLP, residuals, and the head on the last stage) and
ggml computes it on its thread pool. The contracts of Decoder.forward are unchanged: a flat
batch of many sequences, each attending to its own `SequenceKV`, whose torch tensors ggml reads
and writes in place (so truncate, prefix copies and rollback keep working).

Weights are the ones the Decoder already holds: QuantizedLinear/QuantizedEmbedding matrices in
ggml buffers, and dense fp32/fp16/bf16 parameters, which ggml reads straight from torch memory.
"""

from __future__ import annotations

import ctypes
import math
import threading
import time
import weakref

import numpy as np
import torch
from gguf.constants import GGMLQuantizationType as GGML
from torch import Tensor, nn

from meshllm.engine.ggml_lib import Runtime
from meshllm.engine.ggml_weights import GraphScope, custom_op
from meshllm.engine.kernels.custom_ops import (attention_op, batched_attention_ops, k_quant_few_rows_op, q4_few_rows_op,
                                               q4_kx8_few_rows_op, q4_remainder_op, q8_0x8_ops, q8_few_rows_op)
from meshllm.engine.kernels.gemv import ggml_few_rows_op
from meshllm.engine.quantized import FileRowsEmbedding, QuantizedEmbedding, QuantizedLinear
from meshllm.model.decoder import Decoder, MoE, SeqSlice, _inv_freq
from meshllm.model.moe import SWIGLU_ALPHA

_F32 = 4
# Graph capacity: ~25 nodes per layer (~55 with Q4_1 remainders added by ggml ops) plus 14 per
# sequence and layer (views count), with room to spare.
_NODES_PER_LAYER, _NODES_PER_SEQ_LAYER = 80, 24
# A few-row step over K-quant parts split for per-row products (below): up to 7 parts a layer
# (mixed-type q/k/v, gate/up, o, down), each up to 8 nodes (3 views, 3 products, 2 concats) for 1.
_NODES_PER_SPLIT_LAYER = 56
_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# Products of a bf16 weight with at most this many rows run meshllm's kernel as a ggml custom op
# (kernels/gemv.c says why): a row's result never depends on the rows beside it (ggml's tinyBLAS
# GEMM, which takes 2 rows and more, does not promise that), so a verify pass of up to 16 rows is
# bitwise its one-row steps. Measured (AMD Zen 4, 2 threads, 1.1B shapes from DRAM: 2560x2048,
# 11264x2048, 2048x5632), ms op / tinyBLAS: 1 row 2.7 / 2.6 (ggml's gemv), 4 rows 4.0 / 3.9,
# 8 rows 4.3 / 4.5, 12 rows 5.5 / 4.9, 16 rows 6.0 / 5.8. Past 16 (prefill) ggml's GEMM.
FEW_ROWS_MAX = 16
# Products of a repacked Q4_0 matrix (a Q4_1 one's with its remainder), a plain Q8_0 one or a K-quant
# one (Q4_K repacked or plain, Q5_K, Q6_K; from 2 rows) with at most this many rows run meshllm's
# kernels (kernels/quant_few_rows.c, k_quant_few_rows.c say why): bitwise ggml's one-row products,
# an extra row at a fraction of ggml's cost; more rows (prefill) run ggml's GEMM, but for ALL_ROWS_OPS.
QUANT_FEW_ROWS_MAX = 16
# (type, repacked) of the matrices whose op (above) runs at any number of rows, prefill chunks too:
# a repacked Q4_0 one (a Q4_1 one's with its remainder), where meshllm's op out-runs ggml's own
# repacked GEMM at every chunk size measured (2 threads, AMD Zen 4, whole-model prefill tok/s of
# 32 / 128 / 512 rows, ggml's -> the op's): SmolLM2 Q4_1 791 / 891 / 817 -> 1140 / 1256 / 1072,
# Q4_0 940 / 1009 / 784 -> 1495 / 1606 / 1052, a 1.1B Q4_0 (TinyLlama's shape) 132 / 138 / 128 ->
# 243 / 235 / 203. Not the others: plain Q8_0 0.80-0.91x ggml's GEMM from 64 rows, the K-quants
# (SmolLM2 Q4_K_M) 0.97-1.02x.
ALL_ROWS_OPS = frozenset({(int(GGML.Q4_0), True)})
# Steps whose sequences have at most this many rows each reuse their graph (see forward); a few
# shapes are kept (batch 1 with adaptive draft lengths cycles through several).
_MAX_REUSED_ROWS, _MAX_CACHED_GRAPHS = 16, 6
# ggml runs flash attention for this many queries of a sequence or more as tiles (GGML_FA_TILE_Q).
_TILED_ATTENTION_ROWS = 64
# Attention of a sequence's rows over a bf16 KV cache runs meshllm's op (kernels/few_rows_attention.c
# says why) up to this many rows, and any number without a sliding window: it out-runs ggml's flash
# attention on prefill chunks too (ggml's runs up to 63 queries one row at a time, more as tiles
# over an f32 copy of the KV). Measured, 2 threads, AMD Zen 4, whole-model prefill tok/s (Q4 weights),
# ggml's -> the op: SmolLM2 chunks of 32 rows 730 -> 1028, 63 rows 792 -> 1157, 128 of 1024 821 ->
# 988, 512 of 2048 657 -> 731; a 1.1B of TinyLlama's shape (32 heads over 4) 32 rows 217 -> 249,
# 256 of 1024 195 -> 205. With a window, more rows run ggml's (the op's rows would go one by one),
# and with more threads than heads (the op splits its work by head: _attends_by_op). A
# step whose sequences all have at most this many rows runs the batched form: one KV write and one
# attention op per layer for all its sequences, reading where each sequence's rows and KV are from
# a table patched per step, so its graph serves any later step with as many rows however they
# split into sequences (speculative drafts change the split nearly every step; a new graph cost
# ~15 ms of Python and allocation at 8 sequences, half a step).
ATTENTION_FEW_ROWS_MAX = 16
# ggml (0.25.3) multiplies this many activation rows and more of these types, in its plain layout,
# with a tiled GEMM (ggml-cpu/tiled), and fewer with one dot product per row and output. The GEMM
# sums in another order, so a row's bits would depend on how many rows share its step. Steps of
# up to QUANT_FEW_ROWS_MAX rows run the product in pieces of fewer rows: a verify pass scores
# bitwise what its one-row steps score, and a sequence's logits do not depend on its batch, as
# on the types meshllm's few-row ops cover. Measured (2 threads, AMD Zen 4, Q6_K): 8 rows of a
# 11264x2048 matrix 6.8 ms tiled against 2.9 per row, 49152x2048 22 against 13; 16 rows of small
# matrices (2560x2048) 0.7 against 1.5. Prefill chunks (more rows) take the GEMM: 512 rows of
# 5632x2048 Q5_K 24 ms against 147. Q5_K and Q6_K matrices (and Q4_K ones held plain) take
# meshllm's op instead of pieces (kernels/k_quant_few_rows.c: the same per-row arithmetic, the
# weights read once for all rows); the pieces serve the other types (Q3_K, IQ4_XS, ...).
_TILED_GEMM_MIN_ROWS = 8
_TILED_GEMM_TYPES = frozenset(int(t) for t in (
    GGML.Q2_K, GGML.Q3_K, GGML.Q4_K, GGML.Q5_K, GGML.Q6_K, GGML.IQ4_XS, GGML.IQ2_XXS, GGML.IQ2_XS,
    GGML.IQ2_S, GGML.IQ3_XXS, GGML.IQ3_S, GGML.IQ1_S, GGML.IQ1_M))


def _in_row_pieces(n: int) -> bool:
    """Whether a product of `n` activation rows over such a type runs in pieces (above)."""
    return _TILED_GEMM_MIN_ROWS <= n <= QUANT_FEW_ROWS_MAX


_NO_WINDOW = 1 << 62  # a full-attention layer's window in _Step.windows: longer than any context
_TABLE_FIELDS = 7  # per sequence: row, rows, start, K address, V address, position stride, head stride


class _Weights:
    """ggml tensors over one layer's (or the head's) weights; dense ones point into torch memory."""

    def __init__(self, scope: _WeightContext, module: nn.Module):
        # [(tensor, first_row, num_rows, remainder or None)] in output-row order; a remainder is the
        # per-block term of a Q4_1 matrix held as Q4_0 (ggml_weights.split_q4_1)
        self.parts: list[tuple[object, int, int, object | None]] = []
        self.dense_bf16 = False  # one bf16 torch matrix: few-row products may take meshllm's kernel
        # indices of the parts in meshllm's 8-row Q8_0 layout: only meshllm's op reads them
        self.q8_0x8: frozenset[int] = frozenset()
        if isinstance(module, QuantizedLinear):
            self.q8_0x8 = frozenset(i for i, m in enumerate(module.matrices) if m.layout == "q8_0x8")
            row = 0
            for m in module.matrices:
                self.parts.append((m.tensor, row, m.rows, None if m.remainder is None else scope.wrap(m.remainder)))
                row += m.rows
            bias = module.bias
        else:
            assert isinstance(module, nn.Linear), type(module)
            self.parts.append((scope.wrap(module.weight), 0, module.out_features, None))
            self.dense_bf16 = module.weight.dtype == torch.bfloat16
            bias = module.bias
        self.bias = None if bias is None else scope.wrap(scope.keep(bias.detach().float().contiguous()))


def _relay_q8_0(decoder: Decoder) -> None:
    """Re-lay every Q8_0 matrix of the stage's layers and head (experts matrices aside) out in
    meshllm's 8-row layout, in place (GGMLMatrix.repack_q8_0x8): its op reads each block's 8
    scales and 8 rows' bytes together and takes any number of activation rows, each row computed
    alone. A tied embedding shares the head's table: its lookups take the matching op (_build_into).
    Measured, 2 threads, AMD Zen 4: the head is a large share of a one-row step and more of each
    extra verify row (SmolLM2's 49152 x 576 Q8_0 head, one thread, 1 / 4 / 8 / 16 rows 1.5 / 2.9 /
    5.2 / 10.2 ms in ggml's plain layout, 0.8 / 1.2 / 2.0 / 5.4 re-laid out); SmolLM2 Q8_0's layers
    re-laid too (the head either way): decode 222 -> 301 tok/s, prefill of 512 rows 696 -> 1380
    (plain, ggml's GEMM took them), the last logits 0.56 from a float32 reference over the same
    weights where ggml's products are 0.69."""
    for module in decoder.modules():
        if isinstance(module, QuantizedLinear):
            for m in module.matrices:
                if m.fits_q8_0x8 and m.experts == 1:
                    m.repack_q8_0x8()


def _experts(scope: _WeightContext, module: nn.Module, experts: int):
    """A 3-d ggml tensor [cols, rows, experts] over an experts matrix (decoder.MoE), as
    ggml_mul_mat_id reads it: its one block matrix (held 3-d), or a view of its dense weight."""
    if isinstance(module, QuantizedLinear):
        (matrix,) = module.matrices  # stage_weights holds experts as one 3-d matrix (repacked or not)
        return matrix.tensor
    weight = module.weight
    return scope.wrap(weight.view(experts, weight.shape[0] // experts, weight.shape[1]))


class _WeightContext:
    """Metadata of the ggml tensors that point at dense torch weights, kept for the stage's life."""

    def __init__(self, rt: Runtime, max_tensors: int):
        g = self.g = rt.lib
        self.ctx = g.ggml_init(g.ggml_init_params(mem_size=(max_tensors + 8) * g.ggml_tensor_overhead(),
                                                  mem_buffer=None, no_alloc=True))
        self._kept: list[Tensor] = []

    def keep(self, t: Tensor) -> Tensor:
        self._kept.append(t)
        return t

    def wrap(self, t: Tensor):
        assert t.is_contiguous() and t.dtype in _DTYPES, (t.dtype, t.shape)
        dims = list(reversed(t.shape)) + [1] * (4 - t.dim())
        gt = self.g.ggml_new_tensor_4d(self.ctx, _DTYPES[t.dtype], *dims)
        gt.contents.data = t.data_ptr()
        return gt

    def __del__(self):
        if getattr(self, "ctx", None):
            self.g.ggml_free(self.ctx)
            self.ctx = None


def supports(decoder: Decoder) -> str | None:
    """None when GGMLStage can run this decoder, else why not (the torch path runs it)."""
    if decoder.dtype not in _DTYPES:
        return f"dtype {decoder.dtype}"
    mlps = [(m.router, m.gate_proj, m.up_proj, m.down_proj,
             *(() if m.shared is None else (m.shared.gate_up_proj, m.shared.down_proj)))
            if isinstance(m, MoE) else (m.gate_up_proj, m.down_proj) for m in (layer.mlp for layer in decoder.layers)]
    if any(isinstance(m, QuantizedLinear) and (len(m.matrices) != 1 or m.matrices[0].experts != decoder.config.num_experts)
           for layer in decoder.layers if isinstance(layer.mlp, MoE)
           for m in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)):
        return "experts matrices ggml's expert product cannot read"
    linears = [m for layer, mlp in zip(decoder.layers, mlps)
               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp)]
    if decoder.has_head:
        linears.append(decoder.lm_head)
    if not all(isinstance(m, QuantizedLinear) or type(m) is nn.Linear for m in linears):
        return "linears of a form ggml does not read"
    return None


class GGMLStage:
    def __init__(self, rt: Runtime, decoder: Decoder):
        assert supports(decoder) is None, supports(decoder)
        self.rt, self.g = rt, rt.lib
        # Not the decoder itself: it holds this object (decoder.fast_path), and a reference cycle
        # would keep the ggml buffers alive past Unload until the cycle collector happens to run.
        self.has_head = decoder.has_head
        c = self.config = decoder.config
        self.q_size, self.kv_size = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self._ctx = _WeightContext(rt, max_tensors=24 * len(decoder.layers) + 8)
        wrap_f32 = lambda t: self._ctx.wrap(self._ctx.keep(t.detach().float().contiguous()))  # noqa: E731
        self.layers = []
        wrap_norm = lambda norm: None if norm is None else wrap_f32(norm.weight)  # noqa: E731
        self._q8_0x8_ops = q8_0x8_ops()
        if self._q8_0x8_ops is not None:
            _relay_q8_0(decoder)
        for index, layer in enumerate(decoder.layers, start=decoder.first_layer):
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(mlp, MoE):  # a mixture of experts: the router and 3-d experts tensors
                e = c.num_experts
                mlp_weights = dict(router=_Weights(self._ctx, mlp.router), experts_gate=_experts(self._ctx, mlp.gate_proj, e),
                                   experts_up=_experts(self._ctx, mlp.up_proj, e),
                                   experts_down=_experts(self._ctx, mlp.down_proj, e),
                                   # GPT-OSS's [experts, rows] biases, as ggml's add_id reads them
                                   **{f"experts_{name}_bias": None if proj.bias is None else
                                      wrap_f32(proj.bias.view(e, -1))
                                      for name, proj in (("gate", mlp.gate_proj), ("up", mlp.up_proj),
                                                         ("down", mlp.down_proj))},
                                   # GLM-4.5's bias that picks experts, and its shared expert
                                   selection_bias=None if mlp.selection_bias is None else wrap_f32(mlp.selection_bias),
                                   shared=None if mlp.shared is None else dict(
                                       gate_up=_Weights(self._ctx, mlp.shared.gate_up_proj),
                                       down=_Weights(self._ctx, mlp.shared.down_proj)),
                                   # Qwen2-MoE's gate on it
                                   shared_gate=None if mlp.shared_gate is None else _Weights(self._ctx, mlp.shared_gate))
            else:
                mlp_weights = dict(gate_up=_Weights(self._ctx, mlp.gate_up_proj), down=_Weights(self._ctx, mlp.down_proj))
            self.layers.append(dict(
                attn_norm=wrap_f32(layer.input_layernorm.weight), mlp_norm=wrap_f32(layer.post_attention_layernorm.weight),
                qkv=_Weights(self._ctx, attn.qkv_proj), o=_Weights(self._ctx, attn.o_proj), **mlp_weights,
                q_norm=wrap_norm(attn.q_norm), k_norm=wrap_norm(attn.k_norm),
                sinks=None if attn.sinks is None else wrap_f32(attn.sinks),  # GPT-OSS's, one per head
                # Gemma 3: norms on the attention's and the MLP's outputs, and per-layer windows and rotary
                attn_out_norm=wrap_norm(layer.attn_out_norm), mlp_out_norm=wrap_norm(layer.mlp_out_norm),
                window=c.layer_window(index), rope=c.layer_rope(index)))
        # Attention ops scale scores by head_dim ** -0.5: another scale (Gemma's) goes on the queries.
        self.query_scale = 1.0 if c.attention_scale is None else c.attention_scale * math.sqrt(c.head_dim)
        if decoder.has_head:
            head = decoder.lm_head
            self.norm = wrap_f32(decoder.norm.weight)
            self.head = _Weights(self._ctx, head)
        self.embedding, self.embedding_q8_0x8, self.embedding_in_file = None, False, None
        if decoder.has_embedding:
            e = decoder.embed_tokens
            if isinstance(e, FileRowsEmbedding):  # each step reads its rows from the file (_build_into)
                self.embedding_in_file = e
            else:
                self.embedding = e.table.tensor if isinstance(e, QuantizedEmbedding) else self._ctx.wrap(e.weight)
                self.embedding_q8_0x8 = isinstance(e, QuantizedEmbedding) and e.table.layout == "q8_0x8"
        # ggml's NEOX rotary (HF's rotate_half) computes theta_i = pos * base^(-2i/d) / factor_i:
        # the factors carry llama3's frequency scaling, or LongRoPE's as they are. d is the rotated
        # dims (a partial rotary turns the first ones, ggml and transformers alike).
        d = c.rotated_dims
        base = 1.0 / (c.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        factors = base / _inv_freq(c) if c.rope_factors is None else torch.tensor(c.rope_factors)
        # Memory for a step's intermediate tensors, reused (and grown when needed) step after step;
        # the cached decode graph has its own, so a prefill step never moves its tensors.
        self._allocator = self.g.ggml_gallocr_new(rt.cpu_buffer_type)
        # Reusable graphs of few-row steps (decodes, verify passes of a few lengths), each with
        # its own allocator so they keep their tensors' addresses; least recently used last.
        self._cached: dict[tuple, _Step] = {}
        # Plans on one node share a stage's weights, each with its own compute lock
        # (pipeline/loaded_stages.py), so their steps may arrive here at once: the allocator,
        # which a larger graph frees and replaces, and the graph cache are this stage's alone.
        self._lock = threading.Lock()
        self.freq_factors = None if bool((factors == 1).all()) else wrap_f32(factors)
        op = ggml_few_rows_op()
        self._few_rows_op = None if op is None else self.g.ggml_custom_op_t(op)
        op = q4_remainder_op()  # Q4_1 matrices held as Q4_0 (ggml_weights.split_q4_1); else ggml's own ops
        self._remainder_op = None if op is None else self.g.ggml_custom_op_t(op)
        # what few_rows_attention.c takes; soft-capped scores (Gemma 2's) and sinks (GPT-OSS's) go
        # through ggml's own
        attention_fits = c.head_dim % 16 == 0 and c.head_dim <= 256 and c.attn_softcap is None and \
            not c.attention_sinks
        op = attention_op() if attention_fits else None
        self._attention_op = None if op is None else self.g.ggml_custom_op_t(op)
        ops = batched_attention_ops() if attention_fits else None
        self._batched_ops = None if ops is None else tuple(self.g.ggml_custom_op_t(op) for op in ops)
        # (type, whether in ggml's repack buffer) -> meshllm's few-row op for that layout
        self._k_quant_types = frozenset((self.g.GGML_TYPE_Q4_K, self.g.GGML_TYPE_Q5_K, self.g.GGML_TYPE_Q6_K))
        ops = {(self.g.GGML_TYPE_Q4_0, True): q4_few_rows_op(), (self.g.GGML_TYPE_Q8_0, False): q8_few_rows_op(),
               (self.g.GGML_TYPE_Q4_K, True): q4_kx8_few_rows_op(),
               **dict.fromkeys(((t, False) for t in self._k_quant_types), k_quant_few_rows_op())}
        self._quant_few_rows_ops = {key: self.g.ggml_custom_op_t(op) for key, op in ops.items() if op is not None}

    # --- graph pieces ---------------------------------------------------------------------------
    def _linear(self, s: GraphScope, w: _Weights, x):
        """[(output, first_row, num_rows)] of x [in, n] through each row part of w."""
        g = s.g
        outs = []
        n = x.contents.ne[1]
        if w.dense_bf16 and self._few_rows_op is not None and n <= FEW_ROWS_MAX:
            (tensor, first, rows, _), = w.parts
            args = (ctypes.POINTER(type(tensor.contents)) * 2)(tensor, x)
            outs.append((g.ggml_custom_4d(s.ctx, 0, rows, n, 1, 1, args, 2, self._few_rows_op, -1, None), first, rows))
        else:
            sums = None
            for part, (tensor, first, rows, remainder) in enumerate(w.parts):
                if part in w.q8_0x8:  # any number of rows: ggml's ops cannot read the layout
                    outs.append((custom_op(s, self._q8_0x8_ops[0], (rows, n), tensor, x), first, rows))
                    continue
                op = self._quant_few_rows_op(tensor, n)
                if op is not None:
                    args = (ctypes.POINTER(type(tensor.contents)) * 3)(tensor, x, remainder)
                    outs.append((g.ggml_custom_4d(s.ctx, 0, rows, n, 1, 1, args, 2 if remainder is None else 3,
                                                  op, -1, None), first, rows))
                    continue
                if _in_row_pieces(n) and self._takes_tiled_gemm(tensor):
                    out = self._per_row_products(s, tensor, x)
                else:
                    out = g.ggml_mul_mat(s.ctx, tensor, x)
                if remainder is not None and self._remainder_op is not None:
                    args = (ctypes.POINTER(type(out.contents)) * 3)(out, x, remainder)
                    out = g.ggml_custom_4d(s.ctx, 0, rows, n, 1, 1, args, 3, self._remainder_op, -1, None)
                elif remainder is not None:  # + sum over blocks b of R[b] * (x summed over block b)
                    sums = self._block_sums(s, x) if sums is None else sums
                    out = g.ggml_add(s.ctx, out, g.ggml_out_prod(s.ctx, self._remainder_by_block(s, remainder), sums))
                outs.append((out, first, rows))
        if w.bias is not None:  # each part its rows' share (a K-quant mix stores q, k and v in two types)
            outs = [(g.ggml_add(s.ctx, out, w.bias if len(outs) == 1 else
                                g.ggml_view_1d(s.ctx, w.bias, rows, first * w.bias.contents.nb[0])), first, rows)
                    for out, first, rows in outs]
        return outs

    def _quant_few_rows_op(self, tensor, n: int):
        """meshllm's op for `tensor` times `n` rows, or None: Q4_0 in ggml's repack buffer, Q8_0 in
        the plain one (the layouts quant_few_rows.c reads); Q4_K in either, Q5_K and Q6_K in the
        plain one, from 2 rows (k_quant_few_rows.c; one row is ggml's own product, bitwise the
        op's and as fast or faster: 11264x2048, 2 threads, Q5_K 0.58 ms against 0.8, Q6_K 0.49
        against 0.48, repacked Q4_K 0.46 against 0.48)."""
        t = tensor.contents
        if not t.buffer or (n == 1 and t.type in self._k_quant_types):
            return None
        key = (t.type, self._repacked(t))
        return self._quant_few_rows_ops.get(key) if n <= QUANT_FEW_ROWS_MAX or key in ALL_ROWS_OPS else None

    def _takes_tiled_gemm(self, tensor) -> bool:
        """Whether ggml would multiply 8 rows and more of `tensor` with its tiled GEMM: a type it
        has one for, in the plain layout (repacked matrices run their own kernels)."""
        t = tensor.contents
        return t.type in _TILED_GEMM_TYPES and not self._repacked(t)

    def _repacked(self, t) -> bool:
        """Whether ggml tensor `t` (its contents) lies in ggml's repack buffer."""
        return bool(t.buffer) and self.rt.repack_buffer_type is not None and \
            self.g.ggml_backend_buffer_get_type(t.buffer) == self.rt.repack_buffer_type

    @staticmethod
    def _per_row_products(s: GraphScope, tensor, x):
        """tensor times x [cols, n] in pieces of fewer rows than ggml's tiled GEMM takes, joined."""
        g = s.g
        if not g.ggml_is_contiguous(x):
            x = g.ggml_cont(s.ctx, x)
        cols, n, nb1 = x.contents.ne[0], x.contents.ne[1], x.contents.nb[1]
        out = None
        for first in range(0, n, _TILED_GEMM_MIN_ROWS - 1):
            rows = min(_TILED_GEMM_MIN_ROWS - 1, n - first)
            piece = g.ggml_mul_mat(s.ctx, tensor, g.ggml_view_2d(s.ctx, x, cols, rows, nb1, first * nb1))
            out = piece if out is None else g.ggml_concat(s.ctx, out, piece, 1)
        return out

    @staticmethod
    def _remainder_by_block(s: GraphScope, remainder):
        """A group-major remainder [8, blocks, rows / 8] (ggml_weights.split_q4_1) as [rows, blocks]
        in float32, what ggml_out_prod takes: a copy each step, on the path without meshllm's ops only."""
        g, (eight, blocks, groups) = s.g, tuple(remainder.contents.ne[:3])
        if remainder.contents.type != g.GGML_TYPE_F32:  # held in float16 (exactly the same values)
            remainder = g.ggml_cast(s.ctx, remainder, g.GGML_TYPE_F32)
        by_block = g.ggml_cont(s.ctx, g.ggml_permute(s.ctx, remainder, 0, 2, 1, 3))  # [8, groups, blocks]
        return g.ggml_reshape_2d(s.ctx, by_block, eight * groups, blocks)

    @staticmethod
    def _block_sums(s: GraphScope, x):
        """x [cols, n] -> [n, cols / 32] (a transposed view): each 32-column block of a row summed."""
        g = s.g
        cols, n = x.contents.ne[0], x.contents.ne[1]
        if not g.ggml_is_contiguous(x):
            x = g.ggml_cont(s.ctx, x)
        sums = g.ggml_sum_rows(s.ctx, g.ggml_reshape_3d(s.ctx, x, 32, cols // 32, n))  # [1, cols / 32, n]
        return g.ggml_transpose(s.ctx, g.ggml_reshape_2d(s.ctx, sums, cols // 32, n))

    @staticmethod
    def _rows(s: GraphScope, outs, first: int, num: int, shape: tuple[int, ...]):
        """A view of output rows [first, first + num) as `shape` ([ne0, ne1(, ne2)]) of the part holding them."""
        for out, start, rows in outs:
            if start <= first and first + num <= start + rows:
                nb1 = out.contents.nb[1]
                offset = (first - start) * _F32
                if len(shape) == 2:
                    return s.g.ggml_view_2d(s.ctx, out, shape[0], shape[1], nb1, offset)
                return s.g.ggml_view_3d(s.ctx, out, shape[0], shape[1], shape[2], shape[0] * _F32, nb1, offset)
        raise AssertionError(f"rows [{first}, {first + num}) straddle two weight parts")

    def _norm(self, s: GraphScope, x, weight):
        return s.g.ggml_mul(s.ctx, s.g.ggml_rms_norm(s.ctx, x, self.config.rms_norm_eps), weight)

    def _attention(self, s: GraphScope, graph, layer: int, w: dict, x, pos, slices: list[SeqSlice], masks, n: int,
                   table: Tensor | None):
        g, ctx, c = s.g, s.ctx, self.config
        hd, heads, kv_heads = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        qkv = self._linear(s, w["qkv"], x)
        v = self._rows(s, qkv, self.q_size + self.kv_size, self.kv_size, (hd, kv_heads, n))
        if c.qk_norm_across_heads:  # MiniMax-M2: one RMS over all of q's heads, one over k's
            q = self._norm(s, self._rows(s, qkv, 0, self.q_size, (self.q_size, n)), w["q_norm"])
            k = self._norm(s, self._rows(s, qkv, self.q_size, self.kv_size, (self.kv_size, n)), w["k_norm"])
            q, k = g.ggml_reshape_3d(ctx, q, hd, heads, n), g.ggml_reshape_3d(ctx, k, hd, kv_heads, n)
        else:
            q = self._rows(s, qkv, 0, self.q_size, (hd, heads, n))
            k = self._rows(s, qkv, self.q_size, self.kv_size, (hd, kv_heads, n))
        if w["q_norm"] is not None and not c.qk_norm_across_heads:
            q = self._norm(s, q, w["q_norm"])
            k = self._norm(s, k, w["k_norm"])
        if w["rope"] is not None:  # None: a NoPE layer (SmolLM3's every fourth)
            # The layer's base and linear factor (Gemma 3's differ by layer); attn_factor scales cos
            # and sin (LongRoPE's and YaRN's; 1 for other models)
            theta, linear = w["rope"]
            q, k = (g.ggml_rope_ext(ctx, t, pos, self.freq_factors, c.rotated_dims, g.GGML_ROPE_TYPE_NEOX, 0,
                                    theta, 1.0 / linear, 0.0, c.rope_attention_factor, 0.0, 0.0) for t in (q, k))
        if self.query_scale != 1.0:
            q = g.ggml_scale(ctx, q, self.query_scale)
        if table is not None:  # the batched form (ATTENTION_FEW_ROWS_MAX says why)
            write_op, attend_op = self._batched_ops
            row = ctypes.c_void_p(table[layer].data_ptr())
            args = (ctypes.POINTER(type(k.contents)) * 2)(k, v)
            write = g.ggml_custom_4d(ctx, 0, kv_heads, 1, 1, 1, args, 2, write_op, -1, row)  # a placeholder: order only
            s.last_kv_write = write  # only attention reads it: a step without logits must still reach it
            args = (ctypes.POINTER(type(q.contents)) * 2)(q, write)
            attn = g.ggml_custom_4d(ctx, 0, hd, heads, n, 1, args, 2, attend_op, -1, row)
            (o, _, _), = self._linear(s, w["o"], g.ggml_reshape_2d(ctx, attn, self.q_size, n))
            return o
        outs = []
        window = w["window"]
        for index, (seq, (k_cache, v_cache), mask) in enumerate(zip(slices, s.kv[layer], masks)):
            t, start = seq.num_tokens, seq.start
            end, first = start + t, _window_start(window, start)
            elt = seq.kv.k.element_size()
            row_nb, head_nb = hd * elt, seq.kv.capacity * hd * elt
            for new, cache in ((k, k_cache), (v, v_cache)):
                # new [hd, kv_heads, n] rows of this sequence -> cache [hd, t, kv_heads] at `start`
                rows = g.ggml_view_3d(ctx, new, hd, kv_heads, t, new.contents.nb[1], new.contents.nb[2],
                                      seq.row * new.contents.nb[2])
                dst = g.ggml_view_3d(ctx, cache, hd, t, kv_heads, row_nb, head_nb, start * row_nb)
                # Expanded now: the attention below reads the cache through another view, which
                # ggml does not know depends on this write; graph order is execution order.
                write = g.ggml_cpy(ctx, g.ggml_permute(ctx, rows, 0, 2, 1, 3), dst)
                g.ggml_build_forward_expand(graph, write)
                s.writes.append((dst, write, cache.contents.data, row_nb))
            q_seq = g.ggml_view_3d(ctx, q, hd, heads, t, q.contents.nb[1], q.contents.nb[2], seq.row * q.contents.nb[2])

            def cache_rows(first: int, stop: int, row: int | None):
                """Views of K and V at positions [first, stop), patched per step (_Step.patch)."""
                keys = g.ggml_view_3d(ctx, k_cache, hd, stop - first, kv_heads, row_nb, head_nb, first * row_nb)
                values = g.ggml_view_3d(ctx, v_cache, hd, stop - first, kv_heads, row_nb, head_nb, first * row_nb)
                s.reads.append((keys, values, k_cache.contents.data, v_cache.contents.data, row_nb, window, index, row))
                return keys, values

            if self._attends_by_op(seq, window):
                # The op sees every key up to a row's own. With a window each row starts elsewhere:
                # the rows of a few-row step (a verify pass) then go one by one, each exactly as a
                # one-row decode step attends (same op, same key view), so a verify pass keeps
                # scoring what its one-row steps score. (ggml's flash attention, which takes every
                # step of Gemma 2 and GPT-OSS, scores each row of bf16 KV alone as it is.)
                for row, q_rows in ([(None, q_seq)] if t == 1 or window is None else
                                    [(r, g.ggml_view_3d(ctx, q_seq, hd, heads, 1, q_seq.contents.nb[1],
                                                        q_seq.contents.nb[2], r * q_seq.contents.nb[2]))
                                     for r in range(t)]):
                    keys, values = cache_rows(first, end, None) if row is None else \
                        cache_rows(_window_start(window, start + row), start + row + 1, row)
                    args = (ctypes.POINTER(type(q_rows.contents)) * 3)(q_rows, keys, values)
                    outs.append(g.ggml_custom_4d(ctx, 0, hd, heads, q_rows.contents.ne[2], 1, args, 3,
                                                 self._attention_op, -1, None))
                continue
            # Keys [first, end): with a sliding window, from the first one the chunk's first row sees
            keys, values = cache_rows(first, end, None)
            if t >= _TILED_ATTENTION_ROWS and seq.kv.k.dtype == torch.bfloat16:
                # ggml's tiled attention kernel (a chunk of 64+ queries) takes f16 or f32 K/V only; on
                # bf16 it falls back to one query row at a time (SmolLM2 bf16 prefill 512: 420 -> 660
                # tok/s with this). The f32 copy is exact and costs one pass over the attended KV.
                keys, values = g.ggml_cast(ctx, keys, g.GGML_TYPE_F32), g.ggml_cast(ctx, values, g.GGML_TYPE_F32)
            out = g.ggml_flash_attn_ext(ctx, g.ggml_permute(ctx, q_seq, 0, 2, 1, 3), keys, values, mask,
                                        1.0 / math.sqrt(hd), 0.0, c.attn_softcap or 0.0)  # [hd, heads, t]
            if w["sinks"] is not None:  # GPT-OSS's, joined to each row's softmax
                g.ggml_flash_attn_ext_add_sinks(out, w["sinks"])
            g.ggml_flash_attn_ext_set_prec(out, g.GGML_PREC_F32)
            outs.append(out)
        attn = outs[0]
        for out in outs[1:]:
            attn = g.ggml_concat(ctx, attn, out, 2)
        attn = g.ggml_reshape_2d(ctx, attn, self.q_size, n)
        (o, _, _), = self._linear(s, w["o"], attn)
        return o

    def _mlp(self, s: GraphScope, w: dict, x, n: int, i: int | None = None):
        """The dense MLP of intermediate_size, or of width `i` (GLM-4.5's shared expert)."""
        if "router" in w:
            return self._moe(s, w, x, n)
        i = i or self.config.intermediate_size
        gate_up = self._linear(s, w["gate_up"], x)
        gate = self._rows(s, gate_up, 0, i, (i, n))
        up = self._rows(s, gate_up, i, i, (i, n))
        # ggml's GELU is the tanh approximation (transformers' gelu_pytorch_tanh), as llama.cpp runs Gemma
        glu = s.g.ggml_geglu_split if self.config.hidden_act == "gelu_tanh" else s.g.ggml_swiglu_split
        (down, _, _), = self._linear(s, w["down"], glu(s.ctx, gate, up))
        return down

    def _moe(self, s: GraphScope, w: dict, x, n: int):
        """A mixture of experts, as llama.cpp builds it (build_moe_ffn): each row's top experts by
        the router's softmax, their SwiGLU products through ggml's expert product (mul_mat_id),
        summed weighted by those probabilities (renormalized where the model says so)."""
        g, ctx, c = s.g, s.ctx, self.config
        k, experts, h = c.num_experts_per_tok, c.num_experts, c.hidden_size
        (logits, _, _), = self._linear(s, w["router"], x)  # [experts, n]
        if c.sigmoid_router:  # GLM-4.5: sigmoid scores; the bias only picks (llama.cpp's exp_probs_b)
            probs = g.ggml_sigmoid(ctx, logits)
            chosen = g.ggml_argsort_top_k(ctx, g.ggml_add(ctx, probs, w["selection_bias"]), k)
            weights = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, probs, 1, experts, n), chosen)  # [1, k, n]
        elif c.softmax_after_topk:  # GPT-OSS: the softmax of the chosen experts' logits
            chosen = g.ggml_argsort_top_k(ctx, logits, k)
            weights = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, logits, 1, experts, n), chosen)  # [1, k, n]
            weights = g.ggml_reshape_3d(ctx, g.ggml_soft_max(ctx, g.ggml_reshape_2d(ctx, weights, k, n)), 1, k, n)
        else:
            probs = g.ggml_soft_max(ctx, logits)
            chosen = g.ggml_argsort_top_k(ctx, probs, k)  # [k, n] expert ids, most probable first
            weights = g.ggml_get_rows(ctx, g.ggml_reshape_3d(ctx, probs, 1, experts, n), chosen)  # [1, k, n]
        if c.normalize_expert_weights:
            flat = g.ggml_reshape_2d(ctx, weights, k, n)
            weights = g.ggml_reshape_3d(ctx, g.ggml_div(ctx, flat, g.ggml_sum_rows(ctx, flat)), 1, k, n)
        if c.expert_weights_scale != 1.0:
            weights = g.ggml_scale(ctx, weights, c.expert_weights_scale)
        x = x if g.ggml_is_contiguous(x) else g.ggml_cont(ctx, x)
        rows = g.ggml_reshape_3d(ctx, x, h, 1, n)
        with_bias = lambda t, name: t if w[name] is None else g.ggml_add_id(ctx, t, w[name], chosen)  # noqa: E731
        gate = with_bias(g.ggml_mul_mat_id(ctx, w["experts_gate"], rows, chosen), "experts_gate_bias")  # [width, k, n]
        up = with_bias(g.ggml_mul_mat_id(ctx, w["experts_up"], rows, chosen), "experts_up_bias")
        act = g.ggml_swiglu_split(ctx, gate, up) if c.swiglu_limit is None else \
            g.ggml_swiglu_oai(ctx, gate, up, SWIGLU_ALPHA, c.swiglu_limit)  # GPT-OSS's clamped one
        out = with_bias(g.ggml_mul_mat_id(ctx, w["experts_down"], act, chosen), "experts_down_bias")  # [h, k, n]
        out = g.ggml_mul(ctx, out, weights)
        total = None
        for slot in range(k):
            piece = g.ggml_view_2d(ctx, out, h, n, out.contents.nb[2], slot * out.contents.nb[1])
            total = piece if total is None else g.ggml_add(ctx, total, piece)
        if w["shared"] is not None:  # beside the routed experts, for every row
            shared = self._mlp(s, w["shared"], x, n, c.shared_expert_size)
            if w["shared_gate"] is not None:  # Qwen2-MoE: times sigmoid(gate . x), one factor a row
                (gate, _, _), = self._linear(s, w["shared_gate"], x)  # [1, n]
                shared = g.ggml_mul(ctx, shared, g.ggml_sigmoid(ctx, gate))
            total = g.ggml_add(ctx, total, shared)
        return total

    # --- one step ------------------------------------------------------------------------------
    def forward(self, x: Tensor, positions: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> Tensor:
        """Decoder.forward's contract; the caller reserved KV room and commits the lengths.

        A few-row step shaped like an earlier one (same sequences, same KV tensors, as many rows
        each: a decode step, or a speculative verify pass of the same length) reuses that step's
        graph: only the KV write offsets, the attended lengths, the causal masks and the inputs
        change, and those are patched in place instead of rebuilding ~40 nodes per layer from
        Python (~2 ms on SmolLM2).
        """
        with self._lock:
            return self._forward(x, positions, slices, logit_rows)

    def _forward(self, x: Tensor, positions: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> Tensor:
        started = time.perf_counter()
        self._drop_stale()
        key = self._reuse_key(x, slices, logit_rows)
        step = self._cached.pop(key, None) if key is not None else None
        if step is None:
            step = self._build(x, slices, logit_rows, key)
        try:
            step.patch(x, positions, slices, logit_rows)
            out = torch.empty(step.out_shape, dtype=torch.float32)
            built = time.perf_counter()
            step.run(out)
        except BaseException:
            step.close()
            raise
        if key is not None:
            step.kvs = [] if step.table is not None else [weakref.ref(s.kv) for s in slices]
            self._cached[key] = step  # most recently used last
            while len(self._cached) > _MAX_CACHED_GRAPHS:
                self._cached.pop(next(iter(self._cached))).close()
        else:
            step.close()
        # Where a step's time goes (bench/decode.py reports it): Python building the graph, ggml running it.
        self.last_build_s, self.last_compute_s = built - started, time.perf_counter() - built
        # Hidden states leave in float32, as the graph holds them between layers: a stage boundary
        # then rounds nothing, so a pipeline computes what one process does, bit for bit, wherever
        # its boundaries fall (bf16 here cost that for half the bytes of an activation message,
        # which llama.cpp's RPC sends in float32 too).
        return out

    def _attends_by_op(self, seq: SeqSlice, window: int | None) -> bool:
        """Whether `seq`'s rows attend through meshllm's op in a layer with `window` (None: full
        attention): a bf16 KV cache, up to ATTENTION_FEW_ROWS_MAX rows or, without a window, any
        number while ggml's workers do not outnumber the heads (the op splits its work by head,
        ggml's flash attention by row too)."""
        return self._attention_op is not None and seq.kv.k.dtype == torch.bfloat16 and (
            seq.num_tokens <= ATTENTION_FEW_ROWS_MAX or (
                window is None and self.rt.num_threads <= self.config.num_attention_heads))

    def _batched(self, slices: list[SeqSlice]) -> bool:
        """Whether a step's attention takes the batched form (ATTENTION_FEW_ROWS_MAX says why)."""
        # With a sliding window, decode rows only: the table then starts each windowed layer's keys
        # where its window does (_fill_table); rows of one sequence would each need their own start.
        most = 1 if self.config.sliding_window is not None else ATTENTION_FEW_ROWS_MAX
        return self._batched_ops is not None and all(
            s.num_tokens <= most and s.kv.k.dtype == torch.bfloat16 for s in slices)

    def _reuse_key(self, x: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> tuple | None:
        """What a reusable graph depends on; None for steps that build their own (prefill chunks)."""
        if self._batched(slices):  # the split into sequences and their KV are data, patched per step
            return ("batched", x.dtype, x.shape, None if logit_rows is None else logit_rows.numel())
        # A prefill's first chunk (start 0) is never seen again: its sequence's KV is new.
        if any(s.num_tokens > _MAX_REUSED_ROWS or s.start == 0 for s in slices):
            return None
        return (x.dtype, x.shape, None if logit_rows is None else logit_rows.numel(),
                tuple((s.kv.k.data_ptr(), s.kv.v.data_ptr(), s.kv.capacity, s.num_tokens) for s in slices))

    def _drop_stale(self) -> None:
        """Close the kept graphs of sequences that are gone or whose KV moved (grown): they can
        never match again, and their graphs hold those KV tensors alive."""
        for key in [k for k, step in self._cached.items() if not step.current()]:
            self._cached.pop(key).close()

    def _drop_cached(self) -> None:
        for step in self._cached.values():
            step.close()
        self._cached = {}

    def _build(self, x: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None, key: tuple | None) -> _Step:
        n = x.shape[0]
        split = _NODES_PER_SPLIT_LAYER if _in_row_pieces(n) else 0
        # a view and an add per chosen expert; GLM-4.5's bias, scale and shared expert
        experts = 2 * self.config.num_experts_per_tok + (12 if self.config.num_experts else 0)
        # a windowed few-row step attends row by row: four nodes a row (_attention)
        rows = 4 * n if self.config.sliding_window is not None and n <= ATTENTION_FEW_ROWS_MAX * len(slices) else 0
        max_nodes = len(self.layers) * (_NODES_PER_LAYER + _NODES_PER_SEQ_LAYER * len(slices) + split + experts
                                        + rows) + 64
        s = GraphScope(self.rt, max_nodes=max_nodes).__enter__()
        step = _Step(key, s, None, self.g.ggml_gallocr_new(self.rt.cpu_buffer_type) if key is not None
                     else self._allocator)
        try:
            return self._build_into(step, x, slices, logit_rows)
        except BaseException:
            step.close()  # its context and allocator; the KV and lengths are untouched until it runs
            raise

    def _build_into(self, step: _Step, x: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> _Step:
        g, c, n, s = self.g, self.config, x.shape[0], step.scope
        ctx = s.ctx
        s.writes, s.reads, s.last_kv_write = [], [], None
        graph = step.graph = s.new_graph()
        step.pos = torch.zeros(n, dtype=torch.int32)
        pos = s.wrap(step.pos)
        if self._batched(slices):
            step.table = torch.zeros(len(self.layers), 1 + _TABLE_FIELDS * n, dtype=torch.int64)
            if c.sliding_window is not None:  # full layers' "window" past any position: their keys start at 0
                step.windows = np.array([w["window"] or _NO_WINDOW for w in self.layers], dtype=np.int64)
            masks = {w["window"]: [None] * len(slices) for w in self.layers}
        else:
            # per window the layers attend with (Gemma 3's layers have two): each slice's mask
            # (none for a slice meshllm's op attends: it sees each row's keys up to its own)
            masks = {window: [None if self._attends_by_op(seq, window) else self._mask(s, step, seq, index, window)
                              for index, seq in enumerate(slices)]
                     for window in dict.fromkeys(w["window"] for w in self.layers)}
            # A kept graph does not hold its sequences' KV alive: a finished sequence's KV is freed
            # at once, not when a later step drops the graph (_drop_stale, before any reuse).
            keep = step.key is None
            s.kv = [[(s.wrap(seq.kv.k[i], keep), s.wrap(seq.kv.v[i], keep)) for seq in slices]
                    for i in range(len(self.layers))]
        if self.embedding_in_file is not None:
            # The step's rows of the table, read as stored into a buffer of its own (patch), then
            # looked up in order: what get_rows computes over the whole table, for n rows' bytes.
            e = self.embedding_in_file
            step.ids, step.file_table = torch.zeros(n, dtype=torch.int32), e
            step.table_rows = torch.empty(n, e.rows.row_bytes, dtype=torch.uint8)
            h = e.looked_up(s, step.table_rows)
        elif self.embedding is not None:
            step.ids = torch.zeros(n, dtype=torch.int32)
            if self.embedding_q8_0x8:
                h = custom_op(s, self._q8_0x8_ops[1], (c.hidden_size, n), self.embedding, s.wrap(step.ids))
            else:
                h = g.ggml_get_rows(ctx, self.embedding, s.wrap(step.ids))
        else:
            step.hidden = torch.zeros(n, c.hidden_size, dtype=torch.float32)
            h = s.wrap(step.hidden)
        if step.ids is not None and c.embedding_scale != 1.0:  # Gemma, Granite
            h = g.ggml_scale(ctx, h, c.embedding_scale)
        for i, w in enumerate(self.layers):
            attn = self._attention(s, graph, i, w, self._norm(s, h, w["attn_norm"]), pos, slices,
                                   masks.get(w["window"]), n, step.table)
            h = g.ggml_add(ctx, h, self._joining(s, attn, w["attn_out_norm"]))
            mlp = self._mlp(s, w, self._norm(s, h, w["mlp_norm"]), n)
            h = g.ggml_add(ctx, h, self._joining(s, mlp, w["mlp_out_norm"]))
        step.out_shape = (n, c.hidden_size)
        if self.has_head:
            if logit_rows is not None:
                step.rows = torch.zeros(logit_rows.numel(), dtype=torch.int32)
                h = g.ggml_get_rows(ctx, h, s.wrap(step.rows))
            (h, _, _), = self._linear(s, self.head, self._norm(s, h, self.norm))
            if c.logit_scale != 1.0:  # Granite's logits divided, as llama.cpp scales them
                h = g.ggml_scale(ctx, h, 1.0 / c.logit_scale)
            if c.final_softcap is not None:  # Gemma 2's, as llama.cpp caps them
                h = g.ggml_scale(ctx, g.ggml_tanh(ctx, g.ggml_scale(ctx, h, 1.0 / c.final_softcap)), c.final_softcap)
            head_rows = sum(rows for _, _, rows, _ in self.head.parts)  # the vocabulary
            step.out_shape = (n if logit_rows is None else logit_rows.numel(), head_rows)
        step.out = h
        # Without logit rows nothing reads the last layer's attention, so nothing would run the
        # batched form's KV writes (each feeds only its layer's attention): the last one anchors
        # the graph then, and through it every earlier layer's.
        step.kv_anchor = s.last_kv_write
        return step

    def _joining(self, s: GraphScope, out, norm):
        """A sublayer's output as it joins the residual stream: Gemma's normalised, Granite's scaled."""
        if norm is not None:
            out = self._norm(s, out, norm)
        scale = self.config.residual_scale
        return out if scale == 1.0 else s.g.ggml_scale(s.ctx, out, scale)

    @staticmethod
    def _mask(s: GraphScope, step: _Step, seq: SeqSlice, index: int, window: int | None):
        """f16 [t, end - first] additive causal mask (keys from the window's first, _window_start),
        or None when every key is visible (a decode row).

        Its memory holds [t, capacity] so a reused graph can grow `end` in place (_Step.patch)."""
        t = seq.num_tokens
        if t == 1:
            return None
        room = seq.kv.capacity if step.key is not None else seq.start + t
        buffer = s.keep(torch.empty(t * room, dtype=torch.float16))
        width = seq.start + t - _window_start(window, seq.start)
        mask = s.wrap(buffer[: t * width].view(t, width))
        step.masks.append((mask, buffer, index, window))
        _write_mask(mask, buffer, seq.start, t, window)
        return mask

    def __del__(self):
        if getattr(self, "_allocator", None):
            self._drop_cached()
            self.g.ggml_gallocr_free(self._allocator)
            self._allocator = None


def _window_start(window: int | None, start: int) -> int:
    """The first key position a chunk starting at `start` attends to: 0, or with a sliding window
    the first the chunk's first row sees (a row at p sees keys after p - window, as transformers)."""
    return 0 if window is None else max(0, start - window + 1)


def _write_mask(mask, buffer: Tensor, start: int, t: int, window: int | None) -> None:
    """Row i of the [t, end - first] mask over keys [first, end): keys up to position start + i
    visible (and, with a window, after start + i - window), others -inf. Contiguous at its current
    length (ne and nb set to match), in `buffer`'s memory."""
    end, first = start + t, _window_start(window, start)
    width = end - first
    view = buffer[: t * width].view(t, width)
    view.zero_()
    keys, queries = torch.arange(first, end).unsqueeze(0), torch.arange(start, end).unsqueeze(1)
    hidden = keys > queries
    if window is not None:
        hidden |= keys <= queries - window
    view.masked_fill_(hidden, float("-inf"))
    m = mask.contents
    m.ne[0] = width
    m.nb[1] = width * 2
    m.nb[2] = m.nb[3] = t * width * 2


class _Step:
    """One built graph and where a new step's values go into it."""

    def __init__(self, key: tuple | None, scope: GraphScope, graph, allocator):
        self.key, self.scope, self.graph, self.allocator = key, scope, graph, allocator
        self.ids = self.hidden = self.rows = self.pos = self.out = self.kv_anchor = None
        self.file_table = self.table_rows = None  # an embedding left in the file, and this step's rows of it
        self.table: Tensor | None = None  # the batched form's per-layer sequence table
        self.table_layout: list | None = None  # what the table was last filled for, but the starts
        self.windows: np.ndarray | None = None  # each layer's window, where the table applies one
        # (ggml mask, its memory, the index of its slice, its window) of every multi-row slice
        self.masks: list[tuple[object, Tensor, int, int | None]] = []
        self.kvs: list[weakref.ref] = []  # a kept graph's sequences' SequenceKV
        self.out_shape: tuple[int, int] = (0, 0)
        self._allocated = False

    def patch(self, x: Tensor, positions: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> None:
        self.pos.copy_(positions)
        if self.ids is not None:
            self.ids.copy_(x)
            if self.file_table is not None:
                self.file_table.read(self.ids, self.table_rows)
        else:
            self.hidden.copy_(x)
        if self.rows is not None:
            self.rows.copy_(logit_rows)
        if self.table is not None:
            # Step after step the same sequences keep their rows and KV tensors: only where each
            # starts moves, one column per sequence (refilling it all: ~0.09 ms of a 6 ms step).
            layout = [(s.row, s.num_tokens, s.kv.k.data_ptr(), s.kv.v.data_ptr(), s.kv.k.stride()) for s in slices]
            if self.windows is not None:  # windowed layers' K/V addresses move with the starts too
                _fill_table(self.table, slices, self.windows)
            elif layout == self.table_layout:
                self.table.numpy()[:, 3:1 + _TABLE_FIELDS * len(slices):_TABLE_FIELDS] = [s.start for s in slices]
            else:
                _fill_table(self.table, slices)
                self.table_layout = layout
            return
        if self.key is None:  # built for this very step: its offsets are already right
            return
        num_seqs = len(slices)
        # Per layer: k and v writes of each sequence, in slice order (see _attention).
        for i, (dst, write, base, row_nb) in enumerate(self.scope.writes):
            address = base + slices[(i // 2) % num_seqs].start * row_nb
            dst.contents.data = address
            write.contents.data = address
        for keys, values, k_base, v_base, row_nb, window, index, row in self.scope.reads:
            seq = slices[index]  # a whole chunk's keys (row None), or one row's of a windowed chunk
            first = _window_start(window, seq.start if row is None else seq.start + row)
            stop = seq.start + (seq.num_tokens if row is None else row + 1)
            keys.contents.ne[1] = values.contents.ne[1] = stop - first
            if window is not None:
                keys.contents.data, values.contents.data = k_base + first * row_nb, v_base + first * row_nb
        for mask, buffer, index, window in self.masks:
            _write_mask(mask, buffer, slices[index].start, slices[index].num_tokens, window)

    def run(self, out: Tensor) -> None:
        if out.numel():
            self.out.contents.data = out.data_ptr()
            outputs = (self.out,)
        else:  # no logit rows asked for: still write the KV (explicit writes are in the graph already)
            outputs = (self.kv_anchor,)
        if self._allocated:
            self.scope.compute_graph(self.graph)
        else:
            self.scope.compute_graph(self.graph, *outputs, allocator=self.allocator)
            self._allocated = True

    def current(self) -> bool:
        """Whether every sequence this kept graph was built for still holds the KV tensors it points
        at. The graph does not keep them alive, so a KV grown twice may sit at its first address
        again: the capacity, which sets the layers' strides, must match too."""
        if self.table is not None:
            return True  # it points at none: the table says where, step by step
        ptrs = self.key[3]
        return all(kv is not None and (kv.k.data_ptr(), kv.v.data_ptr(), kv.capacity) == ptr[:3]
                   for kv, ptr in zip((ref() for ref in self.kvs), ptrs))

    def close(self) -> None:
        self.scope.__exit__(None, None, None)
        if self.key is not None:  # reused graphs own their allocator
            self.scope.g.ggml_gallocr_free(self.allocator)


def _fill_table(table: Tensor, slices: list[SeqSlice], windows: np.ndarray | None = None) -> None:
    """Where each sequence's rows and KV cache are, per layer, for the batched attention ops
    (kernels/few_rows_attention.c reads it): SequenceKV.k/.v are [layers, kv_heads, capacity, hd].

    In numpy: after a graph streamed the weights through the caches the same dozen torch ops
    took ~0.19 ms of a 6 ms SmolLM2 step, these ~0.09 (measured through the leader)."""
    n, layers = len(slices), table.shape[0]
    per_seq = np.array([[s.row, s.num_tokens, s.start, s.kv.k.data_ptr(), s.kv.v.data_ptr(),
                         s.kv.k.stride(2) * s.kv.k.element_size(), s.kv.k.stride(1) * s.kv.k.element_size()]
                        for s in slices], dtype=np.int64)
    layer_bytes = np.array([s.kv.k.stride(0) * s.kv.k.element_size() for s in slices], dtype=np.int64)
    entries = np.repeat(per_seq[None], layers, axis=0)
    layer_offsets = np.arange(layers, dtype=np.int64)[:, None] * layer_bytes[None, :]
    entries[:, :, 3] += layer_offsets  # each layer's K and V (the same layout)
    entries[:, :, 4] += layer_offsets
    if windows is not None:
        # A decode row at p sees keys p - window < k <= p: each layer's entries start its keys at
        # the window's first (K/V addresses later, start lower by as many positions), and the KV
        # write lands where it did (address + start unchanged). _batched allows one row only.
        assert (entries[:, :, 1] == 1).all(), "a windowed batch step of more than one row"
        first = np.maximum(0, entries[:, :, 2] - windows[:, None] + 1)
        entries[:, :, 2] -= first
        entries[:, :, 3] += first * entries[:, :, 5]
        entries[:, :, 4] += first * entries[:, :, 5]
    view = table.numpy()
    view[:, 0] = n
    view[:, 1:1 + _TABLE_FIELDS * n] = entries.reshape(layers, -1)  # field 2 (start): patch() may rewrite it alone
