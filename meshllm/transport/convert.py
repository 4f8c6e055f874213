"""Protobuf <-> dataclasses for the control plane, converted once, here.

Peer input is checked on the way in: a card with absurd values (negative
memory, a ttl of years, a timestamp far in the future, overlong strings, more
than CARD_MAX_BYTES on the wire) raises InvalidCard and never reaches the
registry.
"""

from __future__ import annotations

import math

from meshllm.cluster.card import (Card, KVReservation, LinkProbe, LoadedShard, ModelOnDisk, NodeId, Role, RoleOffer,
                                  WeightForm)
from meshllm.errors import InvalidCard, MalformedMessage
from meshllm.transport.auth import MAX_CLOCK_SKEW_S
from meshllm.transport.protos import cluster_pb2

CARD_MAX_BYTES = 4096
MAX_CARDS_PER_EXCHANGE = 512
# Room for a full message of maximal cards plus per-field framing.
MAX_EXCHANGE_BYTES = MAX_CARDS_PER_EXCHANGE * (CARD_MAX_BYTES + 8)
# Clock skew tolerated on announced_at: as much as calls are allowed (auth.MAX_CLOCK_SKEW_S). Less
# made a node whose clock ran 10-30 s behind accept every call and drop every card: an empty
# fleet, while the others placed stages on it. More would let a card win last-writer-wins unfairly.
MAX_FUTURE_S = MAX_CLOCK_SKEW_S
MAX_TTL_S = 86_400.0
MAX_MEMORY_BYTES = 1 << 50  # 1 PiB
MAX_BANDWIDTH_GBPS = 1e5
MAX_GFLOPS = 1e7
MAX_LAYERS = 100_000
MAX_ENTRIES = 64  # models, shards or links per card
MAX_RESERVATIONS = 16  # KV reservations per shard, and leader ids per reservation
MAX_LINK_LATENCY_S = 10.0
MAX_ID_CHARS = 128  # node ids, fingerprints
MAX_TEXT_CHARS = 256  # addresses, model ids, paths, platform, device

_ROLE_TO_PB = {
    Role.STAGE: cluster_pb2.ROLE_STAGE,
    Role.VERIFIER: cluster_pb2.ROLE_VERIFIER,
    Role.PROPOSER: cluster_pb2.ROLE_PROPOSER,
}
_PB_TO_ROLE = {v: k for k, v in _ROLE_TO_PB.items()}


# ---------------------------------------------------------------- outward

def model_to_pb(m: ModelOnDisk) -> cluster_pb2.ModelOnDisk:
    return cluster_pb2.ModelOnDisk(model_id=m.model_id, fingerprint=m.fingerprint, num_layers=m.num_layers,
                                   path=m.path)


def shard_to_pb(s: LoadedShard) -> cluster_pb2.LoadedShard:
    return cluster_pb2.LoadedShard(model_id=s.model_id, fingerprint=s.fingerprint, first_layer=s.first_layer,
                                   last_layer=s.last_layer, queue_depth=s.queue_depth, max_streams=s.max_streams,
                                   tp_size=s.tp_size, dtype=s.form.dtype, quantization=s.form.quantization,
                                   batch_invariant=s.form.batch_invariant, kv_reserved_bytes=s.kv_reserved_bytes,
                                   kv_reservations=[cluster_pb2.KVReservation(leader_ids=r.leader_ids, bytes=r.bytes)
                                                    for r in s.kv_reservations])


def link_to_pb(link: LinkProbe) -> cluster_pb2.LinkProbe:
    return cluster_pb2.LinkProbe(peer=link.peer, latency_s=link.latency_s, bandwidth_gbps=link.bandwidth_gbps)


def offer_to_pb(o: RoleOffer) -> cluster_pb2.RoleOffer:
    return cluster_pb2.RoleOffer(role=_ROLE_TO_PB[o.role], model_id=o.model_id, vocab=o.vocab,
                                 tokens_per_second=o.tokens_per_second)


def card_to_pb(card: Card) -> cluster_pb2.Card:
    msg = cluster_pb2.Card(
        node_id=card.node_id, grpc_address=card.grpc_address, platform=card.platform, device=card.device,
        memory_total_bytes=card.memory_total_bytes, memory_free_bytes=card.memory_free_bytes,
        memory_bandwidth_gbps=card.memory_bandwidth_gbps, matmul_gflops=card.matmul_gflops,
        models=[model_to_pb(m) for m in card.models], shards=[shard_to_pb(s) for s in card.shards],
        roles=[_ROLE_TO_PB[r] for r in card.roles],
        announced_at=card.announced_at, ttl_seconds=card.ttl_seconds,
        offers=[offer_to_pb(o) for o in card.offers], links=[link_to_pb(k) for k in card.links])
    if card.collective_endpoint is not None:
        msg.collective_endpoint = card.collective_endpoint
    if card.api_address is not None:
        msg.api_address = card.api_address
    return msg


def card_wire_size(card: Card) -> int:
    return card_to_pb(card).ByteSize()


# ---------------------------------------------------------------- inward

def _text(value: str, what: str, limit: int = MAX_TEXT_CHARS, *, required: bool = True) -> str:
    if required and not value:
        raise InvalidCard(f"{what} is empty")
    if len(value) > limit or not value.isprintable():
        raise InvalidCard(f"{what} is longer than {limit} characters or not printable")
    return value


def node_id_text(value: str, what: str) -> str:
    """A node id as cards carry it (a leader names itself by one): printable, at most MAX_ID_CHARS, no
    whitespace; InvalidCard otherwise."""
    node_id = _text(value, what, MAX_ID_CHARS)
    if any(c.isspace() for c in node_id):
        raise InvalidCard(f"{what} {node_id!r} contains whitespace")
    return node_id


def _bounded(value: float, what: str, low: float, high: float) -> float:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidCard(f"{what}={value} is outside {low}..{high}")
    return value


def _address(value: str, what: str) -> str:
    _text(value, what)
    host, sep, port = value.rpartition(":")
    # isascii: "²" is a digit to isdigit() and not a number to int()
    if not (sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536) \
            or any(c.isspace() for c in value):
        raise InvalidCard(f"{what} {value!r} is not host:port")
    return value


def model_from_pb(m: cluster_pb2.ModelOnDisk) -> ModelOnDisk:
    return ModelOnDisk(
        model_id=_text(m.model_id, "model_id"), fingerprint=_text(m.fingerprint, "fingerprint", MAX_ID_CHARS),
        num_layers=int(_bounded(m.num_layers, "num_layers", 1, MAX_LAYERS)),
        path=_text(m.path, "model path", required=False))


def shard_from_pb(s: cluster_pb2.LoadedShard) -> LoadedShard:
    first = int(_bounded(s.first_layer, "first_layer", 0, MAX_LAYERS))
    last = int(_bounded(s.last_layer, "last_layer", first + 1, MAX_LAYERS))
    return LoadedShard(
        model_id=_text(s.model_id, "shard model_id"),
        fingerprint=_text(s.fingerprint, "shard fingerprint", MAX_ID_CHARS),
        first_layer=first, last_layer=last,
        queue_depth=int(_bounded(s.queue_depth, "queue_depth", 0, 1 << 20)),
        max_streams=int(_bounded(s.max_streams, "max_streams", 1, 1 << 20)),
        tp_size=int(_bounded(max(s.tp_size, 1), "tp_size", 1, 1024)),
        form=WeightForm(_text(s.dtype, "shard dtype", MAX_ID_CHARS, required=False),
                        _text(s.quantization, "shard quantization", MAX_ID_CHARS, required=False), s.batch_invariant),
        kv_reserved_bytes=int(_bounded(s.kv_reserved_bytes, "kv_reserved_bytes", 0, MAX_MEMORY_BYTES)),
        kv_reservations=tuple(_reservation_from_pb(r) for r in _at_most(s.kv_reservations, MAX_RESERVATIONS,
                                                                          "kv_reservations of a shard")))


def _reservation_from_pb(r: cluster_pb2.KVReservation) -> KVReservation:
    ids = _at_most(r.leader_ids, MAX_RESERVATIONS, "leader_ids of a KV reservation")
    return KVReservation(tuple(sorted({node_id_text(i, "reservation leader_id") for i in ids})),
                         int(_bounded(r.bytes, "reservation bytes", 0, MAX_MEMORY_BYTES)))


def _at_most(items, limit: int, what: str):
    if len(items) > limit:
        raise InvalidCard(f"card lists {len(items)} {what}; the limit is {limit}")
    return items


def link_from_pb(k: cluster_pb2.LinkProbe) -> LinkProbe:
    return LinkProbe(peer=NodeId(_text(k.peer, "link peer", MAX_ID_CHARS)),
                     latency_s=_bounded(k.latency_s, "link latency_s", 1e-9, MAX_LINK_LATENCY_S),
                     bandwidth_gbps=_bounded(k.bandwidth_gbps, "link bandwidth_gbps", 1e-6, MAX_BANDWIDTH_GBPS))


def offer_from_pb(o: cluster_pb2.RoleOffer) -> RoleOffer:
    if o.role not in _PB_TO_ROLE:
        raise InvalidCard(f"offer has unknown role {o.role}")
    return RoleOffer(role=_PB_TO_ROLE[o.role], model_id=_text(o.model_id, "offer model_id"),
                     vocab=_text(o.vocab, "offer vocab", MAX_ID_CHARS, required=False),
                     tokens_per_second=_bounded(o.tokens_per_second, "offer tokens_per_second", 0.0, MAX_GFLOPS))


def card_from_pb(msg: cluster_pb2.Card, now: float) -> Card:
    """Validate and convert one wire card; `now` bounds how far ahead it may be stamped."""
    if msg.ByteSize() > CARD_MAX_BYTES:
        raise InvalidCard(f"card of {msg.ByteSize()} bytes exceeds {CARD_MAX_BYTES}")
    node_id = node_id_text(msg.node_id, "node_id")
    total = int(_bounded(msg.memory_total_bytes, "memory_total_bytes", 0, MAX_MEMORY_BYTES))
    free = int(_bounded(msg.memory_free_bytes, "memory_free_bytes", 0, total))
    if max(len(msg.models), len(msg.shards), len(msg.offers), len(msg.links)) > MAX_ENTRIES:
        raise InvalidCard(f"card lists more than {MAX_ENTRIES} models, shards, offers or links")
    unknown_roles = [r for r in msg.roles if r not in _PB_TO_ROLE]
    if unknown_roles or len(set(msg.roles)) != len(msg.roles):
        raise InvalidCard(f"card has unknown or repeated roles {list(msg.roles)}")
    if math.isfinite(msg.announced_at) and msg.announced_at > now + MAX_FUTURE_S:
        raise InvalidCard(f"announced_at is {msg.announced_at - now:.1f}s ahead of this node's clock (limit "
                          f"{MAX_FUTURE_S:.0f}s): clocks out of sync (run NTP), or a forged card")
    announced_at = _bounded(msg.announced_at, "announced_at", 0.0, now + MAX_FUTURE_S)
    return Card(
        node_id=NodeId(node_id),
        grpc_address=_address(msg.grpc_address, "grpc_address"),
        platform=_text(msg.platform, "platform", required=False),
        device=_text(msg.device, "device"),
        memory_total_bytes=total, memory_free_bytes=free,
        memory_bandwidth_gbps=_bounded(msg.memory_bandwidth_gbps, "memory_bandwidth_gbps", 0.0,
                                       MAX_BANDWIDTH_GBPS),
        matmul_gflops=_bounded(msg.matmul_gflops, "matmul_gflops", 0.0, MAX_GFLOPS),
        models=tuple(model_from_pb(m) for m in msg.models),
        shards=tuple(shard_from_pb(s) for s in msg.shards),
        roles=tuple(_PB_TO_ROLE[r] for r in msg.roles),
        collective_endpoint=(_address(msg.collective_endpoint, "collective_endpoint")
                             if msg.HasField("collective_endpoint") else None),
        api_address=_address(msg.api_address, "api_address") if msg.HasField("api_address") else None,
        announced_at=announced_at,
        ttl_seconds=_bounded(msg.ttl_seconds, "ttl_seconds", 0.001, MAX_TTL_S),
        offers=tuple(offer_from_pb(o) for o in msg.offers),
        links=tuple(link_from_pb(k) for k in msg.links))


def cards_from_pb(messages, now: float) -> tuple[list[Card], list[InvalidCard]]:
    """Convert the cards of one Exchange message.

    The whole message is refused (MalformedMessage) when it has too many cards;
    otherwise each bad card is dropped on its own, so one broken or hostile
    peer's card cannot block the good cards travelling with it.
    Returns (valid cards, rejections).
    """
    if len(messages) > MAX_CARDS_PER_EXCHANGE:
        raise MalformedMessage(f"exchange carries {len(messages)} cards; the limit is {MAX_CARDS_PER_EXCHANGE}")
    cards, rejected = [], []
    for msg in messages:
        try:
            cards.append(card_from_pb(msg, now))
        except InvalidCard as e:
            rejected.append(InvalidCard(f"card {msg.node_id[:MAX_ID_CHARS]!r}: {e}"))
    return cards, rejected
