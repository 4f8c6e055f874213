"""Commands from rank 0 to the other ranks, broadcast in fixed-size frames.

A frame is a preallocated int64 buffer of `frame_words`; its first word is the command's
length, so a worker knows after the first frame how many more to receive. A decode step
fits one frame (one broadcast); a prefill chunk of hidden states spans several. The
buffers are reused, so steady decoding allocates nothing here.
"""

from __future__ import annotations

import torch

from meshllm.tp.collective import Collective
from meshllm.tp.command import Command, decode, encode

DEFAULT_FRAME_WORDS = 4096  # 32 KiB: a decode step of a hundred or so sequences (cluster/tp_cost.py counts it)


def num_frames(num_words: int, frame_words: int) -> int:
    """Frames a command of `num_words` takes: the first frame gives one word to the length."""
    return max(1, -(-(num_words + 1) // frame_words))


def to_frames(words: torch.Tensor, frame_words: int) -> list[torch.Tensor]:
    """[length, words..., zero padding] cut into frames of `frame_words` (views of one buffer)."""
    n = num_frames(words.numel(), frame_words)
    flat = torch.zeros(n * frame_words, dtype=torch.int64)
    flat[0] = words.numel()
    flat[1:1 + words.numel()] = words
    return list(flat.view(n, frame_words))


def from_frames(frames: list[torch.Tensor]) -> torch.Tensor:
    flat = torch.cat(frames) if len(frames) > 1 else frames[0]
    return flat[1:1 + int(flat[0])]


class CommandChannel:
    """Rank 0 calls `send`, the others `receive`, in the same order: a broadcast is collective.
    Not thread-safe: the caller serialises (rank 0 under its runner's lock)."""

    def __init__(self, collective: Collective, frame_words: int = DEFAULT_FRAME_WORDS):
        assert frame_words >= 2
        self.collective = collective
        self.frame_words = frame_words
        self._frame = torch.zeros(frame_words, dtype=torch.int64)  # reused by single-frame commands

    def send(self, command: Command) -> None:
        assert self.collective.rank == 0, "only rank 0 sends commands"
        words = encode(command)
        if words.numel() < self.frame_words:
            self._frame[0] = words.numel()
            self._frame[1:1 + words.numel()] = words
            self.collective.broadcast(self._frame)
            return
        for frame in to_frames(words, self.frame_words):
            self.collective.broadcast(frame)

    def receive(self, timeout_s: float | None = None) -> Command:
        """The next command from rank 0; raises TensorParallelFailed when it is gone or silent
        past `timeout_s` (for the first frame; the rest follow at once)."""
        assert self.collective.rank != 0, "rank 0 sends commands"
        first = self.collective.broadcast(self._frame, timeout_s)
        total = int(first[0])
        if total + 1 <= self.frame_words:
            return decode(first[1:1 + total].clone())
        frames = [first.clone()]
        for _ in range(num_frames(total, self.frame_words) - 1):
            frames.append(self.collective.broadcast(torch.empty(self.frame_words, dtype=torch.int64)))
        return decode(from_frames(frames))
