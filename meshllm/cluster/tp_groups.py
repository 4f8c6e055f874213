"""Which nodes form tensor-parallel groups (pure, for placement.py).

Nodes take part only with a collective endpoint (--collective-port). Groups are formed
deterministically from the planner's ranking, each around the fastest measured links.
"""

from __future__ import annotations

from meshllm.cluster.card import Card
from meshllm.cluster.tp_cost import link_between
from meshllm.errors import ShardUnavailable, TensorParallelUnsplittable
from meshllm.model.config import ModelConfig
from meshllm.tp.shard import check_splittable


def splits(config: ModelConfig, size: int) -> bool:
    try:
        check_splittable(config, size)
    except TensorParallelUnsplittable:
        return False
    return True


def form_groups(ranked: list[Card], size: int, measured_only: bool) -> list[tuple[Card, ...]]:
    """Disjoint groups of `size` nodes with collective endpoints, deterministically.

    In rank order, each ungrouped node takes the ungrouped nodes with the fastest links to it
    (lowest all-reduce latency, then node_id); `measured_only` leaves out pairs no card has
    measured. Members are ordered by node_id: the first is rank 0.
    """
    pool = [c for c in ranked if c.collective_endpoint]
    groups = []
    while len(pool) >= size:
        leader, members = pool[0], [pool[0]]
        for other in sorted(pool[1:], key=lambda c: (_link_latency(leader, c), c.node_id)):
            if len(members) == size:
                break
            if measured_only and any(link_between(m, other) is None for m in members):
                continue
            members.append(other)
        if len(members) == size:
            groups.append(tuple(sorted(members, key=lambda c: c.node_id)))
            pool = [c for c in pool if c not in members]
        else:
            pool = pool[1:]
    return groups


def _link_latency(a: Card, b: Card) -> float:
    link = link_between(a, b)
    return link.latency_s if link is not None else float("inf")


def requested_groups(model_id: str, ranked: list[Card], size: int) -> list[tuple[Card, ...]]:
    groups = form_groups(ranked, size, measured_only=False)
    if not groups:
        with_endpoint = [c.node_id for c in ranked if c.collective_endpoint]
        raise ShardUnavailable(
            f"--tp {size} needs {size} nodes with {model_id} and a collective endpoint; the fleet has "
            f"{len(ranked)} with the model, {len(with_endpoint)} of them with an endpoint "
            f"({', '.join(with_endpoint) or 'none'}). Start nodes with --collective-port, or lower --tp.",
            part="tensor-parallel group")
    return groups
