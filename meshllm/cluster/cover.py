"""Greedy cover of a model's layers by shards already loaded on the fleet.

The reference's pipeline construction (pipeline-sharding-spec §5.2): a plan that
reuses shards already in memory starts serving at once instead of loading
weights again. `plan_placement` tries this before planning from scratch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshllm.cluster.card import Card, LoadedShard, WeightForm


@dataclass(frozen=True, slots=True)
class CoveringShard:
    """One loaded shard chosen for a stage, with the card of the node holding it."""

    card: Card
    shard: LoadedShard


def cover_loaded_shards(fingerprint: str, num_layers: int, cards: Iterable[Card],
                        form: WeightForm = WeightForm()) -> tuple[CoveringShard, ...] | None:
    """Contiguous shards covering layers [0, num_layers), or None when no complete cover exists.

    Walks from layer 0; at each cursor takes, among the shards that start exactly
    at the cursor, the one with the lowest queue depth (ties: the longer range,
    so fewer hops, then node_id) and jumps to its end. A shard that starts inside
    an already covered range is ignored: a stage runs its whole loaded range, so
    overlapping shards cannot be chained. A node serves at most one stage, and a
    shard already at its max_streams is skipped (it would queue, spec §5.6).
    Greedy, as the reference: a dead end means "plan from scratch", not search. Only shards
    holding the weights in `form` count: one in another dtype or quantization is not shared (the
    stage would load a second copy, which the fresh planner budgets).
    """
    starting_at: dict[int, list[CoveringShard]] = {}
    for card in cards:
        for shard in card.shards:
            # A tensor-parallel rank holds a slice of its range: only its group can run it.
            if shard.fingerprint != fingerprint or shard.form != form or shard.queue_depth >= shard.max_streams \
                    or shard.tp_size > 1:
                continue
            if not 0 <= shard.first_layer < shard.last_layer <= num_layers:
                continue  # a shard of a differently sized model with the same fingerprint: ignore
            starting_at.setdefault(shard.first_layer, []).append(CoveringShard(card, shard))
    for options in starting_at.values():
        # Sort on every key that differs between options: the cover must not depend on fleet order.
        options.sort(key=lambda c: (c.shard.queue_depth, -c.shard.last_layer, c.card.node_id, c.shard.max_streams))

    chosen: list[CoveringShard] = []
    used_nodes: set[str] = set()
    cursor = 0
    while cursor < num_layers:
        pick = next((c for c in starting_at.get(cursor, ()) if c.card.node_id not in used_nodes), None)
        if pick is None:
            return None
        chosen.append(pick)
        used_nodes.add(pick.card.node_id)
        cursor = pick.shard.last_layer
    return tuple(chosen)
