"""The leader's own recovery from unexpected exceptions (supervision.py decides whether the
loop survives one), and the ends of its life: releasing everything on close, abandoning
everything when the loop stops. A mixin over the Leader's loop-thread state."""

from __future__ import annotations

import logging
import queue

from meshllm.engine.scheduler import MicroBatch
from meshllm.engine.sequence import SeqStatus
from meshllm.errors import MeshError
from meshllm.pipeline.failover import Recovered
from meshllm.pipeline.leader_messages import Submit, notify_failed
from meshllm.pipeline.supervision import Turn

log = logging.getLogger("meshllm.pipeline.leader")


class LeaderLifecycle:
    def _recover(self, error: MeshError) -> None:
        """After an unexpected exception: fail the requests the turn touched; when that is not
        known (scheduling, failover), fail them all and start from a fresh scheduler and prefix cache."""
        turn, self._turn = self._turn, Turn(())
        if turn.refuse is not None:
            turn.refuse(error)
        if turn.seq_ids is not None:
            for seq_id in turn.seq_ids:
                request = self._requests.get(seq_id)
                if request is not None:
                    request.seq.in_flight = False
                    self._finish(request, "error", error)
            return
        started = {s.seq_id for s in self.scheduler.running} | {
            r.seq.seq_id for r in self._requests.values() if r.seq.status is SeqStatus.RUNNING}
        cached = self.prefix.index.hashes()
        pending = set(self._chores.release)  # sequences that ended before: their releases go too
        requests = list(self._requests.values())
        self._requests.clear()
        self._in_flight.clear()  # their replies are dropped when they come
        self._watch.reset()
        self._new_state()
        if self.transport is not None:  # else no stage holds anything of theirs
            self._chores.release.extend(sorted(started | pending))
            self._chores.drop(cached)
        for request in requests:
            if self.drafter is not None:
                self.drafter.finish(request.seq.seq_id)
            notify_failed(request, error)

    def _release_all(self, error: MeshError) -> None:
        """On close: cancel every request and send their releases down the stream, in order after
        the steps already sent (an out-of-band Release could overtake them)."""
        try:
            for request in list(self._requests.values()):
                self._finish(request, "error", error)
            if self._chores and self.transport is not None:
                self._send(MicroBatch(()))
        except Exception:  # noqa: BLE001 - closing anyway: the stages free what the closed stream held
            log.exception("leader: could not release the running sequences on close")

    def _abandon_all(self, error: MeshError) -> None:
        """The loop stopped: end every request and refuse the submits still queued; closing the
        transport ends the stream, so the stages free every sequence of this leader."""
        for request in list(self._requests.values()):
            notify_failed(request, error)
        self._requests.clear()
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(message, Submit):
                message.refuse(error)
            elif isinstance(message, Recovered):
                message.deployment.transport.close()
        if self.transport is not None:
            self.transport.close()
