"""Where a leader's drafts come from: a pure function of (what it wants, the fleet view).

Per capability-exchange-design §3: candidates are live cards offering the proposer role
(with the pinned model or node, when given) whose vocabulary matches the target's (an n-gram
proposer matches any); they are scored by (drafting speed, free memory, node id): speed
first, memory as tie-break, id for determinism, so every node derives the same placement
from the same view. A proposer on a node that holds none of the verifier's stages is
preferred: that moves its weights and compute off the verifier's machines. Draft models are
preferred over n-gram proposers (they draft free text too). No candidate raises
ProposerUnavailable: no silent fallback, the caller decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshllm.cluster.card import Card, NodeId, Role, RoleOffer
from meshllm.cluster.registry import newer
from meshllm.errors import MeshError

NGRAM = "ngram"


class ProposerUnavailable(MeshError):
    code = "proposer_unavailable"


@dataclass(frozen=True, slots=True)
class ProposerWant:
    vocab: str  # the target's vocabulary fingerprint
    verifier_nodes: frozenset[NodeId] = frozenset()  # nodes holding the verifier's stages
    model_id: str | None = None  # pin a proposer model ("ngram" or a draft model's id)
    node_id: NodeId | None = None  # pin a node


@dataclass(frozen=True, slots=True)
class ProposerPlacement:
    node_id: NodeId
    address: str
    model_id: str
    colocated: bool  # on a node that also holds a verifier stage


def place_proposer(want: ProposerWant, fleet: Sequence[Card], exclude: frozenset[NodeId] = frozenset()
                   ) -> ProposerPlacement:
    newest: dict[str, Card] = {}
    for card in fleet:
        current = newest.get(card.node_id)
        newest[card.node_id] = card if current is None else newer(current, card)
    candidates: list[tuple[Card, RoleOffer]] = []
    for card in newest.values():
        if card.node_id in exclude or (want.node_id is not None and card.node_id != want.node_id):
            continue
        for offer in card.offers:
            if offer.role is not Role.PROPOSER or (want.model_id is not None and offer.model_id != want.model_id):
                continue
            if offer.vocab and offer.vocab != want.vocab:
                continue  # a draft model of another tokenizer: its ids mean other text
            candidates.append((card, offer))
    if not candidates:
        raise _unavailable(want, list(newest.values()), exclude)

    def score(c: tuple[Card, RoleOffer]):
        card, offer = c
        return (card.node_id not in want.verifier_nodes, bool(offer.vocab), offer.tokens_per_second,
                card.memory_free_bytes, _descending(card.node_id))

    card, offer = max(candidates, key=score)
    return ProposerPlacement(card.node_id, card.grpc_address, offer.model_id, card.node_id in want.verifier_nodes)


def _descending(node_id: str) -> tuple[int, ...]:
    # max() picks the highest score: invert the id so the lowest node id wins ties.
    return tuple(-ord(c) for c in node_id) + (0,)


def _unavailable(want: ProposerWant, cards: list[Card], exclude: frozenset[NodeId]) -> ProposerUnavailable:
    offering = sorted(c.node_id for c in cards if any(o.role is Role.PROPOSER for o in c.offers))
    pinned = "".join([f" model {want.model_id!r}" if want.model_id else "",
                      f" on node {want.node_id!r}" if want.node_id else ""])
    detail = f"nodes offering proposers: {', '.join(offering)}" if offering else "no node offers a proposer"
    if exclude:
        detail += f"; left out after failing: {', '.join(sorted(exclude))}"
    return ProposerUnavailable(
        f"no proposer{pinned} with a matching vocabulary in the fleet of {len(cards)} nodes ({detail}). Start a "
        f"node with --draft-model PATH (a model sharing the target's tokenizer), or use --speculative ngram")
