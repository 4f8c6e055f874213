"""The layer ranges a node holds: weights shared across plans, runner state per plan.

A re-plan after a failure gives the survivors a new plan id for layers they already
hold. Weights are keyed by what makes them identical (model fingerprint, layer range,
dtype, quantization, batch invariance), so the new plan reuses them and only gets its
own runner (KV cache, prefix blocks, next stage); Unload of the last plan using a
range drops its weights. A tensor-parallel rank's slices are bound to its group's
collectives (tp/layers.py), so their key names the group and no other plan shares them.

A plan is leased: every use by a leader (a step, a Renew, a Release, a Load) renews it, and the
node's sweeper drops plans unused for its --plan-lease (`pop_idle`), so a leader that is gone for
good leaves nothing loaded. Leaders sharing a plan share its lease, so each one's claim (the KV
its streams may grow into) is leased on its own as well: steps and Renews name their leader, and
one that stops naming itself for a lease is let go while the others keep the plan (`lapse_leaders`).
A tensor-parallel worker rank is not leased: only rank 0 sees the steps, and its group ends
(dropping every rank) when rank 0's plan goes.

Thread-safe: gRPC runs every call on its own pool thread, and the gossip thread reads
the list for the node's card. Each plan's stage has its own compute lock, so its
micro-batches run one at a time; the registry's lock only guards the dicts.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from meshllm.cluster.stage_budget import StageMemory
from meshllm.engine.stage_runner import StageRunner
from meshllm.engine.step_limits import StepLimits
from meshllm.model.decoder import Decoder
from meshllm.transport import stage_convert
from meshllm.transport.protos import stage_pb2


@dataclass(frozen=True, slots=True)
class WeightKey:
    fingerprint: str
    first_layer: int
    last_layer: int
    dtype: str
    quantization: str
    batch_invariant: bool
    tp_group: str = ""  # "<group id>/<rank>" for a tensor-parallel rank's slices

    @classmethod
    def of(cls, request: stage_pb2.LoadRequest) -> WeightKey:
        tp_group = f"{request.tp.group_id}/{request.tp.rank}" if request.HasField("tp") else ""
        return cls(request.fingerprint, request.first_layer, request.last_layer, request.dtype,
                   request.quantization, request.batch_invariant, tp_group)


@dataclass(frozen=True, slots=True)
class SharedWeights:
    key: WeightKey
    decoder: Decoder
    num_bytes: int


@dataclass
class LoadedStage:
    """A layer range loaded for one plan. Its limits come with the plan (LoadRequest): every
    step is checked against them, and the prefix store keeps at most the plan's blocks."""

    request: stage_pb2.LoadRequest
    # A StageRunner, or for a tensor-parallel rank one of tp/'s (same interface, plus close()).
    runner: StageRunner
    weights: SharedWeights
    lock: threading.Lock = field(default_factory=threading.Lock)
    limits: StepLimits = field(init=False)
    last_used: float = field(default_factory=time.monotonic)  # the last use by any leader (monotonic)
    # Token rows run through the layers, and rows skipped because their KV was carried over from
    # a failed plan (Stage.Info shows both: how much a failover's re-prefill cost this stage).
    rows_computed: int = 0
    rows_skipped: int = 0
    # The leaders that loaded the plan ("" for one that gave no id): an Unload by one of them
    # leaves the plan to the others (stage_control.unload). Changed only under LoadedStages' lock.
    leaders: set[str] = field(init=False)
    # When each named leader last loaded the plan or used it naming itself (a step's or a Renew's
    # leader_id): one that stops for a lease loses its claim while the others keep the plan in use
    # (LoadedStages.lapse_leaders), and gets it back when it names itself again (`lapsed`).
    renewed_by: dict[str, float] = field(default_factory=dict)
    lapsed: set[str] = field(default_factory=set)
    # The last use naming no leader (an older leader's step or Renew, or a step relayed by an older
    # stage): while there are such uses no claim lapses, since this stage cannot tell whose they are.
    used_unnamed: float = 0.0

    def __post_init__(self):
        self.limits = stage_convert.limits_from_pb(self.request)
        self.leaders = {self.request.leader_id}
        if self.request.leader_id:
            self.renewed_by[self.request.leader_id] = self.last_used
        else:
            self.used_unnamed = self.last_used
        self.runner.prefix.set_capacity(self.limits.max_prefix_blocks)

    @property
    def index(self) -> int:
        return self.request.stage_index

    @property
    def leased(self) -> bool:
        return self.request.tp.rank == 0  # a worker rank lives as long as its group (see the module doc)

    @property
    def kv_bytes(self) -> int:
        """KV and prefix blocks this plan holds here now (allocated capacity, not tokens written)."""
        return self.runner.cache.num_bytes + self.runner.prefix.num_bytes

    def kv_budget(self, streams: int) -> int:
        """The most KV and prefix blocks the plan's limits let `streams` leaders' streams hold here:
        what the planner budgeted for this stage (stage_budget.Footprint.layer_kv), per leader. 0
        for a plan loaded without limits (an older leader): unknown."""
        if not self.request.max_context:
            return 0
        return self.limits.kv_tokens(max(1, streams)) * self.runner.cache.layout.bytes_per_token


@dataclass(frozen=True, slots=True)
class _PlanKV:
    """One plan's KV over its range, read at one moment (LoadedStages._snapshot)."""

    plan_id: str
    key: WeightKey
    leaders: frozenset[str]
    budget: int
    held: int


class LoadedStages:
    def __init__(self):
        self._lock = threading.Lock()
        self._stages: dict[str, LoadedStage] = {}
        self._weights: dict[WeightKey, SharedWeights] = {}
        self._claims_restored = False  # since take_restored: a lapsed leader's use gave its claim back

    def get(self, plan_id: str) -> LoadedStage | None:
        with self._lock:
            return self._stages.get(plan_id)

    def use(self, plan_id: str, leader_id: str | None = None, restore: bool = True) -> LoadedStage | None:
        """The plan's stage, its lease renewed (a leader named it). `leader_id`, for a step, a Renew
        or a Load: the leader it names renews its claim too, and with `restore` gets back one that
        lapsed (it is using the plan; take_restored tells); "" names none (see used_unnamed). None:
        a call that carries no leader field (Release, Adopt) renews the plan only. A Load does not
        restore: its leader joins again, through the memory check (StageControl._join)."""
        with self._lock:
            stage = self._stages.get(plan_id)
            if stage is not None:
                stage.last_used = time.monotonic()
                if leader_id == "":
                    stage.used_unnamed = stage.last_used
                elif leader_id is not None:
                    if restore and leader_id in stage.lapsed:
                        stage.lapsed.discard(leader_id)
                        stage.leaders.add(leader_id)
                        self._claims_restored = True
                    if leader_id in stage.leaders:
                        stage.renewed_by[leader_id] = stage.last_used
            return stage

    def take_restored(self) -> bool:
        """Whether a use gave a lapsed leader its claim back since the last call (the node's card
        then shows a reservation that grew)."""
        with self._lock:
            restored, self._claims_restored = self._claims_restored, False
            return restored

    def claim(self, plan_id: str, leader_id: str) -> None:
        """Another leader loaded the plan (StageControl._join): it holds a claim from now."""
        with self._lock:
            stage = self._stages.get(plan_id)
            if stage is not None:
                stage.leaders.add(leader_id)
                stage.lapsed.discard(leader_id)
                if leader_id:
                    stage.renewed_by[leader_id] = time.monotonic()

    def let_go(self, plan_id: str, leader_id: str) -> bool:
        """Drop one leader's claim when another leader still holds the plan (that leader's
        Unload); False, changing nothing, when it is the last one (then the plan goes)."""
        with self._lock:
            stage = self._stages.get(plan_id)
            if stage is None or not leader_id or not stage.leaders - {leader_id}:
                return False
            stage.leaders.discard(leader_id)
            stage.renewed_by.pop(leader_id, None)
            stage.lapsed.discard(leader_id)
            return True

    def leaders(self, plan_id: str) -> frozenset[str]:
        """The leaders holding a claim on the plan now (none when it is not loaded)."""
        with self._lock:
            stage = self._stages.get(plan_id)
            return frozenset(stage.leaders) if stage is not None else frozenset()

    def pop_idle(self, lease_s: float) -> list[tuple[str, LoadedStage, int]]:
        """Remove the leased plans no leader used for `lease_s`: (plan id, stage, weight bytes freed) each.
        Under the same lock as `use`, so a plan a step just named is never dropped."""
        idle_since = time.monotonic() - lease_s
        with self._lock:
            idle = [p for p, s in self._stages.items() if s.leased and s.last_used < idle_since]
            popped = [self._stages.pop(p) for p in idle]
            return [(p, s, self._drop_unused(s.weights.key)) for p, s in zip(idle, popped)]

    def lapse_leaders(self, lease_s: float) -> list[tuple[str, list[str]]]:
        """Let go of the claims of named leaders that neither loaded a plan nor used it naming
        themselves for `lease_s`, while another leader still holds it: (plan id, leaders let go)
        each. Leaders of one plan share its lease (any step renews it), so without this the claim
        of a leader that is gone (a finished `generate`, a killed server) would reserve its streams'
        KV for as long as the others use the plan. A plan's last leader is never let go here (the
        plan's own lease decides), nor any while the plan has uses naming no leader (an older
        leader's, or steps an older stage relayed), nor a tensor-parallel worker rank's (it sees
        no steps; its group ends with rank 0's plan): there, claims go with the plan as before."""
        idle_since = time.monotonic() - lease_s
        lapsed = []
        with self._lock:
            for plan_id, stage in self._stages.items():
                if not stage.leased or stage.used_unnamed >= idle_since:
                    continue
                gone = sorted(leader for leader, at in stage.renewed_by.items() if at < idle_since)
                if gone and stage.leaders - set(gone):
                    for leader in gone:
                        stage.leaders.discard(leader)
                        del stage.renewed_by[leader]
                    stage.lapsed.update(gone)
                    lapsed.append((plan_id, gone))
        return lapsed

    def weights(self, key: WeightKey) -> SharedWeights | None:
        with self._lock:
            return self._weights.get(key)

    def put(self, plan_id: str, request: stage_pb2.LoadRequest, weights: SharedWeights,
            runner: StageRunner | None = None) -> LoadedStage | None:
        """Give `plan_id` its own runner over `weights` (a tensor-parallel rank brings its own),
        replacing what the plan had; returns the replaced stage (the caller closes it)."""
        if runner is None:  # its caches grow no further than the plan's context (kv_budget counts that)
            runner = StageRunner(weights.decoder, max_context=request.max_context or None)
        stage = LoadedStage(request, runner, weights)
        with self._lock:
            self._weights.setdefault(weights.key, weights)
            previous = self._stages.get(plan_id)
            self._stages[plan_id] = stage
            if previous is not None:
                stage.leaders |= previous.leaders  # a reload (a failed group formed again) serves them all
                stage.renewed_by = {**previous.renewed_by, **stage.renewed_by}
                stage.lapsed = previous.lapsed - stage.leaders
                stage.used_unnamed = max(stage.used_unnamed, previous.used_unnamed)
                self._drop_unused(previous.weights.key)
        return previous

    def pop(self, plan_id: str) -> tuple[LoadedStage | None, int]:
        """Remove a plan; returns its stage and the weight bytes freed (0 while shared)."""
        with self._lock:
            stage = self._stages.pop(plan_id, None)
            freed = self._drop_unused(stage.weights.key) if stage is not None else 0
        return stage, freed

    def pop_runner(self, plan_id: str, runner) -> LoadedStage | None:
        """Drop `plan_id` only while `runner` still serves it (not a stage loaded since)."""
        with self._lock:
            stage = self._stages.get(plan_id)
            if stage is None or stage.runner is not runner:
                return None
            del self._stages[plan_id]
            self._drop_unused(stage.weights.key)
            return stage

    def _drop_unused(self, key: WeightKey) -> int:
        if any(s.weights.key == key for s in self._stages.values()):
            return 0
        weights = self._weights.pop(key, None)
        return weights.num_bytes if weights is not None else 0

    def memory(self) -> StageMemory:
        """Weights and KV held, and KV reserved (see kv_reserved)."""
        weights, plans = self._snapshot()
        return StageMemory(weights + sum(p.held for p in plans), sum(_reserved(plans).values()))

    def kv_reserved(self) -> dict[WeightKey, int]:
        """Per range of weights, the KV its plans may still grow into within their limits. Free memory
        as the OS reports it includes that (caches grow as sequences do), and a second plan placed
        into it would run the node out of memory at long contexts. Plans over one range that share a
        leader are one lineage and reserve its largest budget: a plan and the re-plan that replaces
        it (adopting its KV, kv_parking.py; the leader keeps its id), and leaders sharing one plan
        (counted in its budget). Independent leaders' lineages (two serving processes with plans of
        their own) reserve the sum. Leaders without an id link no plans: each reserves its own."""
        return _reserved(self._snapshot()[1])

    def kv_reservations(self) -> dict[WeightKey, list[tuple[frozenset[str], int]]]:
        """kv_reserved by lineage: its named leaders and what it reserves (the card publishes them,
        so a leader's planner counts as its own only its lineage's: placement._reserved_kv_counted_free)."""
        return _lineages(self._snapshot()[1])

    def reservation_change(self, key: WeightKey, plan_id: str, leaders: set[str], budget: int,
                           keeps_kv: bool) -> tuple[int, int]:
        """memory().reserved now, and once `plan_id` is loaded over `key` for `leaders` with a KV
        budget of `budget` bytes (replacing the plan of that id, if any; `keeps_kv`: with its KV, as
        another leader joining it does), both from one reading (StageControl._check_added_kv)."""
        _, plans = self._snapshot()
        previous = next((p for p in plans if p.plan_id == plan_id), None)
        held = previous.held if keeps_kv and previous is not None else 0
        after = [p for p in plans if p.plan_id != plan_id] + [_PlanKV(plan_id, key, frozenset(leaders), budget, held)]
        return sum(_reserved(plans).values()), sum(_reserved(after).values())

    def _snapshot(self) -> tuple[int, list[_PlanKV]]:
        """(weight bytes, each plan's KV), read together."""
        with self._lock:
            stages = list(self._stages.items())
            weights = sum(w.num_bytes for w in self._weights.values())
            leaders = [frozenset(s.leaders) for _, s in stages]  # under the lock: a Load or lapse changes them
        plans = []
        for (plan_id, s), named in zip(stages, leaders):
            plans.append(_PlanKV(plan_id, s.weights.key, named, s.kv_budget(len(named)), s.kv_bytes))
        return weights, plans

    def items(self) -> list[tuple[str, LoadedStage]]:
        """A snapshot, sorted by plan id."""
        with self._lock:
            return sorted(self._stages.items())


def _reserved(plans: list[_PlanKV]) -> dict[WeightKey, int]:
    """KV reserved per range: summed over its lineages (kv_reserved says why)."""
    return {key: sum(reserved for _, reserved in groups) for key, groups in _lineages(plans).items()}


def _lineages(plans: list[_PlanKV]) -> dict[WeightKey, list[tuple[frozenset[str], int]]]:
    """Per range, each lineage of plans (linked by a named leader they share) with the KV it reserves:
    its largest budget less the KV its plans hold."""
    lineages: dict[WeightKey, list[tuple[frozenset[str], int, int]]] = {}  # (named leaders, budget, held)
    for p in plans:
        named = p.leaders - {""}
        groups = lineages.setdefault(p.key, [])
        joined = [g for g in groups if g[0] & named]
        groups[:] = [g for g in groups if not g[0] & named]
        groups.append((named.union(*(g[0] for g in joined)), max([p.budget, *(g[1] for g in joined)]),
                       p.held + sum(g[2] for g in joined)))
    return {key: [(named, max(0, budget - held)) for named, budget, held in groups]
            for key, groups in lineages.items()}
