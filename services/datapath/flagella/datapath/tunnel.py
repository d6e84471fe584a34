"""The node's VXLAN device for tunnel routing mode (as Cilium's
cilium_vxlan): collect-metadata ("external"), so one device serves every
peer node, the BPF programs choosing the remote node and the VNI (the source
identity) per packet. No ARP on it: the node's own packets routed into it
need no neighbour, and to_tunnel gives them their key."""

from __future__ import annotations

import logging
from typing import Any

from flagella.datapath import netdev

log = logging.getLogger(__name__)

TUNNEL_DEVICE = "flagella_vxlan"
# Outer IPv4 (20) + UDP (8) + VXLAN (8) + the inner Ethernet header (14).
VXLAN_OVERHEAD = 50
IFF_UP = 0x1
IFF_NOARP = 0x80


def _vxlan_port(link: Any) -> int | None:
    """The destination port of a collect-metadata VXLAN link, else None."""
    info = link.get("IFLA_LINKINFO")
    if info is None or info.get("IFLA_INFO_KIND") != "vxlan":
        return None
    data = info.get("IFLA_INFO_DATA")
    if data is None or not data.get("IFLA_VXLAN_COLLECT_METADATA"):
        return None
    port = data.get("IFLA_VXLAN_PORT")
    return int(port) if port is not None else None


async def ensure_tunnel(port: int, mtu: int, proc_sys: str) -> int:
    """The VXLAN device, created if missing (or replaced when it is not a
    collect-metadata device on port), up, with the given MTU. Its ifindex."""
    async with netdev.iproute() as ipr:
        link = await netdev.link_named(ipr, TUNNEL_DEVICE)
        if link is not None and _vxlan_port(link) != port:
            log.info("replacing the tunnel device", extra={"device": TUNNEL_DEVICE, "port": port})
            await ipr.link("del", index=int(link["index"]))
            link = None
        if link is None:
            await ipr.link(
                "add",
                ifname=TUNNEL_DEVICE,
                kind="vxlan",
                vxlan_port=port,
                vxlan_collect_metadata=1,
                vxlan_learning=0,
            )
            link = await netdev.link_named(ipr, TUNNEL_DEVICE)
            if link is None:
                raise netdev.NetdevError(f"{TUNNEL_DEVICE} vanished while being created")
        index = int(link["index"])
        # Packets out of the tunnel for the node itself go up its stack.
        await netdev.write_sysctls(
            None,
            {
                f"net.ipv4.conf.{TUNNEL_DEVICE}.rp_filter": "0",
                f"net.ipv4.conf.{TUNNEL_DEVICE}.forwarding": "1",
            },
            proc_sys,
        )
        await ipr.link(
            "set", index=index, mtu=mtu, flags=IFF_UP | IFF_NOARP, change=IFF_UP | IFF_NOARP
        )
    return index


async def remove_tunnel() -> bool:
    """Native routing: a tunnel device left by an earlier run goes."""
    return await netdev.delete_link(TUNNEL_DEVICE)
