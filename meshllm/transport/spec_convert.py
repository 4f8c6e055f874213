"""Protobuf <-> dataclasses for the Proposer service, converted once, here.

Requests come from leaders and drafts from proposers: both are peers, so counts,
positions and sizes are checked on the way in. A draft's *content* (ids in the
vocabulary, q well formed) is checked by the leader (spec/proposer.checked_draft),
since a bad draft only costs acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import MAX_DRAFT_SUPPORT, DraftDist
from meshllm.errors import MalformedMessage
from meshllm.spec.proposer import MAX_DRAFT_TOKENS, Draft, DraftSampling, ProposeRequest
from meshllm.transport.protos import proposer_pb2, stage_pb2

MAX_ENTRIES = 4096  # sequences per call
MAX_CONTEXT_TOKENS = 1 << 20  # tokens one entry may carry (a whole long prompt on the first call)
MAX_POSITION = 1 << 24


def request_to_pb(model_id: str, requests: Sequence[ProposeRequest], release: Sequence[SeqId] = ()
                  ) -> proposer_pb2.ProposeRequest:
    entries = []
    for r in requests:
        entry = proposer_pb2.ProposeEntry(seq_id=r.seq_id, position=r.position, tokens=r.tokens, k=r.k)
        if r.sampling is not None:
            entry.sampling.CopyFrom(proposer_pb2.DraftSampling(temperature=r.sampling.temperature,
                                                               seed=r.sampling.seed, support=r.sampling.support))
        entries.append(entry)
    return proposer_pb2.ProposeRequest(model_id=model_id, entries=entries, release=list(release))


def requests_from_pb(msg: proposer_pb2.ProposeRequest) -> tuple[list[ProposeRequest], list[SeqId]]:
    if len(msg.entries) > MAX_ENTRIES or len(msg.release) > MAX_ENTRIES:
        raise MalformedMessage(f"a propose call carries at most {MAX_ENTRIES} sequences")
    requests, seen = [], set()
    for e in msg.entries:
        if e.seq_id in seen:
            raise MalformedMessage(f"sequence {e.seq_id} appears twice in one propose call")
        seen.add(e.seq_id)
        if not (0 <= e.position < MAX_POSITION and len(e.tokens) <= MAX_CONTEXT_TOKENS
                and 0 <= e.k <= MAX_DRAFT_TOKENS):
            raise MalformedMessage(f"sequence {e.seq_id}: position {e.position}, {len(e.tokens)} tokens, k {e.k} "
                                   f"out of range (k at most {MAX_DRAFT_TOKENS})")
        if any(t < 0 for t in e.tokens):
            raise MalformedMessage(f"sequence {e.seq_id}: negative token id")
        sampling = None
        if e.HasField("sampling"):
            try:
                sampling = DraftSampling(e.sampling.temperature, e.sampling.seed, e.sampling.support)
            except ValueError as err:
                raise MalformedMessage(f"sequence {e.seq_id}: {err}") from None
        requests.append(ProposeRequest(SeqId(e.seq_id), e.position, tuple(e.tokens), e.k, sampling))
    return requests, [SeqId(s) for s in msg.release]


def drafts_to_pb(drafts: Sequence[Draft]) -> proposer_pb2.ProposeReply:
    out = []
    for d in drafts:
        entry = proposer_pb2.DraftEntry(seq_id=d.seq_id, tokens=d.tokens,
                                        dists=[stage_pb2.DraftDist(ids=q.ids, probs=q.probs) for q in d.dists or ()])
        if d.resync_from is not None:
            entry.resync_from = d.resync_from
        out.append(entry)
    return proposer_pb2.ProposeReply(drafts=out)


def drafts_from_pb(msg: proposer_pb2.ProposeReply, requests: Sequence[ProposeRequest]) -> list[Draft]:
    """Drafts in request order; a sequence the reply leaves out gets an empty draft."""
    if len(msg.drafts) > MAX_ENTRIES:
        raise MalformedMessage(f"a propose reply carries at most {MAX_ENTRIES} drafts")
    by_seq: dict[int, Draft] = {}
    for e in msg.drafts:
        if len(e.tokens) > MAX_DRAFT_TOKENS or len(e.dists) > MAX_DRAFT_TOKENS \
                or any(len(q.ids) > MAX_DRAFT_SUPPORT or len(q.ids) != len(q.probs) for q in e.dists):
            raise MalformedMessage(f"draft for sequence {e.seq_id} is larger than a draft may be")
        dists = tuple(DraftDist(tuple(q.ids), tuple(q.probs)) for q in e.dists) if e.dists else None
        resync = e.resync_from if e.HasField("resync_from") else None
        if resync is not None and not 0 <= resync < MAX_POSITION:
            raise MalformedMessage(f"draft for sequence {e.seq_id}: resync_from {resync} out of range")
        by_seq[e.seq_id] = Draft(SeqId(e.seq_id), tuple(e.tokens), dists, resync)
    return [by_seq.get(r.seq_id, Draft(r.seq_id)) for r in requests]
