"""The stage's control plane: load a layer range for a plan, release sequences, report state.

Called by the gRPC servicer (stage_service.py) on pool threads; raises MeshErrors that
the servicer maps to status codes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.stage_weights import load_stage_decoder
from meshllm.errors import ModelLoadError, WeightsMismatch
from meshllm.model.source import open_model
from meshllm.pipeline.loaded_stages import LoadedStage, LoadedStages
from meshllm.transport.protos import stage_pb2

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
ModelResolver = Callable[[str, str], Path | None]  # (model_id, fingerprint) -> local path


class StageControl:
    def __init__(self, stages: LoadedStages, resolve_model: ModelResolver,
                 on_change: Callable[[], None] = lambda: None):
        self._stages = stages
        self._resolve_model = resolve_model
        self._on_change = on_change  # the node refreshes its card's shard list
        self._load_lock = threading.Lock()  # one load at a time: loads are memory-heavy

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
            decoder = load_stage_decoder(files.source, files.config, request.first_layer, request.last_layer, dtype,
                                         request.quantization or None, request.batch_invariant)
            self._stages.put(request.plan_id, LoadedStage(request, StageRunner(decoder)))
            log.info("loaded %s layers [%d, %d) for plan %s in %.1fs", request.model_id, request.first_layer,
                     request.last_layer, request.plan_id, time.perf_counter() - started)
        self._on_change()
        return stage_pb2.LoadReply(plan_id=request.plan_id, num_bytes_read=files.source.num_bytes_read(),
                                   load_seconds=time.perf_counter() - started)

    def release(self, request: stage_pb2.ReleaseRequest) -> stage_pb2.ReleaseReply:
        stage = self._stages.get(request.plan_id)
        if stage is None:
            return stage_pb2.ReleaseReply(num_released=0)
        with stage.lock:
            ids = request.seq_ids or stage.runner.held_sequences()
            n = stage.runner.release(ids)
        return stage_pb2.ReleaseReply(num_released=n)

    def info(self) -> stage_pb2.StageInfoReply:
        shards = []
        for plan_id, s in self._stages.items():
            with s.lock:  # the runner's dicts change under the compute lock
                shards.append(stage_pb2.ShardState(
                    plan_id=plan_id, model_id=s.request.model_id, first_layer=s.request.first_layer,
                    last_layer=s.request.last_layer, seq_ids=s.runner.held_sequences(),
                    kv_bytes=s.runner.cache.num_bytes, stage_index=s.index, num_prefix_blocks=len(s.runner.prefix)))
        return stage_pb2.StageInfoReply(shards=shards)

    def loaded(self) -> list[stage_pb2.LoadRequest]:
        return [s.request for _, s in self._stages.items()]
