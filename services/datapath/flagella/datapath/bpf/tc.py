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


def attach_all(
    ifindex: int, hooks: Sequence[tuple[int, str, int]], *, proxy: int | None = None
) -> None:
    """attach() for several (prog_fd, name, parent) hooks of one interface,
    on one netlink socket and with one clsact; proxy: a program for the
    ingress after the first (PRIO_PROXY)."""
    with IPRoute() as ipr:
        _ensure_clsact(ipr, ifindex)
        for prog_fd, name, parent, prio in [
            *((fd, n, p, PRIO) for fd, n, p in hooks),
            *(() if proxy is None else ((proxy, "to_proxy", INGRESS, PRIO_PROXY),)),
        ]:
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


def detach(ifindex: int) -> bool:
    """Removes our filters (fixed prio and handle) from both hooks; other
    filters and the clsact qdisc stay. False if none was there."""
    removed = False
    with IPRoute() as ipr:
        for parent, prio in ((INGRESS, PRIO), (EGRESS, PRIO), (INGRESS, PRIO_PROXY)):
            try:
                ipr.tc(
                    "del-filter",
                    "bpf",
                    ifindex,
                    HANDLE,
                    parent=parent,
                    prio=prio,
                    protocol=ETH_P_ALL,
                )
                removed = removed or prio == PRIO
            except NetlinkError as e:
                if e.code not in (errno.ENOENT, errno.EINVAL, errno.ENODEV):
                    raise
    return removed


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
