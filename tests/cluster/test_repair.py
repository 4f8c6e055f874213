"""Repairing a plan that lost a stage: pure, like the planner."""

from __future__ import annotations

from dataclasses import replace

from meshllm.cluster.card import NodeId
from meshllm.cluster.placement import plan_placement
from meshllm.cluster.repair import replace_failed_stage
from tests.cluster.test_placement import GIB, SIXTEEN, card, request


def test_the_failed_stage_moves_to_the_roomiest_spare_and_the_others_keep_their_ranges():
    req = request(SIXTEEN, context_length=1024, max_batch=1, num_stages=3)
    fleet = [card(n, 4 * GIB, num_layers=16) for n in ("a", "b", "c")]
    plan = plan_placement(req, fleet)
    spares = [card("d", 2 * GIB, num_layers=16), card("e", 3 * GIB, num_layers=16)]
    failed = plan.stages[1].node_id
    repaired = replace_failed_stage(plan, failed, replace(req, exclude=frozenset({failed})), fleet + spares)
    assert [s.node_id for s in repaired.stages] == [plan.stages[0].node_id, "e", plan.stages[2].node_id]
    assert [(s.first_layer, s.last_layer) for s in repaired.stages] == \
        [(s.first_layer, s.last_layer) for s in plan.stages]
    assert repaired.stages[1].address == "e.lan:7070" and not repaired.reused_shards


def test_no_repair_without_a_spare_that_can_hold_the_range_or_has_the_weights():
    req = request(SIXTEEN, context_length=1024, max_batch=1, num_stages=2)
    fleet = [card(n, 4 * GIB, num_layers=16) for n in ("a", "b")]
    plan = plan_placement(req, fleet)
    failed = plan.stages[0].node_id
    tiny = card("c", 1024, num_layers=16)  # far too little memory
    other_weights = card("d", 8 * GIB, num_layers=16, fingerprint="other")
    assert replace_failed_stage(plan, failed, req, fleet + [tiny, other_weights]) is None
    assert replace_failed_stage(plan, NodeId("not-in-plan"), req, fleet + [card("e", 8 * GIB, num_layers=16)]) is None
    excluded = replace(req, exclude=frozenset({"e"}))
    assert replace_failed_stage(plan, failed, excluded, fleet + [card("e", 8 * GIB, num_layers=16)]) is None


def test_a_failed_rank_of_a_group_is_replaced_by_a_spare_that_takes_part_in_tensor_parallelism():
    from tests.cluster.test_placement_tp import node, request as tp_request

    req = tp_request(tensor_parallel=2)
    plan = plan_placement(req, [node("a"), node("b")])
    [stage] = plan.stages
    assert stage.node_ids == ("a", "b")
    no_endpoint, spare = node("c", endpoint=False), node("d")
    # A worker fails: the spare becomes that rank; rank 0 and its store stay.
    repaired = replace_failed_stage(plan, NodeId("b"), replace(req, exclude=frozenset({"b"})),
                                    [node("a"), no_endpoint, spare])
    [fixed] = repaired.stages
    assert fixed.node_ids == ("a", "d") and fixed.collective_endpoint == "a.lan:29500"
    assert (fixed.first_layer, fixed.last_layer, fixed.budget_bytes) == \
        (stage.first_layer, stage.last_layer, stage.budget_bytes)
    # Rank 0 fails: the spare is rank 0, and its store is the group's rendezvous point.
    repaired = replace_failed_stage(plan, NodeId("a"), replace(req, exclude=frozenset({"a"})),
                                    [node("b"), spare])
    [fixed] = repaired.stages
    assert fixed.node_ids == ("d", "b") and fixed.address == "d.lan:7070"
    assert fixed.collective_endpoint == "d.lan:29500"
    # A spare that takes no part in tensor parallelism cannot join the group.
    assert replace_failed_stage(plan, NodeId("b"), req, [node("a"), no_endpoint]) is None


def test_a_device_spare_for_a_cpu_first_stage_must_also_hold_the_embedding_table():
    """A CPU first stage reads its embedding rows from the file, so its budget leaves the table out
    (stage_budget.Footprint.fixed_weights); a device spare holds the table and must have room for it."""
    from meshllm.cluster.stage_budget import WeightBytes

    table = 30_081_024
    held = WeightBytes(layer=2_216_448, embedding=table, final_norm=2_304, lm_head=table, embedding_in_file=True)
    req = request(weight_dtype_bytes=2, weight_bytes=held, num_stages=2)
    fleet = [card(n, GIB, num_layers=30) for n in ("a", "b")]
    plan = plan_placement(req, fleet)
    first = plan.stages[0]
    gpu = replace(card("g", first.budget_bytes, num_layers=30), device="cuda:0")
    assert replace_failed_stage(plan, first.node_id, req, fleet + [gpu]) is None  # no room for the table
    roomy = replace(card("g", first.budget_bytes + table, num_layers=30), device="cuda:0")
    repaired = replace_failed_stage(plan, first.node_id, req, fleet + [roomy])
    assert repaired.stages[0].node_id == "g" and repaired.stages[0].weight_bytes == first.weight_bytes + table
    cpu = card("c", first.budget_bytes, num_layers=30)  # another CPU node: the same budget fits
    repaired = replace_failed_stage(plan, first.node_id, req, fleet + [cpu])
    assert repaired.stages[0].node_id == "c" and repaired.stages[0].weight_bytes == first.weight_bytes
