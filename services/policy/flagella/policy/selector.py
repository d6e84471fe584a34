"""Peer and subject selectors over identities, and the selector cache.

A selector is hashable and knows which identities it matches:
- LabelSelector: Kubernetes label-selector requirements (In, NotIn, Exists,
  DoesNotExist) over an identity's labels; an empty one matches everything.
- CIDRSelector: CIDR identities whose prefix lies inside a CIDR and outside
  its excepts; a /0 also selects the world identity.
- EntitySelector: Cilium's entities (host, world, cluster, remote-node,
  init, health, unmanaged; "all" is the WILDCARD).

The SelectorCache (Cilium's selector cache) holds the identities each
selector in use selects, updated incrementally as identities come and go,
so resolving a policy never re-evaluates selectors against every identity.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from flagella.policy.identities import (
    HEALTH,
    HOST,
    INIT,
    REMOTE_NODE,
    UNMANAGED,
    WORLD,
    IdentityInfo,
    IPNetwork,
    Kind,
)
from flagella.policy.labels import NAMESPACE_KEY, SOURCE_ANY, SOURCE_K8S


class Op(enum.Enum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


# Selectors are hashed all the time (selector cache, signatures): each
# caches its hash.


@dataclass(frozen=True, slots=True, order=True)
class Requirement:
    source: str
    key: str
    op: Op
    values: tuple[str, ...] = ()
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.source, self.key, self.op.value, self.values)))

    def __hash__(self) -> int:
        return self._hash

    def matches(self, info: IdentityInfo) -> bool:
        if self.source == SOURCE_ANY:
            found: tuple[str, ...] = info.by_key.get(self.key, ())
        else:
            value = info.by_source_key.get((self.source, self.key))
            found = () if value is None else (value,)
        if self.op is Op.IN:
            return any(v in self.values for v in found)
        if self.op is Op.NOT_IN:
            return not any(v in self.values for v in found)
        if self.op is Op.EXISTS:
            return bool(found)
        return not found

    def __str__(self) -> str:
        name = f"{self.source}:{self.key}"
        if self.op is Op.IN and len(self.values) == 1:
            return f"{name}={self.values[0]}" if self.values[0] else name
        if self.op in (Op.IN, Op.NOT_IN):
            return f"{name} {self.op.value} ({','.join(self.values)})"
        return f"{name} {self.op.value}"


def _order_key(op: Op) -> str:
    return op.value


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """All requirements must hold; none: matches every identity."""

    requirements: tuple[Requirement, ...]
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(("labels", self.requirements)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def of(cls, requirements: Iterable[Requirement]) -> LabelSelector:
        reqs = sorted(
            set(requirements), key=lambda r: (r.source, r.key, _order_key(r.op), r.values)
        )
        return cls(tuple(reqs))

    def matches(self, info: IdentityInfo) -> bool:
        return all(r.matches(info) for r in self.requirements)

    @property
    def is_empty(self) -> bool:
        return not self.requirements

    def names_source(self, source: str) -> bool:
        return any(r.source == source for r in self.requirements)

    def has_key(self, key: str) -> bool:
        return any(r.key == key and r.source in (SOURCE_K8S, SOURCE_ANY) for r in self.requirements)

    def anchors(self) -> list[tuple[str, str, str]] | None:
        """(source, key, value) triples of which an identity must carry one
        to match: the In requirement with the fewest values, preferring keys
        other than the namespace (more selective). None when there is none."""
        best: Requirement | None = None
        for r in self.requirements:
            if r.op is not Op.IN or not r.values:
                continue
            if best is None:
                best = r
                continue
            better_key = best.key == NAMESPACE_KEY and r.key != NAMESPACE_KEY
            same_class = (best.key == NAMESPACE_KEY) == (r.key == NAMESPACE_KEY)
            if better_key or (same_class and len(r.values) < len(best.values)):
                best = r
        if best is None:
            return None
        return [(best.source, best.key, v) for v in best.values]

    def __str__(self) -> str:
        return "{" + ", ".join(str(r) for r in self.requirements) + "}"


@dataclass(frozen=True, slots=True)
class CIDRSelector:
    network: IPNetwork
    excepts: tuple[IPNetwork, ...] = ()
    # A Kubernetes ipBlock whose prefixes get no CIDR identities (the
    # resolved policy's prefix entries match its addresses): it selects only
    # CIDR identities (of other rules' prefixes) wholly inside the block,
    # none holding an except, since an address of an except may carry such
    # an identity; never world. An under-approximation the prefix entries
    # complete.
    strict: bool = False
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(("cidr", self.network, self.excepts, self.strict)))

    def __hash__(self) -> int:
        return self._hash

    def matches(self, info: IdentityInfo) -> bool:
        if info.kind is Kind.CIDR and info.prefix is not None:
            prefix = info.prefix
            if prefix.version != self.network.version:
                return False
            if not prefix.subnet_of(self.network):  # type: ignore[arg-type]
                return False
            if self.strict:
                return not any(
                    e.network_address in prefix or prefix.network_address in e for e in self.excepts
                )
            return not any(
                prefix.subnet_of(e)  # type: ignore[arg-type]
                for e in self.excepts
                if e.version == prefix.version
            )
        if info.id == WORLD and not self.strict:
            return self.network.prefixlen == 0 and not any(e.prefixlen == 0 for e in self.excepts)
        return False

    def __str__(self) -> str:
        if self.excepts:
            return f"cidr:{self.network} except {','.join(map(str, self.excepts))}"
        return f"cidr:{self.network}"


class Entity(enum.Enum):
    ALL = "all"
    WORLD = "world"
    CLUSTER = "cluster"
    HOST = "host"
    REMOTE_NODE = "remote-node"
    INIT = "init"
    HEALTH = "health"
    UNMANAGED = "unmanaged"


_ENTITY_IDS = {
    Entity.HOST: HOST,
    Entity.REMOTE_NODE: REMOTE_NODE,
    Entity.INIT: INIT,
    Entity.HEALTH: HEALTH,
    Entity.UNMANAGED: UNMANAGED,
}


@dataclass(frozen=True, slots=True)
class EntitySelector:
    entity: Entity
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(("entity", self.entity.value)))

    def __hash__(self) -> int:
        return self._hash

    def matches(self, info: IdentityInfo) -> bool:
        entity = self.entity
        if entity is Entity.ALL:
            return True
        if entity is Entity.WORLD:
            return info.is_world
        if entity is Entity.CLUSTER:
            return not info.is_world
        return info.id == _ENTITY_IDS[entity]

    def __str__(self) -> str:
        return f"entity:{self.entity.value}"


Selector = LabelSelector | CIDRSelector | EntitySelector

# Selects every identity: its policy-map entries use identity 0 (any).
WILDCARD = EntitySelector(Entity.ALL)


class SelectorCache:
    """The identities each selector in use selects, kept up to date as
    identities are added and removed. Selectors are reference-counted by
    their users (rules)."""

    def __init__(self) -> None:
        self.identities: dict[int, IdentityInfo] = {}
        self._selections: dict[Selector, set[int]] = {}
        self._users: dict[Selector, int] = {}
        self._anchored: dict[tuple[str, str, str], set[Selector]] = {}
        self._any_anchored: dict[tuple[str, str], set[Selector]] = {}
        self._unanchored: set[Selector] = set()
        # identity -> selectors that select it
        self._selected_by: dict[int, set[Selector]] = {}

    def __len__(self) -> int:
        return len(self._selections)

    def selections(self, selector: Selector) -> set[int]:
        """The identities selector selects (it must be in use)."""
        return self._selections[selector]

    def selectors_of(self, ident: int) -> set[Selector]:
        return self._selected_by.get(ident, set())

    def add_user(self, selector: Selector) -> bool:
        """Registers one user of selector; True when it was new (and was
        evaluated against every identity)."""
        count = self._users.get(selector, 0)
        self._users[selector] = count + 1
        if count:
            return False
        anchors = selector.anchors() if isinstance(selector, LabelSelector) else None
        if anchors is None:
            self._unanchored.add(selector)
            candidates: Iterable[IdentityInfo] = self.identities.values()
        else:
            for source, key, value in anchors:
                if source == SOURCE_ANY:
                    self._any_anchored.setdefault((key, value), set()).add(selector)
                else:
                    self._anchored.setdefault((source, key, value), set()).add(selector)
            candidates = (
                info
                for info in self.identities.values()
                if any(
                    (info.by_key.get(k) and v in info.by_key[k])
                    if s == SOURCE_ANY
                    else info.by_source_key.get((s, k)) == v
                    for s, k, v in anchors
                )
            )
        selected = {info.id for info in candidates if selector.matches(info)}
        self._selections[selector] = selected
        for ident in selected:
            self._selected_by.setdefault(ident, set()).add(selector)
        return True

    def remove_user(self, selector: Selector) -> bool:
        """Drops one user; True when selector is no longer in use."""
        count = self._users.get(selector, 0)
        if count > 1:
            self._users[selector] = count - 1
            return False
        if not count:
            return False
        del self._users[selector]
        for ident in self._selections.pop(selector, set()):
            sels = self._selected_by.get(ident)
            if sels is not None:
                sels.discard(selector)
        anchors = selector.anchors() if isinstance(selector, LabelSelector) else None
        if anchors is None:
            self._unanchored.discard(selector)
        else:
            for source, key, value in anchors:
                if source == SOURCE_ANY:
                    self._any_anchored.get((key, value), set()).discard(selector)
                else:
                    self._anchored.get((source, key, value), set()).discard(selector)
        return True

    def _candidates(self, info: IdentityInfo) -> set[Selector]:
        out = set(self._unanchored)
        for label in info.labels:
            sels = self._anchored.get((label.source, label.key, label.value))
            if sels:
                out |= sels
            any_sels = self._any_anchored.get((label.key, label.value))
            if any_sels:
                out |= any_sels
        return out

    def matching(self, info: IdentityInfo) -> set[Selector]:
        """Selectors in use that select info (whether or not it is added)."""
        return {s for s in self._candidates(info) if s.matches(info)}

    def add_identity(self, info: IdentityInfo) -> set[Selector]:
        """Adds (or replaces) an identity; returns the selectors whose
        selections changed."""
        changed = set()
        if info.id in self.identities:
            changed = self.remove_identity(info.id)
        self.identities[info.id] = info
        matched = self.matching(info)
        for sel in matched:
            self._selections[sel].add(info.id)
        if matched:
            self._selected_by[info.id] = set(matched)
        return changed | matched

    def remove_identity(self, ident: int) -> set[Selector]:
        """Removes an identity; returns the selectors that selected it."""
        if self.identities.pop(ident, None) is None:
            return set()
        sels = self._selected_by.pop(ident, set())
        for sel in sels:
            self._selections[sel].discard(ident)
        return sels
