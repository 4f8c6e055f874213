"""Capability card: what one node advertises to the fleet (DESIGN.md "Capability card").

Frozen dataclasses inside the process; protobuf on the wire (transport/convert.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

NodeId = NewType("NodeId", str)


class Role(str, Enum):
    STAGE = "stage"
    VERIFIER = "verifier"
    PROPOSER = "proposer"


@dataclass(frozen=True, slots=True)
class ModelOnDisk:
    model_id: str  # name a user asks for, e.g. "SmolLM2-135M-Instruct"
    fingerprint: str  # weights fingerprint (model/weights.py)
    num_layers: int
    path: str = ""  # local path on that node; informational for other nodes


@dataclass(frozen=True, slots=True)
class WeightForm:
    """How a stage holds a model's weights. Only a plan asking for the same form shares a loaded
    shard's weights (pipeline/loaded_stages.WeightKey); any other loads a second copy."""

    dtype: str = ""  # "float32" | "float16" | "bfloat16"
    quantization: str = ""  # "" or "int8" / "int4" (--quantize)
    batch_invariant: bool = False


@dataclass(frozen=True, slots=True)
class LoadedShard:
    model_id: str
    fingerprint: str
    first_layer: int  # inclusive
    last_layer: int  # exclusive
    queue_depth: int = 0
    max_streams: int = 64
    tp_size: int = 1  # > 1: one rank's slice of a tensor-parallel group, not the whole range
    form: WeightForm = WeightForm()
    # KV the plans over this range may still grow into within their limits. The card's free memory
    # already leaves it out; a re-plan over the same range takes those plans' place (and their KV).
    kv_reserved_bytes: int = 0
    # The same by lineage (a plan and its re-plans, linked by their named leaders): a re-plan takes
    # the place of its own leader's lineage only. Empty: not known (an older node, a trimmed card).
    kv_reservations: tuple[KVReservation, ...] = ()


@dataclass(frozen=True, slots=True)
class KVReservation:
    leader_ids: tuple[str, ...]  # sorted (one text for one set: cards compare and print alike); empty: no ids
    bytes: int


@dataclass(frozen=True, slots=True)
class LinkProbe:
    """All-reduce cost measured between this node and `peer` over the collective backend."""

    peer: NodeId
    latency_s: float  # one all-reduce of a small tensor (1 KiB), median
    bandwidth_gbps: float  # GB/s of all-reduced payload for large tensors (1 MiB)

    def all_reduce_s(self, num_bytes: int) -> float:
        """Predicted time of one 2-rank all-reduce of `num_bytes` over this link."""
        return self.latency_s + num_bytes / (self.bandwidth_gbps * 1e9)


@dataclass(frozen=True, slots=True)
class RoleOffer:
    """A model this node serves in a role beyond stages: a proposer ("ngram" or a draft model)."""

    role: Role
    model_id: str
    vocab: str = ""  # vocabulary fingerprint (spec/draft_model.py); "" for token-agnostic proposers
    tokens_per_second: float = 0.0  # estimated drafting speed of one sequence


@dataclass(frozen=True, slots=True)
class Card:
    node_id: NodeId
    grpc_address: str  # host:port
    platform: str  # "linux-x86_64", "darwin-arm64"; informational
    device: str  # "cpu", "cuda:0", "mps"
    memory_total_bytes: int
    memory_free_bytes: int
    memory_bandwidth_gbps: float  # measured at start-up, GB/s
    matmul_gflops: float  # measured at start-up
    models: tuple[ModelOnDisk, ...] = ()
    shards: tuple[LoadedShard, ...] = ()
    roles: tuple[Role, ...] = (Role.STAGE,)
    collective_endpoint: str | None = None  # tensor-parallel backend address, when any
    api_address: str | None = None  # host:port of the OpenAI-compatible HTTP API, when served
    announced_at: float = field(default_factory=time.time)  # unix seconds; last writer wins
    ttl_seconds: float = 30.0
    offers: tuple[RoleOffer, ...] = ()
    links: tuple[LinkProbe, ...] = ()  # measured by this node to peers with a collective endpoint

    @property
    def expires_at(self) -> float:
        return self.announced_at + self.ttl_seconds

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at
