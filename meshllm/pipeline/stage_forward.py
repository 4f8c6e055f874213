"""The stage's data plane: one long-lived Forward stream per upstream hop.

Each stream has a pump thread that reads micro-batches, computes them under the
stage's lock, and passes the hidden states on to the next stage over its own stream
(stage_relay.py), or on the last stage puts the sampled tokens in the reply queue;
the gRPC thread yields replies (ours and those relayed back from downstream) in
arrival order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from meshllm.engine.step import StageTiming
from meshllm.errors import MeshError
from meshllm.pipeline.fault_injection import FaultInjector
from meshllm.pipeline.loaded_stages import LoadedStages
from meshllm.pipeline.stage_relay import Downstream
from meshllm.transport import codec, stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2

log = logging.getLogger(__name__)


class ForwardStreams:
    def __init__(self, stages: LoadedStages, channels: ChannelPool, faults: FaultInjector | None = None):
        self._stages = stages
        self._channels = channels
        self._faults = faults or FaultInjector(None)  # tests only: see fault_injection.py

    def serve(self, request_iterator) -> Iterator[stage_pb2.StepReply]:
        """Runs on a gRPC thread for the stream's life."""
        replies: queue.Queue = queue.Queue()
        pump = threading.Thread(target=self._pump, args=(request_iterator, replies), daemon=True,
                                name="stage-pump")
        pump.start()
        while True:
            item = replies.get()
            if item is None:
                return
            yield item

    def _pump(self, request_iterator, replies: queue.Queue) -> None:
        downstream: Downstream | None = None
        try:
            for request in request_iterator:
                received_at = time.time()
                stage = self._stages.get(request.plan_id)
                if stage is None:
                    replies.put(stage_convert.error_reply(request.step_id, "shard_not_loaded",
                                                          f"plan {request.plan_id} is not loaded here", -1))
                    continue
                try:
                    step = stage_convert.step_from_pb(request)
                    started = time.perf_counter()
                    with stage.lock:
                        out = stage.runner.run(step)
                    compute_s = time.perf_counter() - started
                    if step.seqs:
                        out = self._faults.after_compute(out)
                except MeshError as e:
                    log.warning("stage %d step %d failed: %s", stage.index, request.step_id, e.code)
                    replies.put(stage_convert.error_reply(request.step_id, e.code, str(e), stage.index))
                    continue
                timings = list(request.timings) + [
                    stage_convert.timing_to_pb(StageTiming(stage.index, compute_s, received_at, time.time()))]
                if stage.runner.is_last:
                    replies.put(stage_pb2.StepReply(step_id=request.step_id, timings=timings,
                                                    tokens=stage_convert.tokens_to_pb(out)))
                    continue
                if downstream is None or downstream.broken:
                    next_stage = self._channels.get(stage.request.next_address, stage.request.next_node_id)
                    downstream = Downstream(next_stage, replies, stage.index + 1)
                # The same step onward, our output in place of our input (fields listed, not
                # CopyFrom: that would copy the incoming activations only to overwrite them).
                downstream.send(stage_pb2.StepRequest(
                    plan_id=request.plan_id, step_id=request.step_id, seqs=request.seqs, input=codec.to_pb(out),
                    release=request.release, timings=timings, publish=request.publish, evict=request.evict,
                    block_size=request.block_size))
        except grpc.RpcError:
            pass  # upstream went away; the leader re-plans
        finally:
            if downstream is not None:
                downstream.close()
            replies.put(None)
