"""Security identities: the reserved ones, cluster-wide (global) ones
allocated in etcd, and local CIDR identities; what selectors match on.
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flagella.policy.labels import SOURCE_CIDR, SOURCE_FQDN, SOURCE_RESERVED, Label, LabelSet

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# Reserved identities, as Cilium numbers them.
HOST = 1
WORLD = 2
UNMANAGED = 3
HEALTH = 4
INIT = 5
REMOTE_NODE = 6

RESERVED_NAMES: dict[int, str] = {
    HOST: "host",
    WORLD: "world",
    UNMANAGED: "unmanaged",
    HEALTH: "health",
    INIT: "init",
    REMOTE_NODE: "remote-node",
}
RESERVED_BY_NAME = {name: ident for ident, name in RESERVED_NAMES.items()}
MAX_RESERVED = 255

# Cluster-wide identities allocated in etcd (Cilium's range without a
# cluster id).
MIN_GLOBAL = 256
MAX_GLOBAL = 65535

# Local identities (CIDR) carry Cilium's local-scope bit.
LOCAL_SCOPE = 1 << 24
LOCAL_SPACE = (1 << 24) - 1  # ids LOCAL_SCOPE+1 .. LOCAL_SCOPE+LOCAL_SPACE


class Kind(enum.Enum):
    RESERVED = "reserved"
    GLOBAL = "global"
    CIDR = "cidr"


@dataclass(frozen=True, slots=True)
class IdentityInfo:
    """An identity as selectors see it."""

    id: int
    labels: LabelSet
    kind: Kind
    # For CIDR identities: the prefix.
    prefix: IPNetwork | None = None
    # (source, key) -> value and key -> values over all sources, for
    # selector matching.
    by_source_key: Mapping[tuple[str, str], str] = field(default_factory=dict, compare=False)
    by_key: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    @classmethod
    def make(
        cls, ident: int, labels: LabelSet, kind: Kind, prefix: IPNetwork | None = None
    ) -> IdentityInfo:
        by_key: dict[str, list[str]] = {}
        for label in labels:
            by_key.setdefault(label.key, []).append(label.value)
        return cls(
            id=ident,
            labels=labels,
            kind=kind,
            prefix=prefix,
            by_source_key={(label.source, label.key): label.value for label in labels},
            by_key={k: tuple(v) for k, v in by_key.items()},
        )

    @property
    def is_world(self) -> bool:
        """World or a CIDR identity: outside the cluster."""
        return self.id == WORLD or self.kind is Kind.CIDR

    def has(self, source: str, key: str) -> bool:
        return (source, key) in self.by_source_key


def reserved_labels(ident: int) -> LabelSet:
    return (Label(key=RESERVED_NAMES[ident], source=SOURCE_RESERVED),)


RESERVED_INFOS: dict[int, IdentityInfo] = {
    ident: IdentityInfo.make(ident, reserved_labels(ident), Kind.RESERVED)
    for ident in RESERVED_NAMES
}


def reserved_identity_of(labels: LabelSet) -> int | None:
    """The reserved identity a label set names (exactly one reserved label
    and nothing else), else None."""
    if len(labels) == 1 and labels[0].source == SOURCE_RESERVED:
        return RESERVED_BY_NAME.get(labels[0].key)
    return None


def kind_of(labels: LabelSet) -> Kind:
    """The kind of identity a label set names (for selectors and traces)."""
    if reserved_identity_of(labels) is not None:
        return Kind.RESERVED
    if any(lb.source == SOURCE_CIDR for lb in labels):
        return Kind.CIDR
    return Kind.GLOBAL


def is_global(ident: int) -> bool:
    return MIN_GLOBAL <= ident <= MAX_GLOBAL


def is_local(ident: int) -> bool:
    return ident > LOCAL_SCOPE


# --- CIDR identities ---


def cidr_labels(prefix: IPNetwork, fqdn_selectors: Iterable[str] = ()) -> LabelSet:
    """A CIDR identity's labels, as Cilium: the prefix and reserved:world,
    and fqdn:<selector> for each toFQDNs selector that selects it."""
    return tuple(
        sorted(
            (
                Label(key=str(prefix), source=SOURCE_CIDR),
                Label(key=RESERVED_NAMES[WORLD], source=SOURCE_RESERVED),
                *(Label(key=key, source=SOURCE_FQDN) for key in fqdn_selectors),
            )
        )
    )


def _slot(prefix: IPNetwork) -> int:
    digest = hashlib.blake2b(str(prefix).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % LOCAL_SPACE


def assign_cidr_identities(
    prefixes: Mapping[IPNetwork, tuple[int, ...]] | Iterable[IPNetwork],
) -> dict[IPNetwork, int]:
    """Local CIDR identities for a set of prefixes, computed the same way by
    every replica without coordination: LOCAL_SCOPE | (hash of the prefix),
    with linear probing on a collision. Who keeps a contested slot is decided
    by the priority given with each prefix (lower first; e.g. the revision
    its oldest rule was created at) and then by the prefix, so an identity
    only moves when a new prefix collides with it and sorts earlier."""
    if isinstance(prefixes, Mapping):
        ordered = sorted(prefixes, key=lambda p: (prefixes[p], p.version, str(p)))
    else:
        ordered = sorted(set(prefixes), key=lambda p: (p.version, str(p)))
    taken: set[int] = set()
    result: dict[IPNetwork, int] = {}
    for prefix in ordered:
        slot = _slot(prefix)
        while slot in taken:
            slot = (slot + 1) % LOCAL_SPACE
        taken.add(slot)
        result[prefix] = LOCAL_SCOPE + 1 + slot
    return result


def parse_prefix(text: str) -> IPNetwork:
    """An IP (as a full-length prefix) or a CIDR with host bits zero."""
    if "/" not in text:
        addr = ipaddress.ip_address(text)
        return ipaddress.ip_network(f"{addr}/{addr.max_prefixlen}")
    return ipaddress.ip_network(text, strict=True)


def format_prefix(net: IPNetwork) -> str:
    """A full-length prefix as a bare address, any other as a CIDR."""
    if net.prefixlen == net.max_prefixlen:
        return str(net.network_address)
    return str(net)
