"""Give a node the Stage service: it loads layer ranges of the models under its
--models on a leader's request and advertises them in its card."""

from __future__ import annotations

from pathlib import Path

from meshllm.cluster.card import KVReservation, LoadedShard, WeightForm
from meshllm.pipeline.loaded_stages import WeightKey
from meshllm.pipeline.stage_service import StageService
from meshllm.transport.channels import ChannelConfig, ChannelPool
from meshllm.transport.convert import MAX_RESERVATIONS
from meshllm.transport.protos import stage_pb2_grpc


def attach_stage_service(node, key: bytes) -> StageService:
    """Register the Stage service on `node` (before node.start())."""

    def resolve(model_id: str, fingerprint: str) -> Path | None:
        # Same weights first; else a model of that name, whose load then fails with weights_mismatch.
        models = node.models.models
        match = next((m for m in models if m.fingerprint == fingerprint), None)
        match = match or next((m for m in models if m.model_id == model_id), None)
        return Path(match.path) if match else None

    channels = ChannelPool(ChannelConfig(node.node_id, key, node.config.tls))
    # A loaded shard shows in the node's card at once, not at the next gossip round.
    service = StageService(resolve, channels, on_change=lambda: node.registry.update_own(node.card.build()),
                           device=node.config.device, max_streams=node.server.config.max_streams,
                           collective=node.collective, plan_lease_s=node.config.plan_lease_s,
                           memory_cap=node.config.max_memory_bytes)

    def shards() -> tuple[LoadedShard, ...]:
        # One entry per range held, however many plans share its weights. Streams are a node-wide
        # budget: every shard shows the node's open streams and its maximum.
        streams = service.forward
        lineages = service.stages.kv_reservations()

        def shard(r) -> LoadedShard:
            reserved = lineages.get(WeightKey.of(r), [])
            by_leader = tuple(KVReservation(tuple(sorted(leaders)), b) for leaders, b in reserved if b)
            if len(by_leader) > MAX_RESERVATIONS or any(len(x.leader_ids) > MAX_RESERVATIONS for x in by_leader):
                by_leader = ()  # past what peers accept: planners fall back on the total, as for an older node
            return LoadedShard(r.model_id, r.fingerprint, r.first_layer, r.last_layer,
                               queue_depth=streams.num_open, max_streams=streams.max_streams, tp_size=max(r.tp.size, 1),
                               form=WeightForm(r.dtype, r.quantization, r.batch_invariant),
                               kv_reserved_bytes=sum(b for _, b in reserved), kv_reservations=by_leader)

        return tuple(dict.fromkeys(shard(r) for r in service.loaded()))

    node.card.set_shards_source(shards)
    node.plan_memory = service.stages.memory  # left out of the card's free memory
    node.server.add(stage_pb2_grpc.add_StageServicer_to_server, service)
    node.add_service(service)  # stopped first: its tensor-parallel groups are told to stop
    return service
