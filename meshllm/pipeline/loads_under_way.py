"""The Loads a node is running, by plan (stage_control.py).

Loads of different plans run side by side (a tensor-parallel rank's Load waits minutes at most
for the rest of its group; other plans must not wait with it). Loads of one plan take turns: a
second leader deploying the same plan waits for the first's Load, then reuses the stage. An
Unload never waits for a Load: it sets the running Load's `unloaded` flag (under `lock`, the
same lock the Load takes to put its stage in the registry), and the Load drops what it loaded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class _Plan:
    turn: threading.Lock = field(default_factory=threading.Lock)
    unloaded: threading.Event | None = None  # the running Load's flag
    leader_id: str = ""  # the running Load's leader
    num_waiting: int = 0  # Loads holding or waiting for the turn: the entry goes with the last


class LoadsUnderWay:
    def __init__(self):
        self.lock = threading.Lock()  # guards the dict; orders a Load's put against an Unload
        self._plans: dict[str, _Plan] = {}

    @contextlib.contextmanager
    def turn(self, plan_id: str, leader_id: str = "") -> Iterator[threading.Event]:
        """This plan's turn to load; yields the flag an Unload of the plan sets meanwhile (an
        Unload by this Load's leader, or naming none: another leader's is not about this Load)."""
        with self.lock:
            plan = self._plans.setdefault(plan_id, _Plan())
            plan.num_waiting += 1
        try:
            with plan.turn:
                unloaded = threading.Event()  # fresh: an Unload before this Load's turn is not about it
                with self.lock:
                    plan.unloaded, plan.leader_id = unloaded, leader_id
                yield unloaded
        finally:
            with self.lock:
                plan.unloaded = None
                plan.num_waiting -= 1
                if not plan.num_waiting:
                    del self._plans[plan_id]

    def unload(self, plan_id: str, leader_id: str = "") -> None:
        """Tell the plan's running Load (if any) to drop what it loads, when the Unload is its
        leader's or names none. The caller holds `lock`."""
        plan = self._plans.get(plan_id)
        if plan is not None and plan.unloaded is not None and leader_id in ("", plan.leader_id):
            plan.unloaded.set()

    def unload_all(self) -> None:
        """Every running Load (node shutdown). The caller holds `lock`."""
        for plan_id in list(self._plans):
            self.unload(plan_id)
