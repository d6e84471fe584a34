"""tc clsact attachment of the programs with pyroute2, in the current netns.

Filters are added with a fixed priority and handle, so replacing one is
atomic (the kernel swaps the program of the existing filter) and a second
filter is never stacked. The filter holds the program: it stays attached
after this process exits.
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

INGRESS = 0xFFFFFFF2  # TC_H_MAKE(TC_H_CLSACT, TC_H_MIN_INGRESS)
EGRESS = 0xFFFFFFF3
PRIO = 1
# A pod veth's ingress: to_proxy after from_container (which passes DNS for
# the proxy on with TC_ACT_UNSPEC, the next filter's turn).
PRIO_PROXY = 2
HANDLE = 1
ETH_P_ALL = 0x0003
_TCA_OPTIONS = "TCA_OPTIONS"
_TCA_BPF_NAME = "TCA_BPF_NAME"
_TCA_BPF_ID = 11


@dataclass(frozen=True)
class Filter:
    parent: int
    name: str
    prog_id: int


def _ensure_clsact(ipr: IPRoute, ifindex: int) -> None:
    try:
        ipr.tc("add", "clsact", ifindex)
    except NetlinkError as e:
        if e.code != errno.EEXIST:
            raise


def attach(ifindex: int, prog_fd: int, name: str, parent: int) -> None:
    """Attaches (or atomically replaces) the program on one hook."""
    attach_all(ifindex, [(prog_fd, name, parent)])


def attach_all(ifindex: int, hooks: Sequence[tuple[int, str, int]], *, prio: int = PRIO) -> None:
    """attach() for several (prog_fd, name, parent) hooks of one interface,
    on one netlink socket and with one clsact."""
    with IPRoute() as ipr:
        _ensure_clsact(ipr, ifindex)
        for prog_fd, name, parent in hooks:
            ipr.tc(
                "replace-filter",
                "bpf",
                ifindex,
                HANDLE,
                fd=prog_fd,
                name=name,
                parent=parent,
                prio=prio,
                protocol=ETH_P_ALL,
                classid=1,
                direct_action=True,
            )


def _del_filter(ipr: IPRoute, ifindex: int, parent: int, prio: int) -> bool:
    """Deletes our filter at prio on one hook; False if it was not there."""
    try:
        ipr.tc("del-filter", "bpf", ifindex, HANDLE, parent=parent, prio=prio, protocol=ETH_P_ALL)
    except NetlinkError as e:
        if e.code not in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
            raise
        return False
    return True


def detach_proxy(ifindex: int) -> None:
    """Removes the to_proxy filter (PRIO_PROXY) from a pod veth's ingress."""
    with IPRoute() as ipr:
        _del_filter(ipr, ifindex, INGRESS, PRIO_PROXY)


def detach(ifindex: int) -> bool:
    """Removes our filters (fixed prio and handle) from both hooks, and
    to_proxy; other filters and the clsact qdisc stay. False if none of the
    first two was there."""
    with IPRoute() as ipr:
        removed = [_del_filter(ipr, ifindex, parent, PRIO) for parent in (INGRESS, EGRESS)]
        _del_filter(ipr, ifindex, INGRESS, PRIO_PROXY)
    return any(removed)


def filters(ifindex: int, parent: int) -> list[Filter]:
    """The bpf filters on one hook (empty when none or no clsact)."""
    out = []
    with IPRoute() as ipr:
        try:
            msgs = ipr.get_filters(index=ifindex, parent=parent)
        except NetlinkError as e:
            if e.code in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
                return []
            raise
        for msg in msgs:
            if msg.get_attr("TCA_KIND") != "bpf":
                continue
            opts = msg.get_attr(_TCA_OPTIONS)
            if opts is None:
                continue
            out.append(Filter(parent, opts.get_attr(_TCA_BPF_NAME) or "", _prog_id(opts)))
    return out


def _prog_id(opts: Any) -> int:
    """TCA_BPF_ID, which pyroute2's cls_bpf table does not name: read from
    the raw attribute (4-byte header, then the u32)."""
    for attr in opts.get("attrs", []):
        key, value = attr[0], attr[1]
        if key == "TCA_BPF_ID" and isinstance(value, int):
            return value
        if key != "UNKNOWN" or not hasattr(value, "data"):
            continue
        if value.get("header", {}).get("type") != _TCA_BPF_ID:
            continue
        raw = bytes(value.data[value.offset + 4 : value.offset + value.length])
        if len(raw) >= 4:
            return int(struct.unpack_from("=I", raw)[0])
    return 0
