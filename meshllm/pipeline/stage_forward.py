"""The stage's data plane: one long-lived Forward stream per upstream hop.

Each stream has a pump thread that reads micro-batches, computes them under the
stage's lock, and passes the hidden states on to the next stage over its own stream
(stage_relay.py), or on the last stage puts the sampled tokens in the reply queue;
the gRPC thread yields replies (ours and those relayed back from downstream) in
arrival order. A step that fails on a stage is answered by that stage's error, and its
releases, publications and evictions (which the leader counts done) go on to the later
stages as an unanswered step, so none keeps what the leader forgot.

Resources: a stream owns the KV of every sequence it computed and the prefix blocks it
published, and frees them when it ends, however it ends (the leader closed it, crashed,
or the connection broke: gRPC cancels the stream and the pump sees it); except after a
failure the leader re-plans around, where its sequences are parked for a new plan to adopt
(kv_parking.py), and a step of that plan skips the rows it adopted (engine/kv_carry.py). When the stream
to the next stage breaks, that stage has freed this stream's share, so this stream ends
too: the leader sees its stream end and starts over on a fresh chain, never half of one. Each open stream
holds one of the server's threads for its life, so at most `max_streams` are accepted
(what the node advertises); one more is refused with RESOURCE_EXHAUSTED instead of
starving gossip, health and the control plane of threads.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from meshllm.engine.kv_cache import Owner
from meshllm.engine.kv_carry import skip_carried
from meshllm.engine.step import StageTiming
from meshllm.errors import MalformedMessage, MeshError
from meshllm.pipeline.fault_injection import FaultInjector
from meshllm.pipeline.kv_parking import park_stream, parks
from meshllm.pipeline.loaded_stages import LoadedStage, LoadedStages
from meshllm.pipeline.stage_relay import ChainBroken, Downstream
from meshllm.transport import codec, stage_convert
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2

log = logging.getLogger(__name__)

_owners = itertools.count(1)  # 0 is the in-process pipeline's owner
# A stream from the previous stage that ends holding sequences: this long to tell a close from
# that stage's death (which gRPC may first report as a close).
UPSTREAM_DEATH_S = 0.5


class ForwardStreams:
    def __init__(self, stages: LoadedStages, channels: ChannelPool, max_streams: int,
                 faults: FaultInjector | None = None):
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        self._stages = stages
        self._channels = channels
        self.max_streams = max_streams
        self._faults = faults or FaultInjector(None)  # tests only: see fault_injection.py
        self._lock = threading.Lock()
        self._num_open = 0

    @property
    def num_open(self) -> int:
        with self._lock:
            return self._num_open

    def serve(self, request_iterator, context) -> Iterator[stage_pb2.StepReply]:
        """Runs on a gRPC thread for the stream's life."""
        with self._lock:
            full = self._num_open >= self.max_streams
            if not full:
                self._num_open += 1
        if full:
            log.warning("refused a Forward stream: %d already open", self.max_streams)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"[plan_limit_exceeded] this node already serves {self.max_streams} Forward streams, the "
                          f"most it advertises; close an idle one or plan on another node")
        try:
            replies: queue.Queue = queue.Queue()
            pump = threading.Thread(target=self._pump, args=(request_iterator, context, replies,
                                                             Owner(next(_owners))),
                                    daemon=True, name="stage-pump")
            pump.start()
            while True:
                item = replies.get()
                if item is None:
                    return
                if isinstance(item, ChainBroken):  # tell the stage before us which stage failed
                    context.set_trailing_metadata(item.metadata)
                    return
                yield item
        finally:
            with self._lock:
                self._num_open -= 1

    def _pump(self, request_iterator, context, replies: queue.Queue, owner: Owner) -> None:
        downstream: Downstream | None = None
        touched: dict[str, LoadedStage] = {}  # plans this stream computed on: freed when it ends
        park = False  # keep what the stream holds for a re-planned plan (kv_parking.py)
        try:
            for request in request_iterator:
                if request.end != stage_pb2.END_NONE:
                    park = request.end == stage_pb2.END_PARK
                    break
                received_at = time.time()
                stage = self._stages.use(request.plan_id, request.leader_id)  # renews the plan's lease, and its leader's
                if stage is None:
                    if not request.unanswered:
                        replies.put(stage_convert.error_reply(request.step_id, "shard_not_loaded",
                                                              f"plan {request.plan_id} is not loaded here", -1))
                    continue
                touched[request.plan_id] = stage
                if request.unanswered:  # a step an earlier stage failed: its chores only
                    downstream = self._chores_on(request, stage, owner, downstream, replies)
                    continue
                try:
                    step = stage_convert.step_from_pb(request, stage.limits, samples=stage.runner.is_last)
                    started = time.perf_counter()
                    with stage.lock:
                        skipped = skip_carried(step, stage.runner.cache, owner)
                        step = skipped.step
                        out = stage.runner.run(step, owner, max_held=stage.limits.max_seqs)
                        stage.rows_computed += step.num_tokens
                        stage.rows_skipped += skipped.num_rows
                    compute_s = time.perf_counter() - started
                    if step.seqs:
                        out = self._faults.after_compute(out)
                except MeshError as e:
                    log.warning("stage %d step %d failed: %s", stage.index, request.step_id, e.code)
                    replies.put(stage_convert.error_reply(request.step_id, e.code, str(e), stage.index))
                    downstream = self._chores_on(stage_convert.chores_to_pb(request), stage, owner, downstream,
                                                 replies)
                    continue
                except Exception as e:  # noqa: BLE001 - a bug on one step must not end the stream of every sequence
                    log.exception("stage %d step %d failed unexpectedly", stage.index, request.step_id)
                    replies.put(stage_convert.error_reply(request.step_id, "internal",
                                                          f"internal error on this stage: {type(e).__name__}",
                                                          stage.index))
                    downstream = self._chores_on(stage_convert.chores_to_pb(request), stage, owner, downstream,
                                                 replies)
                    continue
                timings = list(request.timings) + [
                    stage_convert.timing_to_pb(StageTiming(stage.index, compute_s, received_at, time.time()))]
                if stage.runner.is_last:
                    replies.put(stage_pb2.StepReply(step_id=request.step_id, timings=timings,
                                                    tokens=stage_convert.tokens_to_pb(out)))
                    continue
                if downstream is not None and downstream.broken:
                    break  # the hop below lost this stream's state: the whole chain ends (see Downstream)
                downstream = downstream or self._downstream(stage, replies)
                # The same step onward, our output in place of our input (fields listed, not
                # CopyFrom: that would copy the incoming activations only to overwrite them).
                seqs = request.seqs if skipped.kept is None else stage_convert.kept_seqs_to_pb(request.seqs,
                                                                                               skipped.kept)
                downstream.send(stage_pb2.StepRequest(
                    plan_id=request.plan_id, step_id=request.step_id, seqs=seqs, input=codec.to_pb(out),
                    release=request.release, timings=timings, publish=request.publish, evict=request.evict,
                    block_size=request.block_size, leader_id=request.leader_id))
            else:
                # The stream ended without a word: closed, or (gRPC may report a peer's death so) the
                # previous stage died; for a stage, a failure the leader will re-plan around. (Not
                # when the hop below broke: this side ended the call then.)
                park = _after_a_stage(touched) and not _broken(downstream) and _holds(touched, owner) \
                    and _upstream_died(context)
        except grpc.RpcError:
            # Upstream went away (crashed or cut off): free what it held below. When it is a stage
            # (not the leader), that node failed: the leader will re-plan, so park instead.
            park = park or (_after_a_stage(touched) and not _broken(downstream))
        finally:
            try:
                if downstream is not None:
                    downstream.close(park)  # the next stage frees (or parks) this stream's share there
                for plan_id, stage in touched.items():
                    if park and parks(stage):
                        num_seqs, num_blocks = park_stream(stage, owner)
                        what = "parked"
                    else:
                        with stage.lock:
                            num_seqs, num_blocks = stage.runner.release_owner(owner)
                        what = "freed"
                    if num_seqs or num_blocks:
                        log.info("stream ended: plan %s %s %d sequences (freed %d prefix blocks)", plan_id,
                                 what, num_seqs, num_blocks)
            finally:
                replies.put(None)  # whatever happened above: else the call and its server thread never end

    def _downstream(self, stage: LoadedStage, replies: queue.Queue) -> Downstream:
        next_stage = self._channels.get(stage.request.next_address, stage.request.next_node_id)
        return Downstream(next_stage, replies, stage.index + 1)

    def _chores_on(self, chores: stage_pb2.StepRequest | None, stage: LoadedStage, owner: Owner,
                   downstream: Downstream | None, replies: queue.Queue) -> Downstream | None:
        """A step failed here or on an earlier stage, and the leader counts its releases,
        publications and evictions done (it failed the step's sequences and moved on): apply them
        here (where the step failed, again: it may have failed before them, and each is idempotent)
        and send them on, unanswered, so no later stage keeps sequences and blocks the leader forgot."""
        if chores is None:
            return downstream
        try:
            step = stage_convert.step_from_pb(chores, stage.limits)
            if step.seqs:
                raise MalformedMessage("an unanswered step carries rows; it may carry only releases, "
                                       "publications and evictions")
            with stage.lock:
                stage.runner.run(step, owner)
        except MeshError as e:  # bad chores: the stages after this one would refuse them too
            log.warning("stage %d: step %d's releases and evictions failed: %s", stage.index, chores.step_id, e.code)
            return downstream
        if stage.runner.is_last or (downstream is not None and downstream.broken):
            return downstream
        downstream = downstream or self._downstream(stage, replies)
        downstream.send(chores)
        return downstream


def _after_a_stage(touched: dict[str, LoadedStage]) -> bool:
    """The stream came from the previous stage of a plan (stage 0's comes from a leader)."""
    return any(stage.index > 0 for stage in touched.values())


def _broken(downstream: Downstream | None) -> bool:
    return downstream is not None and downstream.broken


def _holds(touched: dict[str, LoadedStage], owner: Owner) -> bool:
    for stage in touched.values():
        with stage.lock:
            if stage.runner.cache.owned_by(owner):
                return True
    return False


def _upstream_died(context) -> bool:
    """Whether the call was cancelled (the peer's connection broke) rather than closed: a broken
    connection may first look like a close, and its cancellation follows within milliseconds."""
    deadline = time.monotonic() + UPSTREAM_DEATH_S
    while context.is_active():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True
