"""Keeps the leader's loop serving through its own bugs, or says clearly that it stopped.

The loop thread owns every piece of the leader's state, so an exception escaping it would
end the thread silently: every later `submit` would wait forever while `/health` said ok.
The leader runs each turn of its loop under `LoopSupervisor.survive`: an unexpected
exception is logged (its type and stack at error level; its message, which may quote a
prompt, only at debug level), the leader fails the requests that turn touched, and the
loop goes on. If that recovery raises too, or unexpected errors keep coming (more than
`max_failures` within `window_s` seconds), the supervisor gives up: `failure` says why,
`/health` reports it and `submit` raises it instead of blocking.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from meshllm.engine.kv_cache import SeqId
from meshllm.errors import LeaderDown, MeshError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Turn:
    """What the leader's loop is working on, so a failure there fails only the requests it touched."""

    seq_ids: tuple[SeqId, ...] | None = None  # None: scheduling, where any running sequence may be affected
    refuse: Callable[[MeshError], None] | None = None  # answers a submitter still waiting for admission


class LoopSupervisor:
    """Used by the leader's loop thread; `failure` may be read from any thread."""

    def __init__(self, max_failures: int = 5, window_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_failures < 1 or window_s <= 0:
            raise ValueError("max_failures must be at least 1 and window_s positive")
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._recent: deque[float] = deque()
        self._failure: LeaderDown | None = None
        self._lock = threading.Lock()
        self.num_recovered = 0

    @property
    def failure(self) -> LeaderDown | None:
        """Why the loop stopped serving; None while it serves."""
        with self._lock:
            return self._failure

    def survive(self, error: Exception, recover: Callable[[MeshError], None]) -> bool:
        """Log `error` and call `recover` with the error to fail affected requests with.
        Returns False when the loop must stop (then `failure` is set)."""
        where = "".join(traceback.format_tb(error.__traceback__)[-3:]).rstrip()
        log.error("leader loop: unexpected %s; failing the affected requests\n%s", type(error).__name__, where)
        log.debug("leader loop error details: %r", error)
        now = self._clock()
        self._recent.append(now)
        while self._recent and self._recent[0] < now - self.window_s:
            self._recent.popleft()
        if len(self._recent) > self.max_failures:
            self.give_up(f"{len(self._recent)} internal errors within {self.window_s:g} s (the last a "
                         f"{type(error).__name__})")
            return False
        try:
            recover(MeshError(f"internal error in the leader ({type(error).__name__}); the request was "
                              f"stopped, retry it"))
        except Exception as again:  # noqa: BLE001 - a recovery that fails leaves state we cannot trust
            log.error("leader loop: recovery failed with %s", type(again).__name__, exc_info=log.isEnabledFor(
                logging.DEBUG))
            self.give_up(f"an internal {type(error).__name__} and then a {type(again).__name__} while recovering")
            return False
        self.num_recovered += 1
        return True

    def give_up(self, why: str) -> LeaderDown:
        with self._lock:
            if self._failure is None:
                self._failure = LeaderDown(f"the leader stopped serving: {why}. Restart the server; the log "
                                           f"shows where it failed")
                log.error("%s", self._failure)
            return self._failure
