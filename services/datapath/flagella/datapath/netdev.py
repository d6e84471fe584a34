"""Endpoint plumbing with pyroute2: the veth pair of a pod, its addresses,
routes, static neighbour and sysctls, in the datapath's netns and the pod's.

Netlink sockets for a pod's netns are opened from a short-lived thread that
enters the netns with setns(2) (a thread's netns is its own), so no process
is forked per call and the event loop never leaves the datapath's netns.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from pyroute2 import AsyncIPRoute
from pyroute2.netlink.exceptions import NetlinkError

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000
NUD_PERMANENT = 0x80
LOOPBACK_IFINDEX = 1
RT_SCOPE_LINK = 253
NETLINK_ROUTE = 0

# The pod's default gateway: a link-local address answered by a static
# neighbour entry pointing at the host veth's MAC (no ARP, no address needed
# on the host side).
GATEWAY_V4 = "169.254.1.1"
GATEWAY_V6 = "fe80::1"


class NetdevError(Exception):
    """A kernel operation on an endpoint's interfaces failed."""


def host_ifname(endpoint_id: int) -> str:
    """The host side of an endpoint's veth, named from its id (IFNAMSIZ 15)."""
    name = f"lxc{endpoint_id:x}"
    if len(name) > 15:
        raise ValueError(f"endpoint id {endpoint_id} too large for an interface name")
    return name


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _socket_in_netns(netns_path: str) -> socket.socket:
    """Runs in a throw-away thread: enter the netns, open a netlink socket
    (it stays bound to that netns), come back."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(netns_path, os.O_RDONLY)
        try:
            _setns(target)
            try:
                return socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_ROUTE)
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


def _write_sysctls_in_netns(netns_path: str | None, values: dict[str, str], proc_sys: str) -> None:
    """Write sysctl entries as seen from netns_path (None: our own). A net
    sysctl file belongs to the netns of whoever opens it, so proc_sys may be
    any procfs mount (in a container: the host's /proc/sys, mounted rw)."""

    def write() -> None:
        for key, value in values.items():
            path = f"{proc_sys}/" + key.replace(".", "/")
            with open(path, "w") as f:
                f.write(value)

    if netns_path is None:
        write()
        return
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(netns_path, os.O_RDONLY)
        try:
            _setns(target)
            try:
                write()
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


@contextlib.asynccontextmanager
async def iproute(netns_path: str | None = None) -> AsyncIterator[AsyncIPRoute]:
    """An rtnetlink handle in netns_path (None: the datapath's own netns)."""
    if netns_path is None:
        ipr = AsyncIPRoute()
    else:
        sock = await asyncio.to_thread(_socket_in_netns, netns_path)
        ipr = AsyncIPRoute(fileno=sock.detach())
    async with ipr:
        yield ipr


async def write_sysctls(
    netns_path: str | None, values: dict[str, str], proc_sys: str = "/proc/sys"
) -> None:
    await asyncio.to_thread(_write_sysctls_in_netns, netns_path, values, proc_sys)


@dataclass(frozen=True)
class Interface:
    name: str
    mac: str
    ifindex: int
    mtu: int
    sandbox: str = ""


@dataclass(frozen=True)
class VethSpec:
    endpoint_id: int
    netns_path: str
    ifname: str
    # ip_interface strings; pods get host routes (/32, /128).
    addresses: tuple[str, ...]
    mtu: int = 1500
    proc_sys: str = "/proc/sys"


@dataclass(frozen=True)
class VethResult:
    host: Interface
    container: Interface
    addresses: tuple[str, ...]
    gateways: tuple[str, ...]
    routes: tuple[tuple[str, str], ...] = field(default_factory=tuple)


async def _first(ipr: AsyncIPRoute, ifname: str) -> int | None:
    found = await ipr.link_lookup(ifname=ifname)
    return int(found[0]) if found else None


async def _link(ipr: AsyncIPRoute, ifname: str) -> Any | None:
    """The link named ifname (one RTM_GETLINK), or None. Decoding a link is
    the costly part of a lookup: callers keep what they need from it."""
    try:
        found = await _collect(await ipr.link("get", ifname=ifname))
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return None
        raise
    return found[0] if found else None


async def link_named(ipr: AsyncIPRoute, ifname: str) -> Any | None:
    """The link named ifname in ipr's netns (its full record), or None."""
    return await _link(ipr, ifname)


async def link_mtu(name: str) -> int | None:
    """The MTU of a link of the datapath's netns, or None when absent."""
    async with iproute() as ipr:
        link = await _link(ipr, name)
    return None if link is None else int(link.get("IFLA_MTU"))


def _interface(link: Any, mtu: int, sandbox: str = "", name: str = "") -> Interface:
    """An Interface from a link record read before the caller set its mtu
    (and maybe its name); the mac address does not change."""
    return Interface(
        name=name or str(link.get("ifname")),
        mac=str(link.get("address")),
        ifindex=int(link["index"]),
        mtu=mtu,
        sandbox=sandbox,
    )


async def _collect(result: Any) -> list[Any]:
    """pyroute2 answers some requests with a list, others with an async
    iterator."""
    if hasattr(result, "__aiter__"):
        return [item async for item in result]
    return list(result)


def _gateway_for(addr: ipaddress.IPv4Interface | ipaddress.IPv6Interface) -> str:
    return GATEWAY_V4 if addr.version == 4 else GATEWAY_V6


async def setup_veth(spec: VethSpec) -> VethResult:
    """Create (or re-create) the endpoint's veth pair and configure both
    ends. Idempotent: an existing healthy pair is reconfigured in place."""
    if not os.path.exists(spec.netns_path):
        raise NetdevError(f"netns {spec.netns_path} does not exist")
    host_name = host_ifname(spec.endpoint_id)
    tmp_name = f"tmp{spec.endpoint_id:x}"
    addrs = [ipaddress.ip_interface(a) for a in spec.addresses]
    async with iproute() as host, iproute(spec.netns_path) as pod:
        host_link = await _link(host, host_name)
        pod_link = await _link(pod, spec.ifname)
        if host_link is not None and pod_link is None:
            # Half a pair (e.g. a crash mid-setup): start over.
            await host.link("del", index=int(host_link["index"]))
            host_link = None
        if host_link is None:
            stale = await _first(pod, tmp_name)
            if stale is not None:
                await pod.link("del", index=stale)
            if pod_link is not None:
                raise NetdevError(
                    f"{spec.ifname} already exists in {spec.netns_path} and is not ours"
                )
            try:
                await host.link(
                    "add",
                    ifname=host_name,
                    kind="veth",
                    peer={"ifname": tmp_name, "net_ns_fd": spec.netns_path},
                )
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise NetdevError(f"creating veth {host_name}: {exc}") from exc
            host_link = await _link(host, host_name)
            pod_link = await _link(pod, tmp_name)
            if host_link is None or pod_link is None:
                raise NetdevError(f"veth {host_name} vanished while being set up")
            # Renamed below, with its mtu and up in the same message.
            pod_name = tmp_name
        else:
            pod_name = spec.ifname
        assert host_link is not None
        assert pod_link is not None
        host_index = int(host_link["index"])
        pod_index = int(pod_link["index"])

        has_v6 = any(a.version == 6 for a in addrs)
        # Before the link is up: with DAD on, its link-local address stays
        # tentative for up to 2 s, and the kernel sends no neighbour
        # solicitation for the pod (forwarded IPv6 to it waits 1 s more).
        await write_sysctls(
            None,
            {
                f"net.ipv4.conf.{host_name}.rp_filter": "0",
                f"net.ipv4.conf.{host_name}.forwarding": "1",
            }
            | ({f"net.ipv6.conf.{host_name}.accept_dad": "0"} if has_v6 else {}),
            spec.proc_sys,
        )
        await host.link("set", index=host_index, mtu=spec.mtu, state="up")
        host_if = _interface(host_link, spec.mtu)

        # The loopback device is ifindex 1 in every netns (LOOPBACK_IFINDEX).
        await pod.link("set", index=LOOPBACK_IFINDEX, state="up")
        if has_v6:
            # Under the name it has now: a sysctl follows its device.
            await write_sysctls(
                spec.netns_path, {f"net.ipv6.conf.{pod_name}.accept_dad": "0"}, spec.proc_sys
            )
        # One message: the kernel renames (while still down), sets the mtu,
        # then brings it up.
        await pod.link("set", index=pod_index, ifname=spec.ifname, mtu=spec.mtu, state="up")
        routes: list[tuple[str, str]] = []
        gateways: list[str] = []
        for addr in addrs:
            host_prefix = 32 if addr.version == 4 else 128
            await pod.addr("replace", index=pod_index, address=str(addr.ip), prefixlen=host_prefix)
            gw = _gateway_for(addr)
            family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
            await pod.neigh(
                "replace",
                dst=gw,
                lladdr=host_if.mac,
                ifindex=pod_index,
                state=NUD_PERMANENT,
                family=family,
            )
            if addr.version == 4:
                await pod.route(
                    "replace", dst=f"{gw}/32", oif=pod_index, scope=RT_SCOPE_LINK, family=family
                )
            default = "0.0.0.0/0" if addr.version == 4 else "::/0"
            await pod.route("replace", dst=default, gateway=gw, oif=pod_index, family=family)
            routes.append((default, gw))
            gateways.append(gw)
            # The datapath's netns reaches the pod through the host veth.
            await host.route(
                "replace",
                dst=f"{addr.ip}/{host_prefix}",
                oif=host_index,
                scope=RT_SCOPE_LINK,
                family=family,
            )
        pod_if = _interface(pod_link, spec.mtu, spec.netns_path, name=spec.ifname)
    return VethResult(
        host=host_if,
        container=pod_if,
        addresses=tuple(f"{a.ip}/{32 if a.version == 4 else 128}" for a in addrs),
        gateways=tuple(gateways),
        routes=tuple(routes),
    )


async def teardown_veth(endpoint_id: int, netns_path: str = "", ifname: str = "") -> bool:
    """Remove the endpoint's veth pair (its routes go with it). Idempotent:
    returns whether anything was removed."""
    removed = False
    async with iproute() as host:
        index = await _first(host, host_ifname(endpoint_id))
        if index is not None:
            with contextlib.suppress(NetlinkError):
                await host.link("del", index=index)
                removed = True
    if not removed and netns_path and ifname and os.path.exists(netns_path):
        # The host end is gone but the pod end survived (should not happen
        # with veth pairs; covers a peer left by a crash mid-rename).
        async with iproute(netns_path) as pod:
            for name in (ifname, f"tmp{endpoint_id:x}"):
                index = await _first(pod, name)
                if index is not None:
                    with contextlib.suppress(NetlinkError):
                        await pod.link("del", index=index)
                        removed = True
    return removed


async def host_links(prefix: str = "lxc") -> dict[str, int]:
    """Host-side endpoint interfaces present now: name -> ifindex."""
    async with iproute() as host:
        return {
            str(link.get("ifname")): int(link["index"])
            for link in await _collect(await host.link("dump"))
            if str(link.get("ifname", "")).startswith(prefix)
        }


async def links(names: Iterable[str]) -> dict[str, int]:
    """ifindex of each named link that exists in the datapath's netns."""
    out = {}
    async with iproute() as host:
        for name in names:
            index = await _first(host, name)
            if index is not None:
                out[name] = index
    return out


async def delete_link(name: str) -> bool:
    async with iproute() as host:
        index = await _first(host, name)
        if index is None:
            return False
        with contextlib.suppress(NetlinkError):
            await host.link("del", index=index)
        return True
