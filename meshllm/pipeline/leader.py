"""The leader: runs the scheduler's micro-batches through a plan and streams tokens.

Concurrency contract: `submit` and `cancel` may be called from any thread (HTTP
handlers, the CLI); they post typed messages to the inbox. One loop thread owns the
scheduler, the in-flight micro-batches, stop detection and event delivery, so none of
that state needs a lock. `on_event` callbacks run on the loop thread and must not block.

Failover (with a Replanner, failover.py): a step that fails because of a node, or a
pipeline that stops answering (deadline.py), makes the loop drop every step in flight,
mark every running sequence as having lost its KV (it re-prefills its committed tokens,
prompt and output, and samples only the token after them), and re-plan on a worker
thread; new requests wait meanwhile. The new transport is swapped in by a message.
Between requests no step can fail: the stream to stage 0 ending (a stage died: the chain of
streams ends) starts a probe, or a failover of stage 0 when it broke, at once; routine
probes catch the rest (a hung stage keeps its streams open).
Without a replanner, a stream that ended (the stages freed all it held: its epoch moved)
makes the running sequences re-prefill on the next stream.

Supervision (supervision.py): every turn of the loop runs under a LoopSupervisor, so an
unexpected exception fails the requests that turn touched and the loop keeps serving;
when it cannot, `failure` says why (/health reports it) and `submit` raises it. Every
reply is checked (replies.py) before anything is committed, naming the node at fault.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace

import torch

from meshllm.engine.grammar import Matcher
from meshllm.engine.kv_cache import SeqId
from meshllm.engine.logit_processors import PenaltyCounts
from meshllm.engine.sampler import SamplingParams
from meshllm.engine.scheduler import MicroBatch, Scheduler, SchedulerConfig, Work
from meshllm.engine.sequence import Sequence, SeqStatus
from meshllm.engine.step import SampledToken, SeqWork, Step, StepResult
from meshllm.engine.stopping import StopChecker
from meshllm.errors import BadRequest, ContextOverflow, InvalidReply, LeaderDown, MeshError
from meshllm.pipeline.chores import StageChores
from meshllm.pipeline.deadline import DEFAULT_FLOOR_S, DeadlineConfig, StallWatch
from meshllm.pipeline.events import GenerationEvent, LeaderObserver
from meshllm.pipeline.failover import (Deployment, FailoverConfig, Probed, Recovered, Recovery, RecoveryFailed,
                                       RecoveryTiming, Replanner, StageFailure, blame, invalid_reply_failure)
from meshllm.pipeline.leader_failover import LeaderFailover
from meshllm.pipeline.leader_lifecycle import LeaderLifecycle
from meshllm.pipeline.leader_messages import (Cancel, InFlight, Request, StepDone, StreamEnded, Submit, Wake,
                                             notify_failed)
from meshllm.pipeline.leader_prefix import LeaderPrefixCache
from meshllm.pipeline.replies import ReplyCheck
from meshllm.pipeline.seq_constraints import SeqConstraints
from meshllm.pipeline.supervision import LoopSupervisor, Turn
from meshllm.pipeline.transport import StepTransport, next_step_id
from meshllm.spec.drafter import Drafter, DraftsReady, SpecConfig
from meshllm.spec.proposer import Proposer

log = logging.getLogger(__name__)

Detokenizer = Callable[[int], str]
# Ids of the prompt a text continues, for its spacing (the legacy completions' text): sentencepiece
# drops the space before the first word of a text, which a continuation must keep.
CONTINUATION_CONTEXT = 4


class Leader(LeaderFailover, LeaderLifecycle):
    """`transport` None: no plan yet (the replanner is asked for one when a request comes)."""

    def __init__(self, transport: StepTransport | None, *, eos_token_ids: Collection[int],
                 new_detokenizer: Callable[[list[int]], Detokenizer], max_context: int,
                 config: SchedulerConfig | None = None, observer: LeaderObserver | None = None,
                 step_timeout_s: float = 120.0, proposer: Proposer | None = None,
                 spec_config: SpecConfig | None = None, vocab_size: int | None = None,
                 replanner: Replanner | None = None, deadline: DeadlineConfig | None = None,
                 failover: FailoverConfig | None = None):
        if transport is None and replanner is None:
            raise ValueError("a leader without a transport needs a replanner to get one")
        self.transport = transport
        self.eos_token_ids = frozenset(eos_token_ids)
        self.new_detokenizer = new_detokenizer
        self.max_context = max_context
        # No progress this long means a stalled pipeline (the cap of the measured deadline).
        self.step_timeout_s = step_timeout_s
        config = config or SchedulerConfig()
        self.observer = observer or LeaderObserver()
        self._seq_prefix = secrets.randbits(31) << 32  # seq ids (and prefix hashes) stay unique per leader
        num_stages = transport.num_stages if transport is not None else 1
        self._config = replace(config, num_stages=num_stages)
        self._vocab_size = vocab_size
        self._replies = ReplyCheck(vocab_size, transport.stage_names if transport is not None else ())
        self._epoch = transport.epoch if transport is not None else 0
        self._supervisor = LoopSupervisor()
        self._turn = Turn()
        self._new_state()
        # Without a replanner nothing can probe a suspect, so only the cap declares a stall.
        floor = step_timeout_s if replanner is None else min(DEFAULT_FLOOR_S, step_timeout_s)
        self._watch = StallWatch(deadline or DeadlineConfig(floor_s=floor, cap_s=step_timeout_s))
        self._recovery = (Recovery(replanner, failover or FailoverConfig(), self._inbox_put)
                          if replanner is not None else None)
        self._last_failure: StageFailure | None = None  # until the first token after its failover
        self._swapped: tuple[Deployment, float] | None = None  # the failover's deployment and swap time
        self._inbox: queue.Queue = queue.Queue()
        self._requests: dict[SeqId, Request] = {}
        self._in_flight: dict[int, InFlight] = {}
        self._seq_counter = 0
        self._id_lock = threading.Lock()
        self._closed = threading.Event()
        # Speculative decoding: drafts come back as DraftsReady messages in the inbox.
        self.drafter = None if proposer is None else Drafter(proposer, vocab_size, self._inbox.put, spec_config,
                                                                 self.observer)
        if transport is not None:
            self._watch_stream(transport)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="leader")
        self._thread.start()

    def _inbox_put(self, message) -> None:
        self._inbox.put(message)

    # --- any thread --------------------------------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        """Sequences it holds at most, running and queued: a request of more never fits."""
        return self._config.max_num_seqs + self._config.max_waiting

    def submit(self, prompt_ids: list[int], params: SamplingParams,
               on_event: Callable[[GenerationEvent], None], grammar: Matcher | None = None,
               speculative: bool | None = None, max_draft: int | None = None,
               continues_prompt: bool = False) -> SeqId:
        """Queue a request; events (text deltas, then one with finish_reason) go to on_event.

        `grammar`: a fresh matcher the output must follow (owned by the loop thread from here).
        `speculative` False decodes without drafts; `max_draft` caps draft tokens per step.
        `continues_prompt`: the text goes on from the prompt's (legacy completions), so it keeps
        the space before its first word; a reply (chat) starts a text of its own."""
        if not prompt_ids:
            raise ContextOverflow("the prompt is empty: at least one token is needed")
        if self._vocab_size is not None and not 0 <= min(prompt_ids) <= max(prompt_ids) < self._vocab_size:
            # Refused here, not by the first stage: a stage refusing a step reads as a faulty peer,
            # and the request would end as a stall with a healthy node suspected.
            bad = next(t for t in prompt_ids if not 0 <= t < self._vocab_size)
            raise BadRequest(f"token id {bad} in the prompt is outside the model's vocabulary [0, {self._vocab_size})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} = {total} exceeds the "
                f"model's context of {self.max_context} tokens; shorten the prompt or lower max_tokens")
        user_seeded = params.seed is not None
        if params.seed is None:
            params = replace(params, seed=secrets.randbits(63))
        with self._id_lock:
            self._seq_counter += 1
            seq_id = SeqId(self._seq_prefix | self._seq_counter)
        seq = Sequence(seq_id, list(prompt_ids), params)
        context = list(prompt_ids[-CONTINUATION_CONTEXT:]) if continues_prompt else []
        checker = StopChecker(params, self.eos_token_ids, self.new_detokenizer(context))
        constraints = SeqConstraints(params, seq.prompt_ids, grammar)
        message = Submit(Request(seq, checker, constraints, on_event, time.perf_counter()), user_seeded,
                          speculative, max_draft)
        if self.failure is not None:
            raise self.failure
        self._inbox.put(message)
        while not message.done.wait(0.5):  # the loop answers at once, unless it has stopped
            if self.failure is not None:
                raise self.failure
        if message.refused:
            raise message.refused[0]
        return seq_id

    @property
    def failure(self) -> LeaderDown | None:
        """Why this leader no longer serves (its loop gave up, or it was closed); None while it serves."""
        return self._supervisor.failure or (LeaderDown("the leader is closed") if self._closed.is_set() else None)

    def cancel(self, seq_id: SeqId) -> None:
        self._inbox.put(Cancel(seq_id))

    def generate(self, prompt_ids: list[int], params: SamplingParams, speculative: bool | None = None,
                 grammar: Matcher | None = None, continues_prompt: bool = False) -> Iterator[GenerationEvent]:
        """Blocking convenience: yields events until the sequence finishes."""
        events: queue.Queue = queue.Queue()
        seq_id = self.submit(prompt_ids, params, events.put, grammar=grammar, speculative=speculative,
                             continues_prompt=continues_prompt)
        try:
            while True:
                event = events.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.cancel(seq_id)  # no-op when finished; frees KV when the caller stops early

    def close(self) -> None:
        """Cancel what is running, free it on every stage (a last step carries the releases), and
        close the stream: a stage frees whatever a closed stream still held."""
        self._closed.set()
        self._inbox.put(Wake())
        self._thread.join(timeout=10)
        if self.drafter is not None:
            self.drafter.close()
        if self.transport is not None:
            self.transport.close()
        while True:  # a re-plan that finished after the loop stopped
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, Recovered):
                message.deployment.transport.close()

    # --- loop thread -------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    self._serve_turn()
                except Exception as e:  # noqa: BLE001 - supervised: fail what the turn touched, keep serving
                    if not self._supervisor.survive(e, self._recover):
                        break
        finally:
            if self._closed.is_set():
                self._release_all(MeshError("the server is shutting down"))
            else:
                self._abandon_all(self._supervisor.give_up("its loop thread ended"))

    def _serve_turn(self) -> None:
        self._turn = Turn()  # scheduling and failover: any running sequence may be affected
        self._fill_pipeline()
        try:  # nothing more can be sent until a result or a request arrives
            message = self._inbox.get(timeout=self._wait_s())
        except queue.Empty:
            self._check_progress()
            return
        self._check_progress()
        self._handle(message)
        while True:  # drain whatever else arrived before scheduling again
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                break

    def _handle(self, message) -> None:
        self._turn = Turn(())
        match message:
            case Submit(request=request):
                self._turn = Turn((request.seq.seq_id,), message.refuse)
                try:
                    self.scheduler.add(request.seq)
                    self._requests[request.seq.seq_id] = request
                    if self.drafter is not None and message.speculative is not False:
                        self.drafter.admit(request.seq, request.seq.params, message.user_seeded, message.max_draft)
                except MeshError as e:
                    message.refuse(e)
                message.done.set()
                if self.transport is None and not message.refused:
                    self._recovery.start(None)  # no plan now: this request asks for one
            case Cancel(seq_id=seq_id):
                self._turn = Turn((seq_id,))
                request = self._requests.get(seq_id)
                if request is not None:
                    self._finish(request, "cancelled")
            case StepDone(step_id=step_id, result=result):
                flight = self._in_flight.pop(step_id, None)
                if flight is None:
                    return  # given up as stalled, or sent through a transport since replaced
                self._turn = Turn(tuple(w.seq.seq_id for w in flight.batch.works))
                seconds = time.perf_counter() - flight.sent_at
                self._watch.done(flight.batch.num_tokens, seconds if result.ok else None)
                self.observer.on_step(flight.batch, result, seconds)
                if self.drafter is not None and result.ok:
                    self.drafter.step_done(flight.batch, seconds, result.timings if flight.overlapped else ())
                self._apply(flight.batch, result)
                if flight.epoch != self._epoch:  # its stream ended since: the stages no longer hold its KV
                    self.scheduler.recompute(w.seq for w in flight.batch.works)
            case DraftsReady():
                self._turn = Turn(tuple(r.seq_id for r in message.requests))
                if self.drafter is not None:
                    self.drafter.arrived(message)
            case Recovered() | RecoveryFailed() | Probed():
                self._turn = Turn()  # a failover touches every running sequence
                self._on_recovery(message)
            case StreamEnded():
                self._turn = Turn()
                self._on_stream_end(message)
            case Wake():
                pass
        self.observer.on_queue(len(self.scheduler.waiting), len(self.scheduler.running))

    # --- loop-thread state ---------------------------------------------------------------------------
    def _new_state(self) -> None:
        self._chores = StageChores()
        c = self._config
        self.prefix = LeaderPrefixCache(c.prefix_block_size, c.prefix_cache_blocks, self._seq_prefix,
                                        self._chores, self.observer)
        self.scheduler = Scheduler(c, on_admit=self.prefix.match)

    def _wait_s(self) -> float:
        now = time.perf_counter()
        held = self.drafter.next_deadline() if self.drafter is not None else None
        wait = 1.0 if held is None else max(0.0005, min(1.0, held - now))
        left = self._watch.seconds_left()
        if left is None:
            return wait
        return max(0.0005, min(wait, max(0.01, left)))

    def _fill_pipeline(self) -> None:
        if self.transport is None:
            return  # waiting for a plan
        if self.transport.epoch != self._epoch:  # a stream ended: the stages freed all it held
            self._epoch = self.transport.epoch
            self.prefix.reset()
            self.scheduler.recompute([s for s in self.scheduler.running if not s.in_flight])
        if self.drafter is not None and self.drafter.holding(time.perf_counter()):
            return  # a draft is about to arrive for a sequence that would go out without one
        while len(self._in_flight) < self.transport.num_stages:
            batch = self.scheduler.next_microbatch()
            if batch is None:
                break
            self._send(batch)
        if not self._in_flight and self._chores:
            self._send(MicroBatch(()))  # an empty step carries these through every stage

    def _send(self, batch: MicroBatch) -> None:
        step_id = next_step_id()
        ids: list[int] = []
        works, sent = [], []
        for w in batch.works:
            penalties, masks = PenaltyCounts(), ()
            request = self._requests.get(w.seq.seq_id)
            if w.num_scored and request is not None and request.constraints.active:
                draft, penalties, masks = request.constraints.inputs(w.draft, w.draft_dists is not None)
                if len(draft) < len(w.draft):  # the grammar ends the draft there
                    cut = len(w.draft) - len(draft)
                    dists = None if w.draft_dists is None else w.draft_dists[:len(draft)]
                    w = replace(w, num_tokens=w.num_tokens - cut, num_scored=w.num_scored - cut, draft=draft,
                                draft_dists=dists)
            committed_end = w.start + w.num_tokens - len(w.draft)
            ids.extend(w.seq.token_ids(w.start, committed_end))
            ids.extend(w.draft)
            works.append(SeqWork(w.seq.seq_id, w.start, w.num_tokens, w.num_scored,
                                 w.seq.params if w.num_scored else None, w.attach, w.draft, penalties, masks,
                                 w.draft_dists))
            sent.append(w)
            self.prefix.sent(w)
        batch = MicroBatch(tuple(sent))
        release, publish, evict = self._chores.take()
        step = Step(step_id, tuple(works), torch.tensor(ids, dtype=torch.int64), release, (), publish, evict,
                    self.prefix.block_size)
        self._in_flight[step_id] = InFlight(batch, time.perf_counter(), self._epoch, overlapped=bool(self._in_flight))
        self._watch.sent(batch.num_tokens)
        try:
            future = self.transport.submit(step)
        except BaseException:
            self._chores.release.extend(release)  # not sent: the recovery sends them (leader_lifecycle)
            raise
        future.add_done_callback(lambda f, sid=step_id: self._inbox.put(StepDone(sid, f.result())))

    def _apply(self, batch: MicroBatch, result: StepResult) -> None:
        if not result.ok and result.error_code == "kv_missing" and any(w.attach for w in batch.works):
            self._attach_again(batch)
            return
        if not result.ok:
            failure = blame(result, self.transport.num_stages) if self._recovery is not None else None
            if failure is not None:
                self._fail_over(failure, batch)
                return
            error = self._replies.failure(result)  # names the stage's node
            self._fail(batch.works, error)
            log.warning("step %d failed: %s", result.step_id, error)
            return
        try:
            committed = self._replies.committed(batch.works, result)
        except MeshError as e:  # a stage answered something other than what was asked
            log.warning("step %d: %s", result.step_id, e)
            if isinstance(e, InvalidReply) and self._recovery is not None:
                self._fail_over(invalid_reply_failure(e, self.transport.num_stages), batch)
            else:
                self._fail(batch.works, e)
            return
        now = time.perf_counter()
        for w in batch.works:
            tokens = committed.get(w.seq.seq_id, ())
            num_accepted = max(0, len(tokens) - 1) if w.draft else 0
            self.scheduler.on_computed(w, num_accepted=num_accepted)
            if w.num_scored:
                self.observer.on_verified(len(w.draft), num_accepted)
                if self.drafter is not None:
                    self.drafter.verified(w, num_accepted, batch)
            request = self._requests.get(w.seq.seq_id)
            if request is None or w.seq.status is SeqStatus.FINISHED:
                continue
            self.prefix.computed(w)
            for token in tokens:
                w.seq.output_ids.append(token.token_id)
                refused = request.constraints.commit(token.token_id)
                if refused is not None:
                    self._finish(request, "error", MeshError(refused))
                    break
                try:
                    self._deliver(request, token, now)
                except Exception as e:  # noqa: BLE001 - one request's detokenizer or callback must not stop the loop
                    log.exception("request %d failed while delivering a token", w.seq.seq_id)
                    if w.seq.status is not SeqStatus.FINISHED:  # its last token: _deliver finished it already
                        self._finish(request, "error", notify=False)
                    notify_failed(request, MeshError(f"internal error while streaming: {e}"))  # if it raises again too
                if w.seq.status is SeqStatus.FINISHED:
                    break  # a stop inside accepted draft tokens: the rest are not part of the output
            if self.drafter is not None and w.seq.status is not SeqStatus.FINISHED:
                self.drafter.committed(w.seq)

    def _attach_again(self, batch: MicroBatch) -> None:
        """A stage no longer holds prefix blocks this batch attached: its LRU dropped them (the
        leaders sharing a plan share its stages' prefix room), or the stream that published them
        ended. The attaching sequences prefill their whole prompt instead and the batch goes
        again: the stages before the failed one roll back to each work's start. Not a failover
        (a re-plan would re-prefill every running sequence); KV lost otherwise fails the batch
        again, now without attachments, and takes the usual path."""
        log.info("a stage lacks prefix blocks %d sequences attached; they prefill their prompts",
                 sum(1 for w in batch.works if w.attach))
        self.prefix.drop_attached(batch.works)
        for w in batch.works:
            w.seq.in_flight = False
            if w.attach:
                w.seq.num_computed = w.seq.num_cached = 0

    def _fail(self, works: tuple[Work, ...], error: MeshError) -> None:
        for w in works:
            w.seq.in_flight = False
            request = self._requests.get(w.seq.seq_id)
            if request is not None:
                self._finish(request, "error", error)

    def _deliver(self, request: Request, token: SampledToken, now: float) -> None:
        seq = request.seq
        text = request.checker.feed(token.token_id)
        request.unreleased.append(token)
        first = request.first_token_at is None
        self.observer.on_token(first, now - (request.submitted_at if first else request.last_token_at))
        if self._swapped is not None:  # the first token after a failover: KV rebuilt
            deployment, swapped_at = self._swapped
            failure = self._last_failure
            self.observer.on_recovered(RecoveryTiming(failure.code, failure.stage_index, failure.detect_s,
                                                      deployment.plan_s, deployment.load_s, now - swapped_at,
                                                      deployment.carried_positions))
            self._swapped = self._last_failure = None
        if first:
            request.first_token_at = now
        request.last_token_at = now
        reason = request.checker.finish_reason
        if reason is not None:
            self._finish(request, reason, notify=False)
        # One event per token, in order, once its text goes out, so its logprobs come with that
        # text (the last released token's event carries it; text going out always releases one):
        # a token whose text is held waits; those of a stop string go out at the end without
        # logprobs, their text being no part of the output.
        released = request.checker.released
        going, request.unreleased = request.unreleased[:released], request.unreleased[released:]
        cut = request.unreleased if reason is not None else []
        if reason is not None:
            request.unreleased = []
        events = [(t, t.logprobs) for t in going] + [(t, None) for t in cut]
        for i, (t, logprobs) in enumerate(events):
            request.on_event(GenerationEvent(seq.seq_id, text if i == len(going) - 1 else "", t.token_id, logprobs,
                                             reason if i == len(events) - 1 else None,
                                             num_prompt_tokens=seq.num_prompt_tokens,
                                             num_cached_tokens=seq.num_cached))

    def _finish(self, request: Request, reason: str, error: MeshError | None = None,
                notify: bool = True) -> None:
        seq = request.seq
        self.prefix.forget(seq)
        if self.drafter is not None:
            self.drafter.finish(seq.seq_id)
        was_started = seq.status is SeqStatus.RUNNING
        self.scheduler.finish(seq)
        del self._requests[seq.seq_id]
        if was_started:
            self._chores.release.append(seq.seq_id)
        self.observer.on_finish(reason, len(seq.output_ids))
        if notify:
            request.on_event(GenerationEvent(seq.seq_id, "", finish_reason=reason, error=error,
                                             num_prompt_tokens=seq.num_prompt_tokens,
                                             num_cached_tokens=seq.num_cached))
