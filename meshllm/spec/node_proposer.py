"""Give a node the Proposer service: it drafts (n-gram, and draft models from --draft-model)
for other nodes' leaders and advertises them as proposer offers in its card."""

from __future__ import annotations

from pathlib import Path

from meshllm.spec.factory import DraftOptions, served_proposers
from meshllm.spec.service import ProposerService
from meshllm.transport.protos import proposer_pb2_grpc


def attach_proposer_service(node, draft_paths: list[Path], options: DraftOptions = DraftOptions()) -> ProposerService:
    """Register the Proposer service on `node` (before node.start())."""
    service = ProposerService(served_proposers(draft_paths, node.card.build().memory_bandwidth_gbps, options),
                              lease_s=node.config.plan_lease_s)
    node.card.set_offers(service.offers())
    node.registry.update_own(node.card.build())
    node.server.add(proposer_pb2_grpc.add_ProposerServicer_to_server, service)
    node.add_service(service)  # its lease sweeper
    return service
