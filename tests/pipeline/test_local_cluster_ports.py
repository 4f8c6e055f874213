"""LocalCluster's node ports: outside the kernel's ephemeral range, so no outgoing connection on
the machine can take one between choosing it and the node binding it."""

from __future__ import annotations

import socket

from meshllm.pipeline.local_cluster import _ephemeral_low, free_port


def test_ports_are_below_the_ephemeral_range_bindable_and_never_repeated():
    low = _ephemeral_low()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < low for p in ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free when handed out
