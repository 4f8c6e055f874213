"""This node's card: fresh each build, hooks for shards and API address, always fits the wire."""

import dataclasses
import logging

from meshllm.cluster.card import KVReservation, LoadedShard, ModelOnDisk, NodeId
from meshllm.cluster.own_card import CardIdentity, OwnCard
from meshllm.cluster.profile import DeviceProfile
from meshllm.transport import convert

IDENTITY = CardIdentity(NodeId("n1"), "10.0.0.1:7650", "linux-x86_64", ttl_seconds=30.0)
PROFILE = DeviceProfile("cpu", 12.345, 67.891)


def make(models=(), clock=lambda: 1000.0):
    return OwnCard(IDENTITY, PROFILE, memory=lambda: (16 << 30, 4 << 30), models=lambda: models, clock=clock)


def test_build_reads_its_sources_each_time():
    now = [1000.0]
    own = make(clock=lambda: now[0])
    first = own.build()
    assert (first.node_id, first.memory_free_bytes, first.announced_at, first.ttl_seconds) == ("n1", 4 << 30, 1000.0, 30)
    assert first.memory_bandwidth_gbps == 12.35 and first.shards == () and first.api_address is None
    shards = (LoadedShard("m", "fp", 0, 8),)
    own.set_shards_source(lambda: shards)
    own.set_api_address("10.0.0.1:8000")
    now[0] = 1002.0
    second = own.build()
    assert second.shards == shards and second.api_address == "10.0.0.1:8000" and second.announced_at == 1002.0
    assert convert.card_from_pb(convert.card_to_pb(second), 1002.0) == second


def test_too_many_models_are_trimmed_to_fit_the_wire(caplog):
    models = tuple(ModelOnDisk(f"some-long-model-name-{i:03d}", "f" * 64, 32, f"/srv/models/{i:03d}/weights")
                   for i in range(100))
    with caplog.at_level(logging.WARNING):
        card = make(models).build()
    assert convert.card_wire_size(card) <= convert.CARD_MAX_BYTES
    assert 10 < len(card.models) < 100 and all(m.path == "" for m in card.models)
    assert "--models" in caplog.text
    assert convert.card_from_pb(convert.card_to_pb(card), 1000.0) == card


def test_kv_reservations_by_leader_go_first_when_the_card_must_shrink():
    by_leader = tuple(KVReservation((f"leader-{i:02d}-" + "x" * 100,), 1 << 20) for i in range(8))
    shards = tuple(LoadedShard("m", "f" * 64, i, i + 1, kv_reserved_bytes=8 << 20, kv_reservations=by_leader)
                   for i in range(8))
    models = (ModelOnDisk("m", "f" * 64, 32, "/srv/models/m"),)
    own = make(models)
    own.set_shards_source(lambda: shards)
    card = own.build()
    assert convert.card_wire_size(card) <= convert.CARD_MAX_BYTES
    assert all(s.kv_reservations == () and s.kv_reserved_bytes == 8 << 20 for s in card.shards)  # totals stay
    assert card.models == models  # with its path: nothing else had to go
    small = make(models)
    small.set_shards_source(lambda: (dataclasses.replace(shards[0], kv_reservations=by_leader[:2]),))
    kept = small.build()
    assert kept.shards[0].kv_reservations == by_leader[:2]  # it fits: kept
    assert convert.card_from_pb(convert.card_to_pb(kept), 1000.0) == kept
