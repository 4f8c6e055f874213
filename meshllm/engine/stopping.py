"""Leader-side stop detection: EOS, stop strings and max_tokens, with OpenAI semantics.

The leader feeds each sampled token id; the checker detokenizes incrementally and
returns only text that is safe to stream. Text that could be the start of a stop
string is held back until the next tokens show it is not; the stop string itself
is never emitted. Used by the local generate loop and by the API server.

It also says which tokens the text it returns comes from (`released`), so a token's
logprobs go out with its text: the tokens of a stop string, whose text never goes out,
report none, and a token whose text is held (or is part of a character not yet whole)
reports its logprobs once that text goes out.
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
        # _held is the tail of a token whose text is partly out already (_held_tail characters),
        # then the text of tokens none of whose text is out yet (_unreleased, each one's length).
        self._held_tail = 0
        self._unreleased: list[int] = []
        # How many of the tokens not released before the last feed (oldest first; the fed one is
        # last) that feed released: their text, or a first part of it, is in what it returned, or
        # the sequence ended without cutting it. Once finished, the rest are the stop string's.
        self.released = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def feed(self, token_id: int) -> str:
        """Account for one generated token; return the text that may be streamed now."""
        assert not self.finished, "feed() after the sequence finished"
        self.num_tokens += 1
        if token_id in self.eos_token_ids:
            self._unreleased.append(0)
            return self._finish("stop", self._held, len(self._held), everything=True)
        piece = self.detokenize(token_id)
        text = self._held + piece
        self._unreleased.append(len(piece))
        cut = _first_stop(text, self.params.stop)
        if cut is not None:
            return self._finish("stop", text, cut)
        if self.num_tokens >= self.params.max_tokens:
            return self._finish("length", text, len(text), everything=True)
        keep = _held_length(text, self.params.stop)
        self._release(len(text) - keep)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def _release(self, out: int, everything: bool = False) -> None:
        """The text's first `out` characters go out: so do the tokens whose text starts in them
        (`everything`: all of them, the empty pieces at the end too)."""
        start, n = self._held_tail, 0
        for length in self._unreleased:
            if start >= out and not everything:
                break
            start, n = start + length, n + 1
        if n == 0 and out > 0 and self._unreleased:
            # Only a released token's held tail goes out (two stop strings' prefixes overlapping):
            # the oldest held token goes with it, so that text has an event to ride on.
            start, n = start + self._unreleased[0], 1
        self.released = n
        self._unreleased = self._unreleased[n:]
        # What stays held before the first unreleased token's text is the tail of a released one.
        self._held_tail = start - out

    def _finish(self, reason: FinishReason, text: str, out: int, everything: bool = False) -> str:
        self.finish_reason = reason
        self._release(out, everything)
        self._held, self._held_tail, self._unreleased = "", 0, []
        return text[:out]


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
