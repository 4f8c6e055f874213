"""The leader's failover, split out of leader.py by concern: noticing that the pipeline
stopped making progress (or, between requests, that a stage stopped answering or that the
stream to stage 0 ended: a stage died while idle, looked into at once), dropping the
transport, marking running sequences for a KV rebuild, and swapping in the re-planned
transport. A mixin over the Leader's loop-thread state: every method runs on the loop thread."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from meshllm.engine.scheduler import MicroBatch
from meshllm.engine.step import StepResult
from meshllm.errors import PipelineStalled
from meshllm.pipeline.failover import Probed, Recovered, RecoveryFailed, StageFailure
from meshllm.pipeline.leader_messages import StreamEnded
from meshllm.pipeline.replies import ReplyCheck
from meshllm.pipeline.transport import StepTransport

log = logging.getLogger("meshllm.pipeline.leader")  # one logger for the loop, whichever file

# A failed pipeline's stage 0 may be stuck behind the failure (a tensor-parallel rank 0 waits out
# its group's timeout in a collective): the loop waits this long for it to drain, not the
# transport's default 10 s. The old stream parks what it held on each stage when it ends, for the
# new plan's stages that kept their range to adopt (carry_over.py); the others start fresh.
FAILED_CLOSE_S = 1.0


class LeaderFailover:
    def _check_progress(self) -> None:
        """No reply within the deadline: probe the stages (with a replanner), else give up on
        the steps in flight so a stalled stage gives clear errors instead of hanging requests."""
        if self.transport is None:
            # No plan fits: try again now and then, so the service recovers on its own when a node joins.
            if self._recovery is not None and not self._recovery.running and \
                    time.monotonic() - self._recovery.last_attempt >= self._recovery.config.retry_interval_s:
                self._recovery.start(None)
            return
        if not self._in_flight:
            if self._recovery is not None and self._recovery.idle_probe_due():
                self._recovery.probe(self._recovery.config.idle_probe_timeout_s, idle=True)
            return
        if not self._watch.due():
            return
        if self._recovery is not None:
            self._watch.start_probe()
            self._recovery.probe(self._watch.config.probe_timeout_s)
            return
        stalled_s = self._watch.stalled_for()
        self._watch.reset()
        for step_id, flight in list(self._in_flight.items()):
            del self._in_flight[step_id]
            log.warning("step %d stalled for %.1fs; failing its %d sequences", step_id, stalled_s,
                        len(flight.batch.works))
            self._apply(flight.batch, StepResult(step_id, error_code="pipeline_stalled", failed_stage=None,
                                                 error_message=f"no answer within {stalled_s:.1f}s"))

    def _watch_stream(self, transport: StepTransport) -> None:
        """Any thread: hear about the transport's streams ending while idle (StreamEnded)."""
        transport.watch(lambda end: self._inbox.put(StreamEnded(transport, end)))

    def _on_stream_end(self, message: StreamEnded) -> None:
        """The stream to stage 0 ended with nothing in flight: a stage may have failed between
        requests. Closed by stage 0, a later stage failed (stage_relay.py) and the stream does not
        say which; broken (a gRPC error), stage 0 or the link to it may have, or the channel was
        merely closed under it (CANCELLED when the pool drops a channel, a keepalive blip). Either
        way probe the stages now, not at the next routine check: the probe names a dead or hung
        node within its timeout, and a healthy stage 0 is not failed over for a blip."""
        if message.transport is not self.transport or self._recovery is None:
            return  # about a transport since replaced (or nothing can re-plan: the next submit reopens it)
        how = f"broke ({message.end.why})" if message.end.broken else "was closed by stage 0 (a later stage failed?)"
        log.info("the idle stream to stage 0 %s; probing the stages now", how)
        self._recovery.probe_now()

    def _fail_over(self, failure: StageFailure, failed: MicroBatch | None = None) -> None:
        """Stop using the transport, mark every running sequence for a rebuild of its KV, and
        re-plan off the loop. Sequences past their failover limit end with pipeline_stalled."""
        log.warning("failing over: stage %s [%s] %s", failure.stage_index, failure.code, failure.message)
        self.observer.on_failure(failure)
        self._last_failure = self._last_failure or failure  # a second failure is part of the same recovery
        in_flight = set()
        batches = [f.batch for f in self._in_flight.values()] + ([failed] if failed is not None else [])
        for batch in batches:
            for w in batch.works:
                w.seq.in_flight = False
                in_flight.add(w.seq.seq_id)
        self._in_flight.clear()
        self._watch.reset()
        self.transport.close(FAILED_CLOSE_S, park=True)  # the stages keep what they hold: a new plan may adopt it
        self.transport = None
        self._chores.take()  # the new plan's stages hold none of those sequences or blocks
        limit = self._recovery.config.max_failovers
        carry = {}  # positions whose KV every stage held: stages that keep their range adopt them
        for seq in list(self.scheduler.running):
            held = max(seq.num_computed, seq.num_held_before)  # a stream that just ended reset the first
            seq.num_held_before = 0
            if held:
                carry[seq.seq_id] = held
            if not seq.num_computed and seq.seq_id not in in_flight:
                continue  # admitted but never sent (or reset when its stream ended): nothing more to do
            request = self._requests[seq.seq_id]
            request.num_failovers += 1
            if request.num_failovers > limit:
                carry.pop(seq.seq_id, None)
                self._finish(request, "error", PipelineStalled(
                    f"gave up after {limit} failovers; the last: stage {failure.stage_index} "
                    f"[{failure.code}] {failure.message}"))
                continue
            self.prefix.forget(seq)
            # Re-prefill prompt and output, sampling only the token after them; stages that adopted
            # the carried KV skip the positions they hold (engine/kv_carry.py).
            seq.num_computed = 0
        self._recovery.start(failure, carry)

    def _on_recovery(self, message: Recovered | RecoveryFailed | Probed) -> None:
        if isinstance(message, Probed):
            self._recovery.probing = False
            if self._recovery.suspect and message.idle:  # a stream ended while it ran: it may have asked
                self._recovery.suspect = False  # every node before the failure, so ask again when it found nothing
                if self.transport is not None and not (message.unresponsive or message.refused or message.unloaded):
                    self._recovery.probe_now()
                    return
        if message.epoch != self._recovery.epoch:
            return  # about a transport that has been replaced since
        match message:
            case Probed(refused=refused) if refused and self.transport is not None:
                self._fail_over(_refused(refused[0]))
            case Probed(unresponsive=unresponsive, idle=True):
                if unresponsive and self.transport is not None:
                    i = unresponsive[0]
                    self._fail_over(StageFailure(i, "stage_unreachable", f"stage {i} stopped answering health "
                                                 "checks between requests"))
                elif message.unloaded and self.transport is not None:
                    self._fail_over(_plan_dropped(message.unloaded[0]))
            case Probed(unresponsive=unresponsive):
                if self.transport is None:
                    return
                stalled_s = self._watch.stalled_for()
                if message.unloaded and not unresponsive:
                    self._fail_over(_plan_dropped(message.unloaded[0]))
                elif unresponsive:
                    self.observer.on_stall()
                    i = unresponsive[0]
                    self._fail_over(StageFailure(i, "pipeline_stalled", f"stage {i} stopped answering: no reply "
                                                 f"for {stalled_s:.1f}s and no answer to a health check",
                                                 detect_s=stalled_s))
                elif self._watch.probed():
                    self.observer.on_stall()
                    self._fail_over(StageFailure(None, "pipeline_stalled", f"no reply for {stalled_s:.1f}s "
                                                 f"although every stage answers health checks",
                                                 detect_s=stalled_s))
            case Recovered(deployment=deployment):
                self._recovery.finished()
                self.transport = deployment.transport
                self._watch_stream(deployment.transport)
                self._config = replace(self._config, num_stages=deployment.transport.num_stages)
                self.scheduler.config = replace(self.scheduler.config, num_stages=deployment.transport.num_stages)
                self._replies = ReplyCheck(self._vocab_size, deployment.transport.stage_names)
                self._epoch = deployment.transport.epoch
                self.prefix.reset()
                self._swapped = (deployment, time.perf_counter()) if self._last_failure else None
                log.info("serving through %s%s", deployment.description or "a new plan",
                         f"; stages {list(deployment.carried_by)} kept {deployment.carried_positions} KV positions"
                         if deployment.carried_positions else "")
            case RecoveryFailed(error=error):
                self._recovery.finished()
                self._last_failure = None
                log.warning("no plan: [%s] %s", error.code, error)
                for request in list(self._requests.values()):
                    self._finish(request, "error", error)


def _refused(stage_index: int) -> StageFailure:
    """A node of the stage answers but refuses this leader's calls (authentication, permission):
    it cannot serve this leader's plan; the plan owner leaves it out while it refuses."""
    return StageFailure(stage_index, "plan_refused", f"stage {stage_index} refuses this leader's calls")


def _plan_dropped(stage_index: int) -> StageFailure:
    """A stage dropped the plan (this leader left it unused past the node's lease: paused, cut off):
    load it again; no node is at fault."""
    return StageFailure(None, "shard_not_loaded", f"stage {stage_index} no longer holds the plan (its lease ran "
                        f"out while this leader was away); loading it again")
