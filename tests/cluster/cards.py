"""Card builders and hypothesis strategies shared by the cluster and transport tests."""

from __future__ import annotations

import time

from hypothesis import strategies as st

from meshllm.cluster.card import Card, LoadedShard, ModelOnDisk, NodeId, Role

NOW = 1_800_000_000.0  # a fixed "now" for pure tests


def make_card(node_id: str = "n1", *, announced_at: float | None = None, ttl: float = 30.0, **fields) -> Card:
    defaults = dict(
        grpc_address="127.0.0.1:7650", platform="linux-x86_64", device="cpu",
        memory_total_bytes=16 << 30, memory_free_bytes=8 << 30, memory_bandwidth_gbps=20.0, matmul_gflops=100.0,
        models=(ModelOnDisk("SmolLM2-135M-Instruct", "ab" * 32, 30, "/models/smollm2.gguf"),),
        shards=(LoadedShard("SmolLM2-135M-Instruct", "ab" * 32, 0, 15),))
    defaults.update(fields)
    return Card(node_id=NodeId(node_id), announced_at=time.time() if announced_at is None else announced_at,
                ttl_seconds=ttl, **defaults)


node_ids = st.sampled_from([f"node-{i}" for i in range(6)])


@st.composite
def cards(draw, node_id=node_ids, now: float = NOW) -> Card:
    """Cards of a few node ids, some fresh, some expired at `now`, some sharing a timestamp."""
    announced = now - draw(st.sampled_from([0.0, 1.0, 5.0, 10.0, 29.0, 31.0, 100.0]))
    return make_card(draw(node_id), announced_at=announced, ttl=draw(st.sampled_from([10.0, 30.0])),
                     memory_free_bytes=draw(st.integers(0, 8)) << 30,
                     roles=draw(st.sampled_from([(Role.STAGE,), (Role.STAGE, Role.PROPOSER)])))


card_lists = st.lists(cards(), max_size=8)
