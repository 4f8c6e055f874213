"""The Proposer gRPC service: a node drafts for other nodes' leaders.

Registered on the node's one gRPC server (same port and authentication as every other
service). Holds the node's proposers by model id ("ngram", draft models); each runs
one call at a time under its own lock (its per-sequence state is not thread-safe), in
the server's worker threads, so gossip and stage traffic keep flowing meanwhile.

Per-sequence state is leased like a stage's plans (the node's --plan-lease): a sequence no
Propose named for that long is released, so a leader that crashed (and never sent its
releases) leaves nothing behind; the proposers' own caps (LRU) only bound a burst. A live
leader that comes back to a released sequence gets `resync_from` and resends its context.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import grpc

from meshllm.cluster.card import Role, RoleOffer
from meshllm.engine.kv_cache import SeqId
from meshllm.errors import MalformedMessage
from meshllm.spec.proposer import Draft, Proposer
from meshllm.transport import spec_convert
from meshllm.transport.protos import proposer_pb2, proposer_pb2_grpc

log = logging.getLogger(__name__)

MAX_SWEEP_INTERVAL_S = 15.0  # a crashed leader's sequences go within the lease plus this


@dataclass(frozen=True, slots=True)
class Served:
    proposer: Proposer
    vocab: str = ""  # vocabulary fingerprint; "" for token-agnostic proposers
    vocab_size: int = 0  # 0: any
    tokens_per_second: float = 0.0
    # Positions a sequence may reach, drafts included (a draft model's context); 0: no limit (n-gram).
    # Beyond it a draft is worthless, and a long enough context would pin the node's CPU for minutes.
    max_context: int = 0

    def offer(self) -> RoleOffer:
        return RoleOffer(Role.PROPOSER, self.proposer.name, self.vocab, self.tokens_per_second)


class ProposerService(proposer_pb2_grpc.ProposerServicer):
    def __init__(self, served: list[Served], lease_s: float | None = None):
        """`lease_s`: release a sequence no Propose named this long (swept while started); None: never."""
        if lease_s is not None and lease_s <= 0:
            raise ValueError(f"the proposer's lease must be positive, got {lease_s}")
        self.served = {s.proposer.name: s for s in served}
        self.lease_s = lease_s
        self._locks = {name: threading.Lock() for name in self.served}
        # Per proposer: sequence -> when a Propose last named it (monotonic), oldest first.
        self._last_used: dict[str, dict[SeqId, float]] = {name: {} for name in self.served}
        self._stopped = threading.Event()
        self._sweeper: threading.Thread | None = None

    def offers(self) -> tuple[RoleOffer, ...]:
        return tuple(s.offer() for s in self.served.values())

    def Propose(self, request, context):
        served = self.served.get(request.model_id)
        if served is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"this node serves no proposer {request.model_id!r}; "
                                                     f"it serves {sorted(self.served)}")
        try:
            requests, release = spec_convert.requests_from_pb(request)
        except MalformedMessage as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[{e.code}] {e}")
        if served.vocab_size and any(t >= served.vocab_size for r in requests for t in r.tokens):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a token id is outside {request.model_id}'s vocabulary of {served.vocab_size}")
        # A sequence reaching past the draft model's context (drafts included) gets no draft, now or
        # later (its context only grows): the call answers for the others. Aborting it made the
        # leader leave this proposer out, and so stop drafting for every sequence.
        asked = requests
        beyond = {r.seq_id for r in requests if r.end + r.k > served.max_context} if served.max_context else set()
        if beyond:
            requests = [r for r in requests if r.seq_id not in beyond]
            release = tuple(release) + tuple(sorted(beyond))
        with self._locks[request.model_id]:
            last_used = self._last_used[request.model_id]
            if release:
                served.proposer.release(release)
                for seq_id in release:
                    last_used.pop(seq_id, None)
            if not context.is_active():
                # Cancelled while queued behind another call (a leader's chained call whose draft went
                # stale): the next call is drafted sooner for not drafting this one.
                return spec_convert.drafts_to_pb([])
            drafts = served.proposer.propose(requests, cancelled=lambda: not context.is_active()) if requests else []
            now = time.monotonic()
            for r in requests:
                last_used.pop(r.seq_id, None)  # re-inserted last: the dict stays oldest first
                last_used[r.seq_id] = now
        if beyond:  # in the order asked
            drafted = iter(drafts)
            drafts = [Draft(r.seq_id) if r.seq_id in beyond else next(drafted, Draft(r.seq_id)) for r in asked]
        return spec_convert.drafts_to_pb(drafts)

    def expire(self) -> int:
        """Release the sequences no Propose named for the lease; returns how many."""
        if self.lease_s is None:
            return 0
        idle_since = time.monotonic() - self.lease_s
        total = 0
        for name, served in self.served.items():
            with self._locks[name]:
                last_used = self._last_used[name]
                idle = []
                for seq_id, at in last_used.items():
                    if at >= idle_since:
                        break
                    idle.append(seq_id)
                if idle:
                    served.proposer.release(idle)
                    for seq_id in idle:
                        del last_used[seq_id]
                    log.info("proposer %s: released %d sequences unused for %gs", name, len(idle), self.lease_s)
            total += len(idle)
        return total

    # Node service interface: the lease sweeper runs while the node does.
    def start(self) -> None:
        if self.lease_s is not None:
            self._sweeper = threading.Thread(target=self._sweep, daemon=True, name="proposer-lease")
            self._sweeper.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=10)

    def _sweep(self) -> None:
        while not self._stopped.wait(min(self.lease_s / 4, MAX_SWEEP_INTERVAL_S)):
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad release
                log.exception("releasing expired proposer sequences failed")

    def Info(self, request, context):
        return proposer_pb2.ProposerInfoReply(offers=[
            proposer_pb2.ProposerOffer(model_id=name, vocab=s.vocab, vocab_size=s.vocab_size)
            for name, s in self.served.items()])
