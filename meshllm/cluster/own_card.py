"""Builds this node's capability card, fresh for every gossip round.

Static parts (identity, probe results) are fixed at start; memory, models and
shards are read from their sources each time. Later features plug in through
the setters: the stage service reports loaded shards, the HTTP API its
address.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from meshllm.cluster.card import Card, LinkProbe, LoadedShard, ModelOnDisk, NodeId, Role, RoleOffer
from meshllm.cluster.profile import DeviceProfile
from meshllm.transport.convert import CARD_MAX_BYTES, card_wire_size

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CardIdentity:
    node_id: NodeId
    grpc_address: str  # host:port other nodes dial
    platform: str
    ttl_seconds: float
    roles: tuple[Role, ...] = (Role.STAGE,)


class OwnCard:
    """Thread-safe: the gossip thread calls `build`, other services the setters."""

    def __init__(self, identity: CardIdentity, profile: DeviceProfile,
                 memory: Callable[[], tuple[int, int]], models: Callable[[], tuple[ModelOnDisk, ...]],
                 clock: Callable[[], float] = time.time):
        self._identity = identity
        self._profile = profile
        self._memory = memory
        self._models = models
        self._clock = clock
        self._lock = threading.Lock()
        self._shards: Callable[[], tuple[LoadedShard, ...]] = tuple
        self._api_address: str | None = None
        self._collective_endpoint: str | None = None
        self._offers: tuple[RoleOffer, ...] = ()
        self._links: tuple[LinkProbe, ...] = ()
        self._warned_trim = False

    def set_shards_source(self, shards: Callable[[], tuple[LoadedShard, ...]]) -> None:
        with self._lock:
            self._shards = shards

    def set_api_address(self, address: str | None) -> None:
        with self._lock:
            self._api_address = address

    def set_offers(self, offers: tuple[RoleOffer, ...]) -> None:
        """What this node serves beyond stages (proposers); their roles join the card's roles."""
        with self._lock:
            self._offers = tuple(offers)

    def set_collective_endpoint(self, address: str | None) -> None:
        with self._lock:
            self._collective_endpoint = address

    def set_links(self, links: tuple[LinkProbe, ...]) -> None:
        with self._lock:
            self._links = links

    def build(self) -> Card:
        total, free = self._memory()
        with self._lock:
            shards, api_address, collective = self._shards(), self._api_address, self._collective_endpoint
            offers, links = self._offers, self._links
        roles = tuple(dict.fromkeys((*self._identity.roles, *(o.role for o in offers))))
        card = Card(
            node_id=self._identity.node_id, grpc_address=self._identity.grpc_address,
            platform=self._identity.platform, device=self._profile.device,
            memory_total_bytes=total, memory_free_bytes=min(free, total),
            memory_bandwidth_gbps=round(self._profile.memory_bandwidth_gbps, 2),
            matmul_gflops=round(self._profile.matmul_gflops, 2),
            models=self._models(), shards=tuple(shards), roles=roles, offers=offers,
            collective_endpoint=collective, api_address=api_address,
            announced_at=self._clock(), ttl_seconds=self._identity.ttl_seconds, links=links)
        return self._fit_to_wire(card)

    def _fit_to_wire(self, card: Card) -> Card:
        # Peers refuse cards over CARD_MAX_BYTES. The KV reservations by leader go first (planners
        # fall back on each range's total), then local paths (informational); then models are
        # dropped from the end, with a warning.
        if card_wire_size(card) <= CARD_MAX_BYTES:
            return card
        card = replace(card, shards=tuple(replace(s, kv_reservations=()) for s in card.shards))
        if card_wire_size(card) <= CARD_MAX_BYTES:
            return card
        card = replace(card, models=tuple(replace(m, path="") for m in card.models))
        num_listed = len(card.models)
        while card_wire_size(card) > CARD_MAX_BYTES and card.models:
            card = replace(card, models=card.models[:-1])
        if not self._warned_trim:
            self._warned_trim = True
            log.warning("this node's card is over %d bytes: it lists %d of its %d models, without local paths. "
                        "Pass fewer --models to advertise them all.", CARD_MAX_BYTES, len(card.models), num_listed)
        return card
