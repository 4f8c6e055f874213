"""The drafter's mirror of what a (non-inline) proposer holds, driven step by step by hand.

The leader loop is played here: proposer answers come back through `post`, and the test hands
them to `arrived` and commits tokens the way verifier passes would.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.sequence import Sequence
from meshllm.spec.draft_length import DraftLengthConfig
from meshllm.spec.drafter import Drafter, SpecConfig
from meshllm.spec.proposer import Draft

TEXT = [1, 2, 3, 10, 11, 12, 13, 14, 15, 16, 17]  # the prompt, then what the verifier will commit


class _Perfect:
    """Drafts exactly the verifier's continuation, on the drafter's own thread (not inline)."""

    name, inline = "perfect", False

    def propose(self, requests, cancelled=None):
        return [Draft(r.seq_id, tuple(TEXT[r.position + len(r.tokens):][:r.k])) for r in requests]

    def release(self, seq_ids):
        pass


@pytest.fixture
def drafting():
    """(drafter, answers, seq): a one-token-block drafter over _Perfect, its first block arrived."""
    answers: queue.Queue = queue.Queue()
    config = SpecConfig(lengths=DraftLengthConfig(k_max=1, k_start=1))
    drafter = Drafter(_Perfect(), vocab_size=100, post=answers.put, config=config)
    try:
        seq = Sequence(SeqId(1), TEXT[:3], SamplingParams(temperature=0.0, max_tokens=8))
        drafter.admit(seq, seq.params, user_seeded=False)
        drafter.arrived(answers.get(timeout=5))  # a block of k + 1 = 2 tokens: 10, 11
        yield drafter, answers, seq
    finally:
        drafter.close()


def test_a_draft_arriving_after_a_commit_past_its_start_is_offered_at_once(drafting):
    """A proposer one block behind: the verifier committed a token (a plain step) past the mirror's
    end while the next block was being drafted. When that block arrives, its first token is checked
    against the committed one there and then, and the rest goes out with the next step; it used to
    wait for the next commit, so every other step went plain (fp32 SmolLM2 verifier + Q4_1 draft
    node: 1.27x -> 1.75x over plain decoding once fixed)."""
    drafter, answers, seq = drafting
    assert seq.draft == (10,)
    # The verifier accepts 10 and adds its own 11; the drafter already asked for 12, 13.
    seq.output_ids += [10, 11]
    drafter.committed(seq)
    assert seq.draft == ()
    # A plain step (nothing at hand) commits 12 before the block arrives.
    seq.output_ids += [12]
    drafter.committed(seq)
    drafter.arrived(answers.get(timeout=5))  # 12, 13
    assert seq.draft == (13,) and seq.draft_position == 6


def test_a_draft_that_went_another_way_than_a_commit_is_cut_on_arrival(drafting):
    drafter, answers, seq = drafting
    seq.output_ids += [10, 11]
    drafter.committed(seq)
    seq.output_ids += [99]  # the verifier went elsewhere than the block being drafted (12, 13)
    drafter.committed(seq)
    drafter.arrived(answers.get(timeout=5))
    assert seq.draft == ()  # nothing of the stale block is offered
    # The mirror was cut back to the committed tokens, and drafting goes on from them.
    assert drafter._states[seq.seq_id].mirror == TEXT[:5] + [99]


class _Wrong(_Perfect):
    name = "wrong"

    def propose(self, requests, cancelled=None):
        return [Draft(r.seq_id, (50,) * r.k) for r in requests]


def _acceptance_after_an_overtaken_draft(proposer) -> tuple[float, float]:
    answers: queue.Queue = queue.Queue()
    drafter = Drafter(proposer, vocab_size=100, post=answers.put, config=SpecConfig())
    try:
        seq = Sequence(SeqId(1), TEXT[:3], SamplingParams(temperature=0.0, max_tokens=8))
        drafter.admit(seq, seq.params, user_seeded=False)
        prior = drafter._states[seq.seq_id].length.alpha
        seq.output_ids += [10, 11]  # two plain steps commit before the draft arrives
        drafter.committed(seq)
        drafter.arrived(answers.get(timeout=5))
        return prior, drafter._states[seq.seq_id].length.alpha
    finally:
        drafter.close()


def test_a_draft_overtaken_by_plain_steps_still_measures_acceptance():
    """A proposer slower than the verifier sends only probes while drafting does not pay, and
    probes arrive after plain steps committed past them; what they drafted for those positions is
    checked against the committed tokens, which moves the acceptance estimate (it stayed at the
    prior, so a bf16 verifier never used a Q4_1 draft node that would have paid)."""
    prior, after = _acceptance_after_an_overtaken_draft(_Perfect())
    assert after > prior + 0.1
    prior, after = _acceptance_after_an_overtaken_draft(_Wrong())
    assert after < prior - 0.3


class _Pending:
    """A call in flight on _Chained: answered when the test says so."""

    def __init__(self, requests):
        self.requests, self.callbacks, self.cancelled, self.calls = requests, [], False, None
        self.answer = None  # what receive() gives instead of _Perfect's drafts

    def add_done_callback(self, fn):
        self.callbacks.append(fn)

    def cancel(self):
        self.cancelled = True

    def finish(self):
        for fn in self.callbacks:
            fn(self)


class _Chained(_Perfect):
    """A proposer that takes calls while others are in flight (as a remote node does), answering
    each only when the test finishes it: drafts of the verifier's continuation, like _Perfect."""

    name = "chained"

    def __init__(self):
        self.sent: queue.Queue = queue.Queue()

    def send(self, requests):
        pending = _Pending(requests)
        self.sent.put(pending)
        return pending

    def receive(self, pending):
        return pending.answer or self.propose(pending.requests)


@pytest.fixture
def chained():
    answers: queue.Queue = queue.Queue()
    proposer = _Chained()
    config = SpecConfig(lengths=DraftLengthConfig(k_max=1, k_start=1))
    drafter = Drafter(proposer, vocab_size=100, post=answers.put, config=config)
    try:
        seq = Sequence(SeqId(1), TEXT[:3], SamplingParams(temperature=0.0, max_tokens=8))
        drafter.admit(seq, seq.params, user_seeded=False)
        yield drafter, proposer, answers, seq
    finally:
        drafter.close()


def test_a_second_call_is_chained_onto_the_one_in_flight(chained):
    """The next block is asked for while the first is still being drafted, from where the first
    will end (no tokens: the node holds them), so the node starts it as soon as the first is done
    and the round trip between calls costs nothing."""
    drafter, proposer, answers, seq = chained
    first = proposer.sent.get(timeout=5)
    assert first.requests[0].tokens == (1, 2, 3) and first.requests[0].k == 2
    drafter.committed(seq)  # any event of the loop asks again
    second = proposer.sent.get(timeout=5)
    (request,) = second.requests
    assert (request.position, request.tokens) == (5, ())
    assert proposer.sent.empty()  # two calls per sequence at most
    first.finish()
    second.finish()
    for _ in range(2):
        drafter.arrived(answers.get(timeout=5))
    assert drafter._states[seq.seq_id].mirror == TEXT[:7]
    assert seq.draft == (10,)


def test_a_cut_cancels_the_calls_in_flight_and_asks_again_at_once(chained):
    """When the verifier goes another way, the chained call (drafting past the cut) is cancelled,
    so a node skips it if still queued, its answer is never delivered, and the fresh request goes
    out at once instead of after the stale calls came back."""
    drafter, proposer, answers, seq = chained
    first = proposer.sent.get(timeout=5)
    drafter.committed(seq)
    second = proposer.sent.get(timeout=5)
    first.finish()
    drafter.arrived(answers.get(timeout=5))  # mirror: prompt, 10, 11
    seq.output_ids += [99]  # the verifier chose 99 where the draft said 10
    drafter.committed(seq)
    assert second.cancelled and not first.cancelled
    fresh = proposer.sent.get(timeout=5)
    (request,) = fresh.requests
    assert (request.position, request.tokens) == (3, (99,))
    second.finish()  # its answer comes back after the cut: dropped on the drafter's thread
    fresh.finish()
    message = answers.get(timeout=5)
    assert message.requests == fresh.requests
    drafter.arrived(message)
    assert answers.empty()
    assert drafter._states[seq.seq_id].mirror == TEXT[:3] + [99] + TEXT[4:6]


def test_a_chained_answer_before_the_one_it_continues_is_dropped_without_a_cut(chained):
    """The node's lock does not serve waiting calls in order: the chained call can be answered
    first. It continues nothing the mirror holds yet, so it is dropped, and the call before it,
    still good, is neither cancelled nor made stale."""
    drafter, proposer, answers, seq = chained
    first = proposer.sent.get(timeout=5)
    drafter.committed(seq)
    second = proposer.sent.get(timeout=5)
    second.answer = [Draft(seq.seq_id, resync_from=3)]  # what a node holding 3 tokens answers
    second.finish()
    drafter.arrived(answers.get(timeout=5))
    assert not first.cancelled and drafter._states[seq.seq_id].mirror == TEXT[:3]
    first.finish()
    drafter.arrived(answers.get(timeout=5))
    assert drafter._states[seq.seq_id].mirror == TEXT[:5] and seq.draft == (10,)


def test_blocks_of_one_sequence_queued_together_go_out_in_separate_calls():
    """The drafter's thread sends everything queued meanwhile in one call. A sequence's chained
    block, queued before the thread woke, landed in the same call as the block it continues, which
    a node refuses (a sequence twice in one propose call): in the two-machine bench, verifier and
    leader sharing one core, most remote calls failed that way and drafting all but stopped
    (0.80-0.95x one machine). Here both blocks are queued before the thread sends them (it is held
    inside another sequence's call if it took that one first; usually, under the GIL, it has not
    woken yet): they go out as two calls, in order, each naming the sequence once."""
    gate = threading.Event()

    class _Gated(_Chained):
        def send(self, requests):
            if any(r.seq_id == SeqId(0) for r in requests):
                assert gate.wait(5)
            return super().send(requests)

    answers: queue.Queue = queue.Queue()
    proposer = _Gated()
    drafter = Drafter(proposer, vocab_size=100, post=answers.put,
                      config=SpecConfig(lengths=DraftLengthConfig(k_max=1, k_start=1)))
    try:
        other = Sequence(SeqId(0), TEXT[:3], SamplingParams(temperature=0.0, max_tokens=8))
        drafter.admit(other, other.params, user_seeded=False)  # the thread waits in its send
        seq = Sequence(SeqId(1), TEXT[:3], SamplingParams(temperature=0.0, max_tokens=8))
        drafter.admit(seq, seq.params, user_seeded=False)  # the first block, queued
        drafter.committed(seq)  # the block chained onto it, queued beside it
        gate.set()
        calls = []  # the other sequence's call may hold the first block too (if it was queued in time)
        while sum(r.seq_id == SeqId(1) for call in calls for r in call.requests) < 2:
            calls.append(proposer.sent.get(timeout=5))
        assert proposer.sent.empty()
        for call in calls:
            ids = [r.seq_id for r in call.requests]
            assert len(ids) == len(set(ids)), ids
        positions = [r.position for call in calls for r in call.requests if r.seq_id == SeqId(1)]
        assert positions == [0, 5]  # the prompt and its block, then the block from where that ends
        for call in calls:
            call.finish()
        for _ in calls:
            drafter.arrived(answers.get(timeout=5))
        assert drafter._states[seq.seq_id].mirror == TEXT[:7]
    finally:
        gate.set()
        drafter.close()


def test_a_call_not_queued_behind_another_is_expected_after_its_round_trip_too(chained):
    """A call's expected answer (how long a step is held for it) is its drafting time, measured on
    calls queued behind others, plus, for a call not queued behind one, what such calls took beyond
    that: the round trip and the node's turnaround. Without it a held step gave up just before the
    draft came (~5 ms early with a 3 ms round trip), went plain and overtook the draft."""
    from meshllm.spec.drafter import DraftsReady
    from meshllm.spec.proposer import ProposeRequest

    drafter, proposer, answers, seq = chained
    drafter._draft_s.observe(2, 0.010)  # drafting 2 tokens: 10 ms, timed on queued calls
    request = ProposeRequest(SeqId(7), 9, (4,), 2)
    for _ in range(30):  # unqueued calls of the same size took 16 ms end to end
        drafter._observe_call(DraftsReady((request,), (0,), (Draft(SeqId(7), (5, 6)),), 0.016,
                                          beyond_drafting=True))
    assert drafter._beyond_drafting_s == pytest.approx(0.006, rel=0.01)
    first = proposer.sent.get(timeout=5)  # the prompt's call, sent at admission
    time.sleep(0.012)  # slower than the estimate: a catch-up call may only lower it (_observe_call)
    first.finish()
    answer = answers.get(timeout=5)
    before = time.perf_counter()
    drafter.arrived(answer)  # the next block goes out at once, with no call in flight to queue behind
    after = time.perf_counter()
    (call,) = drafter._states[seq.seq_id].calls
    assert before + 0.016 - 1e-6 <= call.expected_at <= after + 0.016 + 1e-6, (before, call.expected_at, after)
