"""A proposer on another node, as a drop-in for a local one; and re-planning when it goes away.

RemoteProposer sends a batch of requests in one Propose call with a deadline in
milliseconds (per block, not the channel's 10 s default): a draft that misses it is
dropped (ProposerError), the leader decodes without it. Release requests ride along
with the next call. Called from the leader's drafting thread only. `send` starts a call
and returns at once, `receive` takes its answer once done, so the leader can have a
second call queued on the node behind the first (spec/drafter.py, chained calls);
`propose` is the two in one.

A call that carries a sequence's prompt (or a long stretch decoded plainly) is a catch-up:
the proposer must prefill those tokens before it can draft, which for a draft model on a
slow core takes seconds (measured: 300 tokens of SmolLM2-135M, ~7 s on a loaded core), far
past any per-block deadline. Such a call gets a deadline sized for the prefill, from the
proposer's measured seconds per context token (a cautious prior until measured), capped.
The leader is not held meanwhile: drafts arrive on its inbox (spec/drafter.py), so its
sequences decode plainly until the proposer has caught up, then speculation starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from meshllm.cluster.card import Card, NodeId
from meshllm.engine.kv_cache import SeqId
from meshllm.errors import MalformedMessage
from meshllm.spec.placement import ProposerPlacement, ProposerUnavailable, ProposerWant, place_proposer
from meshllm.spec.proposer import Draft, ProposeRequest, ProposerError, catch_up_tokens
from meshllm.transport import spec_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import proposer_pb2_grpc

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 0.5  # per call; a draft later than this is worth nothing to the step it was for
# A proposer left out after failures is tried again after this long: a slow first call (catching
# up a long prompt) or a restart must not end speculation for the life of the leader.
EXCLUSION_S = 10.0
PRIOR_PREFILL_S_PER_TOKEN = 0.05  # until measured: slower than any draft model worth placing
PREFILL_MARGIN = 2.0  # a catch-up may take this many times its measured rate (a busy node)
CATCH_UP_CAP_S = 30.0  # a proposer slower than this on a prompt is not worth waiting for


@dataclass(slots=True)
class PendingCall:
    """A Propose call in flight (RemoteProposer.send). `calls`: the caller's own bookkeeping."""

    call: object  # grpc.Future, or SignedFuture over a signed channel: result(), add_done_callback()
    requests: tuple[ProposeRequest, ...]
    release: tuple[SeqId, ...]
    sent: float
    proposer: "RemoteProposer | None" = None  # ReplanningProposer: the placement it went to
    calls: object = None
    cancelled: bool = False

    def add_done_callback(self, fn: Callable[["PendingCall"], None]) -> None:
        self.call.add_done_callback(lambda _: fn(self))

    def cancel(self) -> None:
        """Nobody wants the answer any more (it is not to be received): a call still queued on the
        node is skipped there (ProposerService), after applying the releases it carried. A call
        cancelled before the node saw it loses those: the node's lease (--plan-lease) frees them."""
        self.cancelled = True
        self.call.cancel()


class RemoteProposer:
    def __init__(self, channel: grpc.Channel, model_id: str, node_id: str, deadline_s: float = DEFAULT_DEADLINE_S):
        self.name = f"remote:{node_id}/{model_id}"
        self.inline = False  # a network round trip
        self.model_id = model_id
        self.node_id = node_id
        self.deadline_s = deadline_s
        self._stub = proposer_pb2_grpc.ProposerStub(channel)
        self._released: list[SeqId] = []
        self.prefill_s_per_token = PRIOR_PREFILL_S_PER_TOKEN  # decaying average over catch-up calls

    def deadline_for(self, requests: Sequence[ProposeRequest]) -> float:
        """The per-block deadline, or for a catch-up call one sized for prefilling its context."""
        context = catch_up_tokens(requests)
        if not context:
            return self.deadline_s
        return min(CATCH_UP_CAP_S, self.deadline_s + PREFILL_MARGIN * context * self.prefill_s_per_token)

    def release(self, seq_ids: Sequence[SeqId]) -> None:
        self._released.extend(seq_ids)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        return self.receive(self.send(requests))

    def send(self, requests: Sequence[ProposeRequest]) -> PendingCall:
        release, self._released = self._released, []
        message = spec_convert.request_to_pb(self.model_id, requests, release)
        call = self._stub.Propose.future(message, timeout=self.deadline_for(requests))
        return PendingCall(call, tuple(requests), tuple(release), time.perf_counter())

    def receive(self, pending: PendingCall) -> list[Draft]:
        """The answer of a call `send` started (waits for it if it is not done)."""
        requests, context = pending.requests, catch_up_tokens(pending.requests)
        try:
            reply = pending.call.result()
        except grpc.RpcError as e:
            self._released = list(pending.release) + self._released  # not delivered: send again next time
            if context and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self.prefill_s_per_token *= 2  # slower than believed: the next catch-up waits longer
            error = ProposerError(f"proposer {self.model_id} on {self.node_id}: {e.code().name}: {e.details()}")
            error.unreachable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND)
            raise error from None
        if context:
            measured = (time.perf_counter() - pending.sent) / context
            self.prefill_s_per_token = 0.5 * self.prefill_s_per_token + 0.5 * measured
        try:
            return spec_convert.drafts_from_pb(reply, requests)
        except MalformedMessage as e:
            raise ProposerError(f"proposer {self.model_id} on {self.node_id} answered malformed drafts: {e}") \
                from None


class ReplanningProposer:
    """The placed remote proposer; when it is unreachable (or fails `max_failures` calls in a row),
    the node is left out for EXCLUSION_S and a proposer is placed again on the current fleet view at
    once. With no candidate left, calls fail (plain decoding) and placement is retried on each call."""

    def __init__(self, want: ProposerWant, fleet_view: Callable[[], list[Card]], channels: ChannelPool,
                 deadline_s: float = DEFAULT_DEADLINE_S, max_failures: int = 2,
                 on_placed: Callable[[ProposerPlacement], None] = lambda placement: None,
                 clock: Callable[[], float] = time.monotonic):
        self.want = want
        self.fleet_view = fleet_view
        self.channels = channels
        self.deadline_s = deadline_s
        self.max_failures = max_failures
        self.on_placed = on_placed
        self.clock = clock
        self.excluded: dict[NodeId, float] = {}  # node -> when it may be placed again
        self._lock = threading.Lock()
        self._current: RemoteProposer | None = None
        self._failures = 0
        self.placement = self._place()  # raises ProposerUnavailable when none fits: the caller decides
        self.name = "remote"
        self.inline = False

    def _place(self) -> ProposerPlacement:
        now = self.clock()
        self.excluded = {node: until for node, until in self.excluded.items() if until > now}
        placement = place_proposer(self.want, self.fleet_view(), frozenset(self.excluded))
        self._current = RemoteProposer(self.channels.get(placement.address, placement.node_id), placement.model_id,
                                       placement.node_id, self.deadline_s)
        self._failures = 0
        log.info("proposer placed: %s on %s (%s)", placement.model_id, placement.node_id, placement.address)
        self.on_placed(placement)
        return placement

    def release(self, seq_ids: Sequence[SeqId]) -> None:
        if self._current is not None:
            self._current.release(seq_ids)

    def propose(self, requests: Sequence[ProposeRequest]) -> list[Draft]:
        return self.receive(self.send(requests))

    def send(self, requests: Sequence[ProposeRequest]) -> PendingCall:
        with self._lock:
            if self._current is None:
                try:
                    self.placement = self._place()
                except ProposerUnavailable as e:
                    raise ProposerError(f"no proposer available: {e}") from None
            current = self._current
        pending = current.send(requests)
        pending.proposer = current
        return pending

    def receive(self, pending: PendingCall) -> list[Draft]:
        current = pending.proposer
        try:
            drafts = current.receive(pending)
        except ProposerError as e:
            with self._lock:
                if self._current is not current:
                    raise  # a call to a proposer already replaced says nothing about the new one
                self._failures += 1
                gone = getattr(e, "unreachable", False)
                if (gone or self._failures >= self.max_failures) and self._current is current:
                    log.warning("proposer on %s failed (%s); placing another", current.node_id, e)
                    self.excluded[NodeId(current.node_id)] = self.clock() + EXCLUSION_S
                    self._current = None
                    try:
                        self.placement = self._place()
                    except ProposerUnavailable as unavailable:
                        log.warning("no other proposer: %s", unavailable)
            raise
        self._failures = 0
        return drafts

