"""Merge laws of the fleet view (pure) and the Registry's own-card rules."""

import logging

from hypothesis import given
from hypothesis import strategies as st

from meshllm.cluster.registry import Registry, merge_views
from tests.cluster.cards import NOW, card_lists, cards, make_card


def view(cards_):
    return merge_views({}, cards_, NOW)


@given(card_lists, card_lists)
def test_merge_is_commutative(a, b):
    assert merge_views(view(a), b, NOW) == merge_views(view(b), a, NOW)


@given(card_lists, card_lists, card_lists)
def test_merge_is_associative(a, b, c):
    left = merge_views(merge_views(view(a), b, NOW), c, NOW)
    right = merge_views(view(a), merge_views(view(b), c, NOW).values(), NOW)
    assert left == right


@given(card_lists)
def test_merge_is_idempotent(a):
    once = view(a)
    assert merge_views(once, once.values(), NOW) == once
    assert merge_views(once, a, NOW) == once


@given(card_lists, card_lists)
def test_merge_keeps_newest_live_card_per_node(a, b):
    merged = merge_views(view(a), b, NOW)
    for card in a + b:
        if card.is_expired(NOW):
            assert merged.get(card.node_id) != card
        else:
            assert merged[card.node_id].announced_at >= card.announced_at


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now



@given(st.lists(card_lists, min_size=1, max_size=5), st.lists(st.floats(0, 20), min_size=5, max_size=5))
def test_expired_cards_never_come_back_through_gossip(rounds, steps):
    clock = Clock(NOW)
    registry = Registry(make_card("self", announced_at=NOW), clock=clock)
    gone: set = set()  # card versions that have expired by now
    for batch, step in zip(rounds, steps):
        registry.merge(batch)
        for card in registry.snapshot():
            assert card not in gone
            assert card.node_id == "self" or not card.is_expired(clock.now)
        clock.now += step
        gone |= {c for batch_ in rounds for c in batch_ if c.is_expired(clock.now)}
    # Replaying every card ever sent cannot resurrect an expired version.
    registry.merge([c for batch in rounds for c in batch])
    assert not set(registry.snapshot()) & gone


@given(card_lists, st.lists(cards(node_id=st.just("self")), max_size=4))
def test_own_card_survives_any_gossip(others, impostors):
    own = make_card("self", announced_at=NOW - 1000, ttl=10.0)  # old and "expired": still ours
    registry = Registry(own, clock=lambda: NOW)
    registry.merge(others + impostors)
    assert registry.own_card() == own
    assert [c for c in registry.snapshot() if c.node_id == "self"] == [own]


def test_merge_result_counts_and_snapshot_order():
    registry = Registry(make_card("b", announced_at=NOW), clock=lambda: NOW)
    first = registry.merge([make_card("c", announced_at=NOW - 1), make_card("a", announced_at=NOW - 2)])
    assert (first.num_new, first.num_updated, first.num_ignored) == (2, 0, 0)
    second = registry.merge([make_card("c", announced_at=NOW), make_card("a", announced_at=NOW - 3),
                             make_card("b", announced_at=NOW + 5)])
    assert (second.num_new, second.num_updated, second.num_ignored) == (0, 1, 2)
    assert [c.node_id for c in registry.snapshot()] == ["a", "b", "c"]
    assert registry.get("c").announced_at == NOW


def test_update_own_refuses_another_node_id():
    registry = Registry(make_card("self", announced_at=NOW))
    try:
        registry.update_own(make_card("other"))
    except ValueError as e:
        assert "self" in str(e)
    else:
        raise AssertionError("update_own accepted another node's card")


def test_a_card_built_earlier_never_replaces_the_own_card_built_later():
    # The gossip thread and the stage service build the card at once; the older build written
    # last advertised a shard just loaded (or unloaded) wrongly for a round.
    registry = Registry(make_card("me", announced_at=NOW), clock=lambda: NOW)
    registry.update_own(make_card("me", announced_at=NOW + 2, shards=()))
    registry.update_own(make_card("me", announced_at=NOW + 1))
    assert registry.own_card().announced_at == NOW + 2 and registry.own_card().shards == ()


def test_another_node_with_this_nodes_id_is_named_in_a_warning(caplog):
    registry = Registry(make_card("pi-7650", announced_at=NOW, grpc_address="192.168.1.20:7650"), clock=lambda: NOW)
    twin = make_card("pi-7650", announced_at=NOW, grpc_address="192.168.1.21:7650")
    with caplog.at_level(logging.WARNING, logger="meshllm.cluster.registry"):
        registry.merge([twin])
        registry.merge([twin])
    warnings = [r.getMessage() for r in caplog.records if "uses this node's id" in r.getMessage()]
    assert len(warnings) == 1 and "192.168.1.21:7650" in warnings[0] and "--node-id" in warnings[0]
    assert registry.own_card().grpc_address == "192.168.1.20:7650"  # its own card stays its own


def test_a_farewell_drops_its_node_at_once_and_keeps_older_cards_of_it_out():
    """A node that stops cleanly sends its card expired on arrival (GossipLoop.stop)."""
    registry = Registry(make_card("self", announced_at=NOW), clock=lambda: NOW)
    registry.merge([make_card("gone", announced_at=NOW - 5), make_card("stays", announced_at=NOW - 5)])
    farewell = make_card("gone", announced_at=NOW - 1, ttl=0.001)
    assert registry.merge([farewell]).num_updated == 1
    assert [c.node_id for c in registry.snapshot()] == ["self", "stays"]
    # A third node that missed the farewell still gossips the card from before it: it stays out.
    assert registry.merge([make_card("gone", announced_at=NOW - 5)]).num_ignored == 1
    assert registry.merge([farewell]).num_ignored == 1  # heard twice: nothing more to do
    # The node starts again: its new card is newer than its farewell.
    assert registry.merge([make_card("gone", announced_at=NOW)]).num_new == 1
    assert [c.node_id for c in registry.snapshot()] == ["gone", "self", "stays"]


def test_an_expired_card_older_than_the_live_one_changes_nothing():
    registry = Registry(make_card("self", announced_at=NOW), clock=lambda: NOW)
    registry.merge([make_card("x", announced_at=NOW - 1)])
    assert registry.merge([make_card("x", announced_at=NOW - 100, ttl=30)]).num_ignored == 1
    assert [c.node_id for c in registry.snapshot()] == ["self", "x"]
    assert registry.merge([make_card("x", announced_at=NOW - 0.5)]).num_updated == 1
