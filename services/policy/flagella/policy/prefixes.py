"""Kubernetes ipBlocks over addresses: the prefix entries of a resolved
policy.

A Kubernetes NetworkPolicy ipBlock selects every address inside its CIDR
and outside its excepts, pods and nodes included, address by address (two
pods of one identity, one inside and one outside, are treated
differently). Identities cannot say that, so a resolved policy also carries
prefix entries: per direction, a prefix and what is allowed to or from the
addresses it holds. A datapath finds the longest prefix holding the peer
address, so the entries are flattened here: every CIDR and except of the
blocks is an entry, allowing the union of the ports of every block that
holds it (inside the block's CIDR, outside its excepts). That is exact: the
prefixes holding an address form a chain, and the longest one is inside
exactly the blocks (and excepts) the address is inside.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from flagella.policy.identities import IPNetwork
from flagella.policy.rules import Clause, Direction, PortKey, Protocol

# (port, end_port, protocol) every port of every protocol
ALL_PORTS: PortKey = (0, 0, Protocol.ANY)


class PrefixEntry(NamedTuple):
    prefix: IPNetwork
    direction: Direction
    # Allowed for the prefix's addresses; () nothing (an except).
    ports: tuple[PortKey, ...]
    derived_from: tuple[str, ...] = ()


class _Block(NamedTuple):
    net: IPNetwork
    excepts: tuple[IPNetwork, ...]
    ports: tuple[PortKey, ...]
    rule: str


def _inside(p: IPNetwork, net: IPNetwork) -> bool:
    return p.version == net.version and p.subnet_of(net)  # type: ignore[arg-type]


def _normalize(ports: set[PortKey]) -> tuple[PortKey, ...]:
    """Ports without what a wider entry of the same protocol covers."""
    if ALL_PORTS in ports:
        return (ALL_PORTS,)
    whole = {proto for port, _, proto in ports if port == 0}
    return tuple(sorted(k for k in ports if k[0] == 0 or k[2] not in whole))


def flatten(clauses: Iterable[Clause]) -> tuple[PrefixEntry, ...]:
    """The prefix entries of the ipBlocks of the given allow clauses."""
    by_dir: dict[Direction, list[_Block]] = {}
    for clause in clauses:
        for net, excepts in clause.blocks:
            # A named port is not resolved per peer address: a block allows
            # nothing by it (fail closed; docs/policy.md, Not done).
            numbered = tuple(k for k in clause.ports if not isinstance(k[0], str))
            by_dir.setdefault(clause.direction, []).append(
                _Block(net, excepts, numbered, clause.rule)
            )
    out: list[PrefixEntry] = []
    for direction, blocks in sorted(by_dir.items()):
        prefixes = {b.net for b in blocks} | {e for b in blocks for e in b.excepts}
        for prefix in prefixes:
            ports: set[PortKey] = set()
            names: set[str] = set()
            for b in blocks:
                if _inside(prefix, b.net) and not any(_inside(prefix, e) for e in b.excepts):
                    ports.update(b.ports)
                    names.add(b.rule)
            out.append(PrefixEntry(prefix, direction, _normalize(ports), tuple(sorted(names))))
    out.sort(key=lambda e: (e.direction, e.prefix.version, e.prefix))
    return tuple(out)
