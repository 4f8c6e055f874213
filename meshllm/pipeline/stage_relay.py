"""A stage's stream to the next stage: requests out, the next stage's replies straight into
the upstream reply queue. A broken stream answers every pending and later step with
`stage_unreachable` naming the next stage, so the leader learns which hop failed, and then
ends the upstream stream (None in the reply queue): the next stage freed what this chain held."""

from __future__ import annotations

import logging
import queue
import threading

import grpc

from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)


class Downstream:
    def __init__(self, channel: grpc.Channel, replies: queue.Queue, next_index: int):
        self._requests: queue.Queue = queue.Queue()
        self._replies = replies
        self._next_index = next_index
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self.broken = False
        self._closing = False
        self._why = "stream closed"
        call = stage_pb2_grpc.StageStub(channel).Forward(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, args=(call,), daemon=True, name="stage-relay")
        self._reader.start()

    def send(self, request: stage_pb2.StepRequest) -> None:
        with self._lock:
            if self.broken:
                self._fail(request.step_id)
                return
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
            why = "it ended the stream (a stage after it failed)"
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
        log.warning("stage %d unreachable: %s", self._next_index, why)
        with self._lock:
            self.broken = True
            self._why = why
            pending, self._pending = self._pending, set()
        for step_id in sorted(pending):
            self._fail(step_id)
        self._replies.put(None)

    def _fail(self, step_id: int) -> None:
        self._replies.put(stage_convert.error_reply(step_id, "stage_unreachable",
                                                    f"stage {self._next_index} is unreachable ({self._why})",
                                                    self._next_index))
