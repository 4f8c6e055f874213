"""Wrap a rank's single-device Decoder so its slices add up to the whole model.

The Decoder a rank loads (tp/load.py) already has its local shapes: its q/k/v and
gate/up hold only its rows (column-parallel, no communication needed), its KV cache
only its heads. What is left is to sum the row-parallel products and to split the
vocabulary; these wrappers do that around whatever module the weight form chose
(dense, bf16 kernel, int8, ggml-quantized), so decoder.py stays single-device.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from meshllm.model.decoder import Decoder
from meshllm.tp.collective import Collective
from meshllm.tp.shard import ShardLayout


class RowParallelLinear(nn.Module):
    """o_proj or down_proj over this rank's input columns; one all-reduce sums the ranks' parts."""

    def __init__(self, inner: nn.Module, collective: Collective):
        super().__init__()
        self.inner = inner
        self.collective = collective

    def forward(self, x: Tensor) -> Tensor:
        # x: [tokens, local in_features] -> [tokens, out_features], the same on every rank
        return self.collective.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Embedding rows `rows` of the vocabulary; each token's row comes from the one rank holding it."""

    def __init__(self, inner: nn.Module, rows: range, collective: Collective):
        super().__init__()
        self.inner = inner
        self.rows = rows
        self.collective = collective

    def forward(self, ids: Tensor) -> Tensor:
        # ids: [tokens] over the whole vocabulary -> [tokens, hidden]; others' rows add as zeros
        local = ids - self.rows.start
        outside = (local < 0) | (local >= len(self.rows))
        out = self.inner(local.masked_fill(outside, 0)).masked_fill(outside[:, None], 0)
        return self.collective.all_reduce(out.contiguous())


class VocabParallelHead(nn.Module):
    """LM head rows `rows`; rank 0 gathers every rank's logits, so only it can sample.

    Other ranks return their own (partial) logits, which their runner never samples."""

    def __init__(self, inner: nn.Module, layout: ShardLayout, collective: Collective):
        super().__init__()
        self.inner = inner
        self.vocab_size = layout.config.vocab_size
        self.padded_rows = layout.vocab_rows_per_rank
        self.collective = collective

    def forward(self, h: Tensor) -> Tensor:
        # h: [rows, hidden] -> rank 0: [rows, vocab]; other ranks: [rows, local vocab]
        local = self.inner(h)
        padded = F.pad(local, (0, self.padded_rows - local.shape[1])).contiguous()
        pieces = self.collective.gather_to_first(padded)
        if pieces is None:
            return local
        return torch.cat(pieces, dim=1)[:, :self.vocab_size]


def shard_decoder(decoder: Decoder, layout: ShardLayout, collective: Collective) -> Decoder:
    """Wrap `decoder` (loaded with layout.local_config()) in place; returns it.

    Afterwards it takes token ids and (on rank 0) returns logits over the whole vocabulary,
    so its config says the whole vocabulary; its head counts and MLP width stay the rank's own
    (they size the layers and the rank-local KV cache).
    """
    assert decoder.config == layout.local_config(), "load the decoder with layout.local_config()"
    for layer in decoder.layers:
        layer.self_attn.o_proj = RowParallelLinear(layer.self_attn.o_proj, collective)
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, collective)
    if decoder.embed_tokens is not None:
        decoder.embed_tokens = VocabParallelEmbedding(decoder.embed_tokens, layout.vocab_rows, collective)
    if decoder.lm_head is not None:
        decoder.lm_head = VocabParallelHead(decoder.lm_head, layout, collective)
    decoder.config = replace(decoder.config, vocab_size=layout.config.vocab_size)
    return decoder
