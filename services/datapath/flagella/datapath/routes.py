"""Routes to the other nodes' pod CIDRs, from the ipam node registry.

Native routing (as Cilium's native-routing mode): each remote node's pod
CIDR is routed via that node's internal IP of the same family. Tunnel mode:
every remote pod CIDR is routed into the VXLAN device, for the node's own
traffic (pods' traffic is redirected into it by from_container, and the
device's to_tunnel program picks the node). The routes carry flagella's own
rtnetlink protocol number, so a prune after a full sync removes exactly the
routes flagella made and nothing else.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError

from flagella.api.ipam.v1 import ipam_pb2
from flagella.common.reconcile import Reconciler
from flagella.datapath.netdev import iproute

log = logging.getLogger(__name__)

# rtnetlink protocol id marking our routes (RTPROT_* ids below 20 are the
# kernel's; Cilium uses 0xc1 for its own routes).
RTPROT_FLAGELLA = 0x66
ESRCH = 3
RT_SCOPE_LINK = 253
RT_SCOPE_NOWHERE = 255


def _family(cidr: str) -> int:
    return socket.AF_INET if ipaddress.ip_network(cidr).version == 4 else socket.AF_INET6


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


class RouteOps:
    """Reconciler operations: key = pod CIDR, value = where it goes: a
    gateway (a node IP) or a device name (the tunnel)."""

    async def update(self, key: str, value: str) -> None:
        async with iproute() as ipr:
            if _is_ip(value):
                via: dict[str, Any] = {"gateway": value}
            else:
                found = await ipr.link_lookup(ifname=value)
                if not found:
                    raise LookupError(f"route {key}: no device {value}")
                via = {"oif": int(found[0]), "scope": RT_SCOPE_LINK}
            await ipr.route("replace", dst=key, proto=RTPROT_FLAGELLA, family=_family(key), **via)

    async def delete(self, key: str) -> None:
        async with iproute() as ipr:
            try:
                # Any scope (a device route is link-scoped), as `ip route del`.
                await ipr.route(
                    "del",
                    dst=key,
                    proto=RTPROT_FLAGELLA,
                    family=_family(key),
                    scope=RT_SCOPE_NOWHERE,
                )
            except NetlinkError as exc:
                if exc.code != ESRCH:
                    raise

    async def list_actual(self) -> Iterable[str]:
        out: list[str] = []
        async with iproute() as ipr:
            for family in (socket.AF_INET, socket.AF_INET6):
                result: Any = await ipr.route("dump", family=family, proto=RTPROT_FLAGELLA)
                routes = [r async for r in result] if hasattr(result, "__aiter__") else result
                for r in routes:
                    if r.get("proto") != RTPROT_FLAGELLA:
                        continue
                    dst = r.get("dst")
                    if dst:
                        out.append(f"{dst}/{r['dst_len']}")
        return out


@dataclass(frozen=True)
class NodeRecord:
    """A node of the registry, as the datapath needs it."""

    name: str
    ips: tuple[str, ...]  # internal IPs
    pod_cidrs: tuple[str, ...]

    def ip_of(self, version: int) -> str | None:
        return next((ip for ip in self.ips if ipaddress.ip_address(ip).version == version), None)


def node_routes(node: NodeRecord, device: str = "") -> dict[str, str]:
    """pod CIDR -> where it goes, for one remote node: into device (tunnel
    mode), else via the node's IP of the CIDR's family (none: no route)."""
    out = {}
    for cidr in node.pod_cidrs:
        if device:
            out[cidr] = device
            continue
        gw = node.ip_of(ipaddress.ip_network(cidr).version)
        if gw is not None:
            out[cidr] = gw
    return out


class NodeRoutesCodec:
    """WatchNodes events -> node name: the node's IPs and pod CIDRs."""

    def key(self, event: ipam_pb2.NodeEvent) -> str:
        return event.node.name

    def decode(self, event: ipam_pb2.NodeEvent) -> NodeRecord:
        n = event.node
        return NodeRecord(
            name=n.name,
            ips=tuple(a.ip for a in n.addresses if a.type == ipam_pb2.NodeAddress.TYPE_INTERNAL_IP),
            pod_cidrs=tuple(n.pod_cidrs),
        )


class NodeRoutes:
    """The nodes table onto the route reconciler: every other node's pod
    CIDRs, routed via its address (native) or into the tunnel device."""

    def __init__(self, local_node: str, routes: Reconciler[str, str], *, device: str = "") -> None:
        self.local_node = local_node
        self.routes = routes
        self.device = device
        self.by_node: dict[str, Mapping[str, str]] = {}

    @property
    def revision(self) -> int:
        return self.routes.revision

    def replace_all(self, items: dict[str, NodeRecord]) -> int:
        self.by_node = {
            name: node_routes(n, self.device)
            for name, n in items.items()
            if name != self.local_node
        }
        return self.routes.replace_all(
            {c: g for routes in self.by_node.values() for c, g in routes.items()}
        )

    def upsert(self, key: str, value: NodeRecord) -> int:
        if key == self.local_node:
            return self.revision
        routes = node_routes(value, self.device)
        for cidr in self.by_node.get(key, {}):
            if cidr not in routes:
                self.routes.delete(cidr)
        for cidr, gw in routes.items():
            self.routes.upsert(cidr, gw)
        self.by_node[key] = routes
        return self.revision

    def delete(self, key: str) -> int:
        for cidr in self.by_node.pop(key, {}):
            self.routes.delete(cidr)
        return self.revision
