"""LB-IPAM (as Cilium's): address pools, and which external address each
LoadBalancer service gets from them. Pure logic: no gRPC, no etcd (the
store, lbipam_store.py, reads the state, asks plan() and commits the
result in one transaction).

A service gets one address per family it asks for, from an enabled pool
whose selector matches its labels (and namespace, as the label
io.kubernetes.service.namespace). An address may be shared only by
services with the same non-empty sharing key on different (protocol,
port): never by two conflicting services.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.common.errors import InvalidArgument
from flagella.lb.selector import Requirement, build_selector

NAMESPACE_LABEL = "io.kubernetes.service.namespace"
CONDITION_TYPE = "io.cilium/lb-ipam-request-satisfied"
MAX_BLOCKS = 64
MAX_REQUESTED = 4
MAX_SHARING_KEY = 253

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
# (protocol, port) of a frontend: what services sharing an address differ in.
Port = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Block:
    """first..last (inclusive) of one family; text as given (a CIDR or a
    start-stop range)."""

    text: str
    family: int
    first: int
    last: int

    @property
    def size(self) -> int:
        return self.last - self.first + 1

    def contains(self, addr: IPAddress) -> bool:
        return addr.version == self.family and self.first <= int(addr) <= self.last

    def overlaps(self, other: Block) -> bool:
        return self.family == other.family and self.first <= other.last and other.first <= self.last


SOURCE_API = "api"
# A CiliumLoadBalancerIPPool object (flagella.lb.lbpoolk8s): the API can
# neither change nor delete it.
SOURCE_KUBERNETES = "kubernetes"


@dataclass(frozen=True)
class Pool:
    name: str
    blocks: tuple[Block, ...]
    # Sorted (key, value) pairs a service's labels must all have.
    selector: tuple[tuple[str, str], ...] = ()
    disabled: bool = False
    # And the requirements they must meet (CiliumLoadBalancerIPPool's
    # serviceSelector.matchExpressions).
    expressions: tuple[Requirement, ...] = ()
    source: str = SOURCE_API
    # Kubernetes pools: the object's creationTimestamp (which of two
    # overlapping pools came first).
    created: str = ""

    @property
    def size(self) -> int:
        return sum(b.size for b in self.blocks)

    def matches(self, namespace: str, labels: Mapping[str, str]) -> bool:
        def have(key: str) -> str | None:
            return namespace if key == NAMESPACE_LABEL else labels.get(key)

        return all(have(key) == value for key, value in self.selector) and all(
            e.matches(have(e.key)) for e in self.expressions
        )

    def overlaps(self, other: Pool) -> tuple[Block, Block] | None:
        """A block of this pool and one of other's that share addresses."""
        for block in self.blocks:
            for theirs in other.blocks:
                if block.overlaps(theirs):
                    return block, theirs
        return None

    def contains(self, addr: IPAddress) -> bool:
        return any(b.contains(addr) for b in self.blocks)

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "blocks": [b.text for b in self.blocks],
            "selector": dict(self.selector),
            "disabled": self.disabled,
        }
        # Absent when default: pools stored before read back the same.
        if self.expressions:
            doc["expressions"] = [[e.key, e.operator, list(e.values)] for e in self.expressions]
        if self.source != SOURCE_API:
            doc["source"] = self.source
        if self.created:
            doc["created"] = self.created
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Pool:
        return cls(
            name=doc["name"],
            blocks=tuple(_parse_block(t, "") for t in doc["blocks"]),
            selector=tuple(sorted(doc.get("selector", {}).items())),
            disabled=bool(doc.get("disabled", False)),
            expressions=tuple(
                Requirement(k, op, tuple(v)) for k, op, v in doc.get("expressions", ())
            ),
            source=doc.get("source", SOURCE_API),
            created=doc.get("created", ""),
        )


def conflicts(pools: Sequence[Pool]) -> dict[str, str]:
    """Pools whose addresses are not used, by name, with why: as Cilium marks
    a CiliumLoadBalancerIPPool overlapping another one conflicting. Pools
    of the API never overlap (refused when written), so only Kubernetes
    pools conflict: each overlapping a pool taken before it (the API's
    first, then Kubernetes' by creation time and name)."""
    order = sorted(pools, key=lambda p: (p.source != SOURCE_API, p.created, p.name))
    taken: list[Pool] = []
    out: dict[str, str] = {}
    for pool in order:
        clash = next(((o, pool.overlaps(o)) for o in taken if pool.overlaps(o)), None)
        if clash is not None and pool.source == SOURCE_KUBERNETES:
            other, blocks = clash
            assert blocks is not None
            out[pool.name] = f"{blocks[0].text} overlaps pool {other.name!r} ({blocks[1].text})"
            continue
        taken.append(pool)
    return out


def usable(pools: Sequence[Pool]) -> list[Pool]:
    """The pools LB-IPAM assigns from and honours requests in: every one but
    the conflicting."""
    bad = conflicts(pools)
    return [p for p in pools if p.name not in bad]


@dataclass(frozen=True)
class LbRequest:
    """What a LoadBalancer service asks for."""

    requested: tuple[str, ...] = ()  # canonical addresses
    sharing_key: str = ""
    families: tuple[int, ...] = (4,)


@dataclass(frozen=True)
class Claimant:
    """A LoadBalancer service as LB-IPAM sees it."""

    name: str
    namespace: str
    labels: Mapping[str, str]
    ports: frozenset[Port]
    request: LbRequest


@dataclass(frozen=True)
class AddressUse:
    """Who holds an address: one sharing key, and each user's ports."""

    sharing_key: str = ""
    users: Mapping[str, frozenset[Port]] = field(default_factory=dict)

    def admits(self, who: Claimant) -> bool:
        """Whether who may use the address too (it does already, or
        shares it with every other user on other ports)."""
        others = {name: ports for name, ports in self.users.items() if name != who.name}
        if not others:
            return True
        key = who.request.sharing_key
        if not key or key != self.sharing_key:
            return False
        return all(not (ports & who.ports) for ports in others.values())

    def with_user(self, who: Claimant) -> AddressUse:
        users = dict(self.users)
        users[who.name] = who.ports
        return AddressUse(who.request.sharing_key, users)

    def without(self, name: str) -> AddressUse | None:
        users = {n: p for n, p in self.users.items() if n != name}
        return AddressUse(self.sharing_key, users) if users else None

    def to_json(self) -> bytes:
        doc = {
            "sharing_key": self.sharing_key,
            "users": {n: sorted([list(p) for p in ports]) for n, ports in self.users.items()},
        }
        return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> AddressUse:
        doc = json.loads(raw)
        return cls(
            doc.get("sharing_key", ""),
            {n: frozenset((str(p), int(q)) for p, q in ports) for n, ports in doc["users"].items()},
        )


@dataclass(frozen=True)
class Condition:
    satisfied: bool
    reason: str
    message: str


SATISFIED = Condition(True, "satisfied", "")


@dataclass(frozen=True)
class Assigned:
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Unsatisfied:
    condition: Condition


def plan(
    who: Claimant,
    pools: Sequence[Pool],
    uses: Mapping[str, AddressUse],
    current: Sequence[str] = (),
) -> Assigned | Unsatisfied:
    """The addresses who gets (one per family asked for), or why none: all
    families or nothing. current: what it holds now (kept while still
    valid, so a service keeps its address across updates)."""
    matching = [p for p in pools if p.matches(who.namespace, who.labels)]
    requested = [ipaddress.ip_address(a) for a in who.request.requested]
    chosen: list[str] = []
    for family in who.request.families:
        wanted = [a for a in requested if a.version == family]
        if wanted:
            outcome = _requested(who, wanted, pools, matching, uses)
        else:
            outcome = _any(who, family, matching, uses, current)
        if isinstance(outcome, Unsatisfied):
            return outcome
        chosen.extend(outcome.addresses)
    return Assigned(tuple(chosen))


def _requested(
    who: Claimant,
    wanted: Sequence[IPAddress],
    pools: Sequence[Pool],
    matching: Sequence[Pool],
    uses: Mapping[str, AddressUse],
) -> Assigned | Unsatisfied:
    for addr in wanted:
        if not any(p.contains(addr) for p in pools):
            return Unsatisfied(Condition(False, "out_of_pools", f"{addr} is in no pool"))
        if not any(p.contains(addr) and not p.disabled for p in matching):
            return Unsatisfied(
                Condition(False, "no_pool", f"{addr} is in no enabled pool selecting the service")
            )
        use = uses.get(str(addr))
        if use is not None and not use.admits(who):
            holders = ", ".join(sorted(n for n in use.users if n != who.name))
            return Unsatisfied(
                Condition(False, "already_allocated", f"{addr} is already allocated to {holders}")
            )
    return Assigned(tuple(str(a) for a in wanted))


def _any(
    who: Claimant,
    family: int,
    matching: Sequence[Pool],
    uses: Mapping[str, AddressUse],
    current: Sequence[str],
) -> Assigned | Unsatisfied:
    # Its own address stays while a matching pool still holds it.
    for text in current:
        addr = ipaddress.ip_address(text)
        if addr.version == family and any(p.contains(addr) for p in matching):
            return Assigned((text,))
    enabled = [p for p in matching if not p.disabled and any(b.family == family for b in p.blocks)]
    if not enabled:
        return Unsatisfied(
            Condition(False, "no_pool", f"no enabled IPv{family} pool selects the service")
        )
    # Share an address of its sharing key first (as Cilium does).
    if who.request.sharing_key:
        for text, use in sorted(uses.items()):
            addr = ipaddress.ip_address(text)
            if (
                addr.version == family
                and use.sharing_key == who.request.sharing_key
                and use.admits(who)
                and any(p.contains(addr) for p in enabled)
            ):
                return Assigned((text,))
    for pool in enabled:
        for text in _free(pool, family, uses):
            return Assigned((text,))
    names = ", ".join(p.name for p in enabled)
    return Unsatisfied(
        Condition(False, "pool_exhausted", f"no free IPv{family} address in {names}")
    )


def _free(pool: Pool, family: int, uses: Mapping[str, AddressUse]) -> Iterator[str]:
    """Free addresses of pool, lowest first (walks past the used ones only)."""
    for block in pool.blocks:
        if block.family != family:
            continue
        value = block.first
        while value <= block.last:
            text = str(ipaddress.ip_address(value))
            if text not in uses:
                yield text
                return
            value += 1


# --- validation ---


def validate_pool(
    name: str,
    blocks: Sequence[tuple[str, str, str]],
    selector: Mapping[str, str],
    disabled: bool,
) -> Pool:
    """A pool from the request's fields ((cidr, start, stop) per block);
    InvalidArgument names the field."""
    if not name or len(name) > 253 or not all(c.isalnum() or c in "-._" for c in name):
        raise InvalidArgument(
            f"{name!r} is not a pool name (1-253 of letters, digits, '-', '.', '_')",
            field="pool.name",
        )
    if not blocks:
        raise InvalidArgument("at least one block is required", field="pool.blocks")
    if len(blocks) > MAX_BLOCKS:
        raise InvalidArgument(f"at most {MAX_BLOCKS} blocks", field="pool.blocks")
    parsed: list[Block] = []
    for i, (cidr, start, stop) in enumerate(blocks):
        where = f"pool.blocks[{i}]"
        if cidr and (start or stop):
            raise InvalidArgument("give a cidr or start and stop, not both", field=where)
        block = _parse_block(cidr if cidr else f"{start}-{stop}", where)
        for j, earlier in enumerate(parsed):
            if block.overlaps(earlier):
                raise InvalidArgument(f"overlaps pool.blocks[{j}]", field=where)
        parsed.append(block)
    # Keys and values as Kubernetes labels (the field names the key).
    labels, _ = build_selector(selector, (), "pool", labels_field="service_selector")
    return Pool(name, tuple(parsed), labels, disabled)


def overlap(pool: Pool, others: Sequence[Pool]) -> InvalidArgument | None:
    """Why pool may not be stored next to others (another pool holds one
    of its addresses), or None. A Kubernetes pool is never refused: the API
    server stored it already (conflicts() marks it instead)."""
    if pool.source == SOURCE_KUBERNETES:
        return None
    for other in others:
        if other.name == pool.name:
            continue
        for i, block in enumerate(pool.blocks):
            for theirs in other.blocks:
                if block.overlaps(theirs):
                    msg = f"{block.text} overlaps pool {other.name!r} ({theirs.text})"
                    return InvalidArgument(msg, field=f"pool.blocks[{i}]")
    return None


def _parse_block(text: str, where: str) -> Block:
    field_name = f"{where}.cidr" if "-" not in text else where
    try:
        if "-" in text:
            start_text, stop_text = text.split("-", 1)
            start = ipaddress.ip_address(start_text)
            stop = ipaddress.ip_address(stop_text)
            if start.version != stop.version:
                raise InvalidArgument("start and stop of different families", field=where)
            if int(stop) < int(start):
                raise InvalidArgument(f"stop {stop} is before start {start}", field=where)
            first, last, family = int(start), int(stop), start.version
        else:
            net = ipaddress.ip_network(text, strict=True)
            first, last, family = int(net.network_address), int(net.broadcast_address), net.version
    except ValueError as exc:
        raise InvalidArgument(f"{text!r}: {exc}", field=field_name) from None
    probe = ipaddress.ip_address(first)
    if probe.is_unspecified or probe.is_multicast or probe.is_loopback:
        raise InvalidArgument(f"{text} is not a unicast block", field=field_name)
    return Block(text, family, first, last)


def validate_request(
    requested: Sequence[str], sharing_key: str, families: Sequence[int], frontend_family: int
) -> LbRequest:
    """The service's LoadBalancer fields; InvalidArgument names the field."""
    where = "service.load_balancer"
    if len(requested) > MAX_REQUESTED:
        raise InvalidArgument(f"at most {MAX_REQUESTED}", field=f"{where}.requested_ips")
    addrs: list[str] = []
    seen_families: set[int] = set()
    for i, text in enumerate(requested):
        try:
            addr = ipaddress.ip_address(text)
        except ValueError:
            raise InvalidArgument(
                f"{text!r} is not an IP address", field=f"{where}.requested_ips[{i}]"
            ) from None
        if addr.version in seen_families:
            raise InvalidArgument(
                f"a second IPv{addr.version} address", field=f"{where}.requested_ips[{i}]"
            )
        seen_families.add(addr.version)
        addrs.append(str(addr))
    if len(sharing_key) > MAX_SHARING_KEY:
        raise InvalidArgument(f"at most {MAX_SHARING_KEY} characters", field=f"{where}.sharing_key")
    for i, family in enumerate(families):
        if family not in (4, 6):
            raise InvalidArgument(f"{family} is not 4 or 6", field=f"{where}.families[{i}]")
    wanted = tuple(sorted(set(families) | seen_families)) or (frontend_family,)
    return LbRequest(tuple(addrs), sharing_key, wanted)
