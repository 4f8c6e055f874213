"""A stage's stream to the next stage: requests out, the next stage's replies straight into
the upstream reply queue. A broken stream answers every pending and later step with
`stage_unreachable` naming the stage that failed, so the leader learns which hop failed, and then
ends the upstream stream (a `ChainBroken` in the reply queue): the next stage freed what this
chain held.

Which stage failed travels up the chain in the trailing metadata of each stream a stage ends
because of it (`chain_end_metadata`): a step still on its way up when a stream ends (sent to a
stage that had already given up on the chain) is blamed on the stage that failed, not on the
healthy stage that ended the stream after it."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import grpc

from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

_FAILED_STAGE = "meshllm-failed-stage"
_FAILED_WHY = "meshllm-failed-why"


def chain_end_metadata(failed_stage: int, why: str) -> tuple[tuple[str, str], ...]:
    """Trailing metadata for a stream ended because stage `failed_stage` failed."""
    return (_FAILED_STAGE, str(failed_stage)), (_FAILED_WHY, why[:500])


@dataclass(frozen=True, slots=True)
class ChainBroken:
    """The last item of a reply queue whose downstream broke: the stream serving it ends here,
    with `metadata` as its trailing metadata."""

    failed_stage: int
    why: str

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return chain_end_metadata(self.failed_stage, self.why)


def failure_named_by(call) -> tuple[int, str] | None:
    """The failed stage (and why) a stream that ended cleanly names in its trailing metadata;
    None when it names none (the peer ended it for its own reasons, or is an older node)."""
    try:
        metadata = dict(call.trailing_metadata() or ())
    except Exception:  # noqa: BLE001 - a call without trailing metadata names nobody
        return None
    try:
        return int(metadata[_FAILED_STAGE]), str(metadata.get(_FAILED_WHY, ""))
    except (KeyError, ValueError):
        return None


class Downstream:
    def __init__(self, channel: grpc.Channel, replies: queue.Queue, next_index: int):
        self._requests: queue.Queue = queue.Queue()
        self._replies = replies
        self._next_index = next_index
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self.broken = False
        self._closing = False
        self.failed_stage = next_index  # the stage blamed once broken: the next one, or a later one it names
        self.why = "stream closed"
        call = stage_pb2_grpc.StageStub(channel).Forward(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, args=(call,), daemon=True, name="stage-relay")
        self._reader.start()

    def send(self, request: stage_pb2.StepRequest) -> None:
        with self._lock:
            if self.broken:
                if not request.unanswered:
                    self._fail(request.step_id)
                return
            if not request.unanswered:  # no reply will come for it
                self._pending.add(request.step_id)
        self._requests.put(request)

    def close(self, park: bool = False) -> None:
        """End the stream: the next stage frees what it holds of it, or with `park` (a failure
        ended this one) keeps it a while for a re-planned plan (kv_parking.py)."""
        self._closing = True
        self._requests.put(stage_pb2.StepRequest(end=stage_pb2.END_PARK if park else stage_pb2.END_FREE))
        self._requests.put(None)
        self._reader.join(timeout=30)

    def _read(self, call) -> None:
        try:
            for reply in call:
                with self._lock:
                    self._pending.discard(reply.step_id)
                self._replies.put(reply)
            if self._closing:
                return
            failed, why = self._next_index, "it ended the stream"
            named = failure_named_by(call)
            if named is not None and named[0] >= self._next_index:
                failed, why = named
        except grpc.RpcError as e:
            failed, why = self._next_index, f"{e.code().name}: {e.details()}"
        log.warning("stage %d unreachable: %s", failed, why)
        with self._lock:
            self.broken = True
            self.failed_stage = failed
            self.why = why
            pending, self._pending = self._pending, set()
        for step_id in sorted(pending):
            self._fail(step_id)
        self._replies.put(ChainBroken(failed, why))

    def _fail(self, step_id: int) -> None:
        self._replies.put(stage_convert.error_reply(step_id, "stage_unreachable",
                                                    f"stage {self.failed_stage} is unreachable ({self.why})",
                                                    self.failed_stage))
