"""The stage's side of KV carry-over across plans: park what a failed stream held, let a
re-planned plan adopt it, and free what nobody adopted.

A leader's stream frees its KV when it ends (stage_forward.py), except when it ends because of
a failure the leader will re-plan around:
- the leader says so: it sends a `park` request before closing its stream after a failure;
- a stage's stream from the previous stage broke (that node died or was cut off).
Either way the stage passes the `park` request on downstream, and the stream's sequences stay,
owned by nobody, for PARK_S. The leader's plan owner then asks each stage of the new plan that
serves the same weights on the same node to Adopt them (`adopt` below): they move to the
new plan, truncated to the positions the leader knows every stage held, and that stage skips
re-computing them (engine/kv_carry.py). What is not adopted goes with the old plan's Unload, or
at the deadline. A tensor-parallel stage's KV lives on every rank: it is never parked.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

from meshllm.engine.kv_cache import Owner, SeqId
from meshllm.pipeline.loaded_stages import LoadedStage

log = logging.getLogger(__name__)

# How long parked KV waits for an Adopt: a re-plan that loads a missing range on a spare takes
# that long at most on a LAN (the plan owner adopts right after the load). Bounded, so a leader
# that never comes back leaks nothing for longer.
PARK_S = 120.0


def parks(stage: LoadedStage) -> bool:
    return not stage.request.HasField("tp")


def park_stream(stage: LoadedStage, owner: Owner) -> tuple[int, int]:
    """Keep what `owner`'s stream held on `stage` for PARK_S (its prefix blocks go now: a new plan
    starts with an empty prefix index). Returns (sequences parked, prefix blocks freed)."""
    with stage.lock:
        num_seqs = stage.runner.cache.park(owner, time.monotonic() + PARK_S)
        num_blocks = stage.runner.prefix.drop_owner(owner)
    if num_seqs:
        _sweep_later(stage)
    return num_seqs, num_blocks


def adopt(target: LoadedStage, source: LoadedStage, seqs: list[tuple[SeqId, int]]) -> list[tuple[SeqId, int]]:
    """Move the KV of `seqs` (id, positions every stage held) from `source`'s plan to `target`'s,
    both over the same weights; returns the (id, positions) adopted. A sequence holding fewer
    positions than asked is dropped, not adopted: the new plan recomputes it."""
    if target.weights.key != source.weights.key or not parks(target) or not parks(source):
        return []
    adopted = []
    until = time.monotonic() + PARK_S
    # Both compute locks, in plan-id order (two adoptions the other way round cannot deadlock).
    stages = [target] if target is source else sorted((target, source), key=lambda s: s.request.plan_id)
    with contextlib.ExitStack() as locks:
        for stage in stages:
            locks.enter_context(stage.lock)
        for seq_id, num_positions in seqs:
            kv = source.runner.cache.take(seq_id)
            if kv is None or not 0 < num_positions <= kv.length:
                continue
            kv.truncate(num_positions)  # beyond: steps the leader never saw finish, or rejected drafts
            kv.carried = num_positions
            target.runner.cache.put_parked(seq_id, kv, until)
            adopted.append((seq_id, num_positions))
    if adopted:
        _sweep_later(target)
    return adopted


def _sweep_later(stage: LoadedStage) -> None:
    # A weak reference: the timer must not keep an unloaded plan's runner and weights resident
    # for PARK_S (its Unload freed the parked KV already, and reported the weights freed).
    ref = weakref.ref(stage)

    def sweep() -> None:
        stage = ref()
        if stage is None:
            return
        with stage.lock:
            num = stage.runner.cache.drop_expired(time.monotonic())
        if num:
            log.info("plan %s: freed %d parked sequences nobody adopted", stage.request.plan_id, num)

    timer = threading.Timer(PARK_S + 0.5, sweep)
    timer.daemon = True
    timer.start()
