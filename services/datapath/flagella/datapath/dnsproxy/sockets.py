"""The proxy's sockets: transparent listeners the BPF assigns pods' DNS to
(bpf_sk_assign; docs/datapath-bpf.md "DNS proxy redirect"), the original
destination of each UDP query, answers sent from it, and the policy
routing that delivers the assigned packets locally."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct

from pyroute2.netlink.exceptions import NetlinkError

from flagella.datapath import netdev

# linux/in.h, linux/in6.h (Python's socket module lacks them).
IP_TRANSPARENT = 19
IP_RECVORIGDSTADDR = 20
IP_ORIGDSTADDR = 20
IPV6_RECVORIGDSTADDR = 74
IPV6_ORIGDSTADDR = 74
IPV6_TRANSPARENT = 75

# bpf/layout.h MARK_MAGIC_TO_PROXY: the BPF marks what it assigns to the
# proxy; this rule routes it to the local table of the proxy.
MARK_TO_PROXY = 0x0A000000
MARK_MASK = 0xFF000000
ROUTE_TABLE = 2004  # as Cilium's proxy routing table
RULE_PRIORITY = 9  # before the main table's rule (32766)

Address = tuple[str, int]


def _transparent(family: int, kind: int) -> socket.socket:
    sock = socket.socket(family, kind)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET:
            sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
        else:
            sock.setsockopt(socket.IPPROTO_IPV6, IPV6_TRANSPARENT, 1)
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    except OSError:
        sock.close()
        raise
    return sock


def listener(family: int, kind: int, port: int) -> socket.socket:
    """A transparent socket on every address at port: what the BPF's
    listener lookup (any address, the proxy's port) finds."""
    sock = _transparent(family, kind)
    try:
        if kind == socket.SOCK_DGRAM:
            if family == socket.AF_INET:
                sock.setsockopt(socket.SOL_IP, IP_RECVORIGDSTADDR, 1)
            else:
                sock.setsockopt(socket.IPPROTO_IPV6, IPV6_RECVORIGDSTADDR, 1)
        sock.bind(("0.0.0.0" if family == socket.AF_INET else "::", port))
        if kind == socket.SOCK_STREAM:
            sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def original_destination(ancdata: list[tuple[int, int, bytes]]) -> Address | None:
    """The destination a UDP query was sent to (IP_ORIGDSTADDR)."""
    for level, kind, data in ancdata:
        if level == socket.SOL_IP and kind == IP_ORIGDSTADDR and len(data) >= 8:
            port = struct.unpack_from("!H", data, 2)[0]
            return str(ipaddress.IPv4Address(data[4:8])), port
        if level == socket.IPPROTO_IPV6 and kind == IPV6_ORIGDSTADDR and len(data) >= 24:
            port = struct.unpack_from("!H", data, 2)[0]
            return str(ipaddress.IPv6Address(data[8:24])), port
    return None


class AnswerSockets:
    """UDP sockets bound to the servers pods asked (transparent: not this
    node's addresses), so an answer comes from where the query went. Few
    servers are asked: kept per address, closed with the proxy."""

    def __init__(self) -> None:
        self._socks: dict[Address, socket.socket] = {}

    def for_server(self, server: Address) -> socket.socket:
        sock = self._socks.get(server)
        if sock is None:
            family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
            sock = _transparent(family, socket.SOCK_DGRAM)
            try:
                sock.bind(server)
            except OSError:
                sock.close()
                raise
            self._socks[server] = sock
        return sock

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()


async def install_routing() -> None:
    """Marked packets (the BPF's, to the proxy) are delivered locally:
    `ip rule fwmark MARK/MASK lookup 2004` and `local default dev lo` in
    that table, both families. Idempotent."""
    async with netdev.iproute() as ipr:
        lo = await netdev.link_named(ipr, "lo")
        if lo is None:
            raise OSError("no loopback device")
        for family, default in ((socket.AF_INET, "0.0.0.0/0"), (socket.AF_INET6, "::/0")):
            await ipr.route(
                "replace",
                dst=default,
                type="local",
                scope=254,  # host, as `ip route add local` sets it
                table=ROUTE_TABLE,
                oif=lo.get("index"),
                family=family,
            )
            with contextlib.suppress(NetlinkError):  # EEXIST: there already
                await ipr.rule(
                    "add",
                    family=family,
                    fwmark=MARK_TO_PROXY,
                    fwmask=MARK_MASK,
                    table=ROUTE_TABLE,
                    priority=RULE_PRIORITY,
                )
