"""A replica's in-memory mirror of the policy state in etcd (identities,
references, node leases, rules, ipcache) and the resolver fed from it.

It is built from a snapshot and then moved forward one batch of watch
events at a time; it is a pure function of the keys it was given, so any
replica, or a rebuild from etcd's history at an older revision, computes the
same identities, CIDR identities, ipcache view and resolved policies. (One
input is not in etcd: the lb services toServices rules resolve to, read as
they are now; services_changed follows them.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from flagella.common.fqdn import matcher as fqdn_matcher
from flagella.common.portnames import NamedPort
from flagella.policy import keys
from flagella.policy.identities import (
    RESERVED_INFOS,
    IdentityInfo,
    IPNetwork,
    Kind,
    assign_cidr_identities,
    cidr_labels,
    format_prefix,
    parse_prefix,
    reserved_identity_of,
)
from flagella.policy.labels import SOURCE_FQDN, LabelError, LabelSet, format_labels, parse_labels
from flagella.policy.resolve import DEFAULT_BUDGET, PolicyContent, ResolvedPolicy, Resolver
from flagella.policy.rules import (
    CIDRGroup,
    CompiledRule,
    Rule,
    ServiceInfo,
    cidr_group_from_json,
    compile_rule,
    rule_from_json,
)

log = logging.getLogger(__name__)

CIDR_POLICY_SOURCE = "cidr-policy"
# An address only toFQDNs selects (learned from a DNS answer).
FQDN_SOURCE = "fqdn"


class KV(Protocol):
    """What the state needs of an etcd key-value (flagella.common.etcd.KeyValue)."""

    @property
    def key(self) -> str: ...
    @property
    def value(self) -> bytes: ...
    @property
    def mod_revision(self) -> int: ...
    @property
    def create_revision(self) -> int: ...
    @property
    def lease(self) -> int: ...


@dataclass(frozen=True, slots=True)
class IPEntry:
    prefix: str
    identity: int
    node: str = ""
    host_ip: str = ""
    source: str = ""
    revision: int = 0
    # The endpoint's named container ports (egress rules naming a port
    # resolve against them on every node).
    named_ports: tuple[NamedPort, ...] = ()


def named_ports_json(ports: tuple[NamedPort, ...]) -> dict[str, Any]:
    """The ipcache JSON's "namedPorts" (absent when none: older entries
    read back the same)."""
    if not ports:
        return {}
    return {"namedPorts": [[p.name, p.port, p.protocol] for p in ports]}


def named_ports_from_json(value: dict[str, Any]) -> tuple[NamedPort, ...]:
    return tuple(NamedPort(str(n), int(p), int(pr)) for n, p, pr in value.get("namedPorts", ()))


@dataclass(frozen=True, slots=True)
class FqdnEntry:
    """What one name resolved to for one endpoint, as its node's DNS proxy
    saw the answer (the FQDN cache). It stays until that node removes it
    (after its TTL, once no connection uses the addresses) or the node's
    lease ends."""

    node: str
    endpoint: str
    name: str
    ips: tuple[str, ...]
    ttl: int
    expires: float
    lookup: float
    revision: int = 0
    create_revision: int = 0

    @property
    def where(self) -> tuple[str, str, str]:
        return (self.node, self.endpoint, self.name)


def fqdn_entry_json(entry: FqdnEntry) -> dict[str, Any]:
    return {
        "ips": list(entry.ips),
        "ttl": entry.ttl,
        "expires": entry.expires,
        "lookup": entry.lookup,
    }


@dataclass(frozen=True, slots=True)
class RefInfo:
    """A node's anonymous reference count on an identity."""

    id: int
    refs: int
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class OwnerRef:
    """One owner's reference (of a node on an identity)."""

    id: int
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class IdentityUse:
    """A node's references on one identity (GetIdentityEndpoints): how many,
    and the owners (endpoints, "<container id>/<ifname>") holding them."""

    identity: int
    node: str
    refs: int
    owners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class GlobalIdentity:
    id: int
    labels: LabelSet
    label_string: str
    mod_revision: int


@dataclass
class Change:
    """What one committed batch changed."""

    revision: int = 0
    # ipcache prefixes whose (merged) entry may have changed
    ipcache: set[str] = field(default_factory=set)
    # identities whose resolved policy may have changed
    dirty: set[int] = field(default_factory=set)
    # node -> identities whose reference by that node changed
    nodes: dict[str, set[int]] = field(default_factory=dict)
    # everything changed (a rebuild): subscribers re-check all they hold
    full: bool = False
    # a rule was put or deleted (whether or not any policy changed)
    rules: bool = False
    # a node's host policy may have changed (a host rule, or what one selects)
    host: bool = False

    def merge(self, other: Change) -> None:
        self.revision = max(self.revision, other.revision)
        self.ipcache |= other.ipcache
        self.dirty |= other.dirty
        for node, ids in other.nodes.items():
            self.nodes.setdefault(node, set()).update(ids)
        self.full = self.full or other.full
        self.rules = self.rules or other.rules
        self.host = self.host or other.host

    def __bool__(self) -> bool:
        return bool(
            self.ipcache or self.dirty or self.nodes or self.full or self.rules or self.host
        )


class PolicyState:
    def __init__(
        self,
        *,
        budget: int = DEFAULT_BUDGET,
        allow_localhost: bool = True,
        k8s_ipblocks: bool = True,
        services: Callable[[], Sequence[ServiceInfo]] | None = None,
    ) -> None:
        self.revision = 0
        # The lb services as this replica follows them now (toServices):
        # not part of etcd's state, so a state of any revision compiles
        # against the current ones.
        self._services = services or (lambda: ())
        self.resolver = Resolver(budget=budget, allow_localhost=allow_localhost)
        # --k8s-ipblock-mode=kubernetes: NetworkPolicy ipBlocks match pods.
        self.k8s_ipblocks = k8s_ipblocks
        for info in RESERVED_INFOS.values():
            self.resolver.add_identity(info)
        self.resolver.take_dirty()
        self.identities: dict[int, GlobalIdentity] = {}
        # The highest global id seen (not lowered by deletions: ids are not
        # reused until the range wraps).
        self.max_global_id = 0
        self.labels_index: dict[str, tuple[int, int]] = {}  # label string -> (id, mod_rev)
        # anonymous references: (label string, node) -> count
        self.refs: dict[tuple[str, str], RefInfo] = {}
        # owned references: (label string, node) -> owner -> reference
        self.owners: dict[tuple[str, str], dict[str, OwnerRef]] = {}
        # every reference (anonymous count + owners), both ways
        self._held: dict[tuple[int, str], tuple[int, int]] = {}  # -> (keys, refs)
        self.refs_by_id: dict[int, dict[str, int]] = {}  # id -> node -> refs
        self.node_refs: dict[str, dict[int, int]] = {}  # node -> id -> refs
        self.node_leases: dict[str, dict[int, int]] = {}  # node -> lease -> record mod_rev
        self.lease_keys: dict[int, int] = {}  # lease -> keys attached (that we mirror)
        self.rules: dict[str, Rule] = {}
        self.cidr_groups: dict[str, CIDRGroup] = {}
        # each group's CIDRs, parsed: what rules naming the group compile to
        self._group_nets: dict[str, tuple[IPNetwork, ...]] = {}
        self.cidr: dict[IPNetwork, int] = {}
        # the labels of each CIDR identity (cidr:, reserved:world, and an
        # fqdn:<selector> per toFQDNs selector selecting its address)
        self._cidr_labels: dict[IPNetwork, LabelSet] = {}
        self._cidr_by_prefix: dict[str, tuple[IPNetwork, int]] = {}
        # prefixes that are CIDR identities only because toFQDNs selects them
        self._fqdn_only: set[str] = set()
        # the FQDN cache: (node, endpoint, name) -> entry
        self.fqdn: dict[tuple[str, str, str], FqdnEntry] = {}
        self.ip: dict[str, IPEntry] = {}
        self._kv_lease: dict[str, int] = {}
        self._pending = Change()
        self._rules_changed = False
        self._fqdn_changed = False

    # --- building ---

    @classmethod
    def from_snapshot(
        cls,
        kvs: Iterable[KV],
        revision: int,
        *,
        budget: int = DEFAULT_BUDGET,
        allow_localhost: bool = True,
    ) -> PolicyState:
        state = cls(budget=budget, allow_localhost=allow_localhost)
        for kv in kvs:
            state.put(kv)
        state.commit(revision)
        return state

    def put(self, kv: KV) -> None:
        self._apply(kv.key, kv, deleted=False)

    def delete(self, key: str, revision: int) -> None:
        self._apply(key, None, deleted=True, revision=revision)

    def _track_lease(self, key: str, lease: int) -> None:
        old = self._kv_lease.pop(key, 0)
        if old:
            left = self.lease_keys.get(old, 0) - 1
            if left > 0:
                self.lease_keys[old] = left
            else:
                self.lease_keys.pop(old, None)
        if lease:
            self._kv_lease[key] = lease
            self.lease_keys[lease] = self.lease_keys.get(lease, 0) + 1

    def _apply(self, key: str, kv: KV | None, *, deleted: bool, revision: int = 0) -> None:
        parsed = keys.parse_key(key)
        if not parsed.kind:
            return
        self._track_lease(key, 0 if kv is None else kv.lease)
        try:
            getattr(self, f"_on_{parsed.kind}")(parsed, kv)
        except (ValueError, KeyError, TypeError, LabelError) as exc:
            # A value we cannot read (written by a newer version?): skip it
            # rather than stop mirroring.
            log.error("ignoring unreadable key", extra={"key": key, "reason": repr(exc)})

    def _on_id(self, p: keys.Parsed, kv: KV | None) -> None:
        ident = int(p.a)
        old = self.identities.pop(ident, None)
        if kv is None:
            if old is not None:
                self.resolver.remove_identity(ident)
            return
        labels = parse_labels(keys.loads(kv.value)["labels"])
        gid = GlobalIdentity(ident, labels, format_labels(labels), kv.mod_revision)
        self.identities[ident] = gid
        self.max_global_id = max(self.max_global_id, ident)
        if old is None or old.labels != labels:
            self.resolver.add_identity(IdentityInfo.make(ident, labels, Kind.GLOBAL))

    def _on_labels(self, p: keys.Parsed, kv: KV | None) -> None:
        if kv is None:
            self.labels_index.pop(p.a, None)
        else:
            self.labels_index[p.a] = (int(keys.loads(kv.value)["id"]), kv.mod_revision)

    def _on_ref(self, p: keys.Parsed, kv: KV | None) -> None:
        label_string, node, owner = p.a, p.b, p.c
        where = (label_string, node)
        # Read the new value before changing anything: an unreadable one
        # leaves the state as it was.
        new: RefInfo | OwnerRef | None = None
        if kv is not None:
            value = keys.loads(kv.value)
            if owner:
                new = OwnerRef(int(value["id"]), kv.lease, kv.mod_revision)
            else:
                new = RefInfo(int(value["id"]), int(value["refs"]), kv.lease, kv.mod_revision)
        old: RefInfo | OwnerRef | None
        if not owner:
            old = self.refs.pop(where, None)
            if isinstance(new, RefInfo):
                self.refs[where] = new
        else:
            owned = self.owners.setdefault(where, {})
            old = owned.pop(owner, None)
            if isinstance(new, OwnerRef):
                owned[owner] = new
            elif not owned:
                del self.owners[where]
        if old is not None:
            self._count(old.id, node, -1, -_refs(old))
        if new is not None:
            self._count(new.id, node, 1, _refs(new))
        for ref in (old, new):
            if ref is not None:
                self._pending.nodes.setdefault(node, set()).add(ref.id)

    def _count(self, ident: int, node: str, keys_delta: int, refs_delta: int) -> None:
        """Moves node's references on ident by refs_delta carried by
        keys_delta keys: the node holds the identity while a key of it
        exists (its anonymous count or an owner's)."""
        held = self._held.get((ident, node), (0, 0))
        n_keys, refs = held[0] + keys_delta, held[1] + refs_delta
        if n_keys > 0:
            self._held[(ident, node)] = (n_keys, refs)
            self.refs_by_id.setdefault(ident, {})[node] = refs
            self.node_refs.setdefault(node, {})[ident] = refs
            return
        self._held.pop((ident, node), None)
        by_node = self.refs_by_id.get(ident)
        if by_node is not None:
            by_node.pop(node, None)
            if not by_node:
                del self.refs_by_id[ident]
        on_node = self.node_refs.get(node)
        if on_node is not None:
            on_node.pop(ident, None)
            if not on_node:
                del self.node_refs[node]

    def _on_node(self, p: keys.Parsed, kv: KV | None) -> None:
        node, lease = p.a, int(p.b, 16)
        leases = self.node_leases.setdefault(node, {})
        if kv is None:
            leases.pop(lease, None)
            if not leases:
                del self.node_leases[node]
        else:
            leases[lease] = kv.mod_revision

    def _on_ip(self, p: keys.Parsed, kv: KV | None) -> None:
        prefix = p.a
        if kv is None:
            self.ip.pop(prefix, None)
        else:
            v = keys.loads(kv.value)
            self.ip[prefix] = IPEntry(
                prefix=prefix,
                identity=int(v["identity"]),
                node=v.get("node", ""),
                host_ip=v.get("hostIP", ""),
                source=v.get("source", ""),
                revision=kv.mod_revision,
                named_ports=named_ports_from_json(v),
            )
        self._pending.ipcache.add(prefix)

    def _on_fqdn(self, p: keys.Parsed, kv: KV | None) -> None:
        where = (p.a, p.b, p.c)
        if kv is None:
            if self.fqdn.pop(where, None) is not None:
                self._fqdn_changed = True
            return
        v = keys.loads(kv.value)
        entry = FqdnEntry(
            node=p.a,
            endpoint=p.b,
            name=p.c,
            ips=tuple(format_prefix(parse_prefix(str(ip))) for ip in v["ips"]),
            ttl=int(v["ttl"]),
            expires=float(v["expires"]),
            lookup=float(v.get("lookup", 0.0)),
            revision=kv.mod_revision,
            create_revision=kv.create_revision,
        )
        old = self.fqdn.get(where)
        self.fqdn[where] = entry
        if old is None or old.ips != entry.ips:
            self._fqdn_changed = True

    def fqdn_selections(self) -> dict[str, dict[str, set[str]]]:
        """Every toFQDNs selector in use (its key) -> the names of the FQDN
        cache it matches -> their addresses."""
        selectors = {k for r in self.resolver.rules.values() for k in r.fqdns}
        if not selectors:
            return {}
        by_name: dict[str, set[str]] = {}
        for entry in self.fqdn.values():
            by_name.setdefault(entry.name, set()).update(entry.ips)
        out: dict[str, dict[str, set[str]]] = {}
        for key in selectors:
            match = fqdn_matcher(key)
            out[key] = {name: ips for name, ips in by_name.items() if match(name)}
        return out

    def _fqdn_prefixes(self) -> dict[IPNetwork, tuple[set[str], int]]:
        """Each address a toFQDNs selector selects -> (the selectors' keys,
        the revision its oldest cache entry was created at)."""
        selected: dict[str, set[str]] = {}  # address -> selector keys
        for key, names in self.fqdn_selections().items():
            for ips in names.values():
                for ip in ips:
                    selected.setdefault(ip, set()).add(key)
        if not selected:  # every rule change comes here: no cache walk then
            return {}
        created: dict[str, int] = {}
        for entry in self.fqdn.values():
            for ip in entry.ips:
                if ip in selected:
                    created[ip] = min(created.get(ip, entry.create_revision), entry.create_revision)
        return {parse_prefix(ip): (keys_, created[ip]) for ip, keys_ in selected.items()}

    def _on_rule(self, p: keys.Parsed, kv: KV | None) -> None:
        name = p.a
        self._rules_changed = True
        if kv is None:
            if self.rules.pop(name, None) is not None:
                self.resolver.delete_rule(name)
            return
        rule = rule_from_json(
            kv.value, revision=kv.mod_revision, create_revision=kv.create_revision
        )
        if rule.key != name:
            raise ValueError(f"rule key {name!r} holds rule {rule.key!r}")
        self.rules[name] = rule
        self.resolver.put_rule(self._compile(rule))

    def _compile(self, rule: Rule) -> CompiledRule:
        services = self._services() if any(p.services for p in rule.peers()) else ()
        return compile_rule(
            rule, self._group_nets, k8s_ipblocks=self.k8s_ipblocks, services=services
        )

    def _on_cidrgroup(self, p: keys.Parsed, kv: KV | None) -> None:
        name = p.a
        if kv is None:
            if self.cidr_groups.pop(name, None) is None:
                return
            self._group_nets.pop(name, None)
        else:
            group = cidr_group_from_json(name, kv.value, revision=kv.mod_revision)
            nets = tuple(parse_prefix(c) for c in group.cidrs)
            self.cidr_groups[name] = group
            if self._group_nets.get(name) == nets:
                return
            self._group_nets[name] = nets
        # Every rule naming the group is compiled again against its CIDRs.
        for compiled in [r for r in self.resolver.rules.values() if name in r.groups]:
            self._rules_changed = True
            self.resolver.put_rule(self._compile(compiled.rule))

    def services_changed(self) -> Change:
        """Compiles the rules with toServices again against the current lb
        services; what changed, at the current revision (the services are
        not in etcd: no revision of their own)."""
        for compiled in [r for r in self.resolver.rules.values() if r.has_services]:
            fresh = self._compile(compiled.rule)
            if fresh.clauses != compiled.clauses:
                self.resolver.put_rule(fresh)
        return self.commit(self.revision)

    def _recompute_cidr(self) -> None:
        priority: dict[IPNetwork, int] = {}
        for name, compiled in self.resolver.rules.items():
            created = self.rules[name].create_revision
            for prefix in compiled.prefixes:
                priority[prefix] = min(priority.get(prefix, created), created)
        from_rules = set(priority)
        fqdn = self._fqdn_prefixes()
        for prefix, (_, created) in fqdn.items():
            priority[prefix] = min(priority.get(prefix, created), created)
        wanted = assign_cidr_identities({p: (r,) for p, r in priority.items()})
        labels = {p: cidr_labels(p, fqdn[p][0] if p in fqdn else ()) for p in wanted}
        if wanted == self.cidr and labels == self._cidr_labels:
            return
        for prefix, ident in self.cidr.items():
            if wanted.get(prefix) != ident:
                self.resolver.remove_identity(ident)
                self._pending.ipcache.add(format_prefix(prefix))
        for prefix, ident in wanted.items():
            if self.cidr.get(prefix) != ident or self._cidr_labels.get(prefix) != labels[prefix]:
                self.resolver.add_identity(
                    IdentityInfo.make(ident, labels[prefix], Kind.CIDR, prefix)
                )
                self._pending.ipcache.add(format_prefix(prefix))
        self.cidr = wanted
        self._cidr_labels = labels
        self._cidr_by_prefix = {format_prefix(p): (p, priority[p]) for p in wanted}
        self._fqdn_only = {format_prefix(p) for p in wanted if p not in from_rules}

    def commit(self, revision: int) -> Change:
        """Ends a batch of events at revision; returns what changed."""
        rules = self._rules_changed
        if self._rules_changed or self._fqdn_changed:
            self._rules_changed = self._fqdn_changed = False
            self._recompute_cidr()
        change, self._pending = self._pending, Change()
        change.rules = rules
        change.revision = revision
        change.dirty = self.resolver.take_dirty()
        change.host = self.resolver.take_host_dirty()
        self.revision = max(self.revision, revision)
        return change

    # --- reading ---

    def identity_of_labels(self, labels: LabelSet) -> int | None:
        reserved = reserved_identity_of(labels)
        if reserved is not None:
            return reserved
        found = self.labels_index.get(format_labels(labels))
        if found is not None and found[0] in self.identities:
            return found[0]
        # A CIDR identity: its cidr: label, with or without reserved:world
        # (and fqdn: labels, which depend on the FQDN cache).
        cidr = [lb for lb in labels if lb.source == "cidr"]
        rest = [lb for lb in labels if lb.source not in ("cidr", SOURCE_FQDN)]
        if len(cidr) == 1 and all(lb.source == "reserved" and lb.key == "world" for lb in rest):
            entry = self._cidr_by_prefix.get(_norm_prefix(cidr[0].key))
            if entry is not None:
                return self.cidr[entry[0]]
        return None

    def cidr_identity_of(self, prefix: str) -> int | None:
        """The CIDR identity of exactly prefix (a bare address for a host)."""
        found = self._cidr_by_prefix.get(prefix)
        return None if found is None else self.cidr[found[0]]

    def info(self, ident: int) -> IdentityInfo | None:
        return self.resolver.identities.get(ident)

    def referenced_by(self, ident: int) -> list[str]:
        return sorted(self.refs_by_id.get(ident, {}))

    def owner_ref(self, label_string: str, node: str, owner: str) -> OwnerRef | None:
        return self.owners.get((label_string, node), {}).get(owner)

    def identity_uses(self, node: str = "") -> list[IdentityUse]:
        """The references of node (every node: ""), per identity."""
        owners: dict[tuple[int, str], list[str]] = {}
        for (_, n), owned in self.owners.items():
            if node and n != node:
                continue
            for owner, ref in owned.items():
                owners.setdefault((ref.id, n), []).append(owner)
        out = []
        for ident, by_node in self.refs_by_id.items():
            for n, refs in by_node.items():
                if node and n != node:
                    continue
                out.append(IdentityUse(ident, n, refs, tuple(sorted(owners.get((ident, n), ())))))
        out.sort(key=lambda u: (u.node, u.identity))
        return out

    def node_identities(self, node: str) -> set[int]:
        return set(self.node_refs.get(node, {}))

    def unreferenced_identities(self) -> list[GlobalIdentity]:
        return [g for i, g in self.identities.items() if i not in self.refs_by_id]

    def unreferenced_count(self) -> int:
        """How many global identities no node references (for a scrape:
        counts only, no walk over the identities)."""
        referenced = len(self.refs_by_id) - sum(1 for i in RESERVED_INFOS if i in self.refs_by_id)
        return max(0, len(self.identities) - referenced)

    def ipcache_entry(self, prefix: str) -> IPEntry | None:
        entry = self.ip.get(prefix)
        if entry is not None:
            return entry
        cidr = self._cidr_by_prefix.get(prefix)
        if cidr is None:
            return None
        net, created = cidr
        return IPEntry(
            prefix=prefix,
            identity=self.cidr[net],
            source=FQDN_SOURCE if prefix in self._fqdn_only else CIDR_POLICY_SOURCE,
            revision=created,
        )

    def cidr_prefixes(self) -> list[str]:
        """The prefixes of the CIDR identities (each has an ipcache entry)."""
        return list(self._cidr_by_prefix)

    def ipcache(self) -> dict[str, IPEntry]:
        """The ipcache the datapath loads: the entries in etcd, plus one per
        CIDR identity whose prefix etcd has no entry for."""
        out = dict(self.ip)
        for prefix in self._cidr_by_prefix:
            if prefix not in out:
                entry = self.ipcache_entry(prefix)
                if entry is not None:
                    out[prefix] = entry
        return out

    def policy(self, ident: int) -> ResolvedPolicy | None:
        content = self.resolver.content(ident)
        if content is None:
            return None
        return ResolvedPolicy(ident, self.revision, content)

    def node_policies(self, node: str) -> dict[int, PolicyContent]:
        out = {}
        for ident in self.node_identities(node):
            content = self.resolver.content(ident)
            if content is not None:
                out[ident] = content
        return out


def _refs(ref: RefInfo | OwnerRef) -> int:
    return ref.refs if isinstance(ref, RefInfo) else 1


def _norm_prefix(text: str) -> str:
    try:
        return format_prefix(parse_prefix(text))
    except ValueError:
        return text
