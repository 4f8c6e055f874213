"""The one owner of a served model's plan: plan, deploy, transport, health, and re-plan
after a failure. Every leader path (the HTTP API, `meshllm generate --peer`, the demo)
builds its Leader here.

Re-planning (`recover`, called by the leader on a worker thread):
1. exclude the failed node: until it answers a health check again (dead or hung), or for
   `quarantine_s` (it sent corrupt activations, or failed its Load as a rank of a
   tensor-parallel group: it answers health checks fine), or while it refuses this leader's
   calls (lease_renewal.py: answering health checks proves nothing then). A failed
   tensor-parallel stage is a group of nodes: those that do not answer are excluded (a
   killed or hung rank), or the whole group when all of them answer (its collectives broke);
2. move the failed stage to a spare that can hold it, so the survivors keep their ranges
   and reuse the weights they hold (cluster/repair.py); else plan again on the survivors,
   with the same number of stages, else the fewest that fit; else, with --fallback-local,
   run the whole model in this process when it fits here;
3. load the new plan (a stage that holds the range already shares the weights: instant),
   have its stages that kept their range adopt the running sequences' KV from the failed
   plan (carry_over.py: the re-prefill skips those positions there), swap the transport,
   and unload the plans no longer used (in the background: a dead node's unload is retried
   when it answers again).
Health (health.py) follows: degraded from the failure until a plan works again (from the
moment a probe finds a node silent, refusing or without the plan, or a re-plan starts: before
the re-plan's health checks of excluded nodes), unavailable with the missing memory when
nothing fits, ok once a plan is deployed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import grpc
import psutil

from meshllm.cluster.card import Card, ModelOnDisk, NodeId
from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.cluster.repair import replace_failed_stage
from meshllm.errors import BadRequest, MeshError, ShardUnavailable
from meshllm.model.source import ModelFiles
from meshllm.engine.kv_cache import SeqId
from meshllm.pipeline.carry_over import carry_over
from meshllm.pipeline.cluster import (ServingOptions, context_of, local_transport, new_leader, placement_request,
                                      plan_for, stage_names_of)
from meshllm.pipeline.deploy import LoadRefused, RankLoadFailed, StageUnreachable, deploy, plan_id_of
from meshllm.pipeline.events import LeaderObserver
from meshllm.pipeline.failover import Deployment, StageFailure, StageProbe
from meshllm.pipeline.health import HealthReport, HealthStatus, ServingHealth, StageSummary
from meshllm.pipeline.leader import Leader
from meshllm.pipeline.lease_renewal import Lease, LeaseRenewer
from meshllm.pipeline.transport import RemotePipeline
from meshllm.spec.factory import SpeculativeChoice, build_proposer
from meshllm.spec.proposer import Proposer
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

QUARANTINE_S = 60.0  # a node that sent corrupt activations is left out this long
READMIT_PROBE_S = 0.5  # an excluded node answering Health.Check this fast may be planned again
UNLOAD_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class _Exclusion:
    reason: str
    until: float | None  # monotonic; None: until the node answers a health check
    refused: bool = False  # it refused this leader's calls: until a Renew is no longer refused


@dataclass(frozen=True, slots=True)
class _Current:
    plan: Plan | None  # None: the whole model in this process (fallback)
    plan_id: str | None


class PlanOwner:
    """Thread-safe: `recover` and `probe` run on the leader's worker threads, `health` is read by
    the HTTP API; one lock serialises re-plans."""

    def __init__(self, files: ModelFiles, fleet_view: Callable[[], list[Card]], channels: ChannelPool,
                 options: ServingOptions, observer: LeaderObserver | None = None,
                 health: ServingHealth | None = None):
        self.files = files
        self.fleet_view = fleet_view
        self.channels = channels
        self.options = options
        self.observer = observer or LeaderObserver()
        self.health = health or ServingHealth(HealthReport(HealthStatus.UNAVAILABLE, "not planned yet"))
        self._lock = threading.Lock()
        self._current: _Current | None = None
        self._excluded: dict[NodeId, _Exclusion] = {}
        self._stale: set[tuple[str, str, str]] = set()  # (address, node id, plan id) to unload once reachable
        # Other leaders (other nodes' APIs) deploy the same plan onto the same stages: this id in
        # each Load and Unload keeps this leader's Unload from dropping a plan they still use.
        # Who it calls as (its node): a leader started again there is the same leader to the
        # stages, so its earlier claims on a plan do not outlive it.
        self.leader_id = channels.config.node_id
        self._num_failovers = 0
        self._leases = LeaseRenewer(channels)
        # Never held across a call: what probe threads share with a re-plan (which holds _lock for
        # seconds): the plan in service and its health, changed together, and the nodes that refused.
        self._swap = threading.Lock()
        self._refusals: dict[NodeId, str] = {}

    @property
    def plan(self) -> Plan | None:
        current = self._current
        return current.plan if current is not None else None

    @property
    def plan_id(self) -> str | None:
        current = self._current
        return current.plan_id if current is not None else None

    def start(self) -> Leader:
        """Plan and deploy now (the leader still starts when nothing fits: it retries on its own
        and whenever a request comes, and /health says why meanwhile)."""
        try:
            transport = self.recover(None).transport
        except MeshError as e:
            log.warning("no plan for %s yet: [%s] %s", self.files.model_id, e.code, e)
            transport = None
        return new_leader(self.files, transport, self.options, self.observer, self._proposer(), replanner=self)

    def _proposer(self) -> Proposer | None:
        """With --speculative: a remote proposer is placed off the plan's nodes where possible (it
        re-places itself when its node dies); ProposerUnavailable when the fleet has none: the
        caller decides."""
        if self.options.speculative is None:
            return None
        plan = self.plan
        verifiers = frozenset(n for s in plan.stages for n in s.node_ids) if plan is not None else frozenset()
        return build_proposer(SpeculativeChoice.parse(self.options.speculative), self.files,
                              fleet_view=self.fleet_view, channels=self.channels, verifier_nodes=verifiers)

    # --- Replanner (worker threads) ----------------------------------------------------------------
    def recover(self, failure: StageFailure | None, carry: Mapping[SeqId, int] | None = None) -> Deployment:
        with self._lock:
            started = time.perf_counter()
            if failure is not None:
                self._num_failovers += 1
                # Degraded now: the health checks below may wait out silent nodes (READMIT_PROBE_S).
                self._degrade(failure, self._blamed(failure))
            self._readmit()  # before excluding the node that just failed: no point probing it now
            failed = self._exclude_failed(failure)
            if failure is not None and failed != self._blamed(failure):
                self._degrade(failure, failed)  # a group's rank that is silent, not its rank 0
            try:
                deployment = self._deploy_new_plan(failed, started, carry or {})
            except ShardUnavailable as e:
                fallback = self._fallback_local(e, started)
                if fallback is not None:
                    return fallback
                self._set_health(HealthStatus.UNAVAILABLE, str(e), failed_node=failed, missing=e.part,
                                 missing_bytes=e.missing_bytes)
                raise
            except MeshError as e:
                self._set_health(HealthStatus.UNAVAILABLE, f"[{e.code}] {e}", failed_node=failed)
                raise
            return deployment

    def probe(self, timeout_s: float) -> StageProbe:
        """Renew the plan's lease on each of its nodes; the answers say who is gone or dropped it."""
        current = self._current
        if current is None or current.plan is None:
            return StageProbe()
        # A group's stage is alive while all its ranks are: a hung worker stalls rank 0's collectives.
        members = [(i, node, address) for i, s in enumerate(current.plan.stages) for node, address in _members(s)]
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            answers = list(pool.map(
                lambda m: self._leases.renew(m[2], m[1], current.plan_id, timeout_s, self.leader_id), members))
        found = {lease: [(i, node, a.detail) for (i, node, _), a in zip(members, answers) if a.lease is lease]
                 for lease in Lease}
        with self._swap:
            self._refusals.update((node, detail) for _, node, detail in found[Lease.REFUSED])
        self._degrade_on_probe(current, found)
        return StageProbe(unresponsive=tuple(sorted({i for i, _, _ in found[Lease.SILENT]})),
                          unloaded=tuple(sorted({i for i, _, _ in found[Lease.DROPPED]})),
                          refused=tuple(sorted({i for i, _, _ in found[Lease.REFUSED]})))

    def _degrade_on_probe(self, current: _Current, found: dict[Lease, list[tuple[int, NodeId, str]]]) -> None:
        """A probe found the plan broken: say so now, not once the leader's re-plan starts. Only
        over an ok report of the plan probed: a re-plan may have replaced it (or found nothing
        that fits) while the probe ran, and its report stands."""
        if found[Lease.REFUSED]:
            i, node, detail = found[Lease.REFUSED][0]
            reason = f"stage {i} on {node} refuses this leader's calls ({detail}); re-planning without it"
        elif found[Lease.SILENT]:
            i, node, _ = found[Lease.SILENT][0]
            reason = f"stage {i} on {node} does not answer; re-planning"
        elif found[Lease.DROPPED]:
            i, node, _ = found[Lease.DROPPED][0]
            reason, node = f"stage {i} on {node} no longer holds the plan (its lease ran out); loading it again", None
        else:
            return
        with self._swap:
            if self._current is current and self.health.report().ok:
                self._set_health(HealthStatus.DEGRADED, reason, failed_node=node)

    # --- under the lock ----------------------------------------------------------------------------
    def _blamed(self, failure: StageFailure) -> NodeId | None:
        """The failed stage's node (rank 0 of a group), before _exclude_failed has looked closer."""
        current = self._current
        if failure.stage_index is None or current is None or current.plan is None:
            return None
        return current.plan.stages[failure.stage_index].node_id

    def _degrade(self, failure: StageFailure, failed: NodeId | None) -> None:
        what = f"stage {failure.stage_index} on {failed}" if failed else "the pipeline"
        with self._swap:
            self._set_health(HealthStatus.DEGRADED, f"{what} failed ([{failure.code}] {failure.message}); "
                             f"re-planning", failed_node=failed)

    def _exclude_failed(self, failure: StageFailure | None) -> NodeId | None:
        current = self._current
        if failure is None or failure.stage_index is None or current is None or current.plan is None:
            return None
        stage = current.plan.stages[failure.stage_index]
        if failure.code == "plan_refused":
            return self._exclude_refusing(stage)
        corrupt = failure.code in ("shard_corrupt", "invalid_reply")
        exclusion = _Exclusion(f"[{failure.code}] {failure.message}",
                               time.monotonic() + QUARANTINE_S if corrupt else None)
        nodes = self._failed_members(stage) if stage.workers else [stage.node_id]
        for node in nodes:
            self._excluded[node] = exclusion
        return nodes[0]

    def _exclude_refusing(self, stage: StageAssignment) -> NodeId:
        """Leave out the stage's nodes that refused this leader's Renew, until they stop refusing
        (_readmit asks them with a Renew: their health checks are answered all along)."""
        with self._swap:
            refusing = [(n, self._refusals.pop(n)) for n in stage.node_ids if n in self._refusals]
        refusing = refusing or [(stage.node_id, "refused")]  # the probe's record was taken by an earlier re-plan
        for node, detail in refusing:
            if not (node in self._excluded and self._excluded[node].refused):  # once per refusal, not per re-plan
                log.warning("node %s refuses this leader's calls (%s): it cannot serve this leader's plans and is "
                            "left out while it refuses; check that it shares this cluster's key and that its "
                            "clock is right", node, detail)
            self._excluded[node] = _Exclusion(f"[plan_refused] {detail}", None, refused=True)
        return refusing[0][0]

    def _failed_members(self, stage: StageAssignment) -> list[NodeId]:
        """The ranks of a failed group that do not answer Health.Check (a killed or hung node),
        or every rank when all answer (the group's own links failed: none of it is trusted)."""
        members = list(zip(stage.node_ids, _addresses(stage)))
        with ThreadPoolExecutor(max_workers=len(members)) as pool:
            alive = list(pool.map(lambda m: self._answers(m[1], READMIT_PROBE_S), members))
        silent = [node for (node, _), ok in zip(members, alive) if not ok]
        return silent or [node for node, _ in members]

    def _readmit(self) -> None:
        """Forgive excluded nodes that answer again (a SIGCONTed or restarted node); corrupt ones
        wait out their quarantine."""
        now = time.monotonic()
        addresses = {c.node_id: c.grpc_address for c in self.fleet_view()}
        for node, exclusion in list(self._excluded.items()):
            if exclusion.until is not None and now >= exclusion.until:
                del self._excluded[node]
        waiting = [n for n, e in self._excluded.items() if e.until is None and n in addresses]
        if not waiting:
            return
        with ThreadPoolExecutor(max_workers=len(waiting)) as pool:
            answers = list(pool.map(lambda n: self._no_longer_refuses(addresses[n], n) if self._excluded[n].refused
                                    else self._answers(addresses[n], READMIT_PROBE_S), waiting))
        for node, answered in zip(waiting, answers):
            if answered:
                log.info("node %s answers again; it may be planned again", node)
                del self._excluded[node]

    def _deploy_new_plan(self, failed: NodeId | None, started: float, carry: Mapping[SeqId, int]) -> Deployment:
        previous = self._current
        refused: LoadRefused | None = None
        limits = self.options.step_limits(context_of(self.files, self.options))
        while True:  # a node that cannot be reached while loading, or refuses it, is excluded: we plan again
            try:
                plan = self._choose_plan(previous.plan if previous else None, failed)
            except ShardUnavailable:
                if refused is None:
                    raise
                raise refused from None  # the refusing node's own account of what did not fit says more
            plan_s = time.perf_counter() - started
            try:
                plan_id = deploy(plan, self.channels, self.options.dtype, self.options.batch_invariant,
                                 self.options.quantization, limits, self.leader_id)
                break
            except StageUnreachable as e:
                log.warning("%s; planning without it", e)
                self._excluded[e.node_id] = _Exclusion(str(e), None)
                failed_load = e.node_id
            except LoadRefused as e:
                # Its card promised room its own check did not find (stale, or KV another leader's
                # plans reserve there): planned on again, the same card would be refused again.
                log.warning("%s; planning without node %s for %.0fs", e, e.node_id, QUARANTINE_S)
                self._excluded[e.node_id] = _Exclusion(str(e), time.monotonic() + QUARANTINE_S)
                refused, failed_load = e, e.node_id
            except RankLoadFailed as e:
                if isinstance(e.cause, BadRequest):
                    raise e.cause from None  # what this leader asked is wrong, not the node: say so
                # It answers health checks, so it is left out for a while, not until it answers.
                log.warning("%s; planning without node %s for %.0fs", e, e.node_id, QUARANTINE_S)
                self._excluded[e.node_id] = _Exclusion(str(e), time.monotonic() + QUARANTINE_S)
                failed_load = e.node_id
                if isinstance(e.cause, LoadRefused):  # a rank's memory check: reported as a node's would be
                    refused = e.cause
            attempt = plan_id_of(plan, self.options.dtype, self.options.batch_invariant, self.options.quantization,
                                 limits)
            if previous is None or attempt != previous.plan_id:  # else its nodes serve it: it stays
                self._unload_attempt(plan, attempt, failed_load)
        load_s = time.perf_counter() - started - plan_s
        carried, carried_by = {}, ()
        if previous is not None and previous.plan is not None and carry:
            # Before the old plan's unload below: that frees what its stages parked.
            carried, carried_by = carry_over(self.channels, previous.plan, previous.plan_id, plan, plan_id, carry)
        with self._swap:  # a probe of the old plan must not report on the new one
            self._current = _Current(plan, plan_id)
            self._set_health(HealthStatus.OK, None, stages=tuple(
                StageSummary(s.node_id, s.address, s.first_layer, s.last_layer) for s in plan.stages))
        if previous is not None and previous.plan is not None and previous.plan_id != plan_id:
            self._stale.update((a, n, previous.plan_id) for s in previous.plan.stages for n, a in _members(s))
        self._stale -= {(a, n, plan_id) for s in plan.stages for n, a in _members(s)}
        threading.Thread(target=self._unload_stale, daemon=True, name="unload-stale").start()
        description = " ".join(f"{'+'.join(s.node_ids)}[{s.first_layer},{s.last_layer})" for s in plan.stages)
        log.info("plan %s for %s: %s (planned in %.2fs, loaded in %.2fs)", plan_id, self.files.model_id,
                 description, plan_s, load_s)
        first = plan.stages[0]
        transport = RemotePipeline(self.channels.get(first.address, first.node_id), plan_id, len(plan.stages),
                                   stage_names_of(plan), leader_id=self.leader_id)
        return Deployment(transport, plan_s, load_s, description, sum(carried.values()), carried_by)

    def _choose_plan(self, previous: Plan | None, failed: NodeId | None) -> Plan:
        fleet = [c for c in self.fleet_view() if c.node_id not in self._excluded]
        exclude = frozenset(self._excluded)
        # Repair moves one node's part; when more of the plan's nodes are excluded (a group whose
        # ranks all failed), plan again.
        if previous is not None and failed is not None and not (
                {n for st in previous.stages for n in st.node_ids if n != failed} & exclude):
            request = replace(placement_request(self.files, self.options, self.leader_id), exclude=exclude)
            repaired = replace_failed_stage(previous, failed, request, fleet)
            if repaired is not None:
                return repaired
        try:
            return plan_for(self.files, fleet, self.options, self.leader_id)
        except ShardUnavailable:
            if self.options.num_stages is None or previous is None:
                raise  # a first plan keeps to --stages: its error says what is missing
            # Fewer nodes than --stages survive a failure: the fewest stages that fit on them.
            return plan_for(self.files, fleet, replace(self.options, num_stages=None), self.leader_id)

    def _fallback_local(self, error: ShardUnavailable, started: float) -> Deployment | None:
        if not self.options.fallback_local or not self._fits_here():
            return None
        if self._current is not None and self._current.plan is None:
            return None  # already running here: nothing more to fall back to
        transport = local_transport(self.files, self.options)
        with self._swap:
            self._current = _Current(None, None)
            self._set_health(HealthStatus.OK, f"serving on the leader alone (--fallback-local): {error}")
        self.observer.on_fallback_local()
        log.warning("falling back to the leader alone: %s", error)
        return Deployment(transport, load_s=time.perf_counter() - started, description="the leader alone")

    def _fits_here(self) -> bool:
        vm = psutil.virtual_memory()
        me = Card(node_id=NodeId("this-leader"), grpc_address="", platform="", device=self.options.device,
                  memory_total_bytes=vm.total, memory_free_bytes=vm.available, memory_bandwidth_gbps=0.0,
                  matmul_gflops=0.0, models=(ModelOnDisk(self.files.model_id, self.files.source.fingerprint(),
                                                         self.files.config.num_hidden_layers),))
        try:
            plan_for(self.files, [me], replace(self.options, num_stages=1))
        except ShardUnavailable:
            return False
        return True

    def _set_health(self, status: HealthStatus, reason: str | None, **fields) -> None:
        self.health.set(HealthReport(status, reason, num_failovers=self._num_failovers, **fields))

    # --- helpers (any thread) ----------------------------------------------------------------------
    def _answers(self, address: str, timeout_s: float) -> bool:
        try:
            cluster_pb2_grpc.HealthStub(self.channels.get(address)).Check(cluster_pb2.HealthRequest(),
                                                                          timeout=timeout_s)
            return True
        except grpc.RpcError:
            return False

    def _no_longer_refuses(self, address: str, node_id: NodeId) -> bool:
        """A Renew of no plan (it changes nothing there) is answered, not refused."""
        return self._leases.renew(address, node_id, "", READMIT_PROBE_S).lease in (Lease.HELD, Lease.DROPPED)

    def _unload_attempt(self, plan: Plan, plan_id: str, failed: NodeId) -> None:
        """Unload a plan whose deploy failed from the nodes that loaded their part: they would hold its
        weights and reserve its KV for its lease, room the next attempt (or another leader) may need.
        Now, before planning again; a node that does not answer in time is left to the stale-plan
        sweep. Caller holds _lock."""
        for stage in plan.stages:
            for node_id, address in _members(stage):
                if node_id == failed:
                    continue  # it loaded nothing (refused, or out of reach)
                try:
                    stage_pb2_grpc.StageStub(self.channels.get(address, node_id)).Unload(
                        stage_pb2.UnloadRequest(plan_id=plan_id, leader_id=self.leader_id), timeout=UNLOAD_TIMEOUT_S)
                except (grpc.RpcError, ValueError):
                    self._stale.add((address, node_id, plan_id))

    def _unload_stale(self) -> None:
        with self._lock:
            stale = sorted(self._stale)
        for address, node_id, plan_id in stale:
            try:
                stage_pb2_grpc.StageStub(self.channels.get(address, node_id)).Unload(
                    stage_pb2.UnloadRequest(plan_id=plan_id, leader_id=self.leader_id), timeout=UNLOAD_TIMEOUT_S)
            except grpc.RpcError as e:
                log.info("unload of plan %s on %s deferred: %s", plan_id, address, e.code().name)
                continue
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel": the process is closing
                log.debug("unload of stale plans stopped: the channels are closed (their leases lapse)")
                return
            with self._lock:
                self._stale.discard((address, node_id, plan_id))


def _members(stage: StageAssignment) -> list[tuple[NodeId, str]]:
    """(node id, address) of every node of a stage: one, or each rank of a group, rank 0 first."""
    return [(stage.node_id, stage.address), *((w.node_id, w.address) for w in stage.workers)]


def _addresses(stage: StageAssignment) -> list[str]:
    return [address for _, address in _members(stage)]
