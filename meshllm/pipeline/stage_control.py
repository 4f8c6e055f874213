"""The stage's control plane: load a layer range for a plan, unload a plan, release
sequences, renew a plan's lease, drop the plans whose lease ran out, report state.

A Load carrying a `tp` part makes this node one rank of a tensor-parallel stage (tp/stage.py);
its slices are bound to its group, so they are never shared with another plan, and the stage
goes when its group ends (a rank failed, an Unload, a node shutdown).

Called by the gRPC servicer (stage_service.py) on pool threads; raises MeshErrors that
the servicer maps to status codes. Loads of different plans run side by side except while
reading weights (one read at a time); a rank waiting for its group never holds up another
plan's Load, an Unload or the lease sweep (loads_under_way.py), and an Unload never waits for
a step stuck in a collective (retire). A plan whose layers this node already holds for
another plan shares their weights (loaded_stages.py): a re-plan after a failure costs the
survivors nothing but a fresh KV cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

from meshllm.cluster.stage_budget import embedding_held
from meshllm.engine.dtypes import DTYPES
from meshllm.engine.stage_weights import decoder_bytes, held_weight_bytes, load_stage_decoder
from meshllm.errors import BadRequest, InvalidCard, ModelLoadError, ShardUnavailable, WeightsMismatch
from meshllm.model.source import ModelFiles, open_model
from meshllm.engine.kv_cache import SeqId
from meshllm.pipeline.kv_parking import adopt
from meshllm.pipeline.loads_under_way import LoadsUnderWay
from meshllm.pipeline.loaded_stages import LoadedStage, LoadedStages, SharedWeights, WeightKey
from meshllm.pipeline.fault_injection import FaultInjector
from meshllm.tp.group import RankRole
from meshllm.tp.load_gate import failures_reported
from meshllm.tp.node_collective import NodeCollective
from meshllm.tp.stage import join_rank, load_rank
from meshllm.transport import stage_convert
from meshllm.transport.convert import node_id_text
from meshllm.transport.protos import stage_pb2

log = logging.getLogger(__name__)

ModelResolver = Callable[[str, str], Path | None]  # (model_id, fingerprint) -> local path
RETIRE_GRACE_S = 0.5  # how long freeing a tensor-parallel stage waits for its running step before going on


class StageControl:
    def __init__(self, stages: LoadedStages, resolve_model: ModelResolver,
                 on_change: Callable[[], None] = lambda: None, device: str = "cpu",
                 collective: NodeCollective | None = None, faults: FaultInjector | None = None,
                 memory_cap: int | None = None):
        """`memory_cap`: the node's --max-memory, the most its plans may take together (what they hold
        and reserve); None: what the OS has free."""
        self._stages = stages
        self._memory_cap = memory_cap
        self._faults = faults or FaultInjector(None)  # tests only: see fault_injection.py
        self._device = device  # the node's --device: where loaded weights, KV and compute go
        self._resolve_model = resolve_model
        self._on_change = on_change  # the node refreshes its card's shard list
        self._collective = collective  # the node's part in tensor parallelism, when it takes one
        # One read at a time: loads are memory-heavy, and a Load's memory check (_check_memory) must
        # see the bytes of the read before it already in use, or two Loads could pass it for the same
        # free memory. Held only while reading weights: never while a tensor-parallel rank waits for
        # its group (minutes at most), which would stall every other plan's Load on this node.
        self._read_lock = threading.Lock()
        self._loading = LoadsUnderWay()  # per plan: one Load at a time, and the flag its Unload sets
        self._closed = False  # the node is stopping: no Load may leave a stage behind (close, _put)

    def load(self, request: stage_pb2.LoadRequest) -> stage_pb2.LoadReply:
        stage_convert.limits_from_pb(request)  # BadRequest for invalid limits, before reading any weights
        _check_leader_id(request.leader_id)
        with self._loading.turn(request.plan_id, request.leader_id) as unloaded:  # a second Load waits, then reuses
            with self._loading.lock:  # ordered against an Unload of the plan by its last other leader
                existing = self._reusable(request)
                if existing is not None and request.leader_id in self._stages.leaders(request.plan_id):
                    # one of its leaders again
                    return stage_pb2.LoadReply(plan_id=request.plan_id, reused_weights=True)
            joined = existing is not None and self._join(request)
            started = time.perf_counter()
            num_bytes_read = 0 if joined else self._load_new(request, unloaded)
            seconds = 0.0 if joined else time.perf_counter() - started
            if not joined:
                log.info("plan %s: %s layers [%d, %d) as stage %d (%s, %.1fs)", request.plan_id, request.model_id,
                         request.first_layer, request.last_layer, request.stage_index,
                         "loaded" if num_bytes_read else "weights shared with another plan", seconds)
        self._on_change()  # the card shows the plan, or a joining leader's reservation, now: not at the next gossip
        return stage_pb2.LoadReply(plan_id=request.plan_id, num_bytes_read=num_bytes_read, load_seconds=seconds,
                                   reused_weights=not num_bytes_read)

    def _load_new(self, request: stage_pb2.LoadRequest, unloaded: threading.Event) -> int:
        """Load the plan's stage (its weights read, or shared with another plan's): bytes read."""
        key = WeightKey.of(request)
        if request.HasField("tp"):
            return self._open_rank(request, key, unloaded)
        with self._read_lock:  # and while it checks for weights to share: one plan reads them once
            weights, num_bytes_read = self._stages.weights(key), 0
            if weights is None:
                weights, num_bytes_read = self._load_weights(request, key)
                self._faults.after_load()
            else:  # no read, so no _check_memory: its KV is all it adds
                # a reload serves the leaders of the plan it replaces too (put)
                leaders = set(self._stages.leaders(request.plan_id)) | {request.leader_id}
                self._check_added_kv(request, weights, leaders, keeps_kv=False)
            self._put(request, weights, None, unloaded)
        return num_bytes_read

    def _join(self, request: stage_pb2.LoadRequest) -> bool:
        """Add another leader to the loaded plan `request` asks for, whose sequences may hold as much
        KV again: checked, against other Loads' checks too (_read_lock, taken first as _put does; it
        may wait for reads). False when the plan was unloaded meanwhile (then it loads anew)."""
        with self._read_lock, self._loading.lock:
            existing = self._reusable(request)
            if existing is None:
                return False
            held = self._stages.leaders(request.plan_id)
            if request.leader_id not in held:
                self._check_added_kv(request, existing.weights, set(held) | {request.leader_id}, keeps_kv=True)
            self._stages.claim(request.plan_id, request.leader_id)
            return True

    def _put(self, request: stage_pb2.LoadRequest, weights: SharedWeights, runner, unloaded: threading.Event) -> None:
        """Serve the loaded stage, unless an Unload of its plan came during the Load: then nothing of
        it stays (ordered against Unload by the same lock, so one of the two always wins whole)."""
        with self._loading.lock:
            # Decided once: an Unload right after this finds the stage and pops it. A node that
            # stopped meanwhile (close) keeps nothing either: nobody would ever free it.
            dropped, stopping = unloaded.is_set() or self._closed, self._closed
            previous = None if dropped else self._stages.put(request.plan_id, request, weights, runner)
        if dropped:
            retire(LoadedStage(request, runner, weights) if runner is not None else None)
            if stopping:
                raise ShardUnavailable("this node stopped while it loaded the plan; plan its layers on another node")
            raise ModelLoadError(f"plan {request.plan_id} was unloaded while this node loaded it")
        retire(previous)

    def _reusable(self, request: stage_pb2.LoadRequest) -> LoadedStage | None:
        """The plan's stage when it already serves what `request` asks (its lease renewed). Caller
        holds _loading.lock."""
        if self._closed:
            raise ShardUnavailable("this node is stopping; plan its layers on another node")
        existing = self._stages.use(request.plan_id, request.leader_id, restore=False)
        return existing if existing is not None and same_load(existing, request) else None

    def _check_added_kv(self, request: stage_pb2.LoadRequest, weights: SharedWeights, leaders: set[str],
                        keeps_kv: bool) -> None:
        """Refuse a plan (or another leader of a loaded one) over weights this node already holds when
        the KV its limits let `leaders` grow into does not fit in free memory less what the loaded
        plans reserve: the weights cost nothing more, the KV does (LoadedStages.kv_reserved says
        whose adds up). `keeps_kv`: the plan is loaded and keeps its KV (another leader joins it)."""
        if not request.max_context:
            return  # an older leader's plan, without limits: its KV is unknown (LoadedStage.kv_budget is 0 too)
        tokens = stage_convert.limits_from_pb(request).kv_tokens(max(1, len(leaders)))
        budget = tokens * weights.decoder.kv_layout().bytes_per_token  # the layout its runner gets (put)
        reserved, after = self._stages.reservation_change(weights.key, request.plan_id, leaders, budget, keeps_kv)
        added = after - reserved
        cap_room = self._cap_room(reserved)
        available = _available(reserved, cap_room)
        if added > available:
            whose = "another leader's sequences need" if keeps_kv else "the plan's KV needs"
            raise ShardUnavailable(f"layers [{request.first_layer}, {request.last_layer}) are loaded here, but "
                                   f"{whose} {added} more bytes; {_free_words(available, reserved, cap_room)}. "
                                   f"Plan them on another node.",
                                   missing_bytes=added - available,
                                   part=f"layers {request.first_layer}-{request.last_layer - 1}")

    def _cap_room(self, reserved: int) -> int | None:
        """Bytes --max-memory leaves for another plan: the cap less what the plans hold and reserve (as
        node.capped_memory advertises it); None without a cap."""
        if self._memory_cap is None:
            return None
        return self._memory_cap - self._stages.memory().held - reserved

    def _open_files(self, request: stage_pb2.LoadRequest) -> tuple[ModelFiles, "torch.dtype"]:
        path = self._resolve_model(request.model_id, request.fingerprint)
        if path is None:
            raise ModelLoadError(f"this node has no model {request.model_id!r} with fingerprint "
                                 f"{request.fingerprint[:12]}; pass its folder with --models")
        files = open_model(path, tokenizer=False)  # a stage never tokenizes
        fingerprint = files.source.fingerprint()
        if fingerprint != request.fingerprint:
            raise WeightsMismatch(f"{path} has fingerprint {fingerprint[:12]}, the plan wants "
                                  f"{request.fingerprint[:12]}; every stage must hold the same weights")
        if files.config.num_hidden_layers != request.num_layers:
            raise WeightsMismatch(f"{path} has {files.config.num_hidden_layers} layers, the plan "
                                  f"expects {request.num_layers}")
        if not 0 <= request.first_layer < request.last_layer <= request.num_layers:
            raise BadRequest(f"layer range [{request.first_layer}, {request.last_layer}) is not inside the model's "
                             f"{request.num_layers} layers")
        dtype = DTYPES.get(request.dtype)
        if dtype is None:
            raise ModelLoadError(f"unknown dtype {request.dtype!r}; use one of {sorted(DTYPES)}")
        reserved = self._stages.memory().reserved
        _check_memory(files, request, dtype.itemsize, reserved, self._device, self._cap_room(reserved))
        return files, dtype

    def _load_weights(self, request: stage_pb2.LoadRequest, key: WeightKey) -> tuple[SharedWeights, int]:
        files, dtype = self._open_files(request)
        decoder = load_stage_decoder(files.source, files.config, request.first_layer, request.last_layer, dtype,
                                     request.quantization or None, request.batch_invariant, device=self._device)
        return SharedWeights(key, decoder, decoder_bytes(decoder)), files.source.num_bytes_read()

    def _open_rank(self, request: stage_pb2.LoadRequest, key: WeightKey, unloaded: threading.Event) -> int:
        """Load this node's rank and serve it; returns the bytes read."""
        role: RankRole = stage_convert.rank_role_from_pb(request)
        hosted = self._collective.store if self._collective is not None else None
        node_name = self._collective.prober.node_id if self._collective is not None else "(no collective endpoint)"
        with failures_reported(role, hosted, node_name):  # the other ranks stop waiting for this one at once
            if self._device != "cpu":
                raise BadRequest(f"tensor-parallel ranks run on the CPU (gloo over the LAN); this node runs "
                                 f"--device {self._device}: plan it as an ordinary stage (--tp 1)")
            with self._read_lock:
                files, dtype = self._open_files(request)
                slices = load_rank(files, role, self._collective, request.first_layer, request.last_layer, dtype,
                                   request.quantization or None, request.batch_invariant, self._faults.after_load)
            runners = []

            def gone(reason: str) -> None:
                # The group ended without an Unload (a rank failed, rank 0 went away): drop the stage
                # now, so no rank outlives its group and the card stops advertising it.
                if runners and self._stages.pop_runner(request.plan_id, runners[0]) is not None:
                    log.warning("plan %s: tensor-parallel rank %d of %d dropped: %s", request.plan_id, role.rank,
                                role.size, reason)
                    self._on_change()

            # Outside the read lock: this waits for the other ranks (their reads, the rendezvous).
            runner = join_rank(slices, self._collective, gone, unloaded.is_set)
            runners.append(runner)
            self._put(request, SharedWeights(key, runner.decoder, decoder_bytes(runner.decoder)), runner, unloaded)
        return files.source.num_bytes_read()

    def close(self) -> None:
        """Node shutdown: tensor-parallel groups are told to stop, not left to time out."""
        with self._loading.lock:
            self._closed = True  # a Load from now on is refused, and one under way keeps nothing (_put)
            self._loading.unload_all()  # Loads under way end at their next look (a group forming: at once)
        for plan_id, _ in self._stages.items():
            stage, _ = self._stages.pop(plan_id)
            retire(stage)

    def unload(self, request: stage_pb2.UnloadRequest) -> stage_pb2.UnloadReply:
        """Forget a plan: its KV goes now, its weights once no other plan uses them. A Load of the
        plan under way is told to drop what it loads (a group forming stops waiting for its ranks).

        Leaders with the same plan share its stages: a leader's Unload (after its own re-plan)
        only lets go of its claim while another leader that loaded the plan still holds one, so
        that leader's streams go on (the plan still goes when no leader uses it for its lease).
        An Unload naming no leader is for every leader."""
        with self._loading.lock:  # never waits for a Load: see _put for the order of the two
            if self._stages.let_go(request.plan_id, request.leader_id):
                log.info("plan %s: one of its leaders let it go; %d still hold it", request.plan_id,
                         len(self._stages.leaders(request.plan_id)))
                return stage_pb2.UnloadReply(was_loaded=True, held_by_other_leaders=True)
            self._loading.unload(request.plan_id, request.leader_id)
            stage, freed = self._stages.pop(request.plan_id)
        if stage is None:
            return stage_pb2.UnloadReply(was_loaded=False)
        self._retire(request.plan_id, stage, freed, "unloaded")
        self._on_change()
        return stage_pb2.UnloadReply(was_loaded=True, weight_bytes_freed=freed)

    def expire(self, lease_s: float) -> list[str]:
        """Drop the plans no leader used for `lease_s` (their leaders are gone: killed, cut off, or
        re-planned elsewhere without reaching this node); returns their ids. A leader that comes
        back finds its plan unknown (Renew, shard_not_loaded) and loads it again. A plan being
        loaded is not in the registry yet: its Load renews it when it puts it there."""
        idle = self._stages.pop_idle(lease_s)
        for plan_id, stage, freed in idle:
            self._retire(plan_id, stage, freed, f"unused for its {lease_s:g}s lease; dropped")
        lapsed = self._stages.lapse_leaders(lease_s)
        for plan_id, leaders in lapsed:
            log.info("plan %s: %d of its leaders stopped renewing it for its %gs lease; their claim lapsed, "
                     "the others keep the plan", plan_id, len(leaders), lease_s)
        # A claim a step gave back (stage_forward cannot rebuild the card) shows from this sweep on.
        if idle or lapsed or self._stages.take_restored():
            self._on_change()  # what the node reserves changed
        return [plan_id for plan_id, _, _ in idle]

    @staticmethod
    def _retire(plan_id: str, stage: LoadedStage, freed: int, why: str) -> None:
        """Free a removed plan's runner state: KV, prefix blocks, a tensor-parallel group."""
        retire(stage, lambda: log.info("plan %s %s (%d weight bytes freed)", plan_id, why, freed))

    def renew(self, request: stage_pb2.RenewRequest) -> stage_pb2.RenewReply:
        loaded = self._stages.use(request.plan_id, request.leader_id) is not None
        if self._stages.take_restored():
            self._on_change()  # a lapsed leader's claim is back: the card shows it now
        return stage_pb2.RenewReply(loaded=loaded)

    def release(self, request: stage_pb2.ReleaseRequest) -> stage_pb2.ReleaseReply:
        stage = self._stages.use(request.plan_id)
        if stage is None:
            return stage_pb2.ReleaseReply(num_released=0)
        with stage.lock:
            ids = request.seq_ids or stage.runner.held_sequences()
            n = stage.runner.release(ids)
        return stage_pb2.ReleaseReply(num_released=n)

    def adopt(self, request: stage_pb2.AdoptRequest) -> stage_pb2.AdoptReply:
        """Carry sequences' KV over from a failed plan to its replacement (kv_parking.py). Plans
        not loaded here, or over other weights, adopt nothing: the leader then recomputes."""
        target, source = self._stages.use(request.plan_id), self._stages.get(request.from_plan_id)
        if target is None or source is None:
            return stage_pb2.AdoptReply()
        seqs = [(SeqId(c.seq_id), c.num_positions) for c in request.seqs]
        if len(seqs) > target.limits.max_seqs or any(not 0 < n <= target.limits.max_context for _, n in seqs):
            raise BadRequest(f"adopt of {len(seqs)} sequences: at most the plan's batch of {target.limits.max_seqs}, "
                             f"each with 1 to {target.limits.max_context} positions")
        adopted = adopt(target, source, seqs)
        if adopted:
            log.info("plan %s adopted %d sequences (%d positions) from plan %s", request.plan_id, len(adopted),
                     sum(n for _, n in adopted), request.from_plan_id)
        return stage_pb2.AdoptReply(adopted=[stage_pb2.CarriedSeq(seq_id=s, num_positions=n) for s, n in adopted])

    def info(self) -> stage_pb2.StageInfoReply:
        shards = []
        for plan_id, s in self._stages.items():
            with s.lock:  # the runner's dicts change under the compute lock
                shards.append(stage_pb2.ShardState(
                    plan_id=plan_id, model_id=s.request.model_id, first_layer=s.request.first_layer,
                    last_layer=s.request.last_layer, seq_ids=s.runner.held_sequences(),
                    kv_bytes=s.runner.cache.num_bytes, stage_index=s.index, num_prefix_blocks=len(s.runner.prefix),
                    weight_bytes=s.weights.num_bytes, prefix_bytes=s.runner.prefix.num_bytes,
                    tp_rank=s.request.tp.rank, tp_size=s.request.tp.size, rows_computed=s.rows_computed,
                    rows_skipped=s.rows_skipped))
        return stage_pb2.StageInfoReply(shards=shards)

    def loaded(self) -> list[stage_pb2.LoadRequest]:
        return [s.request for _, s in self._stages.items()]


def _check_leader_id(leader_id: str) -> None:
    """A leader names itself by its node id, which this node's card repeats (its KV reservations say
    whose they are): one that peers would refuse on a card would take this node out of the fleet.
    "": a leader that gives no id."""
    if leader_id:
        try:
            node_id_text(leader_id, "leader_id")
        except InvalidCard as e:
            raise BadRequest(f"leader_id {leader_id[:40]!r} is not a node id: {e}") from None


def same_load(existing: LoadedStage, request: stage_pb2.LoadRequest) -> bool:
    """A Load of what this node already serves, by any leader. A tensor-parallel rank compares all
    but its group id (fresh per deploy), and only while its group is alive: a second leader
    deploying the same plan reuses the group, a redeploy after a failure forms a new one."""
    if request.HasField("tp") and getattr(existing.runner, "failed", False):
        return False
    mine, theirs = stage_pb2.LoadRequest(), stage_pb2.LoadRequest()
    mine.CopyFrom(existing.request)
    theirs.CopyFrom(request)
    mine.leader_id = theirs.leader_id = ""  # who deploys it does not change what is loaded
    if request.HasField("tp"):
        mine.tp.group_id = theirs.tp.group_id = ""
    return mine == theirs


def retire(stage: LoadedStage | None, then: Callable[[], None] = lambda: None) -> None:
    """Free a stage already out of the registry (no step can find it now): its KV and prefix blocks,
    and a tensor-parallel rank's group (rank 0 tells the workers to stop); `then` runs after.

    A step still running finishes first. In a tensor-parallel group that step may be stuck in a
    collective on a silent rank until the group's timeout (10 s by default), longer than a leader
    waits for its Unload (plan_owner.UNLOAD_TIMEOUT_S): after a short grace the stage is freed on a
    thread of its own, once that step lets go, and the caller (an Unload, a Load replacing the
    plan) answers now."""
    if stage is None:
        return
    in_group = getattr(stage.runner, "close", None) is not None
    if stage.lock.acquire(timeout=RETIRE_GRACE_S if in_group else -1):
        try:
            _free(stage)
        finally:
            stage.lock.release()
        then()
        return

    def when_idle() -> None:
        with stage.lock:  # the stuck step's collective ends (at the group's timeout at most)
            _free(stage)
        then()

    threading.Thread(target=when_idle, daemon=True, name=f"retire-{stage.request.plan_id}").start()


def _free(stage: LoadedStage) -> None:
    """Under the stage's lock."""
    stage.runner.release(stage.runner.held_sequences())
    close = getattr(stage.runner, "close", None)
    if close is not None:
        close()  # first: a worker rank's thread changes its prefix store under the worker's own lock
    stage.runner.prefix.set_capacity(0)  # its prefix blocks too: no step of the plan can come now


def _available(reserved: int, cap_room: int | None) -> int:
    """Bytes free for another plan: the OS's free memory less what the loaded plans reserve, and no
    more than --max-memory leaves (`cap_room`, StageControl._cap_room)."""
    available = psutil.virtual_memory().available - reserved
    return available if cap_room is None else min(available, cap_room)


def _free_words(available: int, reserved: int, cap_room: int | None) -> str:
    where = "within its --max-memory" if cap_room is not None and cap_room == available else "free"
    return f"this node has {available} bytes {where} (less {reserved} its plans' KV may still take)"


def _check_memory(files: ModelFiles, request: stage_pb2.LoadRequest, dtype_bytes: int, reserved: int,
                  device: str = "cpu", cap_room: int | None = None) -> None:
    """Refuse a range whose weights and KV cannot fit in what the OS has free now, less the KV the
    plans loaded here may still grow into (`reserved`), before reading it: a leader that planned on
    a stale card gets a clear error instead of this node swapping now or running out of memory
    once the sequences grow. A tensor-parallel rank holds about 1/size of it, its weights in dense
    form (tp/load.py)."""
    config = files.config
    held = None if request.HasField("tp") else held_weight_bytes(
        files.source, config, dtype_bytes, request.quantization or None, request.batch_invariant)
    vocab_table = config.vocab_size * config.hidden_size * dtype_bytes
    layer = held.layer if held is not None else config.layer_parameters() * dtype_bytes
    need = (request.last_layer - request.first_layer) * layer
    holds_head = request.last_layer == config.num_hidden_layers
    shares_table = config.tie_word_embeddings and request.first_layer == 0 and holds_head  # held once
    if request.first_layer == 0 and embedding_held(held is not None and held.embedding_in_file, shares_table, device):
        need += held.embedding if held is not None else vocab_table
    if holds_head and not shares_table:
        need += held.lm_head if held is not None else vocab_table
    if request.max_context:  # the KV its limits allow (LoadedStage.kv_budget); unknown without them
        need += stage_convert.limits_from_pb(request).kv_tokens() * config.kv_bytes_per_token(
            dtype_bytes, request.last_layer - request.first_layer)
    need //= max(request.tp.size, 1)
    available = _available(reserved, cap_room)
    if need > available:
        raise ShardUnavailable(f"layers [{request.first_layer}, {request.last_layer}) need {need} bytes of weights "
                               f"and KV; {_free_words(available, reserved, cap_room)}. Plan them on another node.",
                               missing_bytes=need - available, part=f"layers {request.first_layer}-"
                               f"{request.last_layer - 1}")
