"""Two network namespaces joined by a veth pair, made (and removed) by the test itself.

Created straight inside the namespaces: the host's own interfaces are never touched.
Skips the test with the reason when namespaces cannot be created (not root, no iproute2).
"""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class NamespacePair:
    ns_a: str
    ns_b: str
    dev_a: str
    dev_b: str
    ip_a: str
    ip_b: str


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


@contextlib.contextmanager
def namespace_pair(ip_a: str, ip_b: str, *, multicast: bool = False, rate: str | None = None
                   ) -> Iterator[NamespacePair]:
    """`multicast` routes 224.0.0.0/4 over the veth (mDNS); `rate` shapes each end with tbf."""
    tag = uuid.uuid4().hex[:6]
    pair = NamespacePair(f"mla{tag}", f"mlb{tag}", f"mva{tag}", f"mvb{tag}", ip_a, ip_b)
    try:
        ip("netns", "add", pair.ns_a)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {getattr(e, 'stderr', e)}")
    try:
        ip("netns", "add", pair.ns_b)
        ip("link", "add", pair.dev_a, "netns", pair.ns_a, "type", "veth", "peer", "name", pair.dev_b,
           "netns", pair.ns_b)
        for ns, dev, address in ((pair.ns_a, pair.dev_a, ip_a), (pair.ns_b, pair.dev_b, ip_b)):
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            ip("-n", ns, "link", "set", dev, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            if multicast:
                ip("-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
            if rate:
                subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                                "rate", rate, "burst", "128kb", "latency", "50ms"],
                               check=True, capture_output=True, text=True, timeout=10)
        yield pair
    finally:
        for ns in (pair.ns_a, pair.ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # removes the veth too
