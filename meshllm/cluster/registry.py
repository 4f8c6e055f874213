"""The fleet view: a last-writer-wins map of capability cards keyed by node_id.

`merge_views` is the pure merge; `Registry` wraps it with a lock, a clock and
this node's own card. Per node_id the card with the larger `announced_at`
wins; expired cards are dropped on merge and on read. Merge is commutative,
associative and idempotent (tests/cluster/test_registry.py checks it with
hypothesis), so views converge whatever order exchanges happen in.

A node that stops cleanly sends its card already expired (GossipLoop's farewell): the
Registry then drops the node at once, not when its last card's TTL runs out, and keeps
older cards of it, still gossiped by nodes that did not hear the farewell, out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Callable

from meshllm.cluster.card import Card, NodeId

log = logging.getLogger(__name__)

View = Mapping[NodeId, Card]
_MAX_FAREWELLS = 1024  # nodes remembered as left; a desk or LAN holds far fewer


def _version(card: Card) -> tuple[float, str]:
    # Equal timestamps with different contents need a deterministic winner, or
    # merge(a, b) and merge(b, a) would disagree; repr orders on every field.
    return card.announced_at, repr(card)


def newer(a: Card, b: Card) -> Card:
    """The card that wins between two versions of the same node's card."""
    return a if _version(a) >= _version(b) else b


def merge_views(a: View, b: Iterable[Card], now: float) -> dict[NodeId, Card]:
    """Union of `a` and `b` keeping the newest card per node, minus expired ones."""
    merged: dict[NodeId, Card] = {}
    for card in (*a.values(), *b):
        if card.is_expired(now):
            continue
        current = merged.get(card.node_id)
        merged[card.node_id] = card if current is None else newer(current, card)
    return merged


@dataclass(frozen=True, slots=True)
class MergeResult:
    num_new: int  # nodes not in the view before
    num_updated: int  # nodes whose card was replaced by a newer one
    num_ignored: int  # stale, expired, or claiming this node's own id


class Registry:
    """This node's view of the fleet. Thread-safe: the gRPC Exchange handler,
    the gossip loop and status readers call it from their own threads."""

    def __init__(self, own: Card, clock: Callable[[], float] = time.time):
        self._clock = clock
        self._lock = threading.Lock()
        self._own = own
        self._others: dict[NodeId, Card] = {}
        self._twins: set[str] = set()  # addresses of other nodes seen with this node's id (warned once)
        self._left: dict[NodeId, float] = {}  # node -> announced_at of its farewell: older cards are stale

    @property
    def node_id(self) -> NodeId:
        return self._own.node_id

    def own_card(self) -> Card:
        with self._lock:
            return self._own

    def update_own(self, card: Card) -> None:
        """Replace this node's card, unless a newer one is in already: the gossip thread and the
        stage service build it at once, and the older build must not undo a shard just loaded."""
        if card.node_id != self._own.node_id:
            raise ValueError(f"own card must keep node_id {self._own.node_id!r}, got {card.node_id!r}")
        with self._lock:
            if card.announced_at >= self._own.announced_at:
                self._own = card

    def merge(self, cards: Iterable[Card]) -> MergeResult:
        """Merge cards from gossip. Cards for this node's id are ignored: the
        node is the only authority on its own card."""
        now = self._clock()
        num_new = num_updated = num_ignored = 0
        with self._lock:
            for card in cards:
                if card.node_id == self._own.node_id and card.grpc_address != self._own.grpc_address \
                        and not card.is_expired(now) and card.grpc_address not in self._twins:
                    # Two machines of one name (cloned images) on the default --node-id: each takes
                    # the other's card for its own, and calls meant for one reach the other.
                    self._twins.add(card.grpc_address)
                    log.warning("another node, at %s, uses this node's id %r: start one of them with its "
                                "own --node-id", card.grpc_address, card.node_id)
                if card.node_id == self._own.node_id:
                    num_ignored += 1
                    continue
                if card.is_expired(now):
                    dropped = self._farewell(card)
                    num_updated, num_ignored = num_updated + dropped, num_ignored + 1 - dropped
                    continue
                if card.announced_at <= self._left.get(card.node_id, float("-inf")):
                    num_ignored += 1  # from before its node left
                    continue
                current = self._others.get(card.node_id)
                if current is not None and current.is_expired(now):
                    current = None
                if current is None:
                    num_new += 1
                elif newer(current, card) is card and card != current:
                    num_updated += 1
                else:
                    num_ignored += 1
                    continue
                self._others[card.node_id] = card
            self._drop_expired(now)
        return MergeResult(num_new, num_updated, num_ignored)

    def _farewell(self, card: Card) -> int:
        """An expired card newer than its node's card here says the node left: drop it and
        remember when (1), else nothing (0). Idempotent. Caller holds the lock."""
        current = self._others.get(card.node_id)
        if (current is not None and newer(current, card) is current) \
                or card.announced_at <= self._left.get(card.node_id, float("-inf")):
            return 0
        if current is not None:
            del self._others[card.node_id]
            log.info("node %s left the fleet", card.node_id)
        self._left[card.node_id] = card.announced_at
        while len(self._left) > _MAX_FAREWELLS:  # the oldest: a card that old has expired anyway
            del self._left[min(self._left, key=self._left.get)]
        return int(current is not None)

    def _drop_expired(self, now: float) -> None:
        for node_id in [n for n, c in self._others.items() if c.is_expired(now)]:
            del self._others[node_id]

    def snapshot(self) -> list[Card]:
        """Live cards sorted by node_id, own card included (a running node is
        live by definition, even if its refresh is late)."""
        with self._lock:
            self._drop_expired(self._clock())
            cards = [self._own, *self._others.values()]
        return sorted(cards, key=lambda c: c.node_id)

    def get(self, node_id: NodeId) -> Card | None:
        return next((c for c in self.snapshot() if c.node_id == node_id), None)
