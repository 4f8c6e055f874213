"""Cards survive the wire unchanged; absurd or oversized cards never get through."""

import dataclasses
import time

import pytest
from hypothesis import given

from meshllm.cluster.card import KVReservation, LinkProbe, LoadedShard, ModelOnDisk, NodeId, Role, WeightForm
from meshllm.errors import InvalidCard, MalformedMessage
from meshllm.transport import convert
from meshllm.transport.protos import cluster_pb2
from tests.cluster.cards import NOW, cards, make_card


def wire(card):
    return cluster_pb2.Card.FromString(convert.card_to_pb(card).SerializeToString())


@given(cards())
def test_round_trip(card):
    assert convert.card_from_pb(wire(card), NOW) == card


def test_round_trip_with_optional_fields_and_all_roles():
    card = make_card(api_address="10.0.0.2:8000", collective_endpoint="10.0.0.2:29500",
                     roles=(Role.STAGE, Role.VERIFIER, Role.PROPOSER), announced_at=NOW,
                     links=(LinkProbe(NodeId("n2"), 8.5e-5, 1.25), LinkProbe(NodeId("n3"), 0.0021, 0.11)))
    assert convert.card_from_pb(wire(card), NOW) == card
    assert convert.card_from_pb(wire(make_card(announced_at=NOW)), NOW).api_address is None


def test_a_shards_weight_form_travels():
    shard = LoadedShard("m", "f", 0, 4, form=WeightForm("bfloat16", "int8", batch_invariant=True))
    assert convert.card_from_pb(wire(make_card(shards=(shard,), announced_at=NOW)), NOW).shards == (shard,)


def test_kv_reservations_by_leader_travel():
    shard = LoadedShard("m", "f", 0, 4, kv_reserved_bytes=3 << 20,
                        kv_reservations=(KVReservation(("leader-a", "leader-b"), 1 << 20),
                                         KVReservation((), 2 << 20)))
    assert convert.card_from_pb(wire(make_card(shards=(shard,), announced_at=NOW)), NOW).shards == (shard,)


def test_a_typical_card_is_well_under_the_wire_limit():
    card = make_card(models=tuple(ModelOnDisk(f"model-{i}", "f" * 64, 32, f"/srv/models/model-{i}")
                                  for i in range(4)))
    assert convert.card_wire_size(card) < 1024 < convert.CARD_MAX_BYTES


ABSURD = {
    "negative memory": dict(memory_total_bytes=-1),
    "free above total": dict(memory_total_bytes=10, memory_free_bytes=11),
    "exabytes of memory": dict(memory_total_bytes=1 << 62, memory_free_bytes=0),
    "ttl of years": dict(ttl=3 * 365 * 86400.0),
    "zero ttl": dict(ttl=0.0),
    "future timestamp": dict(announced_at=NOW + 3600),
    "nan bandwidth": dict(memory_bandwidth_gbps=float("nan")),
    "infinite gflops": dict(matmul_gflops=float("inf")),
    "negative gflops": dict(matmul_gflops=-5.0),
    "overlong node id": dict(node_id="n" * 500),
    "node id with space": dict(node_id="a b"),
    "empty node id": dict(node_id=""),
    "control chars": dict(platform="linux\x00"),
    "address without port": dict(grpc_address="10.0.0.1"),
    "port out of range": dict(grpc_address="10.0.0.1:70000"),
    "empty layer range": dict(shards=(LoadedShard("m", "f", 5, 5),)),
    "negative layer": dict(shards=(LoadedShard("m", "f", -1, 5),)),
    "too many kv reservations": dict(shards=(LoadedShard("m", "f", 0, 5, kv_reservations=tuple(
        KVReservation((f"l{i}",), 1) for i in range(17))),)),
    "too many leaders in a reservation": dict(shards=(LoadedShard("m", "f", 0, 5, kv_reservations=(
        KVReservation(tuple(f"l{i:02d}" for i in range(17)), 1),)),)),
    "negative reservation": dict(shards=(LoadedShard("m", "f", 0, 5, kv_reservations=(
        KVReservation(("l",), -1),)),)),
    "overlong reservation leader": dict(shards=(LoadedShard("m", "f", 0, 5, kv_reservations=(
        KVReservation(("l" * 500,), 1),)),)),
    "zero layer model": dict(models=(ModelOnDisk("m", "f", 0),)),
    "too many models": dict(models=tuple(ModelOnDisk(f"m{i}", "f", 1) for i in range(65))),
    "negative link latency": dict(links=(LinkProbe(NodeId("n2"), -1e-4, 1.0),)),
    "zero link bandwidth": dict(links=(LinkProbe(NodeId("n2"), 1e-4, 0.0),)),
    "nan link latency": dict(links=(LinkProbe(NodeId("n2"), float("nan"), 1.0),)),
    "too many links": dict(links=tuple(LinkProbe(NodeId(f"n{i}"), 1e-4, 1.0) for i in range(65))),
    "oversized card": dict(models=tuple(ModelOnDisk(f"m{i}" * 20, "f" * 100, 1, "p" * 200) for i in range(40))),
}


@pytest.mark.parametrize("fields", ABSURD.values(), ids=ABSURD.keys())
def test_absurd_cards_are_refused(fields):
    fields = dict(fields)
    node_id = fields.pop("node_id", "n1")
    card = make_card(node_id, announced_at=fields.pop("announced_at", NOW), ttl=fields.pop("ttl", 30.0), **fields)
    with pytest.raises(InvalidCard):
        convert.card_from_pb(wire(card), NOW)


def test_unknown_and_repeated_roles_are_refused():
    for roles in ([99], [cluster_pb2.ROLE_STAGE, cluster_pb2.ROLE_STAGE], [cluster_pb2.ROLE_UNSPECIFIED]):
        msg = wire(make_card(announced_at=NOW))
        del msg.roles[:]
        msg.roles.extend(roles)
        with pytest.raises(InvalidCard):
            convert.card_from_pb(msg, NOW)


def test_bad_cards_are_dropped_one_by_one_and_overfull_messages_whole():
    good = [wire(make_card(f"n{i}", announced_at=NOW)) for i in range(3)]
    bad = wire(make_card("evil", announced_at=NOW, memory_total_bytes=-5))
    valid, rejected = convert.cards_from_pb([good[0], bad, good[1], good[2]], NOW)
    assert [c.node_id for c in valid] == ["n0", "n1", "n2"]
    assert len(rejected) == 1 and "evil" in str(rejected[0])
    with pytest.raises(MalformedMessage, match="limit is 512"):
        convert.cards_from_pb(good * 171, NOW)


def test_card_dataclass_fields_all_travel():
    # A field added to Card without a proto field would silently vanish on the wire.
    proto_fields = set(cluster_pb2.Card.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(make_card())} == proto_fields


def test_real_clock_card_is_accepted():
    assert convert.card_from_pb(wire(make_card()), time.time()).node_id == "n1"
