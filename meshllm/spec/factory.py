"""Build the proposer a leader drafts with, from `--speculative ngram|draft:MODEL|remote[:NODE]`,
and the draft models a node serves to others (`meshllm node --draft-model PATH`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from meshllm.cluster.card import Card, NodeId
from meshllm.errors import BadRequest
from meshllm.model.source import ModelFiles, open_model
from meshllm.spec.draft_model import DraftModelProposer, check_same_tokenizer, vocab_fingerprint
from meshllm.spec.ngram import NgramProposer
from meshllm.spec.placement import ProposerPlacement, ProposerWant
from meshllm.spec.proposer import Proposer
from meshllm.spec.remote import DEFAULT_DEADLINE_S, ReplanningProposer
from meshllm.spec.service import Served
from meshllm.transport.channels import ChannelPool

SPECULATIVE_HELP = ("speculative decoding: 'ngram' (prompt lookup, no weights), 'draft:MODEL' (a smaller or "
                    "quantized model sharing the tokenizer, in this process), 'remote' or 'remote:NODE' (a proposer "
                    "node of the cluster, placed from the fleet view); output is unchanged, only speed differs")
DRAFT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class SpeculativeChoice:
    kind: str  # "ngram" | "draft" | "remote"
    model: str | None = None  # draft model path
    node_id: str | None = None  # remote: pinned node

    @classmethod
    def parse(cls, text: str) -> "SpeculativeChoice":
        kind, _, rest = text.partition(":")
        if kind == "ngram" and not rest:
            return cls("ngram")
        if kind == "draft" and rest:
            return cls("draft", model=rest)
        if kind == "remote":
            return cls("remote", node_id=rest or None)
        raise BadRequest(f"--speculative {text!r} is not one of: ngram, draft:MODEL, remote, remote:NODE")


@dataclass(frozen=True, slots=True)
class DraftOptions:
    dtype: str = "bfloat16"
    quantization: str | None = "int8"  # drafts need speed more than the last bits: the verifier keeps output exact
    deadline_s: float = DEFAULT_DEADLINE_S  # per remote call


def load_draft_model(path: str | Path, options: DraftOptions = DraftOptions()) -> tuple[DraftModelProposer, ModelFiles]:
    from meshllm.engine.stage_weights import load_stage_decoder

    files = open_model(path)
    decoder = load_stage_decoder(files.source, files.config, dtype=DRAFT_DTYPES[options.dtype],
                                 quantization=options.quantization)
    return DraftModelProposer(decoder, files.model_id), files


def build_proposer(choice: SpeculativeChoice, target: ModelFiles, *, options: DraftOptions = DraftOptions(),
                   fleet_view: Callable[[], list[Card]] | None = None, channels: ChannelPool | None = None,
                   verifier_nodes: frozenset[NodeId] = frozenset(),
                   on_placed: Callable[[ProposerPlacement], None] = lambda p: None) -> Proposer:
    """The leader's proposer. Raises IncompatibleDraftModel for a draft model of another tokenizer,
    ProposerUnavailable when no remote proposer fits the fleet (the caller decides what then)."""
    if choice.kind == "ngram":
        return NgramProposer()
    if choice.kind == "draft":
        proposer, files = load_draft_model(choice.model, options)
        check_same_tokenizer(target.tokenizer, files.tokenizer, target.model_id, files.model_id)
        return proposer
    if fleet_view is None or channels is None:
        raise BadRequest("--speculative remote needs a cluster: pass --peer")
    want = ProposerWant(vocab_fingerprint(target.tokenizer), verifier_nodes,
                        node_id=NodeId(choice.node_id) if choice.node_id else None)
    return ReplanningProposer(want, fleet_view, channels, options.deadline_s, on_placed=on_placed)


def served_proposers(draft_paths: list[Path], bandwidth_gbps: float, options: DraftOptions = DraftOptions()
                     ) -> list[Served]:
    """What a node serves on its Proposer service: n-gram always, plus each draft model."""
    from meshllm.engine.stage_weights import decoder_bytes

    served = [Served(NgramProposer())]
    for path in draft_paths:
        proposer, files = load_draft_model(path, options)
        weight_bytes = decoder_bytes(proposer.decoder)
        speed = bandwidth_gbps * 1e9 / weight_bytes if weight_bytes else 0.0  # decode reads every weight
        served.append(Served(proposer, vocab_fingerprint(files.tokenizer), files.config.vocab_size, round(speed, 1),
                             files.config.max_position_embeddings))
    return served
