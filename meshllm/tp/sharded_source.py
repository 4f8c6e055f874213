"""A TensorSource that hands the loader one rank's slices under the original tensor names.

The loader then builds an ordinary single-device Decoder from the rank's local config
(ShardLayout.local_config): its q/k/v and gate/up are fused per rank from the sliced
parts, exactly as the whole model's are. Only the slices are read from disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

from meshllm.model.config import ModelConfig
from meshllm.model.tensor_slice import TensorSlice
from meshllm.model.weights import TensorSource
from meshllm.tp.shard import ShardLayout


class ShardedSource:
    def __init__(self, source: TensorSource, layout: ShardLayout):
        self.source = source
        self.layout = layout
        self.path: Path = source.path

    def config(self) -> ModelConfig:
        return self.layout.local_config()

    def tensor_names(self) -> list[str]:
        return self.source.tensor_names()

    def fingerprint(self) -> str:
        return self.source.fingerprint()  # the whole model's: every rank must hold the same weights

    def num_bytes_read(self) -> int:
        return self.source.num_bytes_read()

    def read(self, names: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        names = list(names)
        slices = {n: s for n in names if (s := self.layout.slice_of(n)) is not None}
        whole = [n for n in names if n not in slices]
        out = self.source.read(whole, dtype) if whole else {}
        if slices:
            out.update(self.source.read_slices(slices, dtype))
        return out

    def read_slices(self, slices: Mapping[str, TensorSlice], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        raise NotImplementedError("a sharded source is already sliced; read() returns this rank's part")
