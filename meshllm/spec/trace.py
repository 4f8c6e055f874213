"""An opt-in record of the leader's drafting, for tuning it: `MESHLLM_SPEC_TRACE=PATH` makes each
Drafter append one JSON line to PATH when it closes, with its events in order:

    ["step", t, rows, seconds]                      a decode step came back (spec/drafter.step_done)
    ["verified", t, drafted, accepted]              a sequence's draft was checked in that step
    ["call", t, k, context, drafted, seconds, pos]  a proposer call answered (the longest request's
                                                    k and context tokens, the most drafted, its
                                                    drafting seconds, the first request's position)
    ["request", t, block, k, alpha, answer_s, step_s, pos]
                                                    a request went out: the block length chosen (a
                                                    probe's 1 as well), the tokens asked, the acceptance
                                                    estimate, the seconds until its answer is expected,
                                                    the estimated plain step seconds (None: unknown),
                                                    and its position (a call's `pos` names it)
    ["hold", t, wait_s, k_then, k_now]               the sequence's next step is to be held for a draft
                                                    expected in wait_s (a decision: one step may be
                                                    decided on twice, or go out while in flight)

`t` is time.perf_counter(). `bench/spec_trace.py` summarises a file. Off by default, it costs an
attribute test per event; on, a list append (the drafter thread appends calls: one append is atomic).
No token ids are recorded, only counts and times.
"""

from __future__ import annotations

import json
import os
import time

TRACE_ENV = "MESHLLM_SPEC_TRACE"


class SpecTrace:
    def __init__(self, path: str):
        self.path = path
        self.events: list[list] = []

    @classmethod
    def from_env(cls) -> "SpecTrace | None":
        path = os.environ.get(TRACE_ENV)
        return cls(path) if path else None

    def step(self, rows: int, seconds: float) -> None:
        self.events.append(["step", time.perf_counter(), rows, seconds])

    def verified(self, drafted: int, accepted: int) -> None:
        self.events.append(["verified", time.perf_counter(), drafted, accepted])

    def call(self, k: int, context: int, drafted: int, seconds: float, position: int) -> None:
        self.events.append(["call", time.perf_counter(), k, context, drafted, seconds, position])

    def request(self, block: int, k: int, alpha: float, answer_s: float | None, step_s: float | None,
                position: int) -> None:
        self.events.append(["request", time.perf_counter(), block, k, alpha, answer_s, step_s, position])

    def hold(self, wait_s: float, k_then: int, k_now: int) -> None:
        self.events.append(["hold", time.perf_counter(), wait_s, k_then, k_now])

    def write(self, proposer: str) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"proposer": proposer, "events": self.events}) + "\n")
        self.events = []
