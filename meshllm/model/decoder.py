"""One decoder for the Llama family; variants are switches on ModelConfig.

A Decoder holds layers [first_layer, last_layer) of a model: the embedding when
it starts at layer 0, the final norm and LM head when it ends at the last layer.
Tokens of many sequences travel flat as [num_tokens, hidden]; attention runs per
sequence against that sequence's KV cache.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm.engine.kv_cache import KVLayout, SequenceKV
from meshllm.model.config import ModelConfig, YarnScaling
from meshllm.model.gemma import MODEL_TYPES as GEMMA_TYPES
from meshllm.model.moe import SWIGLU_ALPHA


@dataclass(frozen=True, slots=True)
class SeqSlice:
    """One sequence's share of a flat batch: rows [row, row + num_tokens)."""

    kv: SequenceKV
    row: int
    num_tokens: int

    @property
    def start(self) -> int:  # position of the first new token
        return self.kv.length


@dataclass(frozen=True, slots=True)
class StaticSlice:
    """One sequence's single row in a decode step whose shapes and addresses never change (what a
    CUDA graph replays, engine/cuda_graphs.py): its key and value are written at the device index
    `at` [1], and the query attends over the cache's whole capacity through `visible` [1, 1, 1,
    capacity] (True up to and including `at`, within the sliding window if any)."""

    kv: SequenceKV
    row: int
    at: Tensor
    visible: Tensor
    num_tokens: int = 1


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.weight.dtype != x.dtype:  # Gemma's float32 1 + w (loader.py): computed in float32, as transformers
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


_FIRST_POSITIONS = 4096  # rotary table rows made up front


class Rotary:
    """cos/sin tables indexed by absolute position; llama3 and LongRoPE frequency scaling."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, theta: float | None = None, linear: float = 1.0):
        self.dtype = dtype
        self.inv_freq = _inv_freq(config, theta, linear)
        self.attention_factor = config.rope_attention_factor
        # (cos, sin), replaced whole: plans sharing a stage may step it from several threads, and
        # one must never see a grown cos beside an old sin. Grown under the lock, never shrunk.
        self.tables = (torch.empty(0, config.rotated_dims, dtype=dtype),) * 2
        self.head_dim = config.head_dim
        self._lock = threading.Lock()
        # Grown as positions need it (ensure), not to the model's whole context: Llama 3.1's 131072
        # positions of head_dim 128 take 67 MB in bf16, Gemma 3's two tables of 256 268 MB, on
        # every stage, and a stage on ggml's path never reads them.
        self.ensure(min(config.max_position_embeddings, _FIRST_POSITIONS), torch.device("cpu"))

    @property
    def cos(self) -> Tensor:
        return self.tables[0]

    @property
    def sin(self) -> Tensor:
        return self.tables[1]

    def _made(self, num_positions: int) -> tuple[Tensor, Tensor]:
        t = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:  # LongRoPE scales cos and sin (transformers' attention_scaling)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(self.dtype), sin.to(self.dtype)

    def __call__(self, positions: Tensor, checked: bool = True) -> tuple[Tensor, Tensor]:
        # checked=False: the caller made sure of the tables (ensure) and this must not read the
        # positions back to the host (a step being captured into a CUDA graph)
        if checked:
            self.ensure(int(positions.max()) + 1 if positions.numel() else 0, positions.device)
        cos, sin = self.tables
        return cos[positions], sin[positions]

    def ensure(self, num_positions: int, device: torch.device) -> None:
        """Tables for positions [0, num_positions), on `device`."""
        cos, sin = self.tables
        if num_positions <= cos.shape[0] and cos.device == device:
            return
        with self._lock:
            cos, sin = self.tables
            if num_positions > cos.shape[0]:
                cos, sin = self._made(max(num_positions, 2 * cos.shape[0]))
            # The tables are not module buffers, so Decoder.to(device) leaves them behind: follow the input.
            self.tables = (cos.to(device), sin.to(device))

    def rotation(self, positions: Tensor, checked: bool = True) -> Tensor:
        """Matrices R [tokens, head_dim, head_dim] (fp32) with x @ R == x * cos + rotate_half(x) * sin.

        Rotating q and k of all heads is then one batched matmul per layer instead of
        seven elementwise ops each; at decode the per-op dispatch cost is what counts. Under a
        partial rotary the dims past the rotated ones pass through (ones on the diagonal).
        """
        cos, sin = (t.float() for t in self(positions, checked))  # [tokens, rotated dims]
        n, dim = cos.shape
        half = dim // 2
        cols = torch.arange(dim, device=cos.device)
        # The diagonal from device tensors only: a Python scalar stored through an index is a
        # host-to-device copy, which a CUDA graph's recording refuses (partial rotaries failed so).
        diagonal = torch.ones(n, self.head_dim, device=cos.device)
        diagonal[:, :dim] = cos
        rot = torch.diag_embed(diagonal)
        # rotate_half(x)[j] is -x[j + half] for j < half and x[j - half] for j >= half.
        rot[:, cols[:half] + half, cols[:half]] = -sin[:, :half]
        rot[:, cols[half:] - half, cols[half:]] = sin[:, half:]
        return rot


def _inv_freq(config: ModelConfig, theta: float | None = None, linear: float = 1.0) -> Tensor:
    """Rotary frequencies of the model, or of a base `theta` and linear factor (a Gemma 3 layer's)."""
    dim = config.rotated_dims
    powers = (config.rope_theta if theta is None else theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    if config.rope_factors is not None:  # LongRoPE, in transformers' order of operations
        return 1.0 / (torch.tensor(config.rope_factors, dtype=torch.float32) * powers)
    inv_freq = 1.0 / powers
    if linear != 1.0:  # transformers' "linear" rope: every frequency divided by the factor
        return inv_freq / linear
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if isinstance(s, YarnScaling):
        return _yarn_inv_freq(s, powers, config.rope_theta if theta is None else theta, dim)
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(s: YarnScaling, powers: Tensor, base: float, dim: int) -> Tensor:
    """YaRN's frequencies, as transformers computes them (_compute_yarn_parameters): the dims that
    turn more than beta_fast times over the original context keep their frequency, those under
    beta_slow times are divided by the factor, a linear ramp between."""
    def turned_at(rotations: float) -> float:  # the dim turning `rotations` times over the original context
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = turned_at(s.beta_fast), turned_at(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero (transformers' guard)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return 1.0 / (s.factor * powers) * (1 - extrapolated) + 1.0 / powers * extrapolated


def explicit_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, is_causal: bool, scale: float,
                       cap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """Attention step by step, in float32 as transformers' eager path, for what torch's fused
    kernel cannot do: scores capped as cap * tanh(score / cap) before the softmax (Gemma 2), and
    a sink logit per query head joining each row's softmax without a value (GPT-OSS).
    q [1, a, b, dim] (heads as a or a x b), keys/values [1, kv_heads, s, dim]; sinks [1, a, b, 1]."""
    group = q.shape[1] // keys.shape[1]
    if group > 1:
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if is_causal:  # the t queries are the last t of the s keys
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)
    scores = torch.cat((scores, sinks.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return torch.matmul(scores.softmax(dim=-1)[..., :-1], values.float()).to(q.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.sliding_window = config.layer_window(layer)
        self.scale = config.attention_scale  # None: torch's default, head_dim ** -0.5
        self.softcap = config.attn_softcap  # Gemma 2's; torch's fused attention has no such step
        # GPT-OSS's per-head sink logits [heads]
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads, dtype=dtype)) \
            if config.attention_sinks else None
        h = config.hidden_size
        # q, k and v fused into one matmul: one weight read, one dispatch.
        self.qkv_proj = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, h, bias=config.o_proj_bias, dtype=dtype)
        # per head (Qwen3), or across all heads at once (MiniMax-M2: weights of every head's dims)
        self.qk_norm_across_heads = config.qk_norm_across_heads
        q_dims, k_dims = (self.q_size, self.kv_size) if config.qk_norm_across_heads else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dims, config.rms_norm_eps, dtype) if config.qk_norm else None
        self.k_norm = RMSNorm(k_dims, config.rms_norm_eps, dtype) if config.qk_norm else None
        # Attend one query row at a time with the decode kernel, so a row's bits never depend on
        # how many rows share its chunk (batch-invariant mode; see engine/batch_invariant.py).
        self.per_row = False

    def forward(self, x: Tensor, rotation: Tensor, slices: list[SeqSlice], layer: int) -> Tensor:
        n, heads = x.shape[0], self.num_heads
        qkv = self.qkv_proj(x)
        q_k = self.q_size + self.kv_size
        v = qkv[:, q_k:].view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm_across_heads:  # before the heads are split out
            qk = torch.cat((self.q_norm(qkv[:, :self.q_size]), self.k_norm(qkv[:, self.q_size:q_k])), dim=1)
            qk = qk.view(n, heads + self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, :q_k].view(n, heads + self.num_kv_heads, self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # q and k of every head rotate together in one batched matmul (see Rotary.rotation); a
        # NoPE layer's (rotation None) stay as they are.
        if rotation is not None:
            qk = torch.bmm(qk.float(), rotation).to(x.dtype)
        q, k = qk[:, :heads], qk[:, heads:]
        if len(slices) == 1:
            out = self._attend(q, k, v, slices[0], layer)
        else:
            out = torch.cat([self._attend(q[s.row:s.row + s.num_tokens], k[s.row:s.row + s.num_tokens],
                                          v[s.row:s.row + s.num_tokens], s, layer) for s in slices])
        return self.o_proj(out.reshape(n, self.q_size))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, s: SeqSlice | StaticSlice, layer: int) -> Tensor:
        # q: [t, heads, dim]; k, v: [t, kv_heads, dim] -> [t, heads, dim]
        if isinstance(s, StaticSlice):
            return self._attend_static(q, k, v, s, layer)
        start, t = s.start, s.num_tokens
        end = start + t
        s.kv.k[layer, :, start:end].copy_(k.transpose(0, 1))
        s.kv.v[layer, :, start:end].copy_(v.transpose(0, 1))
        if self.per_row:
            return torch.cat([self._attend_one(q[i], s, layer, start + i + 1) for i in range(t)])
        # 4-d inputs select torch's fused CPU attention kernel; 3-d ones fall back to ~10 separate ops.
        keys, values = s.kv.k[layer, None, :, :end], s.kv.v[layer, None, :, :end]  # [1, kv_heads, end, dim]
        windowed = self.sliding_window is not None and end > self.sliding_window
        if t == 1 and not windowed:
            # Decode: fold the query heads of a group into the query axis; every key is visible.
            qg = q.view(1, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            out = self._sdpa(qg, keys, values)
            return out.reshape(1, self.num_heads, self.head_dim)  # CUDA's kernels may return it strided
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, t, dim]
        if start == 0 and not windowed:
            out = self._sdpa(qh, keys, values, is_causal=True)
        else:
            out = self._sdpa(qh, keys, values, mask=self._mask(start, t, q.device))
        return out[0].transpose(0, 1)

    def _attend_static(self, q: Tensor, k: Tensor, v: Tensor, s: StaticSlice, layer: int) -> Tensor:
        # One decode row: [1, heads, dim] against the whole cache, the positions past `at` masked.
        keys, values = s.kv.k[layer], s.kv.v[layer]  # [kv_heads, capacity, dim]
        keys.index_copy_(1, s.at, k.transpose(0, 1).to(keys.dtype))
        values.index_copy_(1, s.at, v.transpose(0, 1).to(values.dtype))
        qg = q.view(1, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        out = self._sdpa(qg, keys[None], values[None], mask=s.visible)
        return out.reshape(1, self.num_heads, self.head_dim)

    def _attend_one(self, q: Tensor, s: SeqSlice, layer: int, end: int) -> Tensor:
        # One query row [heads, dim] at position end - 1 against its visible keys -> [1, heads, dim].
        first = 0 if self.sliding_window is None else max(0, end - self.sliding_window)
        keys, values = s.kv.k[layer, None, :, first:end], s.kv.v[layer, None, :, first:end]
        qg = q.reshape(1, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
        return self._sdpa(qg, keys, values).reshape(1, self.num_heads, self.head_dim)

    def _sdpa(self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None = None,
              is_causal: bool = False) -> Tensor:
        """q [1, heads, t, dim] against keys and values [1, kv_heads, s, dim] (fewer heads: grouped)."""
        if self.softcap is None and self.sinks is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=is_causal,
                                                  enable_gqa=keys.shape[1] != q.shape[1], scale=self.scale)
        sinks = None if self.sinks is None else self.sinks.view(1, q.shape[1], -1, 1)  # as q's heads are laid out
        return explicit_attention(q, keys, values, mask, is_causal, self.scale or self.head_dim ** -0.5,
                                  self.softcap, sinks)

    def _mask(self, start: int, t: int, device: torch.device) -> Tensor:
        q_pos = torch.arange(start, start + t, device=device).unsqueeze(1)
        k_pos = torch.arange(0, start + t, device=device).unsqueeze(0)
        visible = k_pos <= q_pos
        if self.sliding_window is not None:
            visible &= k_pos > q_pos - self.sliding_window
        return visible


class MLP(nn.Module):
    """The dense SwiGLU (GELU for Gemma) MLP; `width`: other than intermediate_size (GLM-4.5's shared expert)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, width: int | None = None):
        super().__init__()
        self.intermediate_size = width = width or config.intermediate_size
        self.gelu = config.hidden_act == "gelu_tanh"  # Gemma; else SiLU
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * width, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(width, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class MoE(nn.Module):
    """A mixture of SwiGLU experts (model/moe.py). Each projection holds every expert's rows, expert
    after expert ([experts * rows, cols]): one matrix per projection, which ggml's expert product
    (mul_mat_id) reads as [experts, rows, cols]."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, i, e = config.hidden_size, config.expert_intermediate_size, config.num_experts
        self.width, self.top_k, self.normalize = i, config.num_experts_per_tok, config.normalize_expert_weights
        # transformers' Qwen3-MoE rounds the chosen weights to the model's dtype; its Mixtral keeps float32
        self.round_weights = config.model_type in ("qwen3_moe", "qwen2_moe")
        self.softmax_after_topk, self.swiglu_limit = config.softmax_after_topk, config.swiglu_limit
        bias = config.expert_biases  # GPT-OSS's: each expert's rows of the bias too
        # GLM-4.5's router and bias in float32, as transformers keeps them: its bias is a large
        # offset (~10) with a spread of a few hundredths between experts, which bf16 would erase
        self.router = nn.Linear(h, e, bias=bias, dtype=torch.float32 if config.sigmoid_router else dtype)
        self.gate_proj = nn.Linear(h, e * i, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(h, e * i, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(i, e * h, bias=bias, dtype=dtype)
        # GLM-4.5's: sigmoid scores, a bias [experts] that only picks, a scale; a shared expert
        self.sigmoid_router, self.weights_scale = config.sigmoid_router, config.expert_weights_scale
        self.selection_bias = nn.Parameter(torch.zeros(e), requires_grad=False) if config.sigmoid_router else None
        self.shared = MLP(config, dtype, config.shared_expert_size) if config.shared_expert_size else None
        # Qwen2-MoE's gate on the shared expert (one value a token), in float32 as the router: a
        # linear, so batch-invariant mode tiles it as every other
        self.shared_gate = nn.Linear(h, 1, bias=False, dtype=torch.float32) if config.shared_expert_gated else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, experts) [tokens, top_k] of each token, as transformers computes them."""
        if self.sigmoid_router:  # GLM-4.5's Glm4MoeTopkRouter, in float32 as there
            scores = self.router(x.float()).sigmoid()
            experts = (scores + self.selection_bias).topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, experts)
            if self.normalize:
                weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return weights * self.weights_scale, experts
        if self.softmax_after_topk:  # GPT-OSS: the softmax of the chosen experts' logits
            logits, experts = self.router(x).topk(self.top_k, dim=-1)
            return F.softmax(logits, dim=-1, dtype=torch.float32).to(x.dtype), experts
        probs = F.softmax(self.router(x), dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights.to(x.dtype) if self.round_weights else weights), experts

    def forward(self, x: Tensor) -> Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():  # in expert order, each expert's tokens at once
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y = self._expert(e, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y.to(x.dtype))
        if self.shared is None:
            return out
        shared = self.shared(x)
        if self.shared_gate is not None:
            shared = shared * _sigmoid_each(self.shared_gate(x.float())).to(x.dtype)
        return out + shared

    def _expert(self, e: int, x: Tensor) -> Tensor:
        i, h = self.width, x.shape[-1]
        gate = _rows_product(self.gate_proj, x, e * i, (e + 1) * i)
        up = _rows_product(self.up_proj, x, e * i, (e + 1) * i)
        # Side by side, as the dense MLP's gate and up: torch then applies the activation row by
        # row. On one contiguous [rows, width] tensor it runs as one vector, whose tail (computed
        # another way, last bits apart) depends on the row count: a row's bits would depend on how
        # many others chose the expert.
        gate, up = torch.cat((gate, up), dim=1).split(i, dim=1)
        if self.swiglu_limit is None:
            return _rows_product(self.down_proj, F.silu(gate) * up, e * h, (e + 1) * h)
        # GPT-OSS's clamped SwiGLU, as transformers' GptOssExperts
        limit = self.swiglu_limit
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return _rows_product(self.down_proj, gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1), e * h, (e + 1) * h)


_VECTOR_PADDING = 64  # a multiple of every CPU vector loop's step (AVX-512: 16 floats, unrolled twice)


def _sigmoid_each(x: Tensor) -> Tensor:
    """torch.sigmoid of a few values (Qwen2-MoE's gate, one a row), each through the same vector
    code: torch runs a vector's tail apart (last bits apart), so a row's value would depend on
    how many rows share the step. Padded to whole vector steps, none is a tail."""
    flat = x.flatten()
    return torch.sigmoid(F.pad(flat, (0, (-flat.numel()) % _VECTOR_PADDING)))[:flat.numel()].view_as(x)


def _rows_product(linear: nn.Module, x: Tensor, start: int, stop: int) -> Tensor:
    """x times rows [start, stop) of a linear's weight: one expert's slice of an experts matrix.
    Forms with their own product (ggml's blocks, batch-invariant tiles) say how, as rows_product."""
    own = getattr(linear, "rows_product", None)
    if own is not None:  # with the rows' bias, as each form's forward (GPT-OSS's experts have biases)
        return own(x, start, stop)
    assert isinstance(linear, nn.Linear), f"{type(linear).__name__} cannot multiply an expert's rows"
    return F.linear(x, linear.weight[start:stop], None if linear.bias is None else linear.bias[start:stop])


class DecoderLayer(nn.Module):
    """`layer`: its index in the whole model (which window and rotary it takes)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, layer: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps, dtype)
        self.self_attn = Attention(config, dtype, layer)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)  # the norm before the MLP
        self.mlp = MoE(config, dtype) if config.layer_is_moe(layer) else MLP(config, dtype)
        # Gemma's sandwich: the attention's and the MLP's outputs normalised before they join the stream
        self.attn_out_norm = RMSNorm(h, eps, dtype) if config.sandwich_norms else None
        self.mlp_out_norm = RMSNorm(h, eps, dtype) if config.sandwich_norms else None
        self.rope = config.layer_rope(layer)  # which of the decoder's rotations it takes
        self.residual_scale = config.residual_scale

    def forward(self, x: Tensor, rotation: Tensor, slices: list[SeqSlice], layer: int) -> Tensor:
        attn = self.self_attn(self.input_layernorm(x), rotation, slices, layer)
        x = x + self._joining(attn, self.attn_out_norm)
        mlp = self.mlp(self.post_attention_layernorm(x))
        return x + self._joining(mlp, self.mlp_out_norm)

    def _joining(self, out: Tensor, norm: RMSNorm | None) -> Tensor:
        """A sublayer's output as it joins the residual stream: Gemma's normalised, Granite's scaled."""
        if norm is not None:
            out = norm(out)
        return out if self.residual_scale == 1.0 else out * self.residual_scale


class Decoder(nn.Module):
    """Layers [first_layer, last_layer) of a model, on one device, in one dtype."""

    def __init__(self, config: ModelConfig, first_layer: int = 0, last_layer: int | None = None,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        last_layer = config.num_hidden_layers if last_layer is None else last_layer
        if not 0 <= first_layer < last_layer <= config.num_hidden_layers:
            raise ValueError(f"layer range [{first_layer}, {last_layer}) is not inside the model's "
                             f"{config.num_hidden_layers} layers")
        self.config = config
        self.first_layer, self.last_layer = first_layer, last_layer
        self.dtype = dtype
        self.has_embedding = first_layer == 0
        self.has_head = last_layer == config.num_hidden_layers
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h, dtype=dtype) if self.has_embedding else None
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i) for i in range(first_layer, last_layer))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype) if self.has_head else None
        self.lm_head = nn.Linear(h, config.vocab_size, bias=False, dtype=dtype) if self.has_head else None
        with torch.device("cpu"):  # host tables (they follow the input's device), even when built on meta
            # One table per (base, linear factor) this stage's layers use: Gemma 3's sliding layers
            # have their own. `rotary`, the first, is every layer's in the other families (CUDA
            # graphs, which size it ahead of a replay, stay off for Gemma 3).
            # (A stage of NoPE layers only still has the model's table: CUDA graphs key on it.)
            ropes = dict.fromkeys(layer.rope for layer in self.layers if layer.rope is not None) or \
                {(config.rope_theta, config.rope_linear_factor): None}
            self.rotaries = {rope: Rotary(config, dtype, *rope) for rope in ropes}
            self.rotary = next(iter(self.rotaries.values()))
        # Set by engine/stage_weights.py: runs the whole layer range as one ggml graph per step.
        self.fast_path = None
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        """Where the weights are, and so the KV caches and the compute (cpu unless --device)."""
        return self.norm.weight.device if self.norm is not None else next(self.parameters()).device

    def kv_layout(self, kv_dtype: torch.dtype | None = None) -> KVLayout:
        return KVLayout(len(self.layers), self.config.num_key_value_heads, self.config.head_dim,
                        kv_dtype or self.dtype, max_tokens=self.config.max_position_embeddings, device=self.device)

    def forward(self, x: Tensor, positions: Tensor, slices: list[SeqSlice],
                logit_rows: Tensor | None = None) -> Tensor:
        """Run this part of the model on a flat batch and commit its tokens to the KV caches.

        x: token ids [tokens] on the first stage, else hidden states [tokens, hidden].
        Returns hidden states [tokens, hidden], or on the last stage fp32 logits for
        `logit_rows` (all rows when None): [len(logit_rows), vocab].
        """
        # Attention concatenates per-sequence outputs in slice order: slices must tile the rows in order.
        row = 0
        for s in slices:
            assert s.row == row, f"slice rows must tile the batch in order: expected row {row}, got {s.row}"
            row += s.num_tokens
        assert row == x.shape[0] == positions.shape[0], (row, x.shape[0], positions.shape[0])
        for s in slices:
            s.kv.reserve(s.start + s.num_tokens)
        if self.fast_path is not None:  # ggml's graph: no torch op that autograd would track
            out = self.fast_path.forward(x, positions, slices, logit_rows)
        else:
            with torch.inference_mode():  # not around ggml's: ~0.06 ms of a 6 ms SmolLM2 step, for nothing
                out = self.run(x, positions, slices, logit_rows)
        for s in slices:
            s.kv.length += s.num_tokens
        return out

    def run(self, x: Tensor, positions: Tensor, slices: list[SeqSlice] | list[StaticSlice],
            logit_rows: Tensor | None = None) -> Tensor:
        """forward's computation by torch ops, the KV lengths left to the caller. With StaticSlices
        (one row each) nothing is read back to the host: a CUDA graph can capture it."""
        static = bool(slices) and isinstance(slices[0], StaticSlice)
        device = self.device
        # Weights on a GPU (--device): inputs follow them there, each on its own (tokens sampled on
        # the device come with positions made on the host). .to() is free for one already there.
        x, positions = x.to(device), positions.to(device)
        logit_rows = None if logit_rows is None else logit_rows.to(device)
        h = self.embed_tokens(x) if self.has_embedding else x.to(self.dtype)
        if self.has_embedding and self.config.embedding_scale != 1.0:
            # as transformers: Gemma's scale rounded to the weights' dtype first, Granite's not
            scale = self.config.embedding_scale
            h = h * (torch.tensor(scale, dtype=h.dtype) if self.config.model_type in GEMMA_TYPES else scale)
        rotations = {key: rotary.rotation(positions, checked=not static) for key, rotary in self.rotaries.items()}
        for i, layer in enumerate(self.layers):
            h = layer(h, None if layer.rope is None else rotations[layer.rope], slices, i)
        if not self.has_head:
            return h
        if logit_rows is not None:
            h = h.index_select(0, logit_rows)
        logits = self.lm_head(self.norm(h))
        if self.config.logit_scale != 1.0:
            logits = logits / self.config.logit_scale
        if self.config.final_softcap is not None:  # Gemma 2's, in float32 as transformers caps them
            cap = self.config.final_softcap
            return torch.tanh(logits.float() / cap) * cap
        return logits.float()

    def forward_full(self, token_ids: Tensor) -> Tensor:
        """Logits [tokens, vocab] for one sequence from scratch; a convenience for tests."""
        assert self.has_embedding and self.has_head, "forward_full needs the whole model"
        kv = SequenceKV(self.kv_layout(), capacity=max(token_ids.numel(), 1))
        positions = torch.arange(token_ids.numel())
        return self(token_ids, positions, [SeqSlice(kv, 0, token_ids.numel())])
