"""Gossip convergence on simulated fleets, and the size of a card on the wire.

    python bench/gossip.py [--sizes 8 64 256] [--seed 0]

What is real: every node's Registry, its GossipLoop (peer choice, rounds,
error handling), the Exchange servicer, card encoding and validation; each
exchange serializes and parses the protobuf messages both ways.
What is simulated: the network (a fake channel calls the peer's servicer
in-process instead of gRPC over TCP) and the clock (it advances one gossip
interval per round; rounds are synchronous, nodes take turns in random order).

Each fleet gets a random connected seed graph: node i seeds to one random
earlier node (a random tree), plus n/4 extra random seed edges. Convergence is
the first round after which every view holds every card; the goal is at most
the graph's diameter (exchanges are symmetric, so undirected). Two modes:
`seeds_only` (peers = seeds) and `with_random_peer` (the default loop: seeds
plus one random known node per round). Prints JSON.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshllm.cluster.card import Card, LoadedShard, ModelOnDisk, NodeId  # noqa: E402
from meshllm.cluster.gossip import ClusterServicer, GossipLoop  # noqa: E402
from meshllm.cluster.registry import Registry  # noqa: E402
from meshllm.transport import convert  # noqa: E402

INTERVAL_S = 2.0
TTL_S = 30.0
MAX_ROUNDS = 64


class Clock:
    def __init__(self):
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class _Context:
    """The bit of grpc.ServicerContext the Exchange servicer uses."""

    def peer(self) -> str:
        return "simulated"

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


class SimulatedNetwork:
    """Channel pool stand-in: 'dialing' an address calls that node's servicer."""

    def __init__(self):
        self.servicers: dict[str, ClusterServicer] = {}
        self.num_exchanges = 0
        self.num_bytes = 0

    def get(self, address: str):
        network = self

        class Channel:
            def unary_unary(self, method, request_serializer, response_deserializer, **_):
                def call(request, timeout=None):
                    wire = request_serializer(request)
                    request_type = type(request)
                    reply = network.servicers[address].Exchange(request_type.FromString(wire), _Context())
                    reply_wire = reply.SerializeToString()
                    network.num_exchanges += 1
                    network.num_bytes += len(wire) + len(reply_wire)
                    return response_deserializer(reply_wire)
                return call

        return Channel()

    def addresses(self) -> set[str]:
        return set()

    def discard(self, address: str) -> None:
        pass

    def close(self) -> None:
        pass


def typical_card(i: int, now: float) -> Card:
    return Card(
        node_id=NodeId(f"node-{i:04d}"), grpc_address=f"10.0.{i // 250}.{i % 250 + 1}:7650",
        platform="darwin-arm64", device="mps", memory_total_bytes=64 << 30, memory_free_bytes=40 << 30,
        memory_bandwidth_gbps=273.0, matmul_gflops=14000.0,
        models=(ModelOnDisk("Qwen2.5-7B-Instruct", "9f" * 32, 28, "/Users/me/models/Qwen2.5-7B-Instruct"),),
        shards=(LoadedShard("Qwen2.5-7B-Instruct", "9f" * 32, 0, 14),), announced_at=now, ttl_seconds=TTL_S)


def seed_graph(n: int, rng: random.Random) -> dict[int, set[int]]:
    seeds = {i: set() for i in range(n)}
    for i in range(1, n):
        seeds[i].add(rng.randrange(i))
    for _ in range(n // 4):
        a, b = rng.sample(range(n), 2)
        if b not in seeds[a] and a not in seeds[b]:
            seeds[a].add(b)
    return seeds


def diameter(seeds: dict[int, set[int]]) -> int:
    neighbours = collections.defaultdict(set)
    for a, bs in seeds.items():
        for b in bs:
            neighbours[a].add(b)
            neighbours[b].add(a)
    worst = 0
    for start in seeds:
        depth = {start: 0}
        queue = collections.deque([start])
        while queue:
            node = queue.popleft()
            for nxt in neighbours[node]:
                if nxt not in depth:
                    depth[nxt] = depth[node] + 1
                    queue.append(nxt)
        worst = max(worst, max(depth.values()))
    return worst


def simulate(n: int, seeds: dict[int, set[int]], num_random_peers: int, rng: random.Random) -> dict:
    clock, network = Clock(), SimulatedNetwork()
    address = {i: typical_card(i, clock.now).grpc_address for i in range(n)}
    loops = []
    for i in range(n):
        registry = Registry(typical_card(i, clock.now), clock=clock)
        network.servicers[address[i]] = ClusterServicer(registry, clock=clock)
        loop = GossipLoop(registry, network, peers=lambda i=i: {address[j] for j in seeds[i]},
                          refresh_own=lambda i=i: typical_card(i, clock.now), interval_s=INTERVAL_S,
                          rng=random.Random(rng.random()), clock=clock, num_random_peers=num_random_peers)
        loops.append((registry, loop))
    started = time.perf_counter()
    rounds = 0
    while rounds < MAX_ROUNDS and not all(len(r.snapshot()) == n for r, _ in loops):
        rounds += 1
        for _, loop in rng.sample(loops, n):
            loop.run_round()
        clock.now += INTERVAL_S
    cpu_s = time.perf_counter() - started
    converged = all(len(r.snapshot()) == n for r, _ in loops)
    for _, loop in loops:
        loop.stop()
    return {"rounds": rounds, "converged": converged,
            "simulated_seconds": rounds * INTERVAL_S, "simulation_wall_s": round(cpu_s, 3),
            "exchanges": network.num_exchanges, "wire_bytes": network.num_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    fleets = []
    for n in args.sizes:
        seeds = seed_graph(n, rng)
        d = diameter(seeds)
        result = {"nodes": n, "seed_edges": sum(map(len, seeds.values())), "diameter": d}
        for mode, num_random in (("seeds_only", 0), ("with_random_peer", 1)):
            result[mode] = simulate(n, seeds, num_random, random.Random(rng.random()))
            result[mode]["within_diameter"] = result[mode]["rounds"] <= d
        fleets.append(result)
    rich = typical_card(0, 1.8e9)
    rich_card = Card(**{**{f: getattr(rich, f) for f in rich.__dataclass_fields__},
                        "models": tuple(ModelOnDisk(f"model-{k}-Instruct-GGUF", "ab" * 32, 32, f"/srv/models/m{k}")
                                        for k in range(8))})
    print(json.dumps({
        "simulated": "network (in-process calls in place of gRPC) and clock (one interval per round)",
        "gossip_interval_s": INTERVAL_S,
        "card_bytes_on_wire": {"typical_1_model_1_shard": convert.card_wire_size(typical_card(0, 1.8e9)),
                               "8_models": convert.card_wire_size(rich_card),
                               "limit": convert.CARD_MAX_BYTES},
        "fleets": fleets,
    }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
