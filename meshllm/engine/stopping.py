"""Leader-side stop detection: EOS, stop strings and max_tokens, with OpenAI semantics.

The leader feeds each sampled token id; the checker detokenizes incrementally and
returns only text that is safe to stream. Text that could be the start of a stop
string is held back until the next tokens show it is not; the stop string itself
is never emitted. Used by the local generate loop and by the API server.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Literal

from meshllm.engine.sampler import SamplingParams

FinishReason = Literal["stop", "length"]


class StopChecker:
    """Stop state of one sequence. Not thread-safe: one caller feeds it in order.

    `detokenize(token_id) -> str` is the sequence's incremental decoder: it returns
    the text the token completes (possibly "" while a multi-byte character is split
    across tokens).
    """

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int],
                 detokenize: Callable[[int], str]):
        self.params = params
        self.eos_token_ids = frozenset(() if params.ignore_eos else eos_token_ids)
        self.detokenize = detokenize
        self.num_tokens = 0
        self.finish_reason: FinishReason | None = None
        self._held = ""  # text that may be the beginning of a stop string

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_id: int) -> str:
        """Account for one generated token; return the text that may be streamed now."""
        assert not self.finished, "feed() after the sequence finished"
        self.num_tokens += 1
        if token_id in self.eos_token_ids:
            return self._finish("stop", self._held)
        text = self._held + self.detokenize(token_id)
        cut = _first_stop(text, self.params.stop)
        if cut is not None:
            return self._finish("stop", text[:cut])
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", text)
        keep = _held_length(text, self.params.stop)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _finish(self, reason: FinishReason, text: str) -> str:
        self.finish_reason = reason
        self._held = ""
        return text


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in `text`, or None."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _held_length(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
