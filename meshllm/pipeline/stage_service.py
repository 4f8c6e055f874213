"""The Stage gRPC service: the control plane (stage_control.py) and the Forward streams'
data plane (stage_forward.py) over one registry of loaded stages.

This module is only the gRPC glue: it maps named errors to status codes.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from meshllm.errors import BadRequest, MeshError, ShardUnavailable, WeightsMismatch
from meshllm.pipeline.fault_injection import FaultInjector
from meshllm.pipeline.loaded_stages import LoadedStages
from meshllm.pipeline.stage_control import ModelResolver, StageControl
from meshllm.pipeline.stage_forward import ForwardStreams
from meshllm.tp.node_collective import NodeCollective
from meshllm.transport import stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc
from meshllm.transport.server import DEFAULT_MAX_STREAMS


class StageService(stage_pb2_grpc.StageServicer):
    def __init__(self, resolve_model: ModelResolver, channels: ChannelPool,
                 on_change: Callable[[], None] = lambda: None, max_streams: int = DEFAULT_MAX_STREAMS,
                 collective: NodeCollective | None = None):
        self.stages = LoadedStages()
        self.control = StageControl(self.stages, resolve_model, on_change, collective)
        self.forward = ForwardStreams(self.stages, channels, max_streams, FaultInjector.from_env())

    def Load(self, request, context):
        try:
            stage_convert.limits_from_pb(request)  # refuse bad limits before reading any weights
            return self.control.load(request)
        except MeshError as e:
            status = (grpc.StatusCode.FAILED_PRECONDITION if isinstance(e, WeightsMismatch) else
                      grpc.StatusCode.INVALID_ARGUMENT if isinstance(e, BadRequest) else
                      grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, ShardUnavailable) else
                      grpc.StatusCode.NOT_FOUND)
            context.abort(status, f"[{e.code}] {e}")

    def Unload(self, request, context):
        return self.control.unload(request)

    def Release(self, request, context):
        return self.control.release(request)

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
        pass

    def stop(self) -> None:
        self.control.close()
