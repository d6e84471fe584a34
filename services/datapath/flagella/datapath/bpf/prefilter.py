"""The XDP prefilter's maps and attachment (bpf/prefilter.h).

Its maps are pinned in a folder of their own (PIN_FOLDER under the pin
root), outside the versioned datapath layout: the prefilter can be added
or resized without moving conntrack and the other maps to a new folder.
A CIDR's LPM entry holds its counter slot, an index of the per-CPU
`prefilter_drops` array; the list's owner (flagella.datapath.prefilter)
assigns the slots.

XDP is attached through netlink (IFLA_XDP, as `ip link set xdp`): the
program stays on the device after this process exits, like the tc filters,
and a restarted datapath replaces it with its own.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from flagella.datapath.bpf import syscall
from flagella.datapath.bpf.layout import U32, MapSpec
from flagella.datapath.bpf.maps import BpfMap, PerCpuArray

#: CIDRs the prefilter holds at most, both families together (documented
#: in docs/datapath-bpf.md; Cilium's dynamic maps default to 16384 each).
MAX_ENTRIES = 1024
#: Pin folder under the pin root; a layout change here gets a new number.
PIN_FOLDER = "prefilter-1"
PROGRAM = "xdp_prefilter"

XDP_FLAGS_SKB_MODE = 1 << 1
XDP_FLAGS_DRV_MODE = 1 << 2
# IFLA_XDP_ATTACHED values.
_ATTACHED_MODE = {1: "native", 2: "generic", 3: "offload"}

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Key4(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 4)]


class Key6(ctypes.Structure):
    _fields_ = [("prefixlen", ctypes.c_uint32), ("addr", ctypes.c_uint8 * 16)]


KT = TypeVar("KT", Key4, Key6)


class Count(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


def map_specs(max_entries: int = MAX_ENTRIES) -> tuple[MapSpec, ...]:
    """The prefilter's maps, as prefilter.h declares them (names equal)."""
    s = syscall
    return (
        MapSpec("prefilter_v4", s.MAP_TYPE_LPM_TRIE, Key4, U32, max_entries, s.F_NO_PREALLOC,
                None, None),
        MapSpec("prefilter_v6", s.MAP_TYPE_LPM_TRIE, Key6, U32, max_entries, s.F_NO_PREALLOC,
                None, None),
        MapSpec("prefilter_drops", s.MAP_TYPE_PERCPU_ARRAY, U32, Count, max_entries, 0,
                None, None),
    )  # fmt: skip


def _key(cls: type[KT], net: IPNetwork) -> KT:
    key = cls()
    key.prefixlen = net.prefixlen
    raw = net.network_address.packed
    ctypes.memmove(ctypes.addressof(key) + 4, raw, len(raw))
    return key


class PrefilterMaps:
    """The two LPM tries and the counters, opened from their pins."""

    def __init__(self, folder: Path, fds: Mapping[str, int]) -> None:
        self.folder = folder
        specs = {s.name: s for s in map_specs()}

        def pinned(name: str) -> str:
            return str(folder / name)

        self.v4: BpfMap[Key4, U32] = BpfMap(
            specs["prefilter_v4"], fds["prefilter_v4"], pinned("prefilter_v4")
        )
        self.v6: BpfMap[Key6, U32] = BpfMap(
            specs["prefilter_v6"], fds["prefilter_v6"], pinned("prefilter_v6")
        )
        self.drops: PerCpuArray[U32, Count] = PerCpuArray(
            specs["prefilter_drops"], fds["prefilter_drops"], pinned("prefilter_drops")
        )

    def entries(self) -> dict[IPNetwork, int]:
        """CIDR -> counter slot, as the tries hold them now."""
        out: dict[IPNetwork, int] = {}
        for trie, version in ((self.v4, 4), (self.v6, 6)):
            for k, v in trie.items():
                size = 4 if version == 4 else 16
                addr = bytes(k.addr)[:size]
                net = ipaddress.ip_network((addr, int(k.prefixlen)))
                out[net] = int(v.value)
        return out

    def put(self, net: IPNetwork, slot: int, *, reset: bool) -> None:
        """List net with its counter in slot (zeroed first when reset: a
        slot freed by another CIDR)."""
        if reset:
            self.drops.update(U32(slot), Count())
        if net.version == 4:
            self.v4.update(_key(Key4, net), U32(slot))
        else:
            self.v6.update(_key(Key6, net), U32(slot))

    def remove(self, net: IPNetwork) -> None:
        if net.version == 4:
            self.v4.delete(_key(Key4, net))
        else:
            self.v6.delete(_key(Key6, net))

    def counts(self, slots: list[int]) -> dict[int, tuple[int, int]]:
        """slot -> (packets, bytes) summed over CPUs."""
        out = {}
        for slot in slots:
            v = self.drops.get(U32(slot))
            out[slot] = (int(v.packets), int(v.bytes)) if v is not None else (0, 0)
        return out


# --- XDP attachment ---


@dataclass(frozen=True)
class XdpState:
    prog_id: int
    mode: str  # native, generic, offload, or "" when none is attached


def attach_xdp(ifindex: int, prog_fd: int) -> str:
    """Attaches (or atomically replaces) the program: native XDP where the
    driver has it, generic otherwise; returns the mode it runs in."""
    with IPRoute() as ipr:
        current = _state(ipr, ifindex)
        # A program attached in the other mode must go first: the kernel
        # refuses a second mode on one device.
        try:
            if current.mode == "generic":
                raise NetlinkError(errno.EOPNOTSUPP, "keep generic")
            _set(ipr, ifindex, prog_fd, XDP_FLAGS_DRV_MODE)
            return "native"
        except NetlinkError as exc:
            if exc.code not in (errno.EOPNOTSUPP, errno.EINVAL, errno.EBUSY, errno.EEXIST):
                raise
        if current.mode == "native":
            _set(ipr, ifindex, -1, XDP_FLAGS_DRV_MODE)
        _set(ipr, ifindex, prog_fd, XDP_FLAGS_SKB_MODE)
        return "generic"


def detach_xdp(ifindex: int) -> bool:
    """Removes whatever XDP program the device runs; False if none."""
    with IPRoute() as ipr:
        current = _state(ipr, ifindex)
        if not current.mode:
            return False
        flags = XDP_FLAGS_SKB_MODE if current.mode == "generic" else XDP_FLAGS_DRV_MODE
        _set(ipr, ifindex, -1, flags)
        return True


def runs_prefilter(ifindex: int) -> bool:
    """The device runs an xdp_prefilter program (this process's or an
    earlier one's)."""
    state = xdp_state(ifindex)
    if not state.prog_id:
        return False
    try:
        fd = syscall.prog_fd_by_id(state.prog_id)
    except syscall.BpfError:
        return False  # gone meanwhile
    try:
        return syscall.prog_name(fd) == PROGRAM
    finally:
        os.close(fd)


def xdp_state(ifindex: int) -> XdpState:
    with IPRoute() as ipr:
        return _state(ipr, ifindex)


def _set(ipr: IPRoute, ifindex: int, fd: int, flags: int) -> None:
    ipr.link(
        "set",
        index=ifindex,
        xdp={"attrs": [("IFLA_XDP_FD", fd), ("IFLA_XDP_FLAGS", flags)]},
    )


def _state(ipr: IPRoute, ifindex: int) -> XdpState:
    try:
        links: Any = ipr.link("get", index=ifindex)
    except NetlinkError as exc:
        if exc.code == errno.ENODEV:
            return XdpState(0, "")
        raise
    xdp = links[0].get_attr("IFLA_XDP") if links else None
    if xdp is None:
        return XdpState(0, "")
    mode = xdp.get_attr("IFLA_XDP_ATTACHED")
    prog = xdp.get_attr("IFLA_XDP_PROG_ID") or 0
    # pyroute2 maps the mode byte to a name: xdp, xdpgeneric, xdpoffload.
    names = {"xdp": "native", "xdpgeneric": "generic", "xdpoffload": "offload"}
    name = names.get(mode, "") if isinstance(mode, str) else _ATTACHED_MODE.get(mode or 0, "")
    return XdpState(int(prog), name)
