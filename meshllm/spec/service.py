"""The Proposer gRPC service: a node drafts for other nodes' leaders.

Registered on the node's one gRPC server (same port and authentication as every other
service). Holds the node's proposers by model id ("ngram", draft models); each runs
one call at a time under its own lock (its per-sequence state is not thread-safe), in
the server's worker threads, so gossip and stage traffic keep flowing meanwhile.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc

from meshllm.cluster.card import Role, RoleOffer
from meshllm.errors import MalformedMessage
from meshllm.spec.proposer import Proposer
from meshllm.transport import spec_convert
from meshllm.transport.protos import proposer_pb2, proposer_pb2_grpc


@dataclass(frozen=True, slots=True)
class Served:
    proposer: Proposer
    vocab: str = ""  # vocabulary fingerprint; "" for token-agnostic proposers
    vocab_size: int = 0  # 0: any
    tokens_per_second: float = 0.0

    def offer(self) -> RoleOffer:
        return RoleOffer(Role.PROPOSER, self.proposer.name, self.vocab, self.tokens_per_second)


class ProposerService(proposer_pb2_grpc.ProposerServicer):
    def __init__(self, served: list[Served]):
        self.served = {s.proposer.name: s for s in served}
        self._locks = {name: threading.Lock() for name in self.served}

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
        with self._locks[request.model_id]:
            if release:
                served.proposer.release(release)
            drafts = served.proposer.propose(requests)
        return spec_convert.drafts_to_pb(drafts)

    def Info(self, request, context):
        return proposer_pb2.ProposerInfoReply(offers=[
            proposer_pb2.ProposerOffer(model_id=name, vocab=s.vocab, vocab_size=s.vocab_size)
            for name, s in self.served.items()])
