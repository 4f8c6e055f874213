"""The Stage gRPC service: the control plane (stage_control.py) and the Forward streams'
data plane (stage_forward.py) over one registry of loaded stages.

This module is the gRPC glue (it maps named errors to status codes) and the lease sweeper: a
thread that drops the plans no leader has used for `plan_lease_s` (stage_control.expire).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc

from meshllm.errors import BadRequest, MeshError, ShardUnavailable, TensorParallelAborted, WeightsMismatch
from meshllm.pipeline.fault_injection import FaultInjector
from meshllm.pipeline.loaded_stages import LoadedStages
from meshllm.pipeline.stage_control import ModelResolver, StageControl
from meshllm.pipeline.stage_forward import ForwardStreams
from meshllm.tp.node_collective import NodeCollective
from meshllm.transport import stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from meshllm.transport.server import DEFAULT_MAX_STREAMS

log = logging.getLogger(__name__)

MAX_SWEEP_INTERVAL_S = 15.0  # a dead leader's plan goes within its lease plus this


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, resolve_model: ModelResolver, channels: ChannelPool,
                 on_change: Callable[[], None] = lambda: None, max_streams: int = DEFAULT_MAX_STREAMS,
                 device: str = "cpu", collective: NodeCollective | None = None, *, plan_lease_s: float,
                 memory_cap: int | None = None):
        """`plan_lease_s`: a plan no leader used this long is dropped (NodeConfig.plan_lease_s). Leaders
        renew theirs at every step and, between requests, at each idle probe (every 2 s). `memory_cap`:
        the node's --max-memory, which a Load's memory check keeps to (StageControl)."""
        if plan_lease_s <= 0:
            raise ValueError(f"the plan lease must be positive, got {plan_lease_s}")
        self.plan_lease_s = plan_lease_s
        self._stopped = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.stages = LoadedStages()
        faults = FaultInjector.from_env()
        self.control = StageControl(self.stages, resolve_model, on_change, device, collective, faults, memory_cap)
        self.forward = ForwardStreams(self.stages, channels, max_streams, faults)

    def Load(self, request, context):
        try:
            stage_convert.limits_from_pb(request)  # refuse bad limits before reading any weights
            return self.control.load(request)
        except MeshError as e:
            # ABORTED: this rank is fine, another rank of its group failed (the cause, reported by it).
            status = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, WeightsMismatch) else
                      grpc.StatusCode.ABORTED if isinstance(e, TensorParallelAborted) else
                      grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, BadRequest) else
                      grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, ShardUnavailable) else
                      grpc.StatusCode.NOT_FOUND)
            if isinstance(e, ShardUnavailable):  # what did not fit, for the leader's health report
                context.set_trailing_metadata(stage_convert.shortfall_metadata(e))
            context.abort(status, f"[{e.code}] {e}")

    def Unload(self, request, context):
        return self.control.unload(request)

    def Release(self, request, context):
        return self.control.release(request)

    def Renew(self, request, context):
        return self.control.renew(request)

    def Adopt(self, request, context):
        try:
            return self.control.adopt(request)
        except BadRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[{e.code}] {e}")

    def Info(self, request, context):
        reply = self.control.info()
        reply.num_streams, reply.max_streams = self.forward.num_open, self.forward.max_streams
        return reply

    def Forward(self, request_iterator, context):
        return self.forward.serve(request_iterator, context)

    def loaded(self) -> list[stage_pb2.LoadRequest]:
        return self.control.loaded()

    # Node service interface: started with the node, stopped before its gRPC server.
    def start(self) -> None:
        self._sweeper = threading.Thread(target=self._sweep, daemon=True, name="plan-lease")
        self._sweeper.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=10)
        self.control.close()

    def _sweep(self) -> None:
        interval = min(self.plan_lease_s / 4, MAX_SWEEP_INTERVAL_S)
        while not self._stopped.wait(interval):
            try:
                self.control.expire(self.plan_lease_s)
            except Exception:  # noqa: BLE001 - the sweeper must outlive one bad unload
                log.exception("dropping expired plans failed")
