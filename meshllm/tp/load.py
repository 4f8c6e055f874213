"""Load one rank's slice of a layer range, in the weight form the stage asked for.

Two steps, so a node can read its weights before it waits for the other ranks: the
rendezvous then starts when the slowest rank has loaded, and no rank idles inside the
group's timeout while another is still reading its disk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshllm.engine.weight_forms import prepare_for_cpu
from meshllm.model.config import ModelConfig
from meshllm.model.decoder import Decoder
from meshllm.model.loader import load_decoder
from meshllm.model.weights import TensorSource
from meshllm.tp.collective import Collective
from meshllm.tp.layers import shard_decoder
from meshllm.tp.shard import ShardLayout
from meshllm.tp.sharded_source import ShardedSource


def load_rank_weights(source: TensorSource, config: ModelConfig, layout: ShardLayout, first_layer: int = 0,
                      last_layer: int | None = None, dtype: torch.dtype = torch.float32,
                      quantization: str | None = None, batch_invariant: bool = False,
                      progress: Callable[[int, int], None] | None = None) -> Decoder:
    """Layers [first_layer, last_layer) of rank `layout.rank`, its local shapes: only its slices are read.

    The weight form (bf16 kernel, int8, batch-invariant tiles) is applied to the rank's own
    linears, so every form works sharded; `shard_decoder` then wraps them for the group.
    """
    assert layout.config == config, "the layout must be built from this model's config"
    decoder = load_decoder(ShardedSource(source, layout), layout.local_config(), first_layer, last_layer, dtype,
                           progress)
    return prepare_for_cpu(decoder, quantization, batch_invariant)


def load_rank_decoder(source: TensorSource, config: ModelConfig, layout: ShardLayout, collective: Collective,
                      first_layer: int = 0, last_layer: int | None = None, dtype: torch.dtype = torch.float32,
                      quantization: str | None = None, batch_invariant: bool = False) -> Decoder:
    """load_rank_weights, then wrapped for `collective`'s group: ready to run in lockstep."""
    decoder = load_rank_weights(source, config, layout, first_layer, last_layer, dtype, quantization,
                                batch_invariant)
    return shard_decoder(decoder, layout, collective)
