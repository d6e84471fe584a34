"""Address arithmetic of the ipam service, pure (no I/O): a node's pool of
host addresses in one pod CIDR, and the carving of node blocks out of the
cluster CIDRs.

A Pool knows which offsets of its CIDR are used (as this replica last saw
etcd) and which it is trying to take right now (pending), and hands out
candidates next-fit from a cursor: O(1) amortised per allocation while the
pool is not nearly full. It is only a hint: etcd's create-if-absent
transaction decides who gets an address.
"""

from __future__ import annotations

import ipaddress
import random
from collections.abc import Collection, Iterable

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Offsets never handed out: the network address (0), the gateway (1, the
# first host, which the datapath gives the node's router interface) and the
# broadcast address (the last one; reserved for IPv6 too, as the all-ones
# address of the subnet).
FIRST_OFFSET = 2
#: The longest prefixes that still leave one address for a pod.
MAX_PREFIX = {4: 30, 6: 126}


def family_name(version: int) -> str:
    return "IPv4" if version == 4 else "IPv6"


def reserved_reason(net: IPNetwork, ip: IPAddress) -> str | None:
    """Why ip may never be handed out in net, or None."""
    offset = int(ip) - int(net.network_address)
    if offset == 0:
        return "is the network address"
    if offset == 1:
        return "is the gateway address (first host)"
    if offset == net.num_addresses - 1:
        return "is the broadcast address" if net.version == 4 else "is the last address"
    return None


def capacity_of(net: IPNetwork) -> int:
    """How many addresses of net can be handed out."""
    return max(net.num_addresses - 3, 0)


class Pool:
    """The host addresses of one pod CIDR of one node."""

    def __init__(
        self,
        network: IPNetwork,
        used: Iterable[int] = (),
        *,
        rng: random.Random | None = None,
    ) -> None:
        if network.prefixlen > MAX_PREFIX[network.version]:
            raise ValueError(f"{network} leaves no address for pods")
        self.network = network
        self.base = int(network.network_address)
        self.first = FIRST_OFFSET
        self.last = network.num_addresses - 2
        self.capacity = self.last - self.first + 1
        self.used: set[int] = set()
        self.pending: set[int] = set()
        # Replicas start at different places so that they rarely race for
        # the same address.
        self.cursor = (rng or random).randint(self.first, self.last)
        # etcd revision of the last full read of this pool from etcd.
        self.synced_revision = 0
        for off in used:
            self.mark_used(off)

    @property
    def version(self) -> int:
        return self.network.version

    def __repr__(self) -> str:
        return f"Pool({self.network}, used={len(self.used)}, pending={len(self.pending)})"

    # --- addresses <-> offsets ---

    def offset_of(self, ip: IPAddress) -> int | None:
        """ip's offset in the pool, None when outside the CIDR."""
        if ip.version != self.version:
            return None
        off = int(ip) - self.base
        if 0 <= off < self.network.num_addresses:
            return off
        return None

    def ip_at(self, offset: int) -> IPAddress:
        return ipaddress.ip_address(self.base + offset)

    def assignable(self, offset: int) -> bool:
        return self.first <= offset <= self.last

    # --- state ---

    @property
    def taken(self) -> int:
        # An offset can be both: the watch may report our own write before
        # the transaction's reply settles it. pending is small (in flight).
        return len(self.used) + sum(1 for off in self.pending if off not in self.used)

    def is_free(self, offset: int) -> bool:
        return offset not in self.used and offset not in self.pending

    def mark_used(self, offset: int) -> None:
        if self.assignable(offset):
            self.used.add(offset)

    def mark_free(self, offset: int) -> None:
        self.used.discard(offset)

    def replace_used(self, offsets: Iterable[int], revision: int) -> None:
        """The pool as a full read of etcd at revision found it."""
        self.used = {off for off in offsets if self.assignable(off)}
        self.synced_revision = revision

    def take(self) -> int | None:
        """A free offset, marked pending; None when every address is used or
        pending. Next-fit from the cursor."""
        if self.taken >= self.capacity:
            return None
        off = self.cursor
        while True:
            if off > self.last:
                off = self.first
            if self.is_free(off):
                self.pending.add(off)
                self.cursor = off + 1
                return off
            off += 1

    def take_given(self, offset: int) -> bool:
        """Mark a given offset pending; False if used or pending here."""
        if not self.assignable(offset) or not self.is_free(offset):
            return False
        self.pending.add(offset)
        return True

    def settle(self, offset: int) -> None:
        """The attempt on a pending offset is over (whatever its outcome)."""
        self.pending.discard(offset)


# --- node blocks carved from the cluster CIDRs ---


def free_block(
    cluster: IPNetwork,
    mask: int,
    assigned: Collection[IPNetwork],
) -> IPNetwork | None:
    """The lowest /mask block of cluster that overlaps nothing in assigned,
    or None when there is none. Looks at most len(assigned) + 1 candidates
    when every assigned block has the same mask."""
    if mask < cluster.prefixlen or mask > cluster.max_prefixlen:
        raise ValueError(f"/{mask} does not fit in {cluster}")
    same = {int(n.network_address) for n in assigned if n.prefixlen == mask}
    others = [n for n in assigned if n.prefixlen != mask and n.version == cluster.version]
    size = 1 << (cluster.max_prefixlen - mask)
    count = 1 << (mask - cluster.prefixlen)
    base = int(cluster.network_address)
    index = 0
    while index < count:
        start = base + index * size
        if start in same:
            index += 1
            continue
        candidate = ipaddress.ip_network((start, mask))
        clash = next((o for o in others if candidate.overlaps(o)), None)
        if clash is None:
            return candidate
        # Skip past the overlapping block.
        end = int(clash.broadcast_address)
        index = max(index + 1, (end - base) // size + 1)
    return None
