"""The planner's tensor-parallel groups: asked for (--tp N) or chosen by the measured link's
cost model; pure, so these run in milliseconds."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from meshllm.cluster.card import Card, LinkProbe, ModelOnDisk, NodeId, Role
from meshllm.cluster.placement import PlacementRequest, plan_placement
from meshllm.cluster.stage_budget import Footprint
from meshllm.cluster.tp_cost import COMMAND_FRAME_BYTES, UNMEASURED_LINK, estimate, group_link
from meshllm.errors import ShardUnavailable, TensorParallelUnsplittable
from meshllm.model.config import ModelConfig

GIB = 1024**3
# A Llama-2-7B shaped model: 32 layers, 32 heads; 13 GB of fp16 weights.
LLAMA7B = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, head_dim=128,
                      max_position_embeddings=4096)
FAST = (20e-6, 10.0)  # a Thunderbolt-class link: 20 us all-reduces, 10 GB/s
SLOW = (5e-3, 0.05)  # a busy Wi-Fi: 5 ms all-reduces


def node(name: str, free_gib: float = 64, bandwidth: float = 50.0, endpoint: bool = True,
         links: dict[str, tuple[float, float]] | None = None) -> Card:
    return Card(node_id=NodeId(name), grpc_address=f"{name}.lan:7070", platform="linux-x86_64", device="cpu",
                memory_total_bytes=int(2 * free_gib * GIB), memory_free_bytes=int(free_gib * GIB),
                memory_bandwidth_gbps=bandwidth, matmul_gflops=500.0,
                models=(ModelOnDisk("m", "fp", LLAMA7B.num_hidden_layers),), roles=(Role.STAGE,),
                collective_endpoint=f"{name}.lan:29500" if endpoint else None,
                links=tuple(LinkProbe(NodeId(p), lat, bw) for p, (lat, bw) in (links or {}).items()),
                announced_at=1000.0)


def request(config: ModelConfig = LLAMA7B, **overrides) -> PlacementRequest:
    fields = dict(model_id="m", fingerprint="fp", config=config, context_length=4096, max_batch=1,
                  safety_margin_fraction=0.0)
    return PlacementRequest(**(fields | overrides))


def test_asked_for_group_splits_every_layer_and_halves_each_budget():
    fleet = [node("a"), node("b")]
    plan = plan_placement(request(tensor_parallel=2), fleet)
    [stage] = plan.stages
    assert (stage.node_id, [w.node_id for w in stage.workers]) == ("a", ["b"])
    assert stage.collective_endpoint == "a.lan:29500" and stage.tp.size == 2
    alone = plan_placement(request(tensor_parallel=1, num_stages=1), fleet).stages[0]
    assert alone.workers == () and alone.tp is None
    # Each rank holds half of every layer, of the KV heads and of the vocabulary rows.
    assert stage.weight_bytes == pytest.approx(alone.weight_bytes / 2, rel=0.001)
    assert stage.kv_bytes == alone.kv_bytes // 2
    # Asked for, the group is used even over an unmeasured (assumed slow) link.
    assert not stage.tp.link.measured and stage.tp.link.latency_s == UNMEASURED_LINK.latency_s


def test_asked_for_groups_form_every_stage_of_a_pipeline():
    fleet = [node(n, free_gib=5) for n in "abcd"]  # 13 GB of weights: two groups of two
    plan = plan_placement(request(tensor_parallel=2), fleet)
    assert [s.node_ids for s in plan.stages] == [("a", "b"), ("c", "d")] or len(plan.stages) == 2
    assert {n for s in plan.stages for n in s.node_ids} == set("abcd")
    assert sum(s.num_layers for s in plan.stages) == 32


def test_counts_that_cannot_split_are_refused_by_name():
    with pytest.raises(TensorParallelUnsplittable, match="32 attention heads do not divide by 3"):
        request(tensor_parallel=3)


def test_a_group_needs_collective_endpoints():
    with pytest.raises(ShardUnavailable, match="--collective-port"):
        plan_placement(request(tensor_parallel=2), [node("a"), node("b", endpoint=False)])


def test_a_fast_link_makes_the_planner_group_and_a_slow_one_keeps_one_node():
    fast = plan_placement(request(), [node("a", links={"b": FAST}), node("b")])
    slow = plan_placement(request(), [node("a", links={"b": SLOW}), node("b")])
    assert fast.stages[0].workers and fast.stages[0].tp.pays and fast.stages[0].tp.link.measured
    assert not slow.stages[0].workers
    # The considered group's prediction says why: 67 collectives of ~5 ms cost more than the half
    # of the 7B model's compute the split saves.
    assert slow.tp_candidate is not None and not slow.tp_candidate.pays
    assert slow.tp_candidate.collective_s > slow.tp_candidate.saved_s
    assert fast.est_tokens_per_s > slow.est_tokens_per_s


def test_unmeasured_links_never_group_on_their_own():
    plan = plan_placement(request(), [node("a"), node("b")])
    assert not plan.stages[0].workers and plan.tp_candidate is None


def test_memory_pooling_picks_the_faster_of_pipeline_and_group():
    # Neither node holds the model alone: a 2-stage pipeline or a group of 2 both fit.
    fleet = [node("a", free_gib=10, links={"b": FAST}), node("b", free_gib=10)]
    plan = plan_placement(request(), fleet)
    assert len(plan.stages) == 1 and plan.stages[0].tp_size == 2
    piped = plan_placement(request(tensor_parallel=1), fleet)
    assert len(piped.stages) == 2 and plan.est_tokens_per_s > piped.est_tokens_per_s


def test_the_group_is_built_from_the_fastest_links():
    links = {"a": dict(b=SLOW, c=FAST, d=SLOW)}
    fleet = [node(n, links=links.get(n)) for n in "abcd"]
    plan = plan_placement(request(tensor_parallel=2, num_stages=1), fleet)
    assert plan.stages[0].node_ids == ("a", "c")


def test_same_fleet_in_any_order_gives_the_same_plan():
    fleet = [node("a", links={"b": FAST, "c": FAST}), node("b", links={"c": FAST}), node("c"), node("d")]
    plans = {plan_placement(request(), list(order)) for order in itertools.permutations(fleet)}
    assert len(plans) == 1


def test_cost_model_arithmetic():
    config, req = LLAMA7B, request()
    fp = Footprint.of(req)
    a, b = node("a", links={"b": FAST}), node("b")
    est = estimate(config, fp, [a, b], [50.0, 50.0], 0, 1, 32, 1, 4096, 2)
    layer_read = fp.per_layer
    head = fp.final_norm + fp.lm_head
    assert est.compute_s_alone == pytest.approx((32 * layer_read + head) / 50e9)
    assert est.compute_s_split == pytest.approx((32 * layer_read + head) // 2 / 50e9)
    link = group_link([a, b])
    message = 4096 * 2  # one sequence's hidden state in 2-byte activations
    want = (2 * 32 + 1) * (FAST[0] + message / (FAST[1] * 1e9))  # layers' all-reduces + the embedding's
    want += FAST[0] + COMMAND_FRAME_BYTES / (FAST[1] * 1e9)  # the step command
    want += FAST[0] + 1 * 16000 * 4 / (FAST[1] * 1e9)  # rank 1's half of the logits to rank 0
    assert link.measured and est.collective_s == pytest.approx(want)
    assert est.num_collectives == 2 * 32 + 3


def test_per_rank_footprint_replicates_kv_heads_when_fewer_than_ranks():
    gqa = dataclasses.replace(LLAMA7B, num_key_value_heads=2)
    fp = Footprint.of(request(gqa))
    assert fp.per_rank(gqa, 2).layer_kv == fp.layer_kv // 2
    assert fp.per_rank(gqa, 4).layer_kv == fp.layer_kv // 2  # one of two KV heads each
    assert fp.per_rank(gqa, 4).layer_weight == -(-fp.layer_weight // 4)
