"""`meshllm status --json`: every card field serialises, the KV reservations by leader included."""

import json

from meshllm.cluster.card import KVReservation, LoadedShard
from meshllm.commands.status import card_json
from tests.cluster.cards import NOW, make_card


def test_a_card_with_kv_reservations_by_leader_prints_as_json():
    shard = LoadedShard("m", "f", 0, 4, kv_reserved_bytes=3, kv_reservations=(KVReservation(("a", "b"), 1),
                                                                               KVReservation((), 2)))
    data = json.loads(json.dumps(card_json(make_card(shards=(shard,), announced_at=NOW), NOW)))
    assert data["shards"][0]["kv_reservations"] == [{"leader_ids": ["a", "b"], "bytes": 1},
                                                    {"leader_ids": [], "bytes": 2}]
