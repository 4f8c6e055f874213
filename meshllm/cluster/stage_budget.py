"""What one pipeline stage costs in memory, and how layers are split over nodes.

Used by placement.py; pure arithmetic on the model config and the request, so
every node computes the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from meshllm.cluster.card import Card
from meshllm.model.config import ModelConfig

if TYPE_CHECKING:
    from meshllm.cluster.placement import PlacementRequest

# Working precision of a forward step's transient tensors. fp32 is what the CPU path computes
# in; on fp16 devices this overestimates, which only leaves more headroom.
ACTIVATION_DTYPE_BYTES = 4


@dataclass(frozen=True, slots=True)
class WeightBytes:
    """Bytes the weights take as a stage holds them (quantized blocks as stored), measured from the
    model's tensor table at the leader; the planner uses these instead of parameters × dtype bytes."""

    layer: int  # the largest decoder layer (mixed-type files such as Q4_K_M differ a little per layer)
    embedding: int
    final_norm: int
    lm_head: int  # with tied embeddings: the same table (a separate copy unless one stage holds both)
    # A CPU stage reads the embedding's rows from the model file at each lookup (a block-quantized
    # table no head of the stage shares: stage_weights._embedding_in_file), so it holds none of them;
    # a device stage, or one that also multiplies the table as its tied head, holds it.
    embedding_in_file: bool = False

    def __post_init__(self):
        if min(self.layer, self.embedding, self.final_norm, self.lm_head) < 0:
            raise ValueError(f"weight bytes must not be negative: {self}")


@dataclass(frozen=True, slots=True)
class StageMemory:
    """What a node's loaded plans take and may still take (pipeline/loaded_stages.py)."""

    held: int = 0  # weights (each shared range once) and the KV the plans hold now
    reserved: int = 0  # KV the plans may still grow into within their limits: not free for anything else


def embedding_held(in_file: bool, shares_head: bool, device: str | None) -> bool:
    """Whether a first stage holds its embedding table: not on a CPU `device` that reads the rows from
    the file (WeightBytes.embedding_in_file) where the stage's own tied head does not multiply it.
    An unknown device (None) holds it: the safe side. The planner and a node's own memory check
    before a load (pipeline/stage_control.py) both decide by this."""
    return not in_file or shares_head or device != "cpu"


def usable_bytes(card: Card, safety_margin_fraction: float) -> int:
    """Free memory a plan may use on this node: the margin is left for the OS and other programs."""
    return max(0, int(card.memory_free_bytes * (1.0 - safety_margin_fraction)))


@dataclass(frozen=True, slots=True)
class Footprint:
    """Bytes of each part of the model a stage may hold, for one placement request."""

    layer_weight: int  # one decoder layer (all layers are the same size)
    layer_kv: int  # one layer's KV cache for context_length × max_batch, plus its prefix-cache blocks
    embedding: int
    final_norm: int
    lm_head: int  # vocab × hidden; with tied embeddings a separate copy unless one stage holds both
    tied: bool
    embedding_in_file: bool  # WeightBytes.embedding_in_file
    step_activation: int  # working memory of one step on any stage
    logits: int  # extra on the last stage: a row of logits per sequence
    dense: WeightBytes  # the weights in --dtype: what a tensor-parallel rank holds (tp/load.py)

    @classmethod
    def of(cls, request: PlacementRequest) -> Footprint:
        c = request.config
        wb = request.weight_dtype_bytes
        # A step is a prefill chunk or a decode batch, whichever holds more tokens.
        step_tokens = max(min(request.prefill_chunk_tokens, request.context_length), request.max_batch)
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        # Per token: residual in and out, q/k/v, and the MLP's gate, up and product (of each of
        # the experts it takes and a shared expert, in a mixture of experts; GLM-4.5's first
        # layers are dense).
        moe = c.num_experts_per_tok * c.expert_intermediate_size + c.shared_expert_size if c.num_experts else 0
        mlp = max(moe, c.intermediate_size if c.dense_layers or not c.num_experts else 0)
        per_token = 2 * c.hidden_size + q + 2 * kv + 3 * mlp
        # One layer's attention scores if the kernel materialises them (no flash attention on
        # every backend); layers run one at a time, so only one layer's worth is live.
        scores = step_tokens * request.context_length * c.num_attention_heads
        dense = WeightBytes(layer=c.layer_parameters() * wb, embedding=c.vocab_size * c.hidden_size * wb,
                            final_norm=c.hidden_size * wb, lm_head=c.vocab_size * c.hidden_size * wb)
        held = request.weight_bytes or dense
        return cls(
            layer_weight=held.layer,
            layer_kv=c.kv_bytes_per_token(request.kv_dtype_bytes, 1)
            * (request.context_length * request.max_batch + request.prefix_cache_tokens),
            embedding=held.embedding,
            final_norm=held.final_norm,
            lm_head=held.lm_head,
            tied=c.tie_word_embeddings,
            embedding_in_file=held.embedding_in_file,
            step_activation=(step_tokens * per_token + scores) * ACTIVATION_DTYPE_BYTES,
            logits=request.max_batch * c.vocab_size * ACTIVATION_DTYPE_BYTES,
            dense=dense,
        )

    def per_rank(self, config: ModelConfig, size: int) -> Footprint:
        """What one rank of a `size`-way tensor-parallel group holds (tp/shard.py): 1/size of each
        layer's weights, its KV heads (one each when there are fewer KV heads than ranks), its rows
        of the vocabulary; activations and logits whole (rank 0 gathers the logits). Ranks hold
        their slices dense (tp/load.py), so this divides the dense bytes, not the quantized ones."""
        if size == 1:
            return self
        kv_heads = config.num_key_value_heads
        vocab_rows = -(-config.vocab_size // size)
        return replace(self, layer_weight=-(-self.dense.layer // size), embedding_in_file=False,
                       layer_kv=self.layer_kv * max(kv_heads // size, 1) // kv_heads,
                       embedding=self.dense.embedding * vocab_rows // config.vocab_size,
                       final_norm=self.dense.final_norm,
                       lm_head=self.dense.lm_head * vocab_rows // config.vocab_size)

    @property
    def per_layer(self) -> int:
        return self.layer_weight + self.layer_kv

    def fixed_weights(self, position: int, num_stages: int, device: str | None = None) -> int:
        """Weights a stage holds besides its layers: embedding first, final norm and LM head last (the
        embedding as embedding_held says, on the node's `device`; unknown, it counts)."""
        total = self.embedding if self._holds_embedding(position, num_stages, device) else 0
        if position == num_stages - 1:
            total += self.final_norm + (0 if self.tied and num_stages == 1 else self.lm_head)
        return total

    def _holds_embedding(self, position: int, num_stages: int, device: str | None) -> bool:
        return position == 0 and embedding_held(self.embedding_in_file, self.tied and num_stages == 1, device)

    def activations(self, position: int, num_stages: int) -> int:
        return self.step_activation + (self.logits if position == num_stages - 1 else 0)

    def fixed_part_name(self, position: int, num_stages: int, device: str | None = None) -> str:
        """What fixed_weights counts, and the activations, in words (a placement error names them)."""
        parts = (["embedding"] if self._holds_embedding(position, num_stages, device) else []) + \
            (["LM head"] if position == num_stages - 1 else [])
        return " + ".join(parts + ["activations"])

    def room_for_layers(self, card: Card, position: int, num_stages: int, safety_margin_fraction: float) -> int:
        """Bytes `card` has at this position for layers (weights + KV) after its fixed part and activations."""
        return usable_bytes(card, safety_margin_fraction) - self.fixed_weights(position, num_stages, card.device) \
            - self.activations(position, num_stages)

    def capacity_layers(self, card: Card, position: int, num_stages: int, safety_margin_fraction: float) -> int:
        """Whole layers (weights + KV) that fit on `card` at this position; negative if not even the fixed part."""
        return self.room_for_layers(card, position, num_stages, safety_margin_fraction) // self.per_layer

    def bytes_read_per_step(self, position: int, num_stages: int, num_layers: int) -> int:
        """Memory a stage reads per decode step: its layers' weights and KV, plus the LM head if last.

        The embedding lookup reads a few rows, so it does not count.
        """
        head = self.final_norm + self.lm_head if position == num_stages - 1 else 0
        return num_layers * self.per_layer + head


def split_layers(num_layers: int, caps: list[int], weights: list[float]) -> list[int]:
    """Layer counts per node in proportion to `weights`, each in [1, cap], summing to num_layers.

    Water-filling: share the layers by weight; a node whose share exceeds its cap
    is pinned at the cap and the rest is shared again among the others. Then
    whole layers by largest remainder, ties to the earlier node (deterministic).
    Requires 1 <= caps[i], positive weights and len(caps) <= num_layers <= sum(caps).
    """
    assert len(caps) == len(weights) and len(caps) <= num_layers <= sum(caps) and min(caps) >= 1
    shares = [0.0] * len(caps)
    free = list(range(len(caps)))
    remaining = float(num_layers)
    while free:
        total_weight = sum(weights[i] for i in free)
        over = [i for i in free if remaining * weights[i] / total_weight > caps[i]]
        if not over:
            for i in free:
                shares[i] = remaining * weights[i] / total_weight
            break
        for i in over:
            shares[i] = float(caps[i])
            remaining -= caps[i]
        free = [i for i in free if i not in over]

    counts = [min(caps[i], max(1, math.floor(s + 1e-9))) for i, s in enumerate(shares)]
    order = sorted(range(len(caps)), key=lambda i: (-(shares[i] - counts[i]), i))
    while sum(counts) < num_layers:  # hand out the remainders, largest fraction first
        i = next(i for i in order if counts[i] < caps[i])
        counts[i] += 1
        order.remove(i)
        order.append(i)
    order = sorted(range(len(caps)), key=lambda i: (shares[i] - counts[i], i))
    while sum(counts) > num_layers:  # the minimum of one layer pushed the sum over: take from the most over-served
        i = next(i for i in order if counts[i] > 1)
        counts[i] -= 1
        order.remove(i)
        order.append(i)
    return counts
