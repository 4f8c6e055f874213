"""The Stage gRPC service: loads a layer range on request and runs micro-batches.

Concurrency contract: gRPC runs each call on its own pool thread. Every loaded
shard has one lock, so micro-batches of all streams run one at a time on it
(one compute stream per node keeps the CPU threads from fighting). A Forward
stream relays: it computes, passes hidden states to the next stage over its own
stream, and yields the tokens that come back from downstream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step import StageTiming
from meshllm.errors import BadRequest, MeshError, ModelLoadError, WeightsMismatch
from meshllm.engine.weight_forms import prepare_for_cpu
from meshllm.model.loader import load_decoder
from meshllm.model.source import open_model
from meshllm.transport import codec, stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ModelResolver = Callable[[str, str], Path | None]  # (model_id, fingerprint) -> local path


@dataclass
class LoadedStage:
    request: stage_pb2.LoadRequest
    runner: StageRunner
    lock: threading.Lock

    @property
    def index(self) -> int:
        return self.request.stage_index


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, resolve_model: ModelResolver, channels: ChannelPool,
                 on_change: Callable[[], None] = lambda: None):
        self._resolve_model = resolve_model
        self._channels = channels
        self._on_change = on_change  # the node refreshes its card's shard list
        self._stages: dict[str, LoadedStage] = {}
        self._load_lock = threading.Lock()

    # --- control -----------------------------------------------------------------------------------
    def Load(self, request, context):
        try:
            reply = self.load(request)
        except MeshError as e:
            status = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, WeightsMismatch) else
                      grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, BadRequest) else grpc.StatusCode.NOT_FOUND)
            context.abort(status, f"[{e.code}] {e}")
        return reply

    def load(self, request: stage_pb2.LoadRequest) -> stage_pb2.LoadReply:
        with self._load_lock:
            existing = self._stages.get(request.plan_id)
            if existing is not None and existing.request == request:
                return stage_pb2.LoadReply(plan_id=request.plan_id, num_bytes_read=0, load_seconds=0.0)
            started = time.perf_counter()
            path = self._resolve_model(request.model_id, request.fingerprint)
            if path is None:
                raise ModelLoadError(f"this node has no model {request.model_id!r} with fingerprint "
                                     f"{request.fingerprint[:12]}; pass its folder with --models")
            files = open_model(path)
            fingerprint = files.source.fingerprint()
            if fingerprint != request.fingerprint:
                raise WeightsMismatch(f"{path} has fingerprint {fingerprint[:12]}, the plan wants "
                                      f"{request.fingerprint[:12]}; every stage must hold the same weights")
            if files.config.num_hidden_layers != request.num_layers:
                raise WeightsMismatch(f"{path} has {files.config.num_hidden_layers} layers, the plan "
                                      f"expects {request.num_layers}")
            dtype = DTYPES.get(request.dtype)
            if dtype is None:
                raise ModelLoadError(f"unknown dtype {request.dtype!r}; use one of {sorted(DTYPES)}")
            decoder = load_decoder(files.source, files.config, request.first_layer, request.last_layer, dtype)
            prepare_for_cpu(decoder, request.quantization or None, request.batch_invariant)
            self._stages[request.plan_id] = LoadedStage(request, StageRunner(decoder), threading.Lock())
            log.info("loaded %s layers [%d, %d) for plan %s in %.1fs", request.model_id, request.first_layer,
                     request.last_layer, request.plan_id, time.perf_counter() - started)
        self._on_change()
        return stage_pb2.LoadReply(plan_id=request.plan_id, num_bytes_read=files.source.num_bytes_read(),
                                   load_seconds=time.perf_counter() - started)

    def Release(self, request, context):
        stage = self._stages.get(request.plan_id)
        if stage is None:
            return stage_pb2.ReleaseReply(num_released=0)
        with stage.lock:
            ids = request.seq_ids or stage.runner.held_sequences()
            n = stage.runner.release(ids)
        return stage_pb2.ReleaseReply(num_released=n)

    def Info(self, request, context):
        return stage_pb2.StageInfoReply(shards=[
            stage_pb2.ShardState(plan_id=pid, model_id=s.request.model_id, first_layer=s.request.first_layer,
                                 last_layer=s.request.last_layer, seq_ids=s.runner.held_sequences(),
                                 kv_bytes=s.runner.cache.num_bytes, stage_index=s.index,
                                 num_prefix_blocks=len(s.runner.prefix))
            for pid, s in sorted(self._stages.items())])

    def loaded(self) -> list[stage_pb2.LoadRequest]:
        return [s.request for s in self._stages.values()]

    # --- data --------------------------------------------------------------------------------------
    def Forward(self, request_iterator, context):
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
        downstream: _Downstream | None = None
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
                except MeshError as e:
                    log.warning("stage %d step %d failed: %s", stage.index, request.step_id, e.code)
                    replies.put(stage_convert.error_reply(request.step_id, e.code, str(e), stage.index))
                    continue
                timing = StageTiming(stage.index, compute_s, received_at, time.time())
                if stage.runner.is_last:
                    timings = list(request.timings) + [stage_convert.timing_to_pb(timing)]
                    replies.put(stage_pb2.StepReply(step_id=request.step_id, timings=timings,
                                                    tokens=stage_convert.tokens_to_pb(out)))
                    continue
                if downstream is None or downstream.broken:
                    downstream = _Downstream(self._channels.get(stage.request.next_address), replies,
                                             stage.index + 1)
                # The same step onward, our output in place of our input (fields listed, not
                # CopyFrom: that would copy the incoming activations only to overwrite them).
                timings = list(request.timings) + [stage_convert.timing_to_pb(timing)]
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


class _Downstream:
    """Our stream to the next stage; its replies go straight into the upstream reply queue."""

    def __init__(self, channel: grpc.Channel, replies: queue.Queue, next_index: int):
        self._requests: queue.Queue = queue.Queue()
        self._replies = replies
        self._next_index = next_index
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self.broken = False
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

    def close(self) -> None:
        self._requests.put(None)
        self._reader.join(timeout=30)

    def _read(self, call) -> None:
        try:
            for reply in call:
                with self._lock:
                    self._pending.discard(reply.step_id)
                self._replies.put(reply)
        except grpc.RpcError as e:
            log.warning("stage %d unreachable: %s", self._next_index, e.code())
            with self._lock:
                self.broken = True
                pending, self._pending = self._pending, set()
            for step_id in sorted(pending):
                self._fail(step_id)

    def _fail(self, step_id: int) -> None:
        self._replies.put(stage_convert.error_reply(step_id, "stage_unreachable",
                                                    f"stage {self._next_index} is unreachable",
                                                    self._next_index))
