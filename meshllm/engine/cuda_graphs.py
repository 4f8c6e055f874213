"""Decode steps replayed as CUDA graphs (`--device cuda`).

Why: a decode step of a stage is hundreds of small kernels (SmolLM2-135M: ~600), each launched
from Python; on a fast GPU the launches, not the kernels, set the pace (measured on an H200:
~60-90 tok/s, where the weights would allow thousands). A CUDA graph records the step's kernels
once and replays them with one launch. A recorded step reads the same addresses with the same
shapes every time, so the step runs in its static form (model/decoder.py StaticSlice): each
sequence's key and value are written at a device index, and its query attends over the cache's
whole capacity through a mask, instead of over a slice whose length changes every step.

A graph belongs to one batch: its sequences' KV tensors (their addresses and capacity, which
change when a cache grows or a sequence is new) and the row count. A batch is recorded the
second step in a row it is seen (a one-off batch is not worth recording), and up to MAX_GRAPHS
are kept, least recently used dropped, each with its own memory pool for its intermediates.
Steps that are not decode steps of that shape (prefill, verify passes, chosen logit rows) run
as before. A failure to record turns graphs off for the stage, logged once, and the step runs
as before.

    MESHLLM_CUDA_GRAPHS=0 turns them off (bench/device_decode.py measures both).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from meshllm.engine.kv_cache import SequenceKV
from meshllm.model.decoder import Decoder, SeqSlice, StaticSlice

log = logging.getLogger(__name__)

ENABLED = os.environ.get("MESHLLM_CUDA_GRAPHS", "1") != "0"
MAX_GRAPHS = 16


@dataclass
class StaticStep:
    """A decode step's inputs where a graph reads them, and its output where the graph leaves it."""

    x: Tensor  # token ids [rows] or hidden states [rows, hidden]
    positions: Tensor  # [rows], for the rotary tables
    at: Tensor  # [rows]: each sequence's KV length, where its new key and value go
    caches: list[SequenceKV]  # until the step is recorded (the graph keeps their addresses)
    out: Tensor | None = None

    @classmethod
    def build(cls, decoder: Decoder, x: Tensor, positions: Tensor, slices: list[SeqSlice]) -> StaticStep:
        device = decoder.device
        x = x.to(device, copy=True)
        positions = positions.to(device, copy=True)
        at = torch.tensor([s.kv.length for s in slices], device=device)
        return cls(x, positions, at, [s.kv for s in slices])

    def load(self, x: Tensor, positions: Tensor, slices: list[SeqSlice]) -> None:
        self.x.copy_(x, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.at.copy_(torch.tensor([s.kv.length for s in slices]), non_blocking=True)

    def run(self, decoder: Decoder, window: int | None) -> Tensor:
        """The step by torch ops; nothing read back to the host, so a graph can record it."""
        slices = []
        for row, kv in enumerate(self.caches):
            at = self.at[row:row + 1]
            keys = torch.arange(kv.capacity, device=at.device)
            visible = keys <= at
            if window is not None:
                visible &= keys > at - window
            slices.append(StaticSlice(kv, row, at, visible.view(1, 1, 1, -1)))
        self.out = decoder.run(self.x, self.positions, slices)
        return self.out


class GraphedDecode:
    """Decoder.fast_path of a CUDA stage: decode steps as CUDA graphs, other steps as before."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.window = decoder.config.sliding_window
        self.graphs: OrderedDict[tuple, tuple[torch.cuda.CUDAGraph, StaticStep]] = OrderedDict()
        self.stream = torch.cuda.Stream(decoder.device)
        # A static step has one mask for every layer: Gemma 3's layers differ in window, so its
        # decode steps run ungraphed (the eager path handles each layer's own). A mixture of
        # experts picks its experts' products on the host (decoder.MoE), which a graph cannot hold.
        self.enabled = decoder.config.sliding_layers is None and not decoder.config.num_experts
        self._last_key: tuple | None = None
        # Plans on one node share a stage's weights, each with its own compute lock
        # (pipeline/loaded_stages.py): their steps may arrive here at once.
        self._lock = threading.Lock()
        self.replays = self.recorded = 0

    def _key(self, x: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> tuple | None:
        """The batch's identity, or None where this step is not a decode step a graph can run."""
        rows = x.shape[0]
        if not self.enabled or len(slices) != rows or any(s.num_tokens != 1 for s in slices):
            return None
        if logit_rows is not None and not torch.equal(logit_rows.cpu(), torch.arange(rows)):
            return None
        rotary = self.decoder.rotary
        return (tuple(x.shape), x.dtype, rotary.cos.data_ptr(), rotary.sin.data_ptr(),
                tuple((s.kv.k.data_ptr(), s.kv.v.data_ptr(), s.kv.capacity) for s in slices))

    @torch.inference_mode()
    def forward(self, x: Tensor, positions: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> Tensor:
        # The stage's GPU made current: current_stream() below, and recording's synchronize, are
        # the current device's, and a stage may be on cuda:1 while the thread's device is 0.
        with self._lock, torch.cuda.device(self.decoder.device):
            return self._forward(x, positions, slices, logit_rows)

    def _forward(self, x: Tensor, positions: Tensor, slices: list[SeqSlice], logit_rows: Tensor | None) -> Tensor:
        # positions come from the host (stage_runner.py); read back once here, not in the step
        self.decoder.rotary.ensure(int(positions.max()) + 1 if positions.numel() else 0, self.decoder.device)
        key = self._key(x, slices, logit_rows)
        if key is None:
            return self.decoder.run(x, positions, slices, logit_rows)
        held = self.graphs.get(key)
        if held is not None:
            self.graphs.move_to_end(key)
            graph, step = held
            step.load(x, positions, slices)
            graph.replay()
            self.replays += 1
            return step.out.clone()  # the next replay writes over step.out
        step = StaticStep.build(self.decoder, x, positions, slices)
        # The step itself, in its static form, on the side stream a graph records from: this also
        # compiles and tunes whatever the first run of each kernel does, which recording must not.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            step.run(self.decoder, self.window)
        torch.cuda.current_stream().wait_stream(self.stream)
        step.out.record_stream(torch.cuda.current_stream())  # read there next; made on the side stream
        out = step.out.clone()
        if key == self._last_key:
            self._record(key, step)
        self._last_key = key
        return out

    def _record(self, key: tuple, step: StaticStep) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # The outer context puts this thread back on its stream even when the recording's own
            # exit fails (torch ends the capture, which raises, before it restores the stream).
            # thread_local: other threads of the node (a stage of another plan, a transfer) may
            # use the GPU meanwhile; their work is not part of this recording.
            with torch.cuda.stream(torch.cuda.current_stream()), \
                    torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                step.run(self.decoder, self.window)
        except Exception:  # noqa: BLE001 -- any failure: this stage runs its steps as before
            self.enabled = False
            self.graphs.clear()
            log.warning("CUDA graphs off for layers [%d, %d): recording a decode step failed",
                        self.decoder.first_layer, self.decoder.last_layer, exc_info=True)
            return
        # The graph holds the caches' addresses, not the caches: a finished sequence's memory is
        # freed now, not when its graph is dropped. A replay needs live caches at those very
        # addresses and capacities (the key), so it only ever writes into the batch's own.
        step.caches = []
        self.graphs[key] = (graph, step)
        self.recorded += 1
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)


def graphed(decoder: Decoder) -> Decoder:
    """Give a CUDA stage graphed decode steps (unless MESHLLM_CUDA_GRAPHS=0)."""
    if ENABLED and decoder.device.type == "cuda" and decoder.fast_path is None:
        decoder.fast_path = GraphedDecode(decoder)
    return decoder
