"""When the leader suspects a stalled stage: a deadline from the plan's measured step times.

A dead stage shows at once (its stream breaks); a hung one (SIGSTOP, a frozen machine, a
swapping node) just stops answering. The leader expects the next reply within

    allowed(n) = clamp(multiplier * (base + per_token * n), floor, cap)

of the last progress (a reply, or the send of the oldest step in flight), where n is every
token in flight (a long prefill chunk ahead of a decode step delays it too), `base` is the
measured round trip of a small step and `per_token` the measured cost of each further
token. So a decode step on loopback gets the floor (~1 s), while a 512-token prefill chunk
gets what such chunks have been measured to need. Past the deadline the leader probes the
stages (Health.Check): one that does not answer is declared failed; if every stage
answers, it waits another deadline, up to `cap` without progress.

Owned by the leader's loop thread; no locks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_FLOOR_S = 1.0
SMALL_STEP_TOKENS = 4  # steps this small measure the fixed cost of a round trip
_EWMA = 0.2  # weight of the newest measurement


@dataclass(frozen=True, slots=True)
class DeadlineConfig:
    floor_s: float = DEFAULT_FLOOR_S  # never suspect a stage sooner than this after the last progress
    cap_s: float = 30.0  # no progress this long is a stall even when every stage answers probes
    multiplier: float = 4.0  # headroom over the expected time (a loaded machine, GC pauses)
    probe_timeout_s: float = 0.5  # a stage that does not answer Health.Check this fast is hung

    def __post_init__(self):
        if not 0 < self.floor_s <= self.cap_s or self.multiplier < 1 or self.probe_timeout_s <= 0:
            raise ValueError(f"deadline settings must satisfy 0 < floor <= cap, multiplier >= 1, "
                             f"probe timeout > 0: {self}")


class StepCost:
    """Measured round trip of a step as base + per_token * tokens (exponentially weighted)."""

    def __init__(self):
        self.base_s: float | None = None
        self.per_token_s: float | None = None

    def observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens <= SMALL_STEP_TOKENS:
            self.base_s = seconds if self.base_s is None else (1 - _EWMA) * self.base_s + _EWMA * seconds
        elif self.base_s is not None:
            per_token = max(seconds - self.base_s, 0.0) / num_tokens
            self.per_token_s = (per_token if self.per_token_s is None
                                else (1 - _EWMA) * self.per_token_s + _EWMA * per_token)

    def expected_s(self, num_tokens: int) -> float | None:
        """None until measured: a fresh leader gives the first steps the cap."""
        if self.base_s is None or (num_tokens > SMALL_STEP_TOKENS and self.per_token_s is None):
            return None
        return self.base_s + (self.per_token_s or 0.0) * num_tokens


class StallWatch:
    """Tracks progress of the steps in flight and says when to probe the stages."""

    def __init__(self, config: DeadlineConfig, clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.cost = StepCost()  # kept across plans: the next plan's steps cost about the same
        self._clock = clock
        self._num_tokens_in_flight = 0
        self._num_steps_in_flight = 0
        self._last_progress = clock()
        self._stalled_since = self._last_progress  # progress before the first probe that found everyone alive
        self._checked_at: float | None = None  # a probe is running (or found everyone alive) since then
        self.probing = False

    def allowed_s(self, num_tokens: int) -> float:
        c = self.config
        expected = self.cost.expected_s(num_tokens)
        if expected is None:
            return c.cap_s
        return min(max(c.multiplier * expected, c.floor_s), c.cap_s)

    def sent(self, num_tokens: int) -> None:
        if not self._num_steps_in_flight:
            self._last_progress = self._stalled_since = self._clock()
        self._num_steps_in_flight += 1
        self._num_tokens_in_flight += num_tokens

    def done(self, num_tokens: int, seconds: float | None) -> None:
        """A step came back (`seconds` its round trip when it succeeded)."""
        self._num_steps_in_flight = max(0, self._num_steps_in_flight - 1)
        self._num_tokens_in_flight = max(0, self._num_tokens_in_flight - num_tokens)
        self._last_progress = self._stalled_since = self._clock()
        self._checked_at = None
        if seconds is not None:
            self.cost.observe(num_tokens, seconds)

    def reset(self) -> None:
        """Nothing is in flight any more (the transport was swapped)."""
        self._num_steps_in_flight = self._num_tokens_in_flight = 0
        self._checked_at = None
        self.probing = False

    def _deadline(self) -> float | None:
        if not self._num_steps_in_flight or self.probing:
            return None
        start = self._last_progress if self._checked_at is None else self._checked_at
        return start + self.allowed_s(self._num_tokens_in_flight)

    def seconds_left(self) -> float | None:
        deadline = self._deadline()
        return None if deadline is None else deadline - self._clock()

    def due(self) -> bool:
        """Past the deadline: the caller probes the stages, then calls `probed`."""
        left = self.seconds_left()
        return left is not None and left <= 0

    def start_probe(self) -> None:
        self.probing = True

    def probed(self) -> bool:
        """Every stage answered the probe. True when the cap is spent anyway (stalled)."""
        self.probing = False
        now = self._clock()
        self._checked_at = now
        return now - self._stalled_since >= self.config.cap_s

    def stalled_for(self) -> float:
        return self._clock() - self._last_progress
