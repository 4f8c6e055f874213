"""A draft model as a proposer: any smaller or quantized model sharing the target's tokenizer.

It keeps its own KV cache per sequence (engine/kv_cache.py) aligned with the tokens it
holds: the context requests gave it plus the tokens it drafted, assumed accepted. A
request that rolls the context back truncates the KV (the same rollback the stages do);
an extension request after a fully accepted block costs one forward per drafted token,
since the KV of the block is already there. Every round runs all requesting sequences
as one flat batch through the Decoder, as a pipeline stage does.

Drafting is greedy (a point mass on the likeliest token), or, with DraftSampling, a draw
from q = softmax(logits / T) over the `support` likeliest tokens, renormalised, seeded by
(seed, position): q is reported with each token so the verifier can accept with
min(1, p/q) (spec/speculative_sampling.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from meshllm.engine.kv_cache import KVCache, SeqId
from meshllm.engine.sampler import position_generator
from meshllm.model.decoder import Decoder, SeqSlice
from meshllm.spec.proposer import Draft, DraftDist, DraftSampling, IncompatibleDraftModel, ProposeRequest

if TYPE_CHECKING:  # a node imports this module; only a proposer of a draft model holds a tokenizer
    from meshllm.model.tokenizer import Tokenizer

PREFILL_CHUNK = 256  # rows of one sequence per forward while catching up on context


@dataclass
class _Drafting:
    """One request inside a batched draft: the context to catch up on, then tokens to draft."""

    request: ProposeRequest
    tokens: list[int]  # the sequence's held tokens (context, then drafts as they come)
    num_context: int
    drafted: list[int]
    dists: list[DraftDist]


class DraftModelProposer:
    """meshllm.spec.proposer.Proposer over a whole model in this process."""

    def __init__(self, decoder: Decoder, name: str, max_sequences: int = 256):
        assert decoder.has_embedding and decoder.has_head, "a draft model needs the whole model"
        self.decoder = decoder
        self.name = name
        self.inline = False  # a forward pass per token: drafted on the leader's drafting thread
        self.max_sequences = max_sequences
        self.cache = KVCache(decoder.kv_layout())
        self._tokens: dict[SeqId, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return self.decoder.config.vocab_size

    def release(self, seq_ids: Sequence[SeqId]) -> None:
        for s in seq_ids:
            self._tokens.pop(s, None)
            self.cache.release(s)

    def propose(self, requests: Sequence[ProposeRequest], cancelled: Callable[[], bool] = lambda: False
                ) -> list[Draft]:
        """`cancelled`: asked between forward passes; once true, the drafts stop where they are
        (the caller went away: a proposer node's gRPC call was cancelled)."""
        out: dict[SeqId, Draft] = {}
        work: list[_Drafting] = []
        for r in requests:
            tokens = self._context(r)
            if tokens is None:
                out[r.seq_id] = Draft(r.seq_id, resync_from=len(self._tokens.get(r.seq_id, ())))
            elif r.k == 0 or not tokens:
                out[r.seq_id] = Draft(r.seq_id)
            else:
                work.append(_Drafting(r, tokens, len(tokens), [], []))
        self._catch_up(work)
        active = work
        while active and not cancelled():
            self._draft_round(active)
            active = [w for w in active if len(w.drafted) < w.request.k]
        for w in work:
            sampled = w.request.sampling is not None
            out[w.request.seq_id] = Draft(w.request.seq_id, tuple(w.drafted), tuple(w.dists) if sampled else None)
        return [out[r.seq_id] for r in requests]

    def _context(self, r: ProposeRequest) -> list[int] | None:
        """Apply the request to the held tokens and roll the KV back to what still matches them."""
        held = self._tokens.get(r.seq_id)
        if held is None:
            if r.position != 0:
                return None
            while len(self._tokens) >= self.max_sequences:  # a leader that never releases: drop the oldest
                self.release([next(iter(self._tokens))])
            held = self._tokens[r.seq_id] = []
        if r.position > len(held):
            return None
        same = 0
        while same < len(r.tokens) and r.position + same < len(held) and held[r.position + same] == r.tokens[same]:
            same += 1
        del held[r.position + same:]
        held.extend(r.tokens[same:])
        kv = self.cache.get_or_allocate(r.seq_id)
        # Keep the KV of tokens still held, but always rerun the last one: its logits give the first draft.
        kv.truncate(min(kv.length, r.position + same, max(len(held) - 1, 0)))
        return held

    def _catch_up(self, work: list[_Drafting]) -> None:
        # Prefill what each sequence's KV lacks, in chunks (a long new prompt never builds one huge
        # attention buffer), until at most a chunk is left: that joins the first draft round, whose
        # last row gives the first draft. A catch-up pass of its own would cost a whole forward per
        # call: a call after a plain stretch of a few tokens took 3 forwards for 2 drafted tokens.
        while True:
            pending = [(w, self.cache.sequences[w.request.seq_id]) for w in work]
            pending = [(w, kv) for w, kv in pending if kv.length < w.num_context - PREFILL_CHUNK]
            if not pending:
                return
            ids, positions, slices = [], [], []
            for w, kv in pending:
                end = min(w.num_context - PREFILL_CHUNK, kv.length + PREFILL_CHUNK)
                slices.append(SeqSlice(kv, len(ids), end - kv.length))
                positions.extend(range(kv.length, end))
                ids.extend(w.tokens[kv.length:end])
            self.decoder(torch.tensor(ids), torch.tensor(positions), slices, torch.tensor([], dtype=torch.long))

    def _draft_round(self, active: list[_Drafting]) -> None:
        ids, positions, slices, last_rows = [], [], [], []
        for w in active:
            kv = self.cache.sequences[w.request.seq_id]
            n = len(w.tokens) - kv.length  # 1, or on the first round what catching up left (<= a chunk)
            slices.append(SeqSlice(kv, len(ids), n))
            positions.extend(range(kv.length, len(w.tokens)))
            ids.extend(w.tokens[kv.length:])
            last_rows.append(len(ids) - 1)
        logits = self.decoder(torch.tensor(ids), torch.tensor(positions), slices, torch.tensor(last_rows))
        for w, row in zip(active, logits):
            position = len(w.tokens)  # of the token drafted now
            token, dist = self._choose(row, w.request.sampling, position)
            w.tokens.append(token)
            w.drafted.append(token)
            if dist is not None:
                w.dists.append(dist)

    @staticmethod
    def _choose(row: torch.Tensor, sampling: DraftSampling | None, position: int) -> tuple[int, DraftDist | None]:
        if sampling is None:
            return int(row.argmax()), None
        values, ids = torch.topk(row.float() / sampling.temperature, min(sampling.support, row.numel()))
        probs = torch.softmax(values.double(), dim=-1)
        u = float(torch.rand((), generator=position_generator(sampling.seed, position), dtype=torch.float64))
        index = int(torch.searchsorted(torch.cumsum(probs, 0), u * float(probs.sum()), right=True)
                    .clamp_(max=probs.numel() - 1))
        dist = DraftDist(tuple(ids.tolist()), tuple(probs.tolist()))
        return dist.ids[index], dist


def check_same_tokenizer(target: Tokenizer, draft: Tokenizer, target_id: str, draft_id: str) -> None:
    """Refuse a draft model whose token ids mean other text than the target's."""
    t_vocab = target.backend.get_vocab(with_added_tokens=True)
    d_vocab = draft.backend.get_vocab(with_added_tokens=True)
    if t_vocab == d_vocab:
        return
    differing = sorted((tok for tok in t_vocab.keys() | d_vocab.keys() if t_vocab.get(tok) != d_vocab.get(tok)),
                       key=lambda tok: (min(t_vocab.get(tok, 1 << 30), d_vocab.get(tok, 1 << 30)), tok))
    example = differing[0]
    raise IncompatibleDraftModel(
        f"draft model {draft_id} does not share {target_id}'s tokenizer: {len(differing)} tokens differ (e.g. "
        f"{example!r} is id {t_vocab.get(example)} in the target, {d_vocab.get(example)} in the draft; vocabularies "
        f"of {len(t_vocab)} and {len(d_vocab)} tokens). Pick a draft model of the same family, or use "
        f"--speculative ngram")


def vocab_fingerprint(tokenizer: Tokenizer) -> str:
    """A short hash of the token -> id map: proposers advertise it, leaders match their own."""
    import hashlib

    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    digest = hashlib.sha256()
    for token, index in sorted(vocab.items(), key=lambda kv: kv[1]):
        digest.update(f"{index}\0{token}\0".encode())
    return digest.hexdigest()[:16]
