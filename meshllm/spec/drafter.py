"""The leader's side of speculative decoding: keeps each sequence's drafts ahead of its verifier.

Concurrency contract: every method except the worker runs on the leader's loop thread.
Proposer calls run on the drafter's own thread; their answers come back to the loop as
DraftsReady messages in its inbox, so the loop never waits on a proposer.

Per sequence the drafter keeps a *mirror* of the tokens its proposer holds: committed
tokens, then the proposer's drafts, assumed accepted. Drafting runs ahead of verification:
while a block verifies, the proposer is already extending the mirror past it (assuming the
whole block and the verifier's bonus token match its own continuation), so a remote
proposer's round trip and compute overlap the verifier's pass. When the verifier commits,
the committed tokens are compared with the mirror: where they agree, the mirror's next
tokens are the next draft, ready at once; where they differ, the mirror is cut there, the
proposer is told to roll back (the next request's position), and a fresh draft is asked for.
A sequence whose proposer is drafting for it (a draft it lacks, or more than it has) holds
the next micro-batch when waiting pays: when the draft, expected at the proposer's measured
latency, commits more tokens per second than sending the step now (draft_length.wait_pays,
which counts the other rows of the step the hold stalls); else the step goes without, and
the proposer's continuation resumes the chain if the committed tokens match it. A proposer
slower than a verifier pass drafts blocks of the length that maximises the pipelined rate
(draft_length.pipelined_length), none where it cannot keep up (a same-size model drafting on
an equally fast machine).
Requests of many sequences travel as one batch; a draft that misses its block's deadline is
dropped by the proposer client, and failures only cost speed.

A proposer that takes calls while one is in flight (`send`/`receive`: a remote node, which
queues them behind each other; `send` returns the call with its `requests`, `cancel()`,
`cancelled` and `add_done_callback()`, as spec/remote.PendingCall) gets a second call per
sequence *chained* onto the first: it continues from the end the first will reach, so the node
starts it the moment the first is done. Its round trip (and the leader's turnaround) then
overlaps the first call's compute instead of idling the proposer between calls: the proposer's
drafting rate, not a call's latency, bounds a pipelined draft. Measured (SmolLM2 bf16 verifier,
Q4_1 draft node, 3 ms round trip): a 2-token call took 20 ms end to end against 14.5 ms of
drafting.

An *inline* proposer (`proposer.inline`: it answers in microseconds, in this process, with no
I/O, like the n-gram one) is called right here on the loop thread instead: a thread hop and
an inbox round trip cost more than its answer (measured: ~13% of a step on free text on a
loaded 2-core machine), and its draft is ready before the next micro-batch is formed, so the
leader never holds a step for it. It drafts one block ahead only, since it can always draft
again at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.sampler import SamplingParams, draw_seed
from meshllm.engine.scheduler import MicroBatch, Work
from meshllm.engine.sequence import Sequence
from meshllm.engine.step import DraftDist, StageTiming
from meshllm.errors import MeshError
from meshllm.spec.draft_length import (DraftLength, DraftLengthConfig, OfferedLength, StepCosts, pipelined_length,
                                       wait_pays)
from meshllm.spec.proposer import Draft, DraftSampling, Proposer, ProposeRequest, catch_up_tokens, checked_draft
from meshllm.spec.trace import SpecTrace

log = logging.getLogger(__name__)

# A call whose requests carry at most this many context tokens (the verifier's bonus token, and
# one more) times drafting alone.
_STEADY_CONTEXT = 2
DRAFT_SEED_POSITION = 1 << 40  # drafts draw from (seed, this + position): never the verifier's (seed, position)


@dataclass(frozen=True, slots=True)
class SpecConfig:
    lengths: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    sample_drafts: bool = True  # ask sampling proposers for q (min(1, p/q)) for unseeded sampled requests
    draft_support: int = 16  # entries of each sparse q
    retry_after_s: float = 0.2  # after a failed proposer call, plain decoding for this long
    # Hold every decode step until its draft arrives (at most max_wait_s), and send whatever a
    # self-sizing proposer offers: for tests and acceptance measurements, where drafts must be
    # verified even from a proposer as slow as the verifier or when they do not pay.
    wait_for_drafts: bool = False
    max_wait_s: float = 5.0

    def __post_init__(self):
        if self.retry_after_s < 0 or self.max_wait_s < 0:
            raise ValueError(f"retry_after_s and max_wait_s must be >= 0: {self}")


@dataclass(frozen=True, slots=True)
class DraftsReady:
    """A proposer's answer to one batch of requests (the leader's inbox message)."""

    requests: tuple[ProposeRequest, ...]
    generations: tuple[int, ...]
    drafts: tuple[Draft, ...] = ()
    seconds: float = 0.0
    error: MeshError | None = None
    # The seconds include more than drafting: a chained proposer's call that was not queued behind
    # another also timed its round trip, which the calls behind one another hide.
    beyond_drafting: bool = False


@dataclass(slots=True)
class _Call:
    """A proposer call in flight for one sequence. `stale` (loop thread) once the mirror is cut
    after it: its answer would extend the wrong context. `pending` (drafter thread): the call it
    went out in, for chained proposers, so a cut can cancel it (_cut)."""

    generation: int  # the mirror's generation when sent: a cut since makes its answer stale
    position: int  # its request's position
    end: int  # the mirror's length once it answered in full
    expected_at: float | None  # when its answer is expected (None: no estimate yet)
    stale: bool = False
    pending: object = None


class _State:
    def __init__(self, seq: Sequence, sampling: DraftSampling | None, length: DraftLength, k_cap: int,
                 offered_length: OfferedLength | None = None):
        self.seq = seq
        self.sampling = sampling
        self.length = length
        self.k_cap = k_cap
        # For a proposer that sizes its own drafts: it is asked for k_cap tokens, and what is sent
        # of its offer is decided by acceptance per offered length (draft_length.py).
        self.offered_length = offered_length
        self.offered = 0  # length of the last offer a step took
        self.rows = 1  # rows beside this sequence's draft in its last verified step
        self.mirror: list[int] = []  # what the proposer holds: committed tokens, then its drafts
        self.dists: dict[int, DraftDist] = {}  # q of drafted positions (sampling proposers)
        self.confirmed = 0  # mirror[:confirmed] equals the committed tokens
        self.generation = 0  # bumped whenever the mirror is cut: answers to older requests are stale
        self.calls: list[_Call] = []  # in flight and not stale, oldest first
        self.exhausted = False  # the proposer had nothing more for this context: wait for a commit
        self.hold_until: float | None = None
        self.skipped = 0  # requests not made since the last one (the proposer could not keep ahead)

    @property
    def k(self) -> int:
        return self.k_cap if self.offered_length is not None else min(self.length.k, self.k_cap)

    def answered(self, position: int, generation: int) -> None:
        for i, call in enumerate(self.calls):
            if call.position == position and call.generation == generation:
                del self.calls[i]
                return


class Drafter:
    def __init__(self, proposer: Proposer, vocab_size: int, post: Callable[[object], None],
                 config: SpecConfig | None = None, observer=None):
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.config = config or SpecConfig()
        self.observer = observer
        self._post = post
        self._states: dict[SeqId, _State] = {}
        self._costs = StepCosts()
        self._batch_rows = 1  # sequences in the last decode step
        self._latency_s: float | None = None  # decaying average of one proposer call
        # What a call not queued behind another takes beyond its drafting, from the drafter thread's
        # send to its answer: the round trip and the node's turnaround (decaying average; None until
        # measured). See _request.
        self._beyond_drafting_s: float | None = None
        self._draft_s = StepCosts(widest_slope=True)  # a proposer call's seconds by tokens drafted (catch-ups aside)
        self._paused_until = 0.0
        self._work: queue.Queue = queue.Queue()
        self._released: list[SeqId] = []
        self.inline = bool(getattr(proposer, "inline", False))
        self.sizes_drafts = bool(getattr(proposer, "sizes_drafts", False))
        self.chained = not self.inline and hasattr(proposer, "send")  # see the module docstring
        self._trace = SpecTrace.from_env()
        self._last_done = 0.0  # drafter thread: when the last chained call's answer came
        self._thread = None
        if not self.inline:
            self._thread = threading.Thread(target=self._run, daemon=True, name="drafter")
            self._thread.start()

    # --- leader loop thread ------------------------------------------------------------------------
    def admit(self, seq: Sequence, params: SamplingParams, user_seeded: bool, max_draft: int | None = None) -> None:
        """Start drafting for `seq`. Sampled drafts with q only where exactness allows (see verify.py):
        temperature > 0 and no seed from the user, so seeded requests stay bit-reproducible."""
        sampling = None
        if self.config.sample_drafts and not params.greedy and not user_seeded:
            sampling = DraftSampling(params.temperature, draw_seed(params.seed, DRAFT_SEED_POSITION),
                                     self.config.draft_support)
        cap = self.config.lengths.k_max if max_draft is None else max(0, min(max_draft, self.config.lengths.k_max))
        offered = OfferedLength(self.config.lengths) if self.sizes_drafts else None
        st = self._states[seq.seq_id] = _State(seq, sampling, DraftLength(self.config.lengths), cap, offered)
        # Until its first step, it weighs drafts beside as many rows as the last decode step had:
        # a newcomer to a busy batch sized its first drafts as if alone, where rows are cheap.
        st.rows = self._batch_rows
        self._request(st)

    def finish(self, seq_id: SeqId) -> None:
        if self._states.pop(seq_id, None) is not None:
            self._released.append(seq_id)

    def verified(self, work: Work, num_accepted: int, batch: MicroBatch) -> None:
        if self._trace is not None:
            self._trace.verified(len(work.draft), num_accepted)
        st = self._states.get(work.seq.seq_id)
        if st is None:
            return
        # The rows a draft is weighed against: one per sequence of the step (a plain decode step of
        # them) plus its own draft. Not the step's tokens: a prefill chunk's 256 made every draft
        # look free; nor the other sequences' drafts, beside which each looked cheap, so all drafted
        # at once (8 sequences of free text sent 20-28-row steps at 3-4x the cost of 8 rows).
        if st.offered_length is not None:
            st.offered_length.update(st.offered, len(work.draft), num_accepted)
            st.rows = len(batch.works)
        else:
            st.length.update(len(work.draft), num_accepted, self._costs, len(batch.works) + len(work.draft))

    def step_done(self, batch: MicroBatch, seconds: float, overlapped_timings: tuple[StageTiming, ...] = ()) -> None:
        """A step came back after `seconds`. `overlapped_timings`: its stages' timings when another
        micro-batch was in flight beside it; its round trip then includes waiting behind that one,
        the same with or without extra rows, so its cost is its busiest stage's compute (by round
        trips, 2 stages, 8 free-text sequences drafted at 0.59 acceptance and ran 0.84x plain)."""
        if self._trace is not None:
            self._trace.step(batch.num_tokens, seconds)
        if batch.works and all(w.num_scored == w.num_tokens for w in batch.works):  # decode rows only
            busiest = max((t.compute_s for t in overlapped_timings), default=None)
            self._costs.observe(batch.num_tokens, seconds if busiest is None else busiest)
            self._batch_rows = len(batch.works)

    def committed(self, seq: Sequence) -> None:
        """`seq` appended the tokens of a step: check them against the mirror, offer the next draft."""
        st = self._states.get(seq.seq_id)
        if st is None:
            return
        self._confirm(st)
        st.exhausted = False
        self._offer(st)
        self._request(st)
        self._hold_if_it_pays(st)

    def arrived(self, message: DraftsReady) -> None:
        now = time.perf_counter()
        if message.error is not None:
            log.info("proposer %s failed: %s; plain decoding for %.1fs", self.proposer.name, message.error,
                     self.config.retry_after_s)
            self._paused_until = now + self.config.retry_after_s
            if self.observer is not None:
                self.observer.on_proposer_failed(message.error)
        else:
            if not catch_up_tokens(message.requests):
                # A catch-up call (a prompt to prefill) says nothing about how fast blocks are drafted.
                self._latency_s = message.seconds if self._latency_s is None else \
                    0.8 * self._latency_s + 0.2 * message.seconds
            self._observe_call(message)
        for i, (request, generation) in enumerate(zip(message.requests, message.generations)):
            st = self._states.get(request.seq_id)
            if st is None:
                continue
            st.answered(request.position, generation)
            if generation != st.generation:
                continue  # the mirror was cut after this request: its tokens assumed the wrong context
            st.hold_until = None
            if request.position > len(st.mirror):
                # Chained onto a call that has not answered (the node's lock does not serve waiting
                # calls in order) or that drafted less than asked: it continues nothing the mirror
                # holds, and neither its draft nor its failure says anything about what it does hold.
                continue
            if message.error is not None:
                self._cut(st, request.position)  # the proposer may not hold what the request carried
                continue
            draft = checked_draft(message.drafts[i], request, self.vocab_size)
            if draft.resync_from is not None:
                self._cut(st, min(draft.resync_from, len(st.mirror)))
            else:
                start = len(st.mirror)
                for j, token in enumerate(draft.tokens):
                    if draft.dists is not None:
                        st.dists[len(st.mirror)] = draft.dists[j]
                    st.mirror.append(token)
                st.exhausted = len(draft.tokens) < request.k
                # A step may have committed past the mirror's old end meanwhile (the verifier's bonus
                # token): the draft's first tokens are checked against it now, not at the next commit,
                # else the step about to go out would go without the rest of the draft.
                self._confirm(st)
                self._learn_from_overtaken(st, start, len(draft.tokens))
            self._offer(st)
            self._request(st)
            self._hold_if_it_pays(st)

    def _observe_call(self, message: DraftsReady) -> None:
        """Call time by tokens drafted (D in draft_length.pipelined_length). A call that prefills
        (almost) nothing first times drafting alone: what a block costs while drafting keeps
        ahead. A call after a plain stretch also prefilled what was decoded meanwhile, so its time
        only bounds D from above: it lowers a higher estimate (a cold start, a network blip) but
        never raises one; else one slow first sample would stop drafting for good, since the
        probes that could correct it all come after plain stretches."""
        drafted = max((len(d.tokens) for d in message.drafts), default=0)  # sequences draft side by side
        if not drafted:
            return
        steady = max(len(r.tokens) for r in message.requests) <= _STEADY_CONTEXT
        if steady and not message.beyond_drafting:
            self._draft_s.observe(drafted, message.seconds)
            return
        estimate = self._draft_s.seconds(drafted)
        if steady and message.beyond_drafting and estimate is not None:
            extra = max(0.0, message.seconds - estimate)
            old = self._beyond_drafting_s
            self._beyond_drafting_s = extra if old is None else 0.8 * old + 0.2 * extra
        # A steady call that also timed its round trip seeds an empty estimate: a proposer always
        # overtaken by plain steps may never get a call queued behind another to time it.
        if (estimate is None and steady) or (estimate is not None and message.seconds < estimate):
            self._draft_s.observe(drafted, message.seconds)

    def holding(self, now: float) -> bool:
        """Whether the leader should wait a moment before forming a micro-batch: a proposer is
        about to answer for a sequence whose step would otherwise go out with a shorter draft or
        none (set where waiting pays, _hold_if_it_pays; in wait_for_drafts mode, while none is at hand)."""
        return any(st.hold_until is not None and now < st.hold_until and not st.seq.in_flight
                   and not st.seq.is_prefilling
                   and (not self.config.wait_for_drafts or len(st.mirror) <= st.seq.num_tokens)
                   for st in self._states.values())

    def next_deadline(self) -> float | None:
        now = time.perf_counter()
        holds = [st.hold_until for st in self._states.values() if st.hold_until is not None and st.hold_until > now]
        return min(holds) if holds else None

    def close(self) -> None:
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(timeout=5)
        if self._trace is not None:
            self._trace.write(self.proposer.name)

    # --- internals (loop thread) -------------------------------------------------------------------
    def _confirm(self, st: _State) -> None:
        """Compare the mirror with the committed tokens past st.confirmed; cut it where they differ."""
        n = st.seq.num_tokens
        upto = min(n, len(st.mirror))
        same = st.confirmed
        if same < upto:
            tokens = st.seq.token_ids(same, upto)
            while same < upto and tokens[same - st.confirmed] == st.mirror[same]:
                same += 1
        if same < len(st.mirror) and same < n:  # the mirror went another way: cut it there
            self._cut(st, same)
        st.confirmed = same

    def _learn_from_overtaken(self, st: _State, start: int, num_drafted: int) -> None:
        """Acceptance from the part of a draft that plain steps committed past before it arrived:
        those tokens were checked against the verifier's own choice (_confirm), as a verifier pass
        would have. A proposer slower than the verifier only ever sends such probes while drafting
        does not pay, so without this its acceptance stayed at the prior and it was never used
        (SmolLM2 bf16 verifier, Q4_1 draft node: 2-token probes arrived 2 tokens late). Greedy
        drafts only: a sampled draft matching a sampled commit is not the min(1, p/q) rule."""
        checked = min(num_drafted, st.seq.num_tokens - start)
        if checked <= 0 or st.offered_length is not None or st.sampling is not None:
            return
        st.length.observe(checked, min(max(st.confirmed - start, 0), checked))

    def _cut(self, st: _State, length: int) -> None:
        del st.mirror[length:]
        for position in [p for p in st.dists if p >= length]:
            del st.dists[position]
        st.confirmed = min(st.confirmed, length)
        st.generation += 1
        # The calls in flight drafted past the cut: a fresh request goes out at once instead of
        # waiting for them, and a chained call still queued on the node is cancelled, so the node
        # drafts the fresh one next (after a rejection, waiting for two stale calls and asking
        # again took a median 134 ms, 4 plain steps, 30% of a free-text generation).
        stale, st.calls = st.calls, []
        for call in stale:
            call.stale = True
        for pending in {id(c.pending): c.pending for c in stale if c.pending is not None}.values():
            if all(c.stale for c in pending.calls):
                pending.cancel()

    def _offer(self, st: _State) -> None:
        seq = st.seq
        if seq.in_flight:
            return  # offered again when its step commits
        n = seq.num_tokens
        k = st.k
        if k and st.confirmed == n and len(st.mirror) > n:
            seq.draft = tuple(st.mirror[n:n + k])
            if st.offered_length is not None and not self.config.wait_for_drafts:
                st.offered = len(seq.draft)
                seq.draft = seq.draft[:st.offered_length.send_length(st.offered, self._costs, st.rows)]
            seq.draft_position = n
            dists = tuple(st.dists.get(p) for p in range(n, n + len(seq.draft)))
            # A draft without q for every token is verified by exact match, which is exact for any draft.
            seq.draft_dists = dists if st.sampling is not None and None not in dists else None
        else:
            seq.draft, seq.draft_dists = (), None

    def _request(self, st: _State) -> None:
        if len(st.calls) >= (2 if self.chained else 1) or st.exhausted or st.k == 0 \
                or time.perf_counter() < self._paused_until:
            return
        n = st.seq.num_tokens
        previous = st.calls[-1] if st.calls else None
        if previous is not None and st.confirmed < n:
            return  # the committed tokens passed the mirror: the call in flight is checked first
        # Chained onto a call in flight: from the end that call will reach (what it drafts is
        # assumed, as any draft is); else from the mirror's end, with the committed tokens past it.
        position = previous.end if previous is not None else len(st.mirror)
        # Two blocks ahead: the one verifying now (plus the verifier's bonus token), and the next.
        # An inline proposer answers at once, so one block is enough.
        want = n + (1 if self.inline else 2) * (st.k + 1) - position
        if want <= 0 or (len(st.mirror) > n and st.confirmed < n):
            return
        tokens = tuple(st.seq.token_ids(position, n)) if position < n else ()
        k = self._block_length(st)
        if k == 0 and not self.config.wait_for_drafts:
            # This proposer cannot keep ahead of the verifier: plain decoding costs less. A probe now
            # and then keeps its speed measured (the verifier may slow down, or the proposer speed up).
            st.skipped += 1
            if st.skipped < self.config.lengths.probe_every:
                return
            st.skipped, k = 0, 1
        request = ProposeRequest(st.seq.seq_id, position, tokens, min(want, max(k, 1) + 1), st.sampling)
        st.mirror.extend(tokens)
        st.confirmed = max(st.confirmed, min(len(st.mirror), n))
        released, self._released = self._released, []
        now = time.perf_counter()
        expected_s = self._draft_s.seconds(request.k) if self._draft_s.typical_step_s is not None else self._latency_s
        if previous is None and expected_s is not None and self._beyond_drafting_s is not None:
            # Not queued behind a call on the node: the round trip and the node's turnaround come on
            # top of the drafting. Without them a step held for the call gave up ~5 ms before it came
            # (SmolLM2 bf16 verifier, Q4_1 draft node, 3 ms round trip) and went plain, overtaking the
            # draft. (The hops between this thread and the drafter's are not timed: a fraction of a ms.)
            expected_s += self._beyond_drafting_s
        # A chained call starts when the one before it is done.
        start = max(now, previous.expected_at or now) if previous is not None else now
        call = _Call(st.generation, position, request.end + request.k,
                     None if expected_s is None else start + expected_s)
        st.calls.append(call)
        if self._trace is not None:
            self._trace.request(k, request.k, st.length.alpha, None if call.expected_at is None else
                                call.expected_at - now, self._costs.seconds(st.rows), position)
        if self.inline:
            message = self._call([(request, call, tuple(released))])
            if message is not None:  # always, for a request made just now on this thread
                self.arrived(message)
            return
        if self.config.wait_for_drafts:
            st.hold_until = now + self.config.max_wait_s
        self._work.put((request, call, tuple(released)))

    def _block_length(self, st: _State) -> int:
        """Tokens per draft block: st.k, or for a proposer slower than a verifier pass the length
        whose pipelined rate is best (0: none keeps ahead of plain decoding)."""
        if self.inline or self._draft_s.typical_step_s is None or self._costs.typical_step_s is None \
                or st.offered_length is not None:
            return st.k
        return pipelined_length(st.length.alpha, st.k, self._costs, st.rows, self._draft_s)

    def _hold_if_it_pays(self, st: _State) -> None:
        """Hold the next step for `st`'s outstanding draft if waiting for it commits more per second
        than sending at once what is at hand (a shorter draft, or none: wait_pays)."""
        if self.config.wait_for_drafts:
            return  # held until the draft arrives (set with the request)
        st.hold_until = None
        first = st.calls[0] if st.calls else None
        if self.inline or first is None or first.expected_at is None:
            return
        seq = st.seq
        k_now = len(seq.draft)
        k_then = min(st.k, first.end - seq.num_tokens)
        if seq.in_flight or seq.is_prefilling or k_then <= k_now:
            return
        now = time.perf_counter()
        expected_at = first.expected_at
        wait = max(0.0, expected_at - now)
        alpha = st.length.alpha if st.offered_length is None else 0.5
        hold_until = expected_at + 0.25 * wait + 0.001  # a little slack for a late answer
        if hold_until > now and wait_pays(alpha, k_then, self._costs, st.rows, wait, k_now):
            st.hold_until = hold_until
            if self._trace is not None:
                self._trace.hold(wait, k_then, k_now)

    # --- drafter thread (proposers that are not inline) ---------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            batch = [item]
            while True:  # everything asked for meanwhile, in as few calls as _one_per_sequence allows
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                batch.append(item)
            for answer in (i for i in batch if isinstance(i, _Answer)):
                self._post_if(self._received(answer))
            for part in _one_per_sequence([i for i in batch if not isinstance(i, _Answer)]):
                if self.chained:
                    self._send(part)
                else:
                    self._post_if(self._call(part))

    def _post_if(self, message: DraftsReady | None) -> None:
        if message is not None:
            self._post(message)

    def _call(self, batch: list[tuple[ProposeRequest, _Call, tuple[SeqId, ...]]]) -> DraftsReady | None:
        """One proposer call for a batch of (request, call, released seq ids); never raises. None
        when every request went stale while queued (nothing to ask; releases go with the next)."""
        released, requests, calls = _unpack(batch)
        started = time.perf_counter()
        if not requests:
            self.proposer.release(released)
            return None

        def drafts() -> list[Draft]:
            if released:
                self.proposer.release(released)
            return self.proposer.propose(requests)
        return self._ready(requests, calls, drafts, lambda: time.perf_counter() - started)

    def _send(self, batch: list[tuple[ProposeRequest, _Call, tuple[SeqId, ...]]]) -> None:
        """Start a call on a proposer that takes calls while others are in flight; its answer comes
        back through the work queue (_received), so this thread never waits on the network."""
        released, requests, calls = _unpack(batch)
        if not requests:
            self.proposer.release(released)
            return
        sent = time.perf_counter()
        try:
            if released:
                self.proposer.release(released)
            pending = self.proposer.send(requests)
        except Exception as e:  # noqa: BLE001 - reported as the call's answer, as _ready does
            self._post(self._ready(requests, calls, _raiser(e), lambda: 0.0))
            return
        pending.calls = calls
        for call in calls:
            call.pending = pending
        if all(c.stale for c in calls):  # cut while being sent: _cut saw no pending call to cancel
            pending.cancel()
        pending.add_done_callback(lambda _: self._work.put(_Answer(pending, sent, time.perf_counter())))

    def _received(self, answer: "_Answer") -> DraftsReady | None:
        if answer.pending.cancelled:
            return None  # every request in it went stale (Drafter._cut): nobody waits for it
        # The node drafts a sequence's calls one after another: a call sent while another was in flight
        # started drafting when that one was done, so its drafting time is counted from then.
        queued = answer.sent < self._last_done
        seconds = answer.done - max(answer.sent, self._last_done)
        self._last_done = max(self._last_done, answer.done)
        pending = answer.pending
        return self._ready(pending.requests, pending.calls, lambda: self.proposer.receive(pending),
                           lambda: seconds, beyond_drafting=not queued)

    def _ready(self, requests: tuple[ProposeRequest, ...], calls: tuple[_Call, ...],
               drafts: Callable[[], list[Draft]], seconds: Callable[[], float],
               beyond_drafting: bool = False) -> DraftsReady:
        """The leader's message for a call's answer: its drafts, or its error; never raises."""
        generations = tuple(c.generation for c in calls)
        try:
            answer = drafts()
            if len(answer) != len(requests):
                raise MeshError(f"proposer {self.proposer.name} answered {len(answer)} of {len(requests)} requests")
            message = DraftsReady(requests, generations, tuple(answer), seconds(), beyond_drafting=beyond_drafting)
            if self._trace is not None:
                self._trace.call(max(r.k for r in requests), max(len(r.tokens) for r in requests),
                                 max((len(d.tokens) for d in answer), default=0), message.seconds,
                                 requests[0].position)
            return message
        except MeshError as e:
            return DraftsReady(requests, generations, error=e)
        except Exception as e:  # noqa: BLE001 - a broken proposer must cost speed only, never the leader
            log.exception("proposer %s raised", self.proposer.name)
            return DraftsReady(requests, generations, error=MeshError(f"proposer raised {e!r}"))


@dataclass(frozen=True, slots=True)
class _Answer:
    """A chained call's completion, queued for the drafter thread (see Drafter._send)."""

    pending: object  # what the proposer's send returned: its requests, and the calls _send gave it
    sent: float
    done: float


def _unpack(batch) -> tuple[list[SeqId], tuple[ProposeRequest, ...], tuple[_Call, ...]]:
    """Released ids, and the requests (with their calls) not gone stale while queued."""
    live = [(r, c) for r, c, _ in batch if not c.stale]
    return [s for _, _, r in batch for s in r], tuple(r for r, _ in live), tuple(c for _, c in live)


def _one_per_sequence(batch: list) -> list[list]:
    """The queued requests in calls that each hold a sequence once, in order: a block chained onto
    one still queued beside it goes in the call after. A node refuses a call naming a sequence
    twice (transport/spec_convert.py), and when the loop thread queued both blocks before this
    thread woke, one call held both: on one core shared by the verifier and the leader, the
    two-machine bench's remote proposer failed most calls that way and drafting stopped."""
    parts: list[list] = []
    queued: dict[SeqId, int] = {}  # blocks of each sequence placed so far
    for item in batch:
        k = queued[item[0].seq_id] = queued.get(item[0].seq_id, 0) + 1
        if k > len(parts):
            parts.append([])
        parts[k - 1].append(item)
    return parts


def _raiser(error: Exception) -> Callable[[], list[Draft]]:
    def drafts() -> list[Draft]:
        raise error
    return drafts
