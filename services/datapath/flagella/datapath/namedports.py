"""Named ports on the node: the entries of rules that name a port come from
the policy service symbolic (name and protocol, PolicyEntry.port_name) and
are resolved here, per local endpoint, when its policy-map entries are
written:

- ingress: against the endpoint's own named ports (from its pod), exactly;
- egress: against the named ports of the peer identity's endpoints, which
  the ipcache carries for every endpoint of the cluster (PeerPorts): every
  number any endpoint of that identity gives the name (the policy map is
  keyed by peer identity, not address, so two pods of one identity with
  different numbers for a name are each reachable on both numbers); an
  entry for any peer (identity 0) takes the numbers of every endpoint.

A name nobody gives (yet) resolves to no entry: the rule selects no port,
as Kubernetes defines it. Deny over allow holds after resolution since the
policy map applies it itself (bpf/policy.expand: a deny in the peer's or
identity 0's lookup wins, an allow a deny covers is not written).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from flagella.common.portnames import NamedPort
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.policy import PolicyEntry

# (name, protocol number)
NameKey = tuple[str, int]


class IPCacheValue(NamedTuple):
    """An ipcache entry as the datapath keeps it: the identity and the
    endpoint's named ports (none for nodes and CIDRs)."""

    identity: int
    named_ports: tuple[NamedPort, ...] = ()


class PeerPorts:
    """identity -> (name, protocol) -> the numbers its endpoints give the
    name, from the ipcache table (a reconcile Target of it). Calls
    on_change with the identities whose numbers changed."""

    def __init__(self, on_change: Callable[[set[int]], None]) -> None:
        self.on_change = on_change
        self._entries: dict[str, IPCacheValue] = {}
        # identity -> name key -> port -> how many entries give it
        self._ports: dict[int, dict[NameKey, Counter[int]]] = {}
        self._revision = 0

    @property
    def revision(self) -> int:
        return self._revision

    def ports(self, identity: int, name: str, protocol: int) -> set[int]:
        """The numbers of name/protocol on the identity's endpoints (every
        identity's for 0; protocol 0: any)."""
        idents = self._ports.values() if identity == 0 else [self._ports.get(identity, {})]
        out: set[int] = set()
        for by_name in idents:
            for (n, proto), counts in by_name.items():
                if n == name and protocol in (0, proto):
                    out.update(counts)
        return out

    def _add(self, value: IPCacheValue, sign: int) -> None:
        by_name = self._ports.setdefault(value.identity, {})
        for p in value.named_ports:
            counts = by_name.setdefault((p.name, p.protocol), Counter())
            counts[p.port] += sign
            if counts[p.port] <= 0:
                del counts[p.port]
            if not counts:
                del by_name[(p.name, p.protocol)]
        if not by_name:
            del self._ports[value.identity]

    def _set(self, key: str, value: IPCacheValue | None) -> set[int]:
        """The identities whose ports changed."""
        old = self._entries.pop(key, None)
        if value is not None and value.named_ports:
            self._entries[key] = value
        else:
            value = None
        if old == value:
            return set()
        changed: set[int] = set()
        if old is not None:
            self._add(old, -1)
            changed.add(old.identity)
        if value is not None:
            self._add(value, 1)
            changed.add(value.identity)
        return changed

    def replace_all(self, items: dict[str, IPCacheValue]) -> int:
        changed: set[int] = set()
        for key in set(self._entries) - set(items):
            changed |= self._set(key, None)
        for key, value in items.items():
            changed |= self._set(key, value)
        return self._changed(changed)

    def upsert(self, key: str, value: IPCacheValue) -> int:
        return self._changed(self._set(key, value))

    def delete(self, key: str) -> int:
        return self._changed(self._set(key, None))

    def _changed(self, identities: set[int]) -> int:
        self._revision += 1
        if identities:
            self.on_change(identities)
        return self._revision


def has_named(entries: Iterable[PolicyEntry]) -> bool:
    return any(e.port_name for e in entries)


def egress_peers(entries: Iterable[PolicyEntry]) -> frozenset[int]:
    """The peer identities of named egress entries (0: any)."""
    return frozenset(
        e.identity for e in entries if e.port_name and e.direction == L.Direction.EGRESS
    )


def resolve(
    entries: Sequence[PolicyEntry], own: Sequence[NamedPort], peers: PeerPorts
) -> tuple[PolicyEntry, ...]:
    """The entries with each named one replaced by one entry per number
    the name has (none when it has none)."""
    out: list[PolicyEntry] = []
    for e in entries:
        if not e.port_name:
            out.append(e)
            continue
        if e.direction == L.Direction.INGRESS:
            numbers = {
                p.port for p in own if p.name == e.port_name and e.protocol in (0, p.protocol)
            }
        else:
            numbers = peers.ports(e.identity, e.port_name, e.protocol)
        out.extend(
            dataclasses.replace(e, port=n, end_port=0, port_name="") for n in sorted(numbers)
        )
    return tuple(out)
