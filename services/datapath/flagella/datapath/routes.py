"""Routes to the other nodes' pod CIDRs, from the ipam node registry.

Each remote node's pod CIDR is routed via that node's internal IP (direct
routing, as Cilium's native-routing mode). The routes carry flagella's own
rtnetlink protocol number, so a prune after a full sync removes exactly the
routes flagella made and nothing else.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Iterable, Mapping
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


def _family(cidr: str) -> int:
    return socket.AF_INET if ipaddress.ip_network(cidr).version == 4 else socket.AF_INET6


class RouteOps:
    """Reconciler operations: key = pod CIDR, value = gateway (node IP)."""

    async def update(self, key: str, value: str) -> None:
        async with iproute() as ipr:
            await ipr.route(
                "replace", dst=key, gateway=value, proto=RTPROT_FLAGELLA, family=_family(key)
            )

    async def delete(self, key: str) -> None:
        async with iproute() as ipr:
            try:
                await ipr.route("del", dst=key, proto=RTPROT_FLAGELLA, family=_family(key))
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


def node_routes(node: ipam_pb2.Node) -> dict[str, str]:
    """pod CIDR -> gateway for one remote node (one per family it has an IP of)."""
    ips = [a.ip for a in node.addresses if a.type == ipam_pb2.NodeAddress.TYPE_INTERNAL_IP]
    out = {}
    for cidr in node.pod_cidrs:
        version = ipaddress.ip_network(cidr).version
        gw = next((ip for ip in ips if ipaddress.ip_address(ip).version == version), None)
        if gw is not None:
            out[cidr] = gw
    return out


class NodeRoutesCodec:
    """WatchNodes events -> node name: its pod CIDRs with their gateway."""

    def key(self, event: ipam_pb2.NodeEvent) -> str:
        return event.node.name

    def decode(self, event: ipam_pb2.NodeEvent) -> Mapping[str, str]:
        return node_routes(event.node)


class NodeRoutes:
    """The nodes table onto the route reconciler: every other node's pod
    CIDRs, routed via its address."""

    def __init__(self, local_node: str, routes: Reconciler[str, str]) -> None:
        self.local_node = local_node
        self.routes = routes
        self.by_node: dict[str, Mapping[str, str]] = {}

    @property
    def revision(self) -> int:
        return self.routes.revision

    def replace_all(self, items: dict[str, Mapping[str, str]]) -> int:
        self.by_node = {name: r for name, r in items.items() if name != self.local_node}
        return self.routes.replace_all(
            {c: g for routes in self.by_node.values() for c, g in routes.items()}
        )

    def upsert(self, key: str, value: Mapping[str, str]) -> int:
        if key == self.local_node:
            return self.revision
        for cidr in self.by_node.get(key, {}):
            if cidr not in value:
                self.routes.delete(cidr)
        for cidr, gw in value.items():
            self.routes.upsert(cidr, gw)
        self.by_node[key] = value
        return self.revision

    def delete(self, key: str) -> int:
        for cidr in self.by_node.pop(key, {}):
            self.routes.delete(cidr)
        return self.revision
