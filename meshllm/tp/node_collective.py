"""A node's part in tensor parallelism, when started with --collective-port.

It hosts the rendezvous store (StoreHost) for the groups it leads as rank 0 and for
its link probes, advertises it as the card's `collective_endpoint`, answers peers'
link probes (Collective.ProbeLink), and probes its own links in the background: every
peer with a collective endpoint whose node id sorts after ours (so each pair is
measured once), again every `reprobe_s`. The results go in the card (LinkProbe),
where the planner's cost model reads them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from meshllm.cluster.card import Card, LinkProbe, NodeId
from meshllm.errors import TensorParallelFailed
from meshllm.tp.group import StoreHost
from meshllm.tp.link_probe import PROBE_TIMEOUT_S, CollectiveServicer, probe_peer
from meshllm.transport.channels import ChannelPool

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 5.0  # how often to look for peers to probe
REPROBE_S = 600.0  # a link's measurement is refreshed this often


class LinkProber:
    """Node service (start/stop): one probe at a time on its own thread."""

    def __init__(self, node_id: NodeId, fleet: Callable[[], list[Card]], store: StoreHost, bind_host: str,
                 channels: ChannelPool, publish: Callable[[tuple[LinkProbe, ...]], None],
                 interval_s: float = PROBE_INTERVAL_S, reprobe_s: float = REPROBE_S):
        self.node_id = node_id
        self._fleet = fleet
        self._store = store
        self._bind_host = bind_host
        self._channels = channels
        self._publish = publish
        self._interval_s, self._reprobe_s = interval_s, reprobe_s
        self._links: dict[NodeId, tuple[float, LinkProbe]] = {}  # peer -> (measured at, result)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True, name="link-prober")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * PROBE_TIMEOUT_S)  # a probe under way fails that fast at most

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.probe_due()

    def probe_due(self) -> list[LinkProbe]:
        """Probe every peer that is due (one after another); returns what was measured."""
        peers = {c.node_id: c for c in self._fleet() if c.node_id != self.node_id and c.collective_endpoint}
        now = time.monotonic()
        for gone in set(self._links) - set(peers):
            del self._links[gone]  # expired from the view: its link means nothing to the planner now
        measured = []
        for peer in sorted(peers):
            if self._stop.is_set():
                break
            if peer < self.node_id or now - self._links.get(peer, (-1e18, None))[0] < self._reprobe_s:
                continue  # the peer probes us (lower node id first), or we measured it recently
            try:
                link = probe_peer(self._store, self._bind_host, peer, peers[peer].grpc_address, self._channels)
            except TensorParallelFailed as e:
                log.info("link probe to %s failed: %s", peer, e)
                continue
            log.info("link to %s: all-reduce %.0f us, %.2f GB/s", peer, link.latency_s * 1e6, link.bandwidth_gbps)
            self._links[peer] = (time.monotonic(), link)
            measured.append(link)
        self._publish(tuple(link for _, link in sorted(self._links.values(), key=lambda e: e[1].peer)))
        return measured


class NodeCollective:
    """The store, the probe service and the prober of one node; see the module docstring."""

    def __init__(self, node_id: NodeId, advertise_host: str, port: int, fleet: Callable[[], list[Card]],
                 channels: ChannelPool, publish: Callable[[tuple[LinkProbe, ...]], None]):
        self.store = StoreHost(advertise_host, port)
        self.store.start()  # bound now, like the gRPC port, so the advertised endpoint is real
        self.bind_host = advertise_host
        self.servicer = CollectiveServicer(advertise_host)
        self.prober = LinkProber(node_id, fleet, self.store, advertise_host, channels, publish)

    @property
    def endpoint(self) -> str:
        return self.store.endpoint

    def start(self) -> None:
        self.prober.start()

    def stop(self) -> None:
        self.prober.stop()
        self.store.stop()
