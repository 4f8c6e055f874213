"""Renewing a plan's lease on one node (Stage.Renew), and what its answer means for the plan.

The leader's probes (plan_owner.py) renew the lease on every node of the plan; a node that
does not answer in time is dead or hung: the leader re-plans without it until it answers
again. Not every error is silence, though, and treating a refusal as silence loops: the node
answers health checks, so it is let back in, planned again, refused again:
- UNIMPLEMENTED: a node older than leases (it has no Renew, and no lease to lose): alive when
  it answers a health check;
- UNAUTHENTICATED / PERMISSION_DENIED (the node refused the call, or its reply failed our check:
  another cluster key, another node at that address, a clock far off): it cannot serve this
  leader's plan, however well it answers health checks; the plan owner leaves it out for as
  long as its Renew is refused.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from enum import Enum

import grpc

from meshllm.cluster.card import NodeId
from meshllm.transport.channels import ChannelPool
from meshllm.transport.protos import cluster_pb2, cluster_pb2_grpc, stage_pb2, stage_pb2_grpc

log = logging.getLogger(__name__)

_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class Lease(Enum):
    HELD = "held"  # the node holds the plan; its lease is renewed
    DROPPED = "dropped"  # it answered without the plan (its lease ran out): load it again
    SILENT = "silent"  # no answer in time: dead, hung or cut off
    REFUSED = "refused"  # it refuses this leader's calls: it cannot serve the plan


@dataclass(frozen=True, slots=True)
class Renewal:
    lease: Lease
    detail: str = ""  # the refusal, for a person (REFUSED only)


class LeaseRenewer:
    """Thread-safe: the probe renews on every node at once."""

    def __init__(self, channels: ChannelPool):
        self.channels = channels
        self._lock = threading.Lock()
        self._without_renew: set[NodeId] = set()  # logged once each

    def renew(self, address: str, node_id: NodeId, plan_id: str, timeout_s: float, leader_id: str = "") -> Renewal:
        """`leader_id`: the renewing leader's, so the node keeps this leader's claim on the plan
        (LoadedStages.lapse_leaders) and not only the plan."""
        try:
            reply = stage_pb2_grpc.StageStub(self.channels.get(address, node_id)).Renew(
                stage_pb2.RenewRequest(plan_id=plan_id, leader_id=leader_id), timeout=timeout_s)
            return Renewal(Lease.HELD if reply.loaded else Lease.DROPPED)
        except grpc.RpcError as e:
            code = e.code()
            if code in _REFUSALS:
                return Renewal(Lease.REFUSED, f"{code.name}: {e.details()}")
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return self._older_node(address, node_id, timeout_s)
            return Renewal(Lease.SILENT)

    def _older_node(self, address: str, node_id: NodeId, timeout_s: float) -> Renewal:
        with self._lock:
            first = node_id not in self._without_renew
            self._without_renew.add(node_id)
        if first:
            log.warning("node %s at %s has no Stage.Renew (an older meshllm): its health checks stand in for "
                        "lease renewals", node_id, address)
        try:
            cluster_pb2_grpc.HealthStub(self.channels.get(address)).Check(cluster_pb2.HealthRequest(),
                                                                          timeout=timeout_s)
            return Renewal(Lease.HELD)  # it has no lease, so it cannot have dropped the plan for one
        except grpc.RpcError:
            return Renewal(Lease.SILENT)
