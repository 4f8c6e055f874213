"""`meshllm status`: every card field serialises (the KV reservations by leader included), and the
command starts without torch."""

import json
import subprocess
import sys

import pytest

from meshllm.cluster.card import KVReservation, LoadedShard
from meshllm.commands.status import card_json
from tests.cluster.cards import NOW, make_card


def test_a_card_with_kv_reservations_by_leader_prints_as_json():
    shard = LoadedShard("m", "f", 0, 4, kv_reserved_bytes=3, kv_reservations=(KVReservation(("a", "b"), 1),
                                                                               KVReservation((), 2)))
    data = json.loads(json.dumps(card_json(make_card(shards=(shard,), announced_at=NOW), NOW)))
    assert data["shards"][0]["kv_reservations"] == [{"leader_ids": ["a", "b"], "bytes": 1},
                                                    {"leader_ids": [], "bytes": 2}]


@pytest.mark.parametrize("command", ["status", "plan"])
def test_the_fleet_commands_start_without_torch(command):
    # `meshllm status` and `meshllm plan --help` answer in a fraction of a second: importing torch
    # (~1.5 s, ~220 MiB here) is for commands that run a model. status once came with it through
    # the node command's key helper and the node's tensor-parallel collective.
    code = (f"import sys; import meshllm.cli; meshllm.cli.build_parser({command!r}); "
            "print('torch' in sys.modules)")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert imported.stdout.strip() == "False", imported.stderr[-2000:]
