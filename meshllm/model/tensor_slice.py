"""A slice of one tensor, as a rank of a tensor-parallel group reads it (meshllm/tp/shard.py says which).

Apart from the sources (weights.py, gguf.py) so the planner can name slices without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """Rows (dim 0) or columns (dim 1) [start, stop) of a 2-d tensor, or elements of a 1-d one."""

    dim: int
    start: int
    stop: int

    def __post_init__(self):
        assert self.dim in (0, 1) and 0 <= self.start < self.stop, self
