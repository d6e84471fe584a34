"""The FQDN cache (toFQDNs): what names resolved to for each endpoint, as
its node's DNS proxy saw the answers. Entries live in etcd on the node's
lease; every replica's mirror turns the addresses that toFQDNs selectors
select into CIDR identities labelled fqdn:<selector> (state.py), so a
write returns once this replica's ipcache and policies include it."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

from flagella.common.errors import Unavailable
from flagella.common.fqdn import matcher
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.outcomes import FqdnDeleted, FqdnStored
from flagella.policy.state import FqdnEntry, PolicyState
from flagella.policy.store import MAX_ATTEMPTS, PolicyStore


@dataclass(frozen=True, slots=True)
class CacheFilter:
    """Which entries a list or delete means; empty fields match all."""

    node: str = ""
    endpoint: str = ""
    # A canonical name pattern (rules/fqdn.py), matched against names.
    pattern: str = ""
    # Entries with an address inside it.
    cidr: ipaddress.IPv4Network | ipaddress.IPv6Network | None = None

    def matches(self, entry: FqdnEntry) -> bool:
        if self.node and entry.node != self.node:
            return False
        if self.endpoint and entry.endpoint != self.endpoint:
            return False
        if self.pattern and not matcher(self.pattern)(entry.name):
            return False
        cidr = self.cidr
        if cidr is not None:
            return any(
                (a := ipaddress.ip_address(ip)).version == cidr.version and a in cidr
                for ip in entry.ips
            )
        return True


@dataclass(frozen=True, slots=True)
class Selection:
    """A toFQDNs selector in use: the names it matches now, their
    addresses and identities, and the rules that use it."""

    key: str
    names: dict[str, tuple[str, ...]]
    identities: tuple[int, ...]
    rules: tuple[str, ...]


class FqdnCache:
    def __init__(self, store: PolicyStore, mirror: Mirror, leases: NodeLeases) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def upsert(self, node: str, entries: Sequence[FqdnEntry]) -> int:
        """Puts entries (of node) on node's lease in one transaction; the
        revision, once this replica's ipcache and policies include it."""
        for _ in range(MAX_ATTEMPTS):
            self.leases.touch(node)
            lease = await self.leases.lease_for(node)
            put = await self.store.put_fqdn(entries, lease)
            if isinstance(put, FqdnStored):
                for e in entries:
                    if e.where not in self.state.fqdn:
                        self.leases.attached(lease)
                await self.mirror.wait_for(put.revision)
                return put.revision
            self.leases.lost(lease)
        raise Unavailable("FQDN cache update kept conflicting; retry", field="entries")

    def entries(self, which: CacheFilter) -> tuple[list[FqdnEntry], int]:
        state = self.state
        found = [e for e in state.fqdn.values() if which.matches(e)]
        found.sort(key=lambda e: e.where)
        return found, state.revision

    async def delete(self, which: CacheFilter) -> tuple[int, int]:
        """Deletes the entries which matches; (how many, the revision once
        this replica's policies follow)."""
        for _ in range(MAX_ATTEMPTS):
            found, revision = self.entries(which)
            if not found:
                return 0, revision
            done = await self.store.delete_fqdn(found)
            if isinstance(done, FqdnDeleted):
                await self.mirror.wait_for(done.revision)
                return len(found), done.revision
        raise Unavailable("FQDN cache delete kept conflicting; retry", field="match_pattern")

    def selections(self) -> tuple[list[Selection], int]:
        state = self.state
        users: dict[str, list[str]] = {}
        for name, compiled in state.resolver.rules.items():
            for key in compiled.fqdns:
                users.setdefault(key, []).append(name)
        out = []
        for key, names in sorted(state.fqdn_selections().items()):
            ips = {ip for addrs in names.values() for ip in addrs}
            idents = sorted({i for ip in ips if (i := state.cidr_identity_of(ip)) is not None})
            out.append(
                Selection(
                    key=key,
                    names={n: tuple(sorted(a)) for n, a in sorted(names.items())},
                    identities=tuple(idents),
                    rules=tuple(sorted(users.get(key, ()))),
                )
            )
        return out, state.revision
