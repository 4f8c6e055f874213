"""The plan owner's side of KV carry-over: after a failover, the new plan's stages that serve
the same layers on the same node as a stage of the failed plan adopt its sequences' KV, so the
re-prefill skips those positions there.

Only a suffix of the new plan can use carried KV: a stage skips rows, so every stage after it
must hold them too, and the stage after a replaced one needs all the replaced stage's rows,
which need all of its predecessors' (no stage keeps the activations it sent). So the adopting
stages are the longest run of matching stages that ends at the last stage: after a middle
stage dies, the stages after it; after the last one dies, none; after a stall or a re-deploy
onto the same nodes, all of them.

Every adopting stage truncates a sequence to the same count, the positions the leader knows
every stage held (its committed count): a stage upstream of the failed one may hold more (steps
in flight), and a verification step leaves rejected draft positions behind. A sequence that one
adopting stage could not adopt is released on the others, so no stage skips rows a later stage
lacks (a stage would refuse such a step with kv_missing anyway, never compute on a gap).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import grpc

from meshllm.cluster.placement import Plan, StageAssignment
from meshllm.engine.kv_cache import SeqId
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

ADOPT_TIMEOUT_S = 5.0  # a stage that does not answer adopts nothing: its sequences are recomputed


def adopting_stages(old: Plan, new: Plan) -> list[int]:
    """Indexes of the new plan's stages that may adopt the old plan's KV: the longest suffix whose
    every stage has a twin in the old plan (same node and address, same layers, no tensor parallelism)."""
    held = {_twin_key(s) for s in old.stages if not s.workers}
    suffix: list[int] = []
    for i in range(len(new.stages) - 1, -1, -1):
        stage = new.stages[i]
        if stage.workers or _twin_key(stage) not in held:
            break
        suffix.insert(0, i)
    return suffix


def carry_over(channels: ChannelPool, old: Plan, old_plan_id: str, new: Plan, new_plan_id: str,
               positions: Mapping[SeqId, int]) -> tuple[dict[SeqId, int], tuple[int, ...]]:
    """Have the adopting stages of `new` take the sequences' KV over from `old`. Returns the
    positions carried per sequence (adopted by every adopting stage) and those stages."""
    stages = adopting_stages(old, new)
    wanted = {s: n for s, n in positions.items() if n > 0}
    if not stages or not wanted:
        return {}, ()
    request = stage_pb2.AdoptRequest(plan_id=new_plan_id, from_plan_id=old_plan_id, seqs=[
        stage_pb2.CarriedSeq(seq_id=s, num_positions=n) for s, n in sorted(wanted.items())])

    def adopt(i: int) -> dict[SeqId, int]:
        try:
            reply = _stub(channels, new.stages[i]).Adopt(request, timeout=ADOPT_TIMEOUT_S)
        except grpc.RpcError as e:
            log.warning("stage %d could not adopt carried KV (%s): its sequences are recomputed", i, e.code().name)
            return {}
        return {SeqId(c.seq_id): c.num_positions for c in reply.adopted}

    with ThreadPoolExecutor(max_workers=len(stages)) as pool:
        replies = list(pool.map(adopt, stages))
    carried = {s: n for s, n in wanted.items() if all(r.get(s) == n for r in replies)}
    for i, reply in zip(stages, replies):
        partial = sorted(s for s in reply if s not in carried)
        if partial:  # adopted here but not on every adopting stage: recompute it everywhere
            try:
                _stub(channels, new.stages[i]).Release(stage_pb2.ReleaseRequest(plan_id=new_plan_id, seq_ids=partial),
                                                       timeout=ADOPT_TIMEOUT_S)
            except grpc.RpcError as e:
                log.warning("stage %d: release of %d partly carried sequences failed (%s); a step that would "
                            "skip them fails with kv_missing and is re-planned", i, len(partial), e.code().name)
    log.info("carried the KV of %d of %d sequences (%d positions) over to stages %s", len(carried), len(wanted),
             sum(carried.values()), stages)
    return carried, tuple(stages)


def _twin_key(stage: StageAssignment) -> tuple[str, str, int, int]:
    return stage.node_id, stage.address, stage.first_layer, stage.last_layer


def _stub(channels: ChannelPool, stage: StageAssignment) -> stage_pb2_grpc.StageStub:
    return stage_pb2_grpc.StageStub(channels.get(stage.address, stage.node_id))
