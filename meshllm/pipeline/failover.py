"""Failover at the leader: whom a failed step blames, and re-planning off the loop thread.

Blame the node at fault, not the one that noticed:
- a broken or refused stream (`stage_unreachable`, stage i): the node of stage i;
- `shard_corrupt` raised by stage i (NaN/Inf, wrong shape or dtype in what it received):
  stage i-1, the sender (stage 0 receives token ids from the leader: nobody to exclude);
- a reply the leader refuses (`invalid_reply`): the last stage, which produced it;
- a stage that stopped answering (deadline, then Health.Check): that stage;
- between requests: a stream to stage 0 broken by a gRPC error: stage 0; one stage 0 closed
  (a later stage failed and the chain of streams ended): whoever the probe it triggers finds;
- a stage that refuses this leader's calls (`plan_refused`: authentication, permission): that
  node, for as long as it refuses;
- a tensor-parallel stage whose group failed (`tp_group_failed`, a rank died or hung): that
  stage; the plan owner leaves out the group's nodes that do not answer;
- `shard_not_loaded` / `kv_missing`: the node restarted or lost state; re-deploy, exclude nobody.
Errors that belong to the request itself (a bad parameter) are not failures of any node.

The Leader calls `Recovery.start` on its loop thread; the re-plan (planner, loads, unloads:
seconds) runs on a worker thread and its outcome comes back as a message in the leader's
inbox, so the loop keeps answering submits and cancels meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from meshllm.engine.kv_cache import SeqId
from meshllm.engine.step import StepResult
from meshllm.errors import MeshError
from meshllm.pipeline.transport import StepTransport

log = logging.getLogger(__name__)

# tp_group_failed: a rank of a tensor-parallel stage died or hung, so the whole group (one stage)
# failed; the plan owner works out which of its nodes to leave out.
_NODE_FAULTS = {"stage_unreachable", "internal", "pipeline_stalled", "tp_group_failed"}
_REDEPLOY = {"shard_not_loaded", "kv_missing"}


@dataclass(frozen=True, slots=True)
class FailoverConfig:
    max_failovers: int = 3  # per request; past it the request ends with pipeline_stalled
    retry_interval_s: float = 2.0  # while no plan fits: how often to try again on the current fleet
    # While nothing is in flight no step can fail, so the plan's stages are health-checked this
    # often: /health turns degraded (and a re-plan starts) when a stage dies between requests,
    # not at the next request. The timeout is generous: an idle false alarm costs a re-plan.
    idle_probe_interval_s: float = 2.0
    idle_probe_timeout_s: float = 2.0

    def __post_init__(self):
        if self.max_failovers < 0 or self.retry_interval_s <= 0 or self.idle_probe_interval_s <= 0 \
                or self.idle_probe_timeout_s <= 0:
            raise ValueError(f"failover settings must be non-negative / positive: {self}")


@dataclass(frozen=True, slots=True)
class StageFailure:
    stage_index: int | None  # the stage whose node is at fault; None: no node to blame (re-deploy)
    code: str  # stage_unreachable | shard_corrupt | invalid_reply | pipeline_stalled | ...
    message: str
    detect_s: float = 0.0  # from the last progress of the pipeline to the failure being declared


def blame(result: StepResult, num_stages: int) -> StageFailure | None:
    """The failure a failed step reports, or None when it is the request's own error."""
    code, where = result.error_code, result.failed_stage
    known = where is not None and 0 <= where < num_stages
    if code == "shard_corrupt":
        return StageFailure(where - 1 if known and where > 0 else None, code, result.error_message)
    if code in _NODE_FAULTS:
        return StageFailure(where if known else None, code, result.error_message)
    if code in _REDEPLOY:
        return StageFailure(None, code, result.error_message)
    return None


def invalid_reply_failure(error: MeshError, num_stages: int) -> StageFailure:
    """The leader refused the last stage's reply: that stage produced it."""
    return StageFailure(num_stages - 1, error.code, str(error))


@dataclass(frozen=True, slots=True)
class RecoveryTiming:
    """One failover, from the failure to the first token after it."""

    code: str
    stage_index: int | None
    detect_s: float  # last progress -> failure declared (a broken stream: ~0; a hung stage: the deadline + probe)
    plan_s: float  # choosing the new plan
    load_s: float  # loading the missing range (0 when every stage already held its range)
    reprefill_s: float  # new plan swapped in -> first token: rebuilding the KV of every running sequence
    carried_positions: int = 0  # KV positions stages of the new plan kept from the failed one (not re-prefilled)

    @property
    def total_s(self) -> float:
        return self.detect_s + self.plan_s + self.load_s + self.reprefill_s


@dataclass(frozen=True, slots=True)
class Deployment:
    """A plan in service: what the leader sends steps through."""

    transport: StepTransport
    plan_s: float = 0.0  # choosing the plan
    load_s: float = 0.0  # stages loading weights (0 when every range was already held)
    description: str = ""  # "node-0[0,2) node-3[2,4)", for logs
    carried_positions: int = 0  # KV positions the new plan's stages adopted from the failed plan, all sequences
    carried_by: tuple[int, ...] = ()  # the stages that adopted them (and skip re-computing them)


@dataclass(frozen=True, slots=True)
class StageProbe:
    """What a probe of the plan's stages found (indexes of stages)."""

    unresponsive: tuple[int, ...] = ()  # a node of the stage did not answer in time: dead or hung
    unloaded: tuple[int, ...] = ()  # it answered but no longer holds the plan (its lease ran out): re-deploy
    refused: tuple[int, ...] = ()  # a node of the stage refuses this leader's calls: it cannot serve the plan


class Replanner(Protocol):
    """What the leader needs from whoever owns the plan (plan_owner.py). Both calls block and
    run on worker threads, never on the leader's loop."""

    def recover(self, failure: StageFailure | None, carry: Mapping[SeqId, int] | None = None) -> Deployment:
        """A working deployment without the failed node (None: the first plan, or another try
        after nothing fit). Raises MeshError (ShardUnavailable naming what is missing).

        `carry`: per running sequence, the positions whose KV every stage of the failed plan
        held; stages of the new plan that serve the same layers on the same node adopt them."""
        ...

    def probe(self, timeout_s: float) -> StageProbe:
        """Ask every node of the current plan whether it still holds the plan (which renews its
        lease there): who does not answer in time, who answers without it."""
        ...


@dataclass(frozen=True, slots=True)
class Recovered:
    epoch: int
    deployment: Deployment


@dataclass(frozen=True, slots=True)
class RecoveryFailed:
    epoch: int
    error: MeshError


@dataclass(frozen=True, slots=True)
class Probed:
    epoch: int
    unresponsive: tuple[int, ...]
    idle: bool = False  # a routine check between requests, not a suspected stall
    unloaded: tuple[int, ...] = ()  # stages that answered but no longer hold the plan
    refused: tuple[int, ...] = ()  # stages with a node that refuses this leader's calls


class Recovery:
    """Runs the replanner's blocking calls on worker threads; results go to `post` (the
    leader's inbox) tagged with the epoch they were started in, so a stale answer (a probe
    from before a swap) is recognisable."""

    def __init__(self, replanner: Replanner, config: FailoverConfig, post: Callable[[object], None]):
        self.replanner = replanner
        self.config = config
        self._post = post
        self.epoch = 0  # bumped at each swap of the transport
        self.running = False  # a re-plan is under way
        self.last_attempt = float("-inf")
        self.probing = False  # a probe's answer is awaited
        self.last_probe = time.monotonic()
        self.suspect = False  # a stream ended while the probe in flight was under way: it may predate the failure

    def start(self, failure: StageFailure | None, carry: Mapping[SeqId, int] | None = None) -> None:
        """Loop thread: begin a re-plan (no-op while one runs)."""
        if self.running:
            return
        self.running = True
        self.last_attempt = time.monotonic()
        epoch = self.epoch
        threading.Thread(target=self._recover, args=(epoch, failure, dict(carry or {})), daemon=True,
                         name="leader-replan").start()

    def _recover(self, epoch: int, failure: StageFailure | None, carry: dict[SeqId, int]) -> None:
        try:
            self._post(Recovered(epoch, self.replanner.recover(failure, carry)))
        except MeshError as e:
            self._post(RecoveryFailed(epoch, e))
        except Exception as e:  # noqa: BLE001 - a bug must end in a clear error, never a request that hangs
            log.exception("re-planning failed")
            self._post(RecoveryFailed(epoch, MeshError(f"re-planning failed: {e}")))

    def probe(self, timeout_s: float, idle: bool = False) -> None:
        """Loop thread: health-check the plan's stages; the answer arrives as Probed."""
        self.probing = True
        self.last_probe = time.monotonic()
        epoch = self.epoch
        threading.Thread(target=self._probe, args=(epoch, timeout_s, idle), daemon=True, name="leader-probe").start()

    def _probe(self, epoch: int, timeout_s: float, idle: bool) -> None:
        try:
            found = self.replanner.probe(timeout_s)
        except Exception:  # noqa: BLE001 - an answer must come, or no probe would ever start again
            log.exception("probing the stages failed")
            found = StageProbe()
        self._post(Probed(epoch, found.unresponsive, idle, found.unloaded, found.refused))

    def idle_probe_due(self) -> bool:
        return not self.running and not self.probing and \
            time.monotonic() - self.last_probe >= self.config.idle_probe_interval_s

    def probe_now(self) -> None:
        """Loop thread: a stream ended while idle, so a stage probably failed: probe at once rather
        than at the next routine check. One probe at a time: when one is under way (it may have
        renewed the dead node's lease just before it died), a second follows its answer instead.
        It counts as the routine check too (last_probe): no second probe right behind it."""
        if self.running:
            return  # a re-plan is under way: it replaces this transport anyway
        if self.probing:
            self.suspect = True
            return
        self.probe(self.config.idle_probe_timeout_s, idle=True)

    def finished(self) -> None:
        """Loop thread: the re-plan's outcome was handled."""
        self.running = False
        self.epoch += 1
