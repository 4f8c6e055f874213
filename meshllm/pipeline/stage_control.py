"""The stage's control plane: load a layer range for a plan, unload a plan, release
sequences, report state.

Called by the gRPC servicer (stage_service.py) on pool threads; raises MeshErrors that
the servicer maps to status codes. A plan whose layers this node already holds for
another plan shares their weights (loaded_stages.py): a re-plan after a failure costs the
survivors nothing but a fresh KV cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from meshllm.engine.dtypes import DTYPES
from meshllm.engine.stage_weights import decoder_bytes, held_weight_bytes, load_stage_decoder
from meshllm.errors import BadRequest, ModelLoadError, ShardUnavailable, WeightsMismatch
from meshllm.model.source import ModelFiles, open_model
from meshllm.pipeline.loaded_stages import LoadedStages, SharedWeights, WeightKey
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2

log = logging.getLogger(__name__)

ModelResolver = Callable[[str, str], Path | None]  # (model_id, fingerprint) -> local path


class StageControl:
    def __init__(self, stages: LoadedStages, resolve_model: ModelResolver,
                 on_change: Callable[[], None] = lambda: None, device: str = "cpu"):
        self._stages = stages
        self._device = device  # the node's --device: where loaded weights, KV and compute go
        self._resolve_model = resolve_model
        self._on_change = on_change  # the node refreshes its card's shard list
        self._load_lock = threading.Lock()  # one load at a time: loads are memory-heavy

    def load(self, request: stage_pb2.LoadRequest) -> stage_pb2.LoadReply:
        stage_convert.limits_from_pb(request)  # BadRequest for invalid limits, before reading any weights
        with self._load_lock:
            existing = self._stages.get(request.plan_id)
            if existing is not None and existing.request == request:
                return stage_pb2.LoadReply(plan_id=request.plan_id, reused_weights=True)
            started = time.perf_counter()
            key = WeightKey.of(request)
            weights = self._stages.weights(key)
            num_bytes_read = 0
            if weights is None:
                weights, num_bytes_read = self._load_weights(request, key)
            self._stages.put(request.plan_id, request, weights)
            seconds = time.perf_counter() - started
            log.info("plan %s: %s layers [%d, %d) as stage %d (%s, %.1fs)", request.plan_id, request.model_id,
                     request.first_layer, request.last_layer, request.stage_index,
                     "loaded" if num_bytes_read else "weights shared with another plan", seconds)
        self._on_change()
        return stage_pb2.LoadReply(plan_id=request.plan_id, num_bytes_read=num_bytes_read, load_seconds=seconds,
                                   reused_weights=not num_bytes_read)

    def _load_weights(self, request: stage_pb2.LoadRequest, key: WeightKey) -> tuple[SharedWeights, int]:
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
        if not 0 <= request.first_layer < request.last_layer <= request.num_layers:
            raise BadRequest(f"layer range [{request.first_layer}, {request.last_layer}) is not inside the model's "
                             f"{request.num_layers} layers")
        dtype = DTYPES.get(request.dtype)
        if dtype is None:
            raise ModelLoadError(f"unknown dtype {request.dtype!r}; use one of {sorted(DTYPES)}")
        _check_memory(files, request, dtype.itemsize)
        decoder = load_stage_decoder(files.source, files.config, request.first_layer, request.last_layer, dtype,
                                     request.quantization or None, request.batch_invariant, device=self._device)
        return SharedWeights(key, decoder, decoder_bytes(decoder)), files.source.num_bytes_read()

    def unload(self, request: stage_pb2.UnloadRequest) -> stage_pb2.UnloadReply:
        """Forget a plan: its KV goes now, its weights once no other plan uses them."""
        with self._load_lock:
            stage, freed = self._stages.pop(request.plan_id)
        if stage is None:
            return stage_pb2.UnloadReply(was_loaded=False)
        with stage.lock:  # a step of that plan still running finishes first
            stage.runner.release(stage.runner.held_sequences())
            stage.runner.prefix.set_capacity(0)  # its prefix blocks too: no step of the plan can come now
        log.info("plan %s unloaded (%d weight bytes freed)", request.plan_id, freed)
        self._on_change()
        return stage_pb2.UnloadReply(was_loaded=True, weight_bytes_freed=freed)

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
                    kv_bytes=s.runner.cache.num_bytes, stage_index=s.index, num_prefix_blocks=len(s.runner.prefix),
                    weight_bytes=s.weights.num_bytes, prefix_bytes=s.runner.prefix.num_bytes))
        return stage_pb2.StageInfoReply(shards=shards)

    def loaded(self) -> list[stage_pb2.LoadRequest]:
        return [s.request for _, s in self._stages.items()]


def _check_memory(files: ModelFiles, request: stage_pb2.LoadRequest, dtype_bytes: int) -> None:
    """Refuse a range whose weights cannot fit in what the OS has free now, before reading it: a
    leader that planned on a stale card gets a clear error instead of this node swapping."""
    config = files.config
    held = held_weight_bytes(files.source, config, dtype_bytes, request.quantization or None,
                             request.batch_invariant)
    vocab_table = config.vocab_size * config.hidden_size * dtype_bytes
    layer = held.layer if held is not None else config.layer_parameters() * dtype_bytes
    need = (request.last_layer - request.first_layer) * layer
    if request.first_layer == 0:
        need += held.embedding if held is not None else vocab_table
    if request.last_layer == config.num_hidden_layers:
        need += held.lm_head if held is not None else vocab_table
    available = psutil.virtual_memory().available
    if need > available:
        raise ShardUnavailable(f"layers [{request.first_layer}, {request.last_layer}) need {need} bytes of weights; "
                               f"this node has {available} bytes free. Plan them on another node.",
                               missing_bytes=need - available, part=f"layers {request.first_layer}-"
                               f"{request.last_layer - 1}")
