"""Placement planner: which node runs which contiguous range of a model's layers.

A pure function of (request, fleet view): no I/O, no clock, no randomness, so
every node derives the same plan from the same view and nobody negotiates.
Per node it budgets weights + KV cache for the target context and batch +
activation headroom within the node's free memory less a safety margin
(high-context-cluster-notes: budget the full context up front, not what fits
today). A plan first reuses shards already loaded (cover.py), else splits the
layers over the fewest nodes that fit.

A stage may be a tensor-parallel group of nodes (tp/): asked for with
`tensor_parallel=N`, or chosen when the nodes' measured links make the two
all-reduces per layer cheaper than the compute the split saves (tp_cost.py);
the pipeline plan and the grouped one are compared by estimated tokens/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from meshllm.cluster.card import Card, NodeId, Role, WeightForm
from meshllm.cluster.cover import cover_loaded_shards
from meshllm.cluster.registry import newer
from meshllm.cluster.stage_budget import Footprint, WeightBytes, split_layers, usable_bytes
from meshllm.cluster.tp_cost import TPEstimate, estimate
from meshllm.cluster.tp_groups import form_groups, requested_groups, splits
from meshllm.errors import BadRequest, ContextOverflow, ShardUnavailable
from meshllm.model.config import ModelConfig
from meshllm.tp.shard import check_splittable

# Per network hop per decode step: one small gRPC message on a LAN, (de)serialisation included.
HOP_OVERHEAD_S = 0.002
# Stands in for a card that reports no bandwidth (not measured yet): slow, so it is not favoured.
UNMEASURED_BANDWIDTH_GBPS = 1.0
GIB = 1024**3
# A grouped plan replaces the pipeline one only when it is predicted this much faster: below
# that, measurement noise in the cards would flip plans back and forth.
TP_MIN_GAIN = 0.05


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    model_id: str
    fingerprint: str  # weights fingerprint; only nodes with these exact weights are candidates
    config: ModelConfig
    context_length: int  # tokens per sequence; KV is budgeted for all of them
    max_batch: int  # sequences decoding at once
    weight_dtype_bytes: int = 2
    kv_dtype_bytes: int = 2
    num_stages: int | None = None  # None = the fewest stages that fit
    safety_margin_fraction: float = 0.1  # of each node's free memory, never planned for
    exclude: frozenset[NodeId] = frozenset()  # nodes to leave out (failed ones when re-planning)
    prefill_chunk_tokens: int = 512  # tokens per prefill chunk; sizes the activation headroom
    # Real bytes of the weights as stages hold them (quantized GGUF blocks, --quantize); None:
    # every parameter takes weight_dtype_bytes.
    weight_bytes: WeightBytes | None = None
    # How the stages will hold the weights: a loaded shard in another form is not reused (its node
    # would load a second copy), so the plan budgets that copy like any fresh load.
    form: WeightForm = WeightForm()
    prefix_cache_tokens: int = 0  # prompt KV each stage keeps for reuse (the leader's prefix cache), budgeted too
    # Nodes per stage: None groups nodes whose measured link makes it pay, 1 never groups, N > 1
    # makes every stage a tensor-parallel group of N (--tp N).
    tensor_parallel: int | None = None
    # The planning leader (its node id, as it names itself to the stages): the KV its own plans
    # reserve on a node counts as free for its re-plan, other leaders' does not. "": unknown, so
    # every reservation of the model counts as free, as before cards said whose it is.
    leader_id: str = ""

    def __post_init__(self):
        for name in ("context_length", "max_batch", "weight_dtype_bytes", "kv_dtype_bytes", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise BadRequest(f"placement {name} must be at least 1, got {getattr(self, name)}")
        if self.prefix_cache_tokens < 0:
            raise BadRequest(f"placement prefix_cache_tokens must be non-negative, got {self.prefix_cache_tokens}")
        if self.num_stages is not None and self.num_stages < 1:
            raise BadRequest(f"--stages must be at least 1 (or left out for the fewest that fit), got {self.num_stages}")
        if self.tensor_parallel is not None:
            if self.tensor_parallel < 1:
                raise BadRequest(f"--tp must be at least 1 (or left out to decide by link speed), "
                                 f"got {self.tensor_parallel}")
            check_splittable(self.config, self.tensor_parallel)
        if not 0.0 <= self.safety_margin_fraction < 1.0:
            raise BadRequest(f"safety_margin_fraction must be in [0, 1), got {self.safety_margin_fraction}")
        if self.context_length > self.config.max_position_embeddings:
            raise ContextOverflow(
                f"context {self.context_length} exceeds {self.model_id}'s max_position_embeddings "
                f"{self.config.max_position_embeddings}; lower --context")


@dataclass(frozen=True, slots=True)
class GroupMember:
    """A non-zero rank of a tensor-parallel stage."""

    node_id: NodeId
    address: str  # its gRPC host:port (the leader loads it there)


@dataclass(frozen=True, slots=True)
class StageAssignment:
    node_id: NodeId  # the node (rank 0 of a group) that speaks the pipeline's protocol
    address: str  # the node's gRPC host:port
    first_layer: int  # inclusive
    last_layer: int  # exclusive
    # Per node (per rank of a group):
    weight_bytes: int  # its layers, + embedding on the first stage, + final norm and LM head on the last
    kv_bytes: int  # KV cache of its layers for context_length × max_batch, and the prefix cache
    activation_bytes: int  # working memory of one step (prefill chunk or decode batch)
    workers: tuple[GroupMember, ...] = ()  # ranks 1.. of a tensor-parallel group; () for one node
    collective_endpoint: str | None = None  # rank 0's rendezvous store, for a group
    tp: TPEstimate | None = None  # the cost model's prediction, for a group

    @property
    def num_layers(self) -> int:
        return self.last_layer - self.first_layer

    @property
    def tp_size(self) -> int:
        return 1 + len(self.workers)

    @property
    def node_ids(self) -> tuple[NodeId, ...]:
        return (self.node_id, *(w.node_id for w in self.workers))

    @property
    def budget_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes + self.activation_bytes


@dataclass(frozen=True, slots=True)
class Plan:
    model_id: str
    fingerprint: str
    num_layers: int
    context_length: int
    max_batch: int
    weight_dtype_bytes: int
    kv_dtype_bytes: int
    stages: tuple[StageAssignment, ...]  # in pipeline order; ranges are contiguous and cover all layers
    # Decode tokens/s of one sequence while max_batch sequences at the full context decode together,
    # without pipeline interleaving: a floor, not a promise (see _estimate_tokens_per_s).
    est_tokens_per_s: float
    reused_shards: bool  # True when every stage is a shard already loaded
    # Deciding by link speed: the best group considered but not used (its prediction says why).
    tp_candidate: TPEstimate | None = None


def plan_placement(request: PlacementRequest, fleet: Sequence[Card]) -> Plan:
    """The plan for `request` on `fleet`; raises ShardUnavailable naming what does not fit.

    Called by the leader on each (re)plan and by `meshllm plan`. Same request and
    same set of cards (in any order) give the same plan on every node.
    """
    footprint = Footprint.of(request)
    stage_nodes = [_reserved_kv_counted_free(c, request.fingerprint, request.leader_id)
                   for c in _unique_by_node(fleet) if Role.STAGE in c.roles and c.node_id not in request.exclude]
    reused = _plan_on_loaded_shards(request, footprint, stage_nodes)
    if reused is not None:
        return reused
    candidates = [c for c in stage_nodes if _has_weights(c, request)]
    if not candidates:
        raise _no_candidates(request, fleet)
    return _plan_fresh(request, footprint, candidates)


def bandwidth_gbps(card: Card) -> float:
    return card.memory_bandwidth_gbps if card.memory_bandwidth_gbps > 0 else UNMEASURED_BANDWIDTH_GBPS


def _unique_by_node(fleet: Sequence[Card]) -> list[Card]:
    # A view should hold one card per node; if not, the registry's rule picks the winner. Sorted by
    # node_id: every node must derive the same plan from the same view, whatever its order.
    newest: dict[str, Card] = {}
    for card in fleet:
        current = newest.get(card.node_id)
        newest[card.node_id] = card if current is None else newer(current, card)
    return [newest[node_id] for node_id in sorted(newest)]


def _reserved_kv_counted_free(card: Card, fingerprint: str, leader_id: str = "") -> Card:
    """`card` with the KV its plans of this model reserve for `leader_id`'s lineage counted as free.
    A card's free memory leaves out the KV its loaded plans may still grow into, so that no other
    plan is placed into it; this leader's re-plan (after a failure, or over more nodes) takes its own
    plans' place: they are unloaded once it is deployed, their KV adopted or freed. Another leader's
    plans stay (two serving processes with plans of their own): their KV stays reserved. A card
    without reservations by lineage (an older node, a card trimmed to fit the wire), or a planner
    that gives no id, counts every reservation of the model as free, as before; the node's own check
    at Load then refuses what does not fit (stage_control._check_added_kv), and the leader plans
    around it (plan_owner)."""
    reserved = 0
    for s in card.shards:
        if s.fingerprint != fingerprint:
            continue
        if leader_id and s.kv_reservations:
            reserved += sum(r.bytes for r in s.kv_reservations if leader_id in r.leader_ids)
        else:
            reserved += s.kv_reserved_bytes
    if not reserved:
        return card
    return replace(card, memory_free_bytes=min(card.memory_total_bytes, card.memory_free_bytes + reserved))


def _has_weights(card: Card, request: PlacementRequest) -> bool:
    # A node can only load weights it has on disk, and only identical weights may share a pipeline.
    return any(m.fingerprint == request.fingerprint and m.num_layers == request.config.num_hidden_layers
               for m in card.models)


def _plan_on_loaded_shards(request: PlacementRequest, footprint: Footprint, stage_nodes: list[Card]) -> Plan | None:
    if (request.tensor_parallel or 1) > 1:
        return None  # loaded shards are single nodes' ranges
    num_layers = request.config.num_hidden_layers
    cover = cover_loaded_shards(request.fingerprint, num_layers, stage_nodes, request.form)
    if cover is None or (request.num_stages is not None and len(cover) != request.num_stages):
        return None
    stages = tuple(_assignment(request, footprint, (c.card,), i, len(cover), c.shard.first_layer, c.shard.last_layer)
                   for i, c in enumerate(cover))
    # The shard's weights already sit in memory (not in memory_free_bytes); KV and activations must still fit.
    for stage, c in zip(stages, cover):
        if stage.kv_bytes + stage.activation_bytes > usable_bytes(c.card, request.safety_margin_fraction):
            return None
    return _plan(request, footprint, stages, [(c.card,) for c in cover], reused=True)


def _plan_fresh(request: PlacementRequest, footprint: Footprint, candidates: list[Card]) -> Plan:
    # The fewest stages come from the nodes with the most free memory (faster first among equals).
    margin = request.safety_margin_fraction
    ranked = sorted(candidates, key=lambda c: (-usable_bytes(c, margin), -bandwidth_gbps(c), c.node_id))
    size = request.tensor_parallel
    if size is not None:
        if size > 1:
            return _plan_units(request, footprint, requested_groups(request.model_id, ranked, size), size)
        return _plan_units(request, footprint, [(c,) for c in ranked], 1)
    # Decide by link speed: the pipeline plan against plans whose stages are groups of nodes
    # with measured links, by estimated tokens/s.
    try:
        best: Plan | None = _plan_units(request, footprint, [(c,) for c in ranked], 1)
        error = None
    except ShardUnavailable as e:
        best, error = None, e
    candidate: TPEstimate | None = None
    for size in range(2, len(ranked) + 1):
        groups = form_groups(ranked, size, measured_only=True)
        if not groups or not splits(request.config, size):
            continue
        try:
            grouped = _plan_units(request, footprint, groups, size)
        except ShardUnavailable:
            continue
        if best is None or grouped.est_tokens_per_s > best.est_tokens_per_s * (1 + TP_MIN_GAIN):
            best = grouped
        elif candidate is None or grouped.stages[0].tp.seconds_split < candidate.seconds_split:
            candidate = grouped.stages[0].tp
    if best is None:
        raise error
    return best if any(s.workers for s in best.stages) else replace(best, tp_candidate=candidate)


def _plan_units(request: PlacementRequest, footprint: Footprint, units: list[tuple[Card, ...]], size: int) -> Plan:
    """Split the layers over the fewest units (single nodes, or groups of `size`) that fit."""
    num_layers = request.config.num_hidden_layers
    margin = request.safety_margin_fraction
    rank = footprint.per_rank(request.config, size)
    ranked = sorted(units, key=lambda u: (-min(usable_bytes(c, margin) for c in u),
                                          -min(bandwidth_gbps(c) for c in u), u[0].node_id))
    max_stages = min(len(ranked), num_layers)
    what = "candidate node(s)" if size == 1 else f"group(s) of {size} nodes"
    if request.num_stages is not None and request.num_stages > max_stages:
        limit = (f"{request.model_id} has {num_layers} layers" if num_layers < len(ranked) else
                 f"the fleet has {len(ranked)} {what} with {request.model_id}'s weights")
        raise ShardUnavailable(f"--stages {request.num_stages} asks for more stages than this can give: {limit}. "
                               f"Lower --stages{'' if num_layers < len(ranked) else ' or add nodes'}.", part="stages")
    sizes = [request.num_stages] if request.num_stages is not None else range(1, max_stages + 1)
    for num_stages in sizes:
        chosen = sorted(ranked[:num_stages], key=lambda u: u[0].node_id)
        caps = [min(rank.capacity_layers(c, i, num_stages, margin) for c in u) for i, u in enumerate(chosen)]
        if min(caps) < 1 or sum(caps) < num_layers:
            continue
        # Weight by capacity × bandwidth: at equal speed layers go in proportion to memory (every
        # node keeps the same share of headroom), at equal memory in proportion to speed, and a
        # node strong in both takes more, which shortens the per-token sum over stages. Clamped
        # to capacity, so a fast node never gets more layers than fit in its memory. A group
        # reads with all its members' bandwidth.
        weights = [cap * size * min(bandwidth_gbps(c) for c in u) for cap, u in zip(caps, chosen)]
        counts = split_layers(num_layers, caps, weights)
        stages, first = [], 0
        for i, (unit, count) in enumerate(zip(chosen, counts)):
            stages.append(_assignment(request, footprint, unit, i, num_stages, first, first + count))
            first += count
        return _plan(request, footprint, tuple(stages), chosen, reused=False)
    if size == 1:
        raise _not_enough_memory(request, footprint, sorted([u[0] for u in ranked[:sizes[-1]]],
                                                            key=lambda c: c.node_id), len(ranked))
    raise ShardUnavailable(
        f"{request.model_id} with KV for {request.context_length} tokens × batch {request.max_batch} does not fit "
        f"on {len(ranked)} {what}: each rank must hold 1/{size} of its layers, and a rank with too little free "
        f"memory limits its group. Add nodes, lower --tp, or lower --context or --batch.", part="all layers")


def _assignment(request: PlacementRequest, footprint: Footprint, unit: tuple[Card, ...], position: int,
                num_stages: int, first: int, last: int) -> StageAssignment:
    """Stage `position` on `unit` (one node, or a group with rank 0 first); budgets are per node."""
    count, rank = last - first, footprint.per_rank(request.config, len(unit))
    leader = unit[0]
    tp = None
    if len(unit) > 1:
        tp = estimate(request.config, footprint, unit, [bandwidth_gbps(c) for c in unit], position, num_stages,
                      count, request.max_batch, request.context_length, request.weight_dtype_bytes)
    return StageAssignment(
        node_id=leader.node_id, address=leader.grpc_address, first_layer=first, last_layer=last,
        weight_bytes=count * rank.layer_weight + rank.fixed_weights(position, num_stages, leader.device),
        kv_bytes=count * rank.layer_kv, activation_bytes=rank.activations(position, num_stages),
        workers=tuple(GroupMember(c.node_id, c.grpc_address) for c in unit[1:]),
        collective_endpoint=leader.collective_endpoint if len(unit) > 1 else None, tp=tp)


def _plan(request: PlacementRequest, footprint: Footprint, stages: tuple[StageAssignment, ...],
          units: list[tuple[Card, ...]], reused: bool) -> Plan:
    return Plan(
        model_id=request.model_id, fingerprint=request.fingerprint, num_layers=request.config.num_hidden_layers,
        context_length=request.context_length, max_batch=request.max_batch,
        weight_dtype_bytes=request.weight_dtype_bytes, kv_dtype_bytes=request.kv_dtype_bytes,
        stages=stages, est_tokens_per_s=_estimate_tokens_per_s(footprint, stages, units), reused_shards=reused)


def _estimate_tokens_per_s(footprint: Footprint, stages: tuple[StageAssignment, ...],
                           units: list[tuple[Card, ...]]) -> float:
    # Decode is memory bound: each step a stage reads its layers' weights and all its KV (every
    # sequence attends to its whole context), the last stage the LM head too. Stages run one
    # after another for a given token, and each adds one network hop; the hop back to the
    # leader is the +1. A group's stage takes its ranks' share plus its collectives (tp_cost.py).
    seconds = HOP_OVERHEAD_S * (len(stages) + 1)
    for i, (stage, unit) in enumerate(zip(stages, units)):
        if stage.tp is not None:
            seconds += stage.tp.seconds_split
            continue
        read = footprint.bytes_read_per_step(i, len(stages), stage.num_layers)
        seconds += read / (bandwidth_gbps(unit[0]) * 1e9)
    return 1.0 / seconds


def _no_candidates(request: PlacementRequest, fleet: Sequence[Card]) -> ShardUnavailable:
    other_weights = sorted({c.node_id for c in fleet for m in c.models
                            if m.model_id == request.model_id and m.fingerprint != request.fingerprint})
    reasons = []
    if other_weights:
        reasons.append(f"{', '.join(other_weights)} have {request.model_id} with different weights "
                       f"(fingerprint differs); only identical weights may share a pipeline")
    if request.exclude:
        reasons.append(f"{len(request.exclude)} nodes are excluded after failing")
    detail = f" ({'; '.join(reasons)})" if reasons else ""
    return ShardUnavailable(
        f"no stage node in the fleet of {len(fleet)} has {request.model_id} (fingerprint "
        f"{request.fingerprint[:12]}) on disk{detail}. Copy the same model files to a node and start it with "
        f"--model, or check the other nodes are running.", part="all layers")


def _not_enough_memory(request: PlacementRequest, footprint: Footprint, nodes: list[Card],
                       num_candidates: int) -> ShardUnavailable:
    num_layers, num_stages = request.config.num_hidden_layers, len(nodes)
    margin = request.safety_margin_fraction
    fixed = sum(footprint.fixed_weights(i, num_stages, c.device) + footprint.activations(i, num_stages)
                for i, c in enumerate(nodes))
    need = fixed + num_layers * footprint.per_layer
    hold = sum(usable_bytes(c, margin) for c in nodes)
    rooms = [footprint.room_for_layers(c, i, num_stages, margin) for i, c in enumerate(nodes)]
    caps = [room // footprint.per_layer for room in rooms]
    num_covered = min(num_layers, sum(max(cap, 0) for cap in caps))
    if num_covered < num_layers:
        part = f"layers {num_covered}-{num_layers - 1}"
        # Bytes left over on each node after its whole layers; the best one could take more with less added.
        leftovers = [room - cap * footprint.per_layer for room, cap in zip(rooms, caps) if cap >= 0]
        shortfall = (num_layers - num_covered) * footprint.per_layer - max(leftovers, default=0)
    else:
        # Enough in total, but some stage cannot hold its fixed part (embedding, LM head) plus one layer.
        i = min(range(num_stages), key=lambda j: (caps[j], nodes[j].node_id))
        part = f"stage {i} on {nodes[i].node_id} ({footprint.fixed_part_name(i, num_stages, nodes[i].device)} + 1 layer)"
        shortfall = footprint.per_layer - rooms[i]
    missing = max(need - hold, shortfall, 1)
    if num_stages < num_candidates:
        which = f"the {num_stages} largest of the fleet's {num_candidates} candidate nodes"
    else:
        which = "the fleet's only candidate node" if num_stages == 1 else f"the fleet's {num_stages} candidate nodes"
    lower = "--context or --batch" if request.max_batch > 1 else "--context"
    way_out = f"{'raise --stages, ' if request.num_stages else ''}add a node or lower {lower}"
    return ShardUnavailable(
        f"{request.model_id} layers 0-{num_layers - 1} + KV for {request.context_length} tokens × batch "
        f"{request.max_batch} need {need / GIB:.1f} GiB; {which} can hold {hold / GIB:.1f} GiB (free memory less "
        f"the {margin:.0%} safety margin); {missing / GIB:.1f} GiB ({missing} bytes) missing for {part}. "
        f"{way_out[0].upper()}{way_out[1:]}.", missing_bytes=missing, part=part)
