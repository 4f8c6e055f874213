"""Does splitting a stage over a tensor-parallel group pay on the link at hand? (pure arithmetic)

Decode is memory-bound: per token a stage reads each layer's weights and its KV cache
once (Footprint.per_layer). Split over n ranks, each reads 1/n of it in parallel, so the
stage saves (1 - 1/n) of its compute time; it pays two all-reduces of the hidden states
per layer (after o_proj and down_proj), one broadcast of the step command, an all-reduce
of the embedding on the first stage and a gather of the logits on the last. The
collectives cost what the nodes measured on their link (LinkProbe in the cards: latency
of a small all-reduce, bandwidth of a large one); a pair nobody measured is assumed slow,
so the planner never groups it unless asked to (`--tp`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.cluster.card import Card, LinkProbe, NodeId
from meshllm.cluster.stage_budget import Footprint
from meshllm.model.config import ModelConfig

# Stands in for a link no card reports: 1 ms and 100 MB/s, worse than any LAN worth grouping.
UNMEASURED_LINK = LinkProbe(NodeId(""), latency_s=1e-3, bandwidth_gbps=0.1)
COMMAND_FRAME_BYTES = 4096 * 8  # tp/channel.py DEFAULT_FRAME_WORDS: a decode step's command is one frame


@dataclass(frozen=True, slots=True)
class GroupLink:
    """The slowest link inside a group: every all-reduce waits for it."""

    latency_s: float
    bandwidth_gbps: float
    measured: bool  # False when some pair of the group has no probe in either card

    def all_reduce_s(self, num_bytes: int, size: int) -> float:
        # The probe measured n = 2 (latency and bandwidth of a 2-rank all-reduce); a ring of n ranks
        # takes n - 1 such exchanges of num_bytes/n each way (reduce-scatter, then all-gather).
        return (size - 1) * self.latency_s + 2 * (size - 1) / size * num_bytes / (self.bandwidth_gbps * 1e9)

    def transfer_s(self, num_bytes: int) -> float:
        """One message of `num_bytes` from one rank to the others (a broadcast or a gather's pieces)."""
        return self.latency_s + num_bytes / (self.bandwidth_gbps * 1e9)


def link_between(a: Card, b: Card) -> LinkProbe | None:
    """The slower of what `a` measured to `b` and `b` to `a` (either may be missing)."""
    found = [k for k in a.links if k.peer == b.node_id] + [k for k in b.links if k.peer == a.node_id]
    if not found:
        return None
    return LinkProbe(b.node_id, max(k.latency_s for k in found), min(k.bandwidth_gbps for k in found))


def group_link(cards: Sequence[Card]) -> GroupLink:
    links = [link_between(a, b) for i, a in enumerate(cards) for b in cards[i + 1:]]
    measured = all(k is not None for k in links)
    links = [k or UNMEASURED_LINK for k in links] or [UNMEASURED_LINK]
    return GroupLink(max(k.latency_s for k in links), min(k.bandwidth_gbps for k in links), measured)


@dataclass(frozen=True, slots=True)
class TPEstimate:
    """Per decode token, one stage of `num_layers` layers on one node vs split over `size` nodes."""

    nodes: tuple[NodeId, ...]
    size: int
    num_layers: int
    link: GroupLink
    compute_s_alone: float  # the layers (and head) on the group's slowest node alone
    compute_s_split: float  # each rank's 1/size share, in parallel
    collective_s: float  # what the split adds in communication
    num_collectives: int  # per step
    message_bytes: int  # hidden states of one decode step, all-reduced twice per layer

    @property
    def saved_s(self) -> float:
        return self.compute_s_alone - self.compute_s_split

    @property
    def pays(self) -> bool:
        return self.collective_s < self.saved_s

    @property
    def seconds_split(self) -> float:
        return self.compute_s_split + self.collective_s


def compute_s(card: Card, read_bytes: int, flops: float, bandwidth_gbps: float) -> float:
    """Seconds to read `read_bytes` and do `flops` on `card`: the slower of the two (decode overlaps them)."""
    seconds = read_bytes / (bandwidth_gbps * 1e9)
    return max(seconds, flops / (card.matmul_gflops * 1e9)) if card.matmul_gflops > 0 else seconds


def estimate(config: ModelConfig, footprint: Footprint, cards: Sequence[Card], bandwidth_gbps: Sequence[float],
             position: int, num_stages: int, num_layers: int, max_batch: int, context_length: int,
             activation_bytes: int) -> TPEstimate:
    """The cost model for a stage at `position` of `num_stages` on the group `cards` (rank 0 first).

    `footprint` is the whole model's (not a rank's); `bandwidth_gbps` the cards' bandwidths as the
    planner counts them (unmeasured ones already replaced).
    """
    size = len(cards)
    read = footprint.bytes_read_per_step(position, num_stages, num_layers)
    head_rows = config.vocab_size if position == num_stages - 1 else 0
    # 2 flops per weight per sequence, plus attention over the whole context (q.k and p.v).
    layer_flops = 2 * config.layer_parameters() + 4 * context_length * config.num_attention_heads * config.head_dim
    flops = max_batch * (num_layers * layer_flops + 2 * head_rows * config.hidden_size)
    alone = max(compute_s(c, read, flops, bw) for c, bw in zip(cards, bandwidth_gbps))
    split = max(compute_s(c, read // size, flops / size, bw) for c, bw in zip(cards, bandwidth_gbps))
    link = group_link(cards)
    message = max_batch * config.hidden_size * activation_bytes
    num_all_reduce = 2 * num_layers + (1 if position == 0 else 0)
    collective = num_all_reduce * link.all_reduce_s(message, size)
    collective += link.transfer_s(COMMAND_FRAME_BYTES)  # the step command, rank 0 to the rest
    num_collectives = num_all_reduce + 1
    if head_rows:  # rank 0 gathers every other rank's slice of the logits (fp32)
        collective += link.transfer_s(max_batch * -(-head_rows // size) * 4 * (size - 1))
        num_collectives += 1
    return TPEstimate(tuple(c.node_id for c in cards), size, num_layers, link, alone, split, collective,
                      num_collectives, message)
