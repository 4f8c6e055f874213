"""Zero-configuration discovery on the LAN with mDNS/DNS-SD (zeroconf).

Each node registers `<node>._meshllm._tcp.local.` with its gRPC port and a
public tag of the cluster key, and browses for the others. Discovered
addresses of the same cluster become gossip peers, so they feed the same
merge as --peer seeds. Nodes of other clusters on the LAN are ignored.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import re
import socket
import threading

import psutil
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf
from zeroconf import EventLoopBlocked, InterfaceChoice, NonUniqueNameException

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshllm._tcp.local."
_LOOKUP_TIMEOUT_MS = 2000


def _instance_name(node_id: str) -> str:
    # DNS labels: at most 63 bytes; a hash keeps truncated ids distinct.
    label = re.sub(r"[^A-Za-z0-9-]", "-", node_id)
    if len(label) > 50:
        label = f"{label[:40]}-{hashlib.sha256(node_id.encode()).hexdigest()[:8]}"
    return label


def is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


# Interfaces of containers and VMs on this machine: their addresses mean this machine only to
# itself (every Docker host has 172.17.0.1), so a node never advertises them first.
_VIRTUAL_INTERFACES = ("docker", "br-", "virbr", "veth", "cni", "flannel", "vboxnet", "vmnet", "lxc", "lxd",
                       "podman", "kube")


def lan_ipv4_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses, for a node bound to 0.0.0.0; the one a node
    advertises first: the address its default route leaves from, then those of interfaces that
    are up and not container or VM bridges, link-local ones last. (Sorted as text, docker0's
    172.17.0.1 came before 192.168.x.x, and peers on other machines dialled their own bridge.)"""
    stats = psutil.net_if_stats()
    found = [(name, entry.address) for name, entries in psutil.net_if_addrs().items() for entry in entries
             if entry.family == socket.AF_INET and not ipaddress.ip_address(entry.address).is_loopback]
    primary = _default_route_address()

    def rank(item: tuple[str, str]):
        name, address = item
        ip = ipaddress.ip_address(address)
        up = stats[name].isup if name in stats else True
        return address != primary, not up, name.startswith(_VIRTUAL_INTERFACES), ip.is_link_local, ip

    return list(dict.fromkeys(address for _, address in sorted(found, key=rank)))


def _default_route_address() -> str | None:
    """The source address of this machine's default route, or None without one. A UDP connect
    sends nothing: the kernel only picks the route (203.0.113.1 is TEST-NET-3, never a real host)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("203.0.113.1", 9))
            return probe.getsockname()[0]
    except OSError:
        return None


class Discovery:
    """Advertises this node and collects peers' gRPC addresses.

    zeroconf calls `_on_change` on its browser thread; `peers()` is read by the
    gossip loop, so the address map is guarded by a lock.
    """

    def __init__(self, node_id: str, host: str, port: int, cluster_tag: str):
        self._node_id = node_id
        self._host = host
        self._port = port
        self._cluster_tag = cluster_tag
        self._lock = threading.Lock()
        self._found: dict[str, str] = {}  # service name -> "ip:port"
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._starter: threading.Thread | None = None
        self._stopped = False

    def peers(self) -> set[str]:
        with self._lock:
            return set(self._found.values())

    def start(self) -> None:
        # Registering probes the LAN for name conflicts (~1.5 s): do it off the
        # start-up path so the node serves gossip meanwhile.
        self._starter = threading.Thread(target=self._register_and_browse, name="mdns-start", daemon=True)
        self._starter.start()

    def _register_and_browse(self) -> None:
        wildcard = is_wildcard(self._host)
        advertised = lan_ipv4_addresses() if wildcard else [self._host]
        try:
            with self._lock:
                if self._stopped:
                    return
                self._zc = Zeroconf(interfaces=InterfaceChoice.All if wildcard else [self._host],
                                    ip_version=IPVersion.V4Only)
            info = ServiceInfo(
                SERVICE_TYPE, f"{_instance_name(self._node_id)}.{SERVICE_TYPE}",
                addresses=[socket.inet_aton(a) for a in advertised], port=self._port,
                properties={"node_id": self._node_id, "cluster": self._cluster_tag},
                server=f"{_instance_name(self._node_id)}.local.")
            self._zc.register_service(info, allow_name_change=True)
            self._browser = ServiceBrowser(self._zc, SERVICE_TYPE, handlers=[self._on_change])
        except (OSError, ValueError, EventLoopBlocked, NonUniqueNameException) as e:
            # Discovery is a convenience: a node on an interface without
            # multicast (loopback, some VPNs) still gossips with its --peer seeds.
            log.warning("mDNS discovery is off on %s: %s. Use --peer host:port to name peers.", self._host, e)
            self._close()
            return
        log.info("mDNS discovery on %s advertising %s port %d", self._host, advertised, self._port)

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        if self._starter is not None:
            self._starter.join(timeout=10)
        self._close()

    def _close(self) -> None:
        if self._browser is not None:
            self._browser.cancel()
            self._browser = None
        if self._zc is not None:
            self._zc.unregister_all_services()
            self._zc.close()
            self._zc = None

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed:
            with self._lock:
                self._found.pop(name, None)
            return
        info = zeroconf.get_service_info(service_type, name, timeout=_LOOKUP_TIMEOUT_MS)
        if info is None:
            return
        props = {k.decode(errors="replace"): (v or b"").decode(errors="replace") for k, v in info.properties.items()}
        if props.get("cluster") != self._cluster_tag or props.get("node_id") == self._node_id:
            return
        addresses = info.parsed_addresses(IPVersion.V4Only)
        if not addresses or not info.port:
            return
        address = f"{addresses[0]}:{info.port}"
        with self._lock:
            is_new = self._found.get(name) != address
            self._found[name] = address
        if is_new:
            log.info("discovered node %s at %s", props.get("node_id"), address)
