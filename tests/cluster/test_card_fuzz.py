"""Property-based fuzzing of gossip cards into the registry merge: any Card message a peer can
send (parsed as the wire parses it) is either converted to a card inside every bound or dropped
with InvalidCard; an Exchange with too many cards is refused whole; merging what passes never
raises, never replaces this node's own card, never keeps an expired card, and merging it again
changes nothing. Bounded: a couple hundred examples, no deadline."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from meshllm.cluster.registry import Registry
from meshllm.errors import InvalidCard, MalformedMessage
from meshllm.transport import convert
from meshllm.transport.protos import cluster_pb2
from tests.cluster.cards import NOW, make_card

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OWN = make_card("me", announced_at=NOW)

texts = st.one_of(st.sampled_from(["", "node-1", "me", "127.0.0.1:7650", "cpu", "x" * 300, "a\nb", "h:0"]),
                  st.text(max_size=20))
numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e300]),
                    st.floats(0, 1e6))
int64 = st.integers(-(1 << 63), (1 << 63) - 1)


def sometimes(wild):
    """None (keep the valid card's value) 15 times in 16, else a wild value."""
    return st.sampled_from([False] * 15 + [True]).flatmap(lambda w: wild if w else st.none())


@st.composite
def wire_cards(draw) -> cluster_pb2.Card:
    """A valid card of a few node ids with some fields replaced by anything the wire can carry."""
    node = draw(st.sampled_from(["node-1", "node-2", "me"]))
    card = convert.card_to_pb(make_card(node, announced_at=NOW - draw(st.sampled_from([0.0, 5.0, 40.0]))))
    wild = dict(node_id=texts, grpc_address=texts, platform=texts, device=texts, memory_total_bytes=int64,
                memory_free_bytes=int64, memory_bandwidth_gbps=numbers, matmul_gflops=numbers,
                announced_at=st.one_of(st.sampled_from([NOW + 59.0, NOW + 61.0]), numbers), ttl_seconds=numbers)
    for name, strategy in wild.items():
        value = draw(sometimes(strategy))
        if value is not None:
            setattr(card, name, value)
    if (roles := draw(sometimes(st.lists(st.integers(-2, 5), max_size=4)))) is not None:
        card.ClearField("roles")
        card.roles.extend(roles)
    for _ in range(draw(st.sampled_from([0] * 6 + [1, 2]))):
        card.models.add(model_id=draw(texts), fingerprint=draw(texts), num_layers=draw(st.integers(-5, 200_000)),
                        path=draw(texts))
    for _ in range(draw(st.sampled_from([0] * 6 + [1, 2]))):
        card.shards.add(model_id=draw(texts), fingerprint=draw(texts), first_layer=draw(st.integers(-5, 40)),
                        last_layer=draw(st.integers(-5, 40)), queue_depth=draw(st.integers(-5, 1 << 22)),
                        max_streams=draw(st.integers(-5, 1 << 22)))
    if (api := draw(sometimes(texts))) is not None:
        card.api_address = api
    if (endpoint := draw(sometimes(texts))) is not None:
        card.collective_endpoint = endpoint
    return cluster_pb2.Card.FromString(card.SerializeToString())


@FUZZ
@given(st.lists(wire_cards(), max_size=6))
def test_any_gossiped_cards_merge_safely(messages):
    registry = Registry(OWN, clock=lambda: NOW)
    cards, rejected = convert.cards_from_pb(messages, NOW)
    assert len(cards) + len(rejected) == len(messages)
    assert all(isinstance(r, InvalidCard) and str(r) for r in rejected)
    for card in cards:  # what passes is inside every bound
        assert card.node_id and card.node_id.isprintable() and " " not in card.node_id
        assert 0 <= card.memory_free_bytes <= card.memory_total_bytes <= convert.MAX_MEMORY_BYTES
        assert math.isfinite(card.announced_at) and card.announced_at <= NOW + convert.MAX_FUTURE_S
        assert 0 < card.ttl_seconds <= convert.MAX_TTL_S
        assert all(0 <= s.first_layer < s.last_layer and s.max_streams >= 1 for s in card.shards)
    registry.merge(cards)
    view = registry.snapshot()
    event("cards merged" if len(view) > 1 else "none merged")
    assert registry.own_card() == OWN and [c for c in view if c.node_id == "me"] == [OWN]
    assert all(not c.is_expired(NOW) for c in view)
    registry.merge(cards)  # idempotent
    assert registry.snapshot() == view


def test_an_exchange_with_too_many_cards_is_refused_whole():
    messages = [convert.card_to_pb(make_card(f"n{i}", announced_at=NOW))
                for i in range(convert.MAX_CARDS_PER_EXCHANGE + 1)]
    try:
        convert.cards_from_pb(messages, NOW)
    except MalformedMessage as e:
        assert str(convert.MAX_CARDS_PER_EXCHANGE) in str(e)
    else:
        raise AssertionError("an overfull exchange was accepted")


def test_a_port_of_non_ascii_digits_is_an_invalid_card_not_a_crash():
    # "²" passes str.isdigit() and fails int(): a ValueError failed the whole exchange.
    msg = convert.card_to_pb(make_card("n1", announced_at=NOW))
    msg.grpc_address = "10.0.0.1:²"
    with pytest.raises(InvalidCard, match="host:port"):
        convert.card_from_pb(msg, NOW)


def test_cards_from_a_clock_ahead_by_what_calls_tolerate_are_accepted():
    # A node whose clock runs 20 s behind its peers passed every call's check (30 s) and dropped
    # every card (10 s): it saw an empty fleet.
    from meshllm.transport.auth import MAX_CLOCK_SKEW_S

    ahead = make_card("n1", announced_at=NOW + MAX_CLOCK_SKEW_S - 1)
    assert convert.card_from_pb(convert.card_to_pb(ahead), NOW).announced_at == ahead.announced_at
    with pytest.raises(InvalidCard, match="clocks out of sync"):
        convert.card_from_pb(convert.card_to_pb(make_card("n1", announced_at=NOW + MAX_CLOCK_SKEW_S + 5)), NOW)
