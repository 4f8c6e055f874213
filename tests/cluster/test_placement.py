"""Placement planner: pure and deterministic, so these tests run in milliseconds.

Fleets are built from real Card dataclasses; model configs are a SmolLM2-135M
shaped config, a synthetic 16-layer one and the real aidreams-260k folder,
whose safetensors sizes and engine KV allocation the budgets must match.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from meshllm.cluster.card import Card, KVReservation, LoadedShard, ModelOnDisk, NodeId, Role, WeightForm
from meshllm.cluster.cover import cover_loaded_shards
from meshllm.cluster.placement import HOP_OVERHEAD_S, PlacementRequest, plan_placement
from meshllm.cluster.stage_budget import Footprint, split_layers
from meshllm.errors import BadRequest, ContextOverflow, ShardUnavailable
from meshllm.model.config import ModelConfig

GIB = 1024**3
SMOL = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                   tie_word_embeddings=True)
SIXTEEN = ModelConfig(model_type="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=16,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def card(node_id: str, free_bytes: int, bandwidth: float = 50.0, fingerprint: str = "fp", num_layers: int = 30,
         shards: tuple[LoadedShard, ...] = (), roles: tuple[Role, ...] = (Role.STAGE,), model_id: str = "m") -> Card:
    return Card(node_id=NodeId(node_id), grpc_address=f"{node_id}.lan:7070", platform="linux-x86_64", device="cpu",
                memory_total_bytes=2 * free_bytes + GIB, memory_free_bytes=free_bytes, memory_bandwidth_gbps=bandwidth,
                matmul_gflops=100.0, models=(ModelOnDisk(model_id, fingerprint, num_layers),), shards=shards,
                roles=roles, announced_at=1000.0)


def request(config: ModelConfig = SMOL, **overrides) -> PlacementRequest:
    fields = dict(model_id="m", fingerprint="fp", config=config, context_length=2048, max_batch=1,
                  safety_margin_fraction=0.0)
    return PlacementRequest(**(fields | overrides))


def free_for(req: PlacementRequest, num_layers_held: list[int]) -> list[int]:
    """Free memory that holds exactly these layer counts at positions 0..k-1 (with a 0 safety margin)."""
    fp, k = Footprint.of(req), len(num_layers_held)
    return [fp.fixed_weights(i, k) + fp.activations(i, k) + n * fp.per_layer for i, n in enumerate(num_layers_held)]


def ranges(plan) -> list[tuple[str, int, int]]:
    return [(s.node_id, s.first_layer, s.last_layer) for s in plan.stages]


# --- greedy cover over loaded shards (pipeline-sharding-spec §5.2 / §8.1) ---------------------------

def test_reference_cover_case_picks_0_7_and_8_15_ignoring_the_overlapping_shard():
    req = request(SIXTEEN)
    shard = lambda first, last: (LoadedShard("m", "fp", first, last),)  # noqa: E731 - exclusive last
    fleet = [card("n1", 4 * GIB, num_layers=16, shards=shard(0, 8)),
             card("n2", 4 * GIB, num_layers=16, shards=shard(4, 12)),
             card("n3", 4 * GIB, num_layers=16, shards=shard(8, 16))]
    cover = cover_loaded_shards("fp", 16, fleet)
    assert [(c.card.node_id, c.shard.first_layer, c.shard.last_layer) for c in cover] == [("n1", 0, 8), ("n3", 8, 16)]
    plan = plan_placement(req, fleet)
    assert plan.reused_shards and ranges(plan) == [("n1", 0, 8), ("n3", 8, 16)]
    assert plan.stages[0].weight_bytes > plan.stages[1].weight_bytes - Footprint.of(req).lm_head  # embedding on first


def test_cover_prefers_lowest_queue_depth_and_skips_full_wrong_fingerprint_and_excluded_shards():
    def fleet(depth_a: int, depth_b: int) -> list[Card]:
        return [card("a", GIB, num_layers=16, shards=(LoadedShard("m", "fp", 0, 16, queue_depth=depth_a),)),
                card("b", GIB, num_layers=16, shards=(LoadedShard("m", "fp", 0, 16, queue_depth=depth_b),)),
                card("c", GIB, num_layers=16, shards=(LoadedShard("m", "other", 0, 16),))]
    assert [c.card.node_id for c in cover_loaded_shards("fp", 16, fleet(3, 1))] == ["b"]
    assert [c.card.node_id for c in cover_loaded_shards("fp", 16, fleet(1, 3))] == ["a"]
    assert [c.card.node_id for c in cover_loaded_shards("fp", 16, fleet(64, 3))] == ["b"]  # a is at max_streams
    assert cover_loaded_shards("fp", 16, fleet(64, 64)) is None
    assert ranges(plan_placement(request(SIXTEEN, exclude=frozenset({"b"})), fleet(3, 1))) == [("a", 0, 16)]


def test_incomplete_cover_falls_back_to_a_fresh_plan():
    fleet = [card("a", 4 * GIB, num_layers=16, shards=(LoadedShard("m", "fp", 0, 8),)),
             card("b", 4 * GIB, num_layers=16, shards=(LoadedShard("m", "fp", 4, 16),))]
    plan = plan_placement(request(SIXTEEN), fleet)
    assert not plan.reused_shards and ranges(plan) == [("a", 0, 16)]


def test_reused_shards_must_still_fit_kv_for_the_target_context():
    req = request(SIXTEEN, context_length=4096, max_batch=8)
    kv_needed = 8 * Footprint.of(req).layer_kv
    fleet = [card("a", kv_needed // 2, num_layers=16, shards=(LoadedShard("m", "fp", 0, 8),)),
             card("b", kv_needed // 2, num_layers=16, shards=(LoadedShard("m", "fp", 8, 16),)),
             card("c", 16 * GIB, num_layers=16)]
    plan = plan_placement(req, fleet)
    assert not plan.reused_shards and ranges(plan) == [("c", 0, 16)]


def test_a_replan_may_use_the_kv_its_models_plans_reserved_and_no_other_model_may():
    # A node's card leaves the KV its loaded plans may still grow into out of its free memory and
    # names it per shard. A plan of the same model takes their place (a re-plan adopts or frees
    # their KV), so that room counts for it; a plan of another model must not be placed into it.
    req = request(SIXTEEN, context_length=4096, max_batch=8)
    fp = Footprint.of(req)
    need = [8 * fp.layer_kv + fp.activations(i, 2) for i in range(2)]
    reserved = lambda first, last, kv, model="fp": (LoadedShard("m", model, first, last, kv_reserved_bytes=kv),)  # noqa: E731
    fleet = [card("a", need[0] // 2, num_layers=16, shards=reserved(0, 8, need[0] - need[0] // 2)),
             card("b", need[1] // 2, num_layers=16, shards=reserved(8, 16, need[1] - need[1] // 2)),
             card("c", 16 * GIB, num_layers=16)]
    plan = plan_placement(req, fleet)
    assert plan.reused_shards and ranges(plan) == [("a", 0, 8), ("b", 8, 16)]
    # One byte short of the room on a: a fresh plan on c instead.
    fleet[0] = card("a", need[0] // 2, num_layers=16, shards=reserved(0, 8, need[0] - need[0] // 2 - 1))
    plan = plan_placement(req, fleet)
    assert not plan.reused_shards and ranges(plan) == [("c", 0, 16)]
    # A fresh plan counts it too: the nodes hold another range of this model (the plan it replaces).
    layer = fp.per_layer
    small = [card(n, 4 * layer, num_layers=16, shards=reserved(0, 1, 8 * layer)) for n in ("a", "b")]
    assert len(plan_placement(req, small).stages) == 2
    # Another model's reservation is not room for this one.
    other = [card(n, 4 * layer, num_layers=16, shards=reserved(0, 1, 8 * layer, model="other")) for n in ("a", "b")]
    with pytest.raises(ShardUnavailable):
        plan_placement(req, other)


def test_a_leader_counts_as_free_only_the_kv_its_own_plans_reserve():
    """Two serving processes (leaders) with plans of their own over one range: a re-plan by one takes
    its own plans' place, not the other's, whose KV stays reserved (the card says whose is whose)."""
    req = request(SIXTEEN, context_length=4096, max_batch=8)
    fp = Footprint.of(req)
    need = 16 * fp.layer_kv + fp.activations(0, 1)
    free = need - need // 2  # with need // 2 more counted free, exactly what a plan on the shard needs

    def fleet(*reservations: KVReservation) -> list:
        shard = LoadedShard("m", "fp", 0, 16, kv_reserved_bytes=sum(r.bytes for r in reservations),
                            kv_reservations=reservations)
        return [card("a", free, num_layers=16, shards=(shard,))]

    as_a, as_b = dataclasses.replace(req, leader_id="leader-a"), dataclasses.replace(req, leader_id="leader-b")
    enough, short = need // 2, need // 2 - 1
    two = fleet(KVReservation(("leader-a", "leader-c"), enough), KVReservation(("leader-b",), short))
    assert plan_placement(as_a, two).reused_shards  # its lineage (shared with leader-c) reserves enough
    with pytest.raises(ShardUnavailable):
        plan_placement(as_b, two)  # its own is a byte short; leader-a's is not its room
    with pytest.raises(ShardUnavailable):
        plan_placement(dataclasses.replace(req, leader_id="leader-d"), two)  # none of it is a newcomer's
    # A planner without an id counts the range's whole reservation as free, as before cards said whose
    # it is; so does any planner on a card without them (an older node, a card trimmed to fit the wire).
    assert plan_placement(req, two).reused_shards
    older = fleet(KVReservation(("leader-a",), short), KVReservation(("leader-b",), 1))
    older[0] = dataclasses.replace(older[0], shards=tuple(dataclasses.replace(s, kv_reservations=())
                                                           for s in older[0].shards))
    assert plan_placement(as_b, older).reused_shards


def test_a_shard_loaded_in_another_dtype_is_not_reused_and_the_second_copy_is_budgeted():
    """The stage would load the weights again in the new dtype (issue 12): the plan must count that copy."""
    fp32 = request(SIXTEEN, weight_dtype_bytes=4, form=WeightForm("float32"))
    bf16 = dataclasses.replace(fp32, weight_dtype_bytes=2, form=WeightForm("bfloat16"))
    room = free_for(bf16, [16])[0]
    # `a` holds the fp32 copy (outside its free memory); its free memory holds the KV, not another copy.
    a = card("a", room - 1, num_layers=16, shards=(LoadedShard("m", "fp", 0, 16, form=WeightForm("float32")),))
    assert plan_placement(fp32, [a]).reused_shards
    with pytest.raises(ShardUnavailable):
        plan_placement(bf16, [a])
    with pytest.raises(ShardUnavailable):  # the same dtype quantized is another copy too
        plan_placement(dataclasses.replace(fp32, form=WeightForm("float32", "int8")), [a])
    b = card("b", room, num_layers=16)
    plan = plan_placement(bf16, [a, b])
    assert not plan.reused_shards and ranges(plan) == [("b", 0, 16)]
    assert plan.stages[0].weight_bytes == Footprint.of(bf16).fixed_weights(0, 1) + 16 * Footprint.of(bf16).layer_weight


# --- memory-proportional and speed-aware splits ----------------------------------------------------

def test_heterogeneous_memory_gives_proportional_ranges():
    req = request(num_stages=3)
    fleet = [card(n, f) for n, f in zip("abc", free_for(req, [15, 10, 5]))]  # room for 30 layers, 3:2:1
    assert ranges(plan_placement(req, fleet)) == [("a", 0, 15), ("b", 15, 25), ("c", 25, 30)]

    req = request(num_stages=2)
    fleet = [card(n, f) for n, f in zip("ab", free_for(req, [40, 20]))]  # twice the room needed, still 2:1
    assert ranges(plan_placement(req, fleet)) == [("a", 0, 20), ("b", 20, 30)]


def test_fewest_stages_that_fit_are_chosen_from_the_largest_nodes():
    two = free_for(request(), [22, 8])
    fleet = [card("a", two[0]), card("b", two[1]), card("c", two[1]), card("d", 2 * GIB)]
    assert ranges(plan_placement(request(), fleet)) == [("d", 0, 30)]  # one node holds it all
    fleet = fleet[:3]
    assert ranges(plan_placement(request(), fleet)) == [("a", 0, 22), ("b", 22, 30)]
    assert len(plan_placement(request(num_stages=3), fleet).stages) == 3  # more when asked


def test_faster_node_gets_more_layers_but_never_more_than_fit():
    req = request(num_stages=2)
    even = free_for(req, [30, 30])
    plan = plan_placement(req, [card("a", even[0], bandwidth=200.0), card("b", even[1], bandwidth=100.0)])
    assert ranges(plan) == [("a", 0, 20), ("b", 20, 30)]
    tight = free_for(req, [12, 30])
    plan = plan_placement(req, [card("a", tight[0], bandwidth=1000.0), card("b", tight[1], bandwidth=10.0)])
    assert ranges(plan) == [("a", 0, 12), ("b", 12, 30)]


def test_split_layers_respects_caps_minimum_and_total():
    assert split_layers(10, [10, 10, 10], [1.0, 1.0, 1.0]) == [4, 3, 3]
    assert split_layers(10, [1, 20], [1000.0, 1.0]) == [1, 9]
    assert split_layers(3, [5, 5, 5], [100.0, 1.0, 1.0]) == [1, 1, 1]
    assert split_layers(80, [3] * 20 + [100], [1.0] * 21) == [3] * 20 + [20]


# --- errors -------------------------------------------------------------------------------------

def test_context_that_cannot_fit_raises_shard_unavailable_with_the_exact_missing_bytes():
    req = request(context_length=8192, max_batch=4)
    fleet = [card("a", 400 * 1024**2), card("b", 300 * 1024**2)]
    with pytest.raises(ShardUnavailable) as raised:
        plan_placement(req, fleet)
    e = raised.value
    assert e.code == "shard_unavailable" and e.missing_bytes > 0 and e.part.startswith("layers ")
    assert f"({e.missing_bytes} bytes) missing for {e.part}" in str(e) and "lower --context" in str(e)
    assert "KV for 8192 tokens × batch 4" in str(e) and "2 candidate nodes" in str(e)
    # Exactly that much more memory on one node makes it fit; one byte less does not.
    one = [card("a", 400 * 1024**2)]
    with pytest.raises(ShardUnavailable) as raised:
        plan_placement(req, one)
    missing = raised.value.missing_bytes
    assert raised.value.part.endswith("-29")
    with pytest.raises(ShardUnavailable):
        plan_placement(req, [card("a", 400 * 1024**2 + missing - 1)])
    assert ranges(plan_placement(req, [card("a", 400 * 1024**2 + missing)])) == [("a", 0, 30)]


def test_no_node_with_the_weights_is_a_clear_error():
    with pytest.raises(ShardUnavailable, match="different weights"):
        plan_placement(request(), [card("a", 8 * GIB, fingerprint="other")])
    with pytest.raises(ShardUnavailable, match="has m .* on disk"):
        plan_placement(request(), [card("a", 8 * GIB, roles=(Role.PROPOSER,)), card("b", 8 * GIB, num_layers=16)])
    with pytest.raises(ShardUnavailable, match="excluded"):
        plan_placement(request(exclude=frozenset({NodeId("a")})), [card("a", 8 * GIB)])
    with pytest.raises(ShardUnavailable, match="Lower --stages"):
        plan_placement(request(num_stages=3), [card("a", 8 * GIB), card("b", 8 * GIB)])


def test_malformed_requests_are_named_errors():
    with pytest.raises(ContextOverflow, match="max_position_embeddings 8192"):
        request(context_length=8193)
    with pytest.raises(BadRequest, match="max_batch"):
        request(max_batch=0)
    with pytest.raises(BadRequest, match="stages"):
        request(num_stages=0)


# --- estimate and real-model budgets ---------------------------------------------------------------

def test_tokens_per_s_is_memory_bound_sum_over_stages_plus_hops():
    req = request(context_length=4096, max_batch=2, num_stages=2)
    fleet = [card("a", 2 * GIB, bandwidth=100.0), card("b", 2 * GIB, bandwidth=50.0)]
    plan = plan_placement(req, fleet)
    kv_per_layer = SMOL.kv_bytes_per_token(2, 1) * 4096 * 2
    head = SMOL.vocab_size * SMOL.hidden_size * 2 + SMOL.hidden_size * 2
    seconds = 3 * HOP_OVERHEAD_S
    for stage, bandwidth in zip(plan.stages, (100e9, 50e9)):
        read = stage.num_layers * (SMOL.layer_parameters() * 2 + kv_per_layer) + (head if stage.node_id == "b" else 0)
        seconds += read / bandwidth
    assert plan.est_tokens_per_s == pytest.approx(1 / seconds)
    faster = plan_placement(req, [dataclasses.replace(c, memory_bandwidth_gbps=400.0) for c in fleet])
    assert faster.est_tokens_per_s > plan.est_tokens_per_s


def test_budgets_match_the_real_model_files_and_the_engine_kv_cache(aidreams_path):
    from safetensors import safe_open

    from meshllm.model.loader import name_map

    config = ModelConfig.from_folder(aidreams_path)
    with safe_open(aidreams_path / "model.safetensors", "pt") as f:
        numel = {name: math.prod(f.get_slice(name).get_shape()) for name in f.keys()}
    req = request(config, context_length=128, max_batch=1, weight_dtype_bytes=4, kv_dtype_bytes=4)
    for num_stages in (1, 2, 3):
        plan = plan_placement(dataclasses.replace(req, num_stages=num_stages),
                              [card(n, 64 * 1024**2, num_layers=4) for n in "abc"])
        assert plan.stages[-1].last_layer == 4
        for stage in plan.stages:
            hf_names = {n for names in name_map(config, stage.first_layer, stage.last_layer).values() for n in names}
            assert stage.weight_bytes == 4 * sum(numel[n] for n in hf_names)

    import torch

    from meshllm.engine.kv_cache import KVLayout, SequenceKV
    stage = plan_placement(req, [card("a", 64 * 1024**2, num_layers=4)]).stages[0]
    kv = SequenceKV(KVLayout(stage.num_layers, config.num_key_value_heads, config.head_dim, torch.float32))
    kv.reserve(128)
    assert kv.k.nbytes + kv.v.nbytes == stage.kv_bytes


# --- determinism and invariants over random fleets --------------------------------------------------

# Up to 500 MiB a node: SmolLM2 at these contexts needs 1 to 8 stages, or does not fit at all.
fleets = st.lists(st.tuples(st.integers(0, 500 * 1024**2), st.floats(0.0, 400.0), st.booleans()), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(fleet_spec=fleets, context=st.sampled_from([512, 2048, 8192]), batch=st.integers(1, 8),
       stages=st.one_of(st.none(), st.integers(1, 4)), seed=st.randoms(use_true_random=False))
def test_same_inputs_give_the_same_valid_plan_in_any_fleet_order(fleet_spec, context, batch, stages, seed):
    req = request(context_length=context, max_batch=batch, num_stages=stages, safety_margin_fraction=0.1)
    fleet = [card(f"node-{i:02d}", free, bw, fingerprint="fp" if has else "other")
             for i, (free, bw, has) in enumerate(fleet_spec)]
    shuffled = list(fleet)
    seed.shuffle(shuffled)
    try:
        plan = plan_placement(req, fleet)
    except ShardUnavailable as e:
        with pytest.raises(ShardUnavailable) as again:
            plan_placement(req, shuffled)
        assert str(again.value) == str(e)
        return
    assert plan_placement(req, shuffled) == plan
    by_id = {c.node_id: c for c in fleet}
    assert plan.stages[0].first_layer == 0 and plan.stages[-1].last_layer == 30
    assert len({s.node_id for s in plan.stages}) == len(plan.stages)
    for before, after in zip(plan.stages, plan.stages[1:]):
        assert before.last_layer == after.first_layer
    for s in plan.stages:
        assert s.num_layers >= 1 and by_id[s.node_id].models[0].fingerprint == "fp"
        assert s.budget_bytes <= int(by_id[s.node_id].memory_free_bytes * 0.9)
    if stages is None and len(plan.stages) > 1:  # fewest: one stage fewer does not fit
        with pytest.raises(ShardUnavailable):
            plan_placement(dataclasses.replace(req, num_stages=len(plan.stages) - 1), fleet)


def test_duplicate_cards_of_a_node_resolve_to_the_newest_in_any_order():
    old = card("a", 100 * 1024**2)
    new = dataclasses.replace(old, memory_free_bytes=2 * GIB, announced_at=old.announced_at + 5)
    for fleet in ([old, new], [new, old]):
        plan = plan_placement(request(), fleet)
        assert ranges(plan) == [("a", 0, 30)]


# --- real bytes: quantized weights as held (WeightBytes) ---------------------------------------------

def test_quantized_weight_bytes_replace_parameters_times_dtype_bytes():
    from meshllm.cluster.stage_budget import WeightBytes

    q4 = WeightBytes(layer=2_216_448, embedding=30_081_024, final_norm=2_304, lm_head=30_081_024)  # SmolLM2 Q4_1
    dense, quantized = request(weight_dtype_bytes=2), request(weight_dtype_bytes=2, weight_bytes=q4)
    fp = Footprint.of(quantized)
    assert (fp.layer_weight, fp.embedding, fp.lm_head) == (q4.layer, q4.embedding, q4.lm_head)
    # A node that holds the Q4_1 model but not its 16-bit dequantization: only real bytes plan it.
    free = free_for(quantized, [30])[0]
    assert free < free_for(dense, [30])[0]
    plan = plan_placement(quantized, [card("a", free)])
    assert ranges(plan) == [("a", 0, 30)] and plan.stages[0].weight_bytes == 30 * q4.layer + q4.embedding + q4.final_norm
    with pytest.raises(ShardUnavailable):
        plan_placement(dense, [card("a", free)])
    assert plan_placement(quantized, [card("a", free)]) == plan  # still a pure function


def test_held_weight_bytes_of_the_q4_1_gguf_are_what_a_stage_holds(smollm2_gguf_path):
    """About the file's size: the blocks as stored, the Q4_1 layers as Q4_0 blocks plus a per-block
    remainder (ggml_weights.split_q4_1), budgeted in float32 (10% over the file's 20 bytes a block),
    what a loaded stage holds at most: it holds 118 of its 120 matrices' in float16."""
    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.stage_weights import decoder_bytes, held_weight_bytes, load_stage_decoder
    from meshllm.model.source import open_model

    if runtime() is None:
        pytest.skip("ggml is not built here: GGUF weights are dequantized, parameters x dtype bytes is right")
    files = open_model(smollm2_gguf_path)
    held = held_weight_bytes(files.source, files.config, dtype_bytes=4)
    total = files.config.num_hidden_layers * held.layer + held.embedding + held.final_norm  # tied head: no copy
    assert 0.95 < total / smollm2_gguf_path.stat().st_size < 1.1
    assert held.lm_head == held.embedding  # tied: the same Q8_0 table
    stage = load_stage_decoder(files.source, files.config, dtype=torch.float32)
    assert 0.9 * total < decoder_bytes(stage) <= total


def test_a_cpu_first_stage_that_reads_embedding_rows_from_the_file_is_not_charged_for_the_table():
    """A CPU stage whose head does not share the embedding reads its rows from the GGUF at each
    lookup (stage_weights._embedding_in_file), so the planner does not charge it for the table; a
    device stage holds the table, and so does a single stage that multiplies it as its tied head."""
    from meshllm.cluster.stage_budget import WeightBytes

    q4 = WeightBytes(layer=2_216_448, embedding=30_081_024, final_norm=2_304, lm_head=30_081_024,
                     embedding_in_file=True)
    fp = Footprint.of(request(weight_dtype_bytes=2, weight_bytes=q4))
    cpu = card("a", GIB)
    gpu = dataclasses.replace(cpu, device="cuda:0")
    assert fp.fixed_weights(0, 2, cpu.device) == 0
    assert fp.fixed_weights(0, 2, gpu.device) == q4.embedding
    assert fp.fixed_weights(0, 2) == q4.embedding  # no device known: the safe side
    assert fp.fixed_weights(0, 1, cpu.device) == q4.embedding + q4.final_norm  # tied head on the same stage
    assert fp.capacity_layers(cpu, 0, 2, 0.0) > fp.capacity_layers(gpu, 0, 2, 0.0)
    # A placement error names what was counted: no table on the CPU stage, the table on the device's.
    assert fp.fixed_part_name(0, 2, cpu.device) == "activations"
    assert fp.fixed_part_name(0, 2, gpu.device) == "embedding + activations"
    assert fp.fixed_part_name(0, 1, cpu.device) == "embedding + LM head + activations"
    held = dataclasses.replace(q4, embedding_in_file=False)
    assert Footprint.of(request(weight_dtype_bytes=2, weight_bytes=held)).fixed_weights(0, 2, cpu.device) == q4.embedding
    # Through the planner: the first stage's weights on a CPU node leave the table out, on a device not.
    req = request(weight_dtype_bytes=2, weight_bytes=q4, num_stages=2)
    fleets = {"cpu": [card("a", GIB), card("b", GIB)],
              "gpu": [dataclasses.replace(card("a", GIB), device="cuda:0"), card("b", GIB)]}
    plans = {kind: plan_placement(req, fleet) for kind, fleet in fleets.items()}
    for kind, plan in plans.items():
        first = plan.stages[0]
        assert first.node_id == "a"
        assert first.weight_bytes == first.num_layers * q4.layer + (q4.embedding if kind == "gpu" else 0)
    # Tensor-parallel ranks hold dense slices of the table, read from no file.
    assert fp.per_rank(SMOL, 2).fixed_weights(0, 2, cpu.device) == fp.per_rank(SMOL, 2).embedding > 0


def test_a_first_stage_of_the_q4_1_gguf_holds_no_embedding_table(smollm2_gguf_path):
    """What the budget above assumes, on real weights: a first stage of SmolLM2 Q4_1 (its Q8_0 table
    tied to a head the stage does not hold) holds its layers and none of the table (the layers
    budgeted with float32 remainders, held mostly in float16: at most the budget, within 10%)."""
    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.stage_weights import decoder_bytes, held_weight_bytes, load_stage_decoder
    from meshllm.model.source import open_model

    if runtime() is None:
        pytest.skip("ggml is not built here: GGUF weights are dequantized and the table is held")
    files = open_model(smollm2_gguf_path)
    held = held_weight_bytes(files.source, files.config, dtype_bytes=4)
    assert held.embedding_in_file
    stage = load_stage_decoder(files.source, files.config, 0, 10, dtype=torch.float32)
    assert 0.9 * 10 * held.layer < decoder_bytes(stage) <= 10 * held.layer


def test_a_cpu_node_checks_a_first_stage_load_without_the_table_it_will_not_hold(smollm2_gguf_path, monkeypatch):
    """The node's own memory check before reading a range agrees with the planner: on a CPU node a
    first stage of SmolLM2 Q4_1 needs its layers only; on a device, or with the tied head beside it,
    the table too."""
    from types import SimpleNamespace

    from meshllm.engine.ggml_lib import runtime
    from meshllm.engine.stage_weights import held_weight_bytes
    from meshllm.errors import ShardUnavailable
    from meshllm.model.source import open_model
    from meshllm.pipeline import stage_control
    from meshllm.transport.protos import stage_pb2

    if runtime() is None:
        pytest.skip("ggml is not built here: GGUF weights are dequantized and the table is held")
    files = open_model(smollm2_gguf_path)
    held = held_weight_bytes(files.source, files.config, dtype_bytes=4)
    monkeypatch.setattr(stage_control.psutil, "virtual_memory", lambda: SimpleNamespace(available=0))

    def need(first: int, last: int, device: str) -> int:
        with pytest.raises(ShardUnavailable) as refused:
            stage_control._check_memory(files, stage_pb2.LoadRequest(first_layer=first, last_layer=last), 4, 0, device)
        return refused.value.missing_bytes

    assert need(0, 10, "cpu") == 10 * held.layer
    assert need(0, 10, "cuda:0") == 10 * held.layer + held.embedding
    # The whole model: the tied head multiplies the table, held once (it was counted twice).
    assert need(0, 30, "cpu") == need(0, 30, "cuda:0") == 30 * held.layer + held.embedding
