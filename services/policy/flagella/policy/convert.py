"""Proto <-> domain conversion for the servicer (flagella.policy.servicer),
with the structural checks of rules given as protos."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.common.errors import InvalidArgument
from flagella.common.sync import Batching, Change, MessageCache
from flagella.policy.allocator import IdentityView
from flagella.policy.fqdncache import Selection
from flagella.policy.hostpolicy import HOST_IDENTITY, HostPolicy
from flagella.policy.labels import Label, LabelError, split_label
from flagella.policy.prefixes import PrefixEntry
from flagella.policy.resolve import PolicyContent, PolicyEntry, ResolvedPolicy
from flagella.policy.rules import (
    ICMP_PROTOCOLS,
    CIDRGroup,
    CIDRSpec,
    Direction,
    Expression,
    PeerSpec,
    PortSpec,
    Protocol,
    Rule,
    RuleSource,
    SelectorSpec,
    ServicePeer,
    check_cidr,
    check_name,
    check_namespace,
    check_port,
    check_selector,
    check_service_peer,
    icmp_port,
    icmp_type_of,
)
from flagella.policy.rules.admin import check_admin_rule
from flagella.policy.rules.fqdn import DNS_EGRESS_ONLY, DNS_PORT_ONLY, has_dns_port
from flagella.policy.rules.fqdn import check_name as check_fqdn_name
from flagella.policy.rules.fqdn import check_selector as check_fqdn_selector
from flagella.policy.rules.groups import make_cidr_group
from flagella.policy.rules.model import (
    ACTION_ALLOW,
    ACTION_DENY,
    ACTION_PASS,
    TIER_ADMIN,
    TIER_BASELINE,
)
from flagella.policy.runtimeconfig import ConfigEvent, ConfigView
from flagella.policy.selector import Entity
from flagella.policy.state import FqdnEntry, IPEntry
from flagella.policy.streams import EventKind, WatchCounters
from flagella.policy.validation import check_fqdn_endpoint, check_fqdn_ips, check_fqdn_ttl

_EVENT_KINDS = {
    EventKind.RESET: pb.EVENT_KIND_RESET,
    EventKind.UPSERT: pb.EVENT_KIND_UPSERT,
    EventKind.DELETE: pb.EVENT_KIND_DELETE,
    EventKind.SYNCED: pb.EVENT_KIND_SYNCED,
}
_OPERATORS = {
    pb.LabelSelectorRequirement.OPERATOR_IN: "In",
    pb.LabelSelectorRequirement.OPERATOR_NOT_IN: "NotIn",
    pb.LabelSelectorRequirement.OPERATOR_EXISTS: "Exists",
    pb.LabelSelectorRequirement.OPERATOR_DOES_NOT_EXIST: "DoesNotExist",
}
_OPERATOR_PB = {v: k for k, v in _OPERATORS.items()}
_ENTITIES = {
    pb.ENTITY_ALL: Entity.ALL,
    pb.ENTITY_WORLD: Entity.WORLD,
    pb.ENTITY_CLUSTER: Entity.CLUSTER,
    pb.ENTITY_HOST: Entity.HOST,
    pb.ENTITY_REMOTE_NODE: Entity.REMOTE_NODE,
    pb.ENTITY_INIT: Entity.INIT,
    pb.ENTITY_HEALTH: Entity.HEALTH,
    pb.ENTITY_UNMANAGED: Entity.UNMANAGED,
}
_ENTITY_PB = {v: k for k, v in _ENTITIES.items()}
PROTOCOLS = {int(p): p for p in Protocol}


# --- labels and identities ---


def labels_from_pb(labels: Sequence[pb.Label], field: str) -> list[Label]:
    out = []
    for i, label in enumerate(labels):
        source, key = label.source, label.key
        if not source:
            source, key, _ = split_label(key)
        try:
            out.append(Label.make(source, key, label.value))
        except LabelError as exc:
            raise InvalidArgument(str(exc), field=f"{field}[{i}]") from None
    return out


def label_pb(label: Label) -> pb.Label:
    return pb.Label(source=label.source, key=label.key, value=label.value)


def identity_pb(view: IdentityView) -> pb.Identity:
    return pb.Identity(
        id=view.id,
        labels=[label_pb(lb) for lb in view.labels],
        reserved=view.reserved,
        referenced_by=list(view.referenced_by),
        revision=view.revision,
    )


# --- rules ---

_TIERS = {
    pb.POLICY_TIER_NETWORK_POLICY: "",
    pb.POLICY_TIER_ADMIN: TIER_ADMIN,
    pb.POLICY_TIER_BASELINE: TIER_BASELINE,
}
_TIER_PB = {v: k for k, v in _TIERS.items()}
_ACTIONS = {
    pb.ADMIN_ACTION_ALLOW: ACTION_ALLOW,
    pb.ADMIN_ACTION_DENY: ACTION_DENY,
    pb.ADMIN_ACTION_PASS: ACTION_PASS,
}
_ACTION_PB = {v: k for k, v in _ACTIONS.items()}


def _selector_from_pb(sel: pb.EndpointSelector, path: str) -> SelectorSpec:
    exprs = []
    for i, e in enumerate(sel.match_expressions):
        if e.operator not in _OPERATORS:
            raise InvalidArgument(
                "operator is required (In, NotIn, Exists, DoesNotExist)",
                field=f"{path}.match_expressions[{i}].operator",
            )
        exprs.append(Expression(e.key, _OPERATORS[e.operator], tuple(e.values)))
    spec = SelectorSpec(tuple(sorted(sel.match_labels.items())), tuple(exprs))
    check_selector(spec, path, labels_path="match_labels", exprs_path="match_expressions")
    return spec


def _peer_from_pb(peer: pb.PeerRule, path: str, warnings: list[str] | None) -> PeerSpec:
    endpoints = tuple(
        _selector_from_pb(s, f"{path}.endpoints[{i}]") for i, s in enumerate(peer.endpoints)
    )
    cidrs = []
    for i, c in enumerate(peer.cidrs):
        if c.cidr and c.group:
            raise InvalidArgument("give cidr or group, not both", field=f"{path}.cidrs[{i}].group")
        spec = CIDRSpec(c.cidr, tuple(getattr(c, "except")), c.group)
        cidrs.append(
            check_cidr(
                spec,
                f"{path}.cidrs[{i}]",
                cidr_field="cidr",
                except_field="except",
                group_field="group",
                warnings=warnings,
            )
        )
    entities = []
    for i, e in enumerate(peer.entities):
        if e not in _ENTITIES:
            raise InvalidArgument("unknown entity", field=f"{path}.entities[{i}]")
        entities.append(_ENTITIES[e])
    to_ports = []
    for i, pr in enumerate(peer.to_ports):
        ports = []
        for j, p in enumerate(pr.ports):
            pp = f"{path}.to_ports[{i}].ports[{j}]"
            if p.protocol not in PROTOCOLS:
                raise InvalidArgument("unknown protocol", field=f"{pp}.protocol")
            spec_p = _port_spec(p, pp)
            check_port(spec_p, pp, end_field="end_port")
            ports.append(spec_p)
        to_ports.append(tuple(ports))
    requires = tuple(
        _selector_from_pb(s, f"{path}.requires[{i}]") for i, s in enumerate(peer.requires)
    )
    services = tuple(
        _service_from_pb(s, f"{path}.services[{i}]") for i, s in enumerate(peer.services)
    )
    fqdns = tuple(
        dict.fromkeys(
            check_fqdn_selector(f.match_name, f.match_pattern, f"{path}.fqdns[{i}]")
            for i, f in enumerate(peer.fqdns)
        )
    )
    dns = tuple(
        dict.fromkeys(
            check_fqdn_selector(f.match_name, f.match_pattern, f"{path}.dns[{i}]")
            for i, f in enumerate(peer.dns)
        )
    )
    if dns and not any(has_dns_port(pr) for pr in to_ports):
        raise InvalidArgument(DNS_PORT_ONLY, field=f"{path}.dns")
    return PeerSpec(
        endpoints,
        tuple(cidrs),
        tuple(entities),
        tuple(to_ports),
        requires,
        services,
        action=_ACTIONS.get(peer.action, ""),
        name=peer.name,
        fqdns=fqdns,
        dns=dns,
    )


def _service_from_pb(s: pb.ServiceSelector, path: str) -> ServicePeer:
    selector = None
    if s.HasField("selector"):
        selector = _selector_from_pb(s.selector, f"{path}.selector")
    peer = ServicePeer(name=s.name, selector=selector, namespace=s.namespace)
    check_service_peer(peer, path, name_field="name", selector_field="selector")
    check_namespace(s.namespace, f"{path}.namespace")
    return peer


def _service_pb(s: ServicePeer) -> pb.ServiceSelector:
    out = pb.ServiceSelector(name=s.name, namespace=s.namespace)
    if s.selector is not None:
        out.selector.CopyFrom(_selector_pb(s.selector))
    return out


def rule_from_pb(rule: pb.Rule, path: str, warnings: list[str] | None = None) -> Rule:
    """The rule of a proto (validated; raises InvalidArgument naming the
    field); CIDRs with host bits are masked, with a warning in warnings."""
    name, namespace = rule.name, rule.namespace
    if "/" in name:
        ns, _, name = name.partition("/")
        if namespace and namespace != ns:
            raise InvalidArgument(
                f"name says namespace {ns!r}, namespace says {namespace!r}", field=f"{path}.name"
            )
        namespace = ns
    check_name(name, f"{path}.name")
    check_namespace(namespace, f"{path}.namespace")
    node_selector = None
    if rule.HasField("node_selector"):
        # A host policy: cluster-wide, and nodes or pods, never both.
        if rule.HasField("endpoint_selector"):
            raise InvalidArgument(
                "give endpoint_selector or node_selector, not both", field=f"{path}.node_selector"
            )
        if namespace:
            raise InvalidArgument(
                "a node_selector (host policy) needs a cluster-wide rule (no namespace)",
                field=f"{path}.node_selector",
            )
        node_selector = _selector_from_pb(rule.node_selector, f"{path}.node_selector")
    elif not rule.HasField("endpoint_selector"):
        raise InvalidArgument(
            "required (or node_selector for a host policy)", field=f"{path}.endpoint_selector"
        )

    def peers(items: Sequence[pb.PeerRule], fld: str) -> tuple[PeerSpec, ...]:
        out = tuple(_peer_from_pb(p, f"{path}.{fld}[{i}]", warnings) for i, p in enumerate(items))
        for i, p in enumerate(out):
            # Backends are matched by address, which only allows
            # (docs/policy.md, toServices).
            if p.services and fld != "egress":
                raise InvalidArgument(
                    "toServices only allows egress (not ingress, not a deny)",
                    field=f"{path}.{fld}[{i}].services",
                )
            # A name's addresses are learned from answers the proxy lets
            # through: they can only be allowed (as Cilium).
            if p.dns and fld != "egress":
                raise InvalidArgument(DNS_EGRESS_ONLY, field=f"{path}.{fld}[{i}].dns")
            if p.fqdns and fld != "egress":
                raise InvalidArgument(
                    "toFQDNs only allows egress (not ingress, not a deny)",
                    field=f"{path}.{fld}[{i}].fqdns",
                )
        return out

    if rule.tier not in _TIERS:
        raise InvalidArgument("unknown tier", field=f"{path}.tier")
    out = Rule(
        name=name,
        namespace=namespace,
        endpoint_selector=(
            SelectorSpec()
            if node_selector is not None
            else _selector_from_pb(rule.endpoint_selector, f"{path}.endpoint_selector")
        ),
        ingress=peers(rule.ingress, "ingress"),
        ingress_deny=peers(rule.ingress_deny, "ingress_deny"),
        egress=peers(rule.egress, "egress"),
        egress_deny=peers(rule.egress_deny, "egress_deny"),
        enforce_ingress=rule.enforce_ingress,
        enforce_egress=rule.enforce_egress,
        description=rule.description,
        labels=tuple(sorted(rule.labels.items())),
        node_selector=node_selector,
        tier=_TIERS[rule.tier],
        priority=rule.priority,
    )
    check_admin_rule(out, path)
    return out


def _selector_pb(spec: SelectorSpec) -> pb.EndpointSelector:
    return pb.EndpointSelector(
        match_labels=dict(spec.match_labels),
        match_expressions=[
            pb.LabelSelectorRequirement(
                key=e.key, operator=_OPERATOR_PB[e.operator], values=list(e.values)
            )
            for e in spec.match_expressions
        ],
    )


def _cidr_pb(c: CIDRSpec) -> pb.CIDRRule:
    out = pb.CIDRRule(cidr=c.cidr, group=c.group)
    getattr(out, "except").extend(c.excepts)  # "except" is a Python keyword
    return out


def _port_spec(p: pb.PortProtocol, path: str) -> PortSpec:
    protocol = PROTOCOLS[p.protocol]
    if protocol not in ICMP_PROTOCOLS:
        if p.HasField("icmp_type"):
            raise InvalidArgument(
                "an ICMP type needs protocol ICMP or ICMPV6", field=f"{path}.icmp_type"
            )
        return PortSpec(p.port, p.end_port, protocol, p.name)
    if p.name:
        raise InvalidArgument(f"{protocol.name} takes no port name", field=f"{path}.name")
    if p.port:
        raise InvalidArgument(f"{protocol.name} takes no port; set icmp_type", field=f"{path}.port")
    if not p.HasField("icmp_type"):
        return PortSpec(0, p.end_port, protocol)
    if p.icmp_type > 255:
        raise InvalidArgument(
            f"ICMP type {p.icmp_type} out of range (0-255)", field=f"{path}.icmp_type"
        )
    return PortSpec(icmp_port(p.icmp_type), p.end_port, protocol)


def _port_pb(p: PortSpec) -> pb.PortProtocol:
    out = pb.PortProtocol(end_port=p.end_port, protocol=int(p.protocol))  # type: ignore[arg-type]
    if p.protocol not in ICMP_PROTOCOLS:
        out.port = p.port
        out.name = p.name
    elif (icmp_type := icmp_type_of(p.port)) is not None:
        out.icmp_type = icmp_type
    return out


def _peer_pb(peer: PeerSpec) -> pb.PeerRule:
    return pb.PeerRule(
        endpoints=[_selector_pb(s) for s in peer.endpoints],
        cidrs=[_cidr_pb(c) for c in peer.cidrs],
        entities=[_ENTITY_PB[e] for e in peer.entities],
        to_ports=[pb.PortRule(ports=[_port_pb(p) for p in pr]) for pr in peer.to_ports],
        requires=[_selector_pb(s) for s in peer.requires],
        services=[_service_pb(s) for s in peer.services],
        action=_ACTION_PB.get(peer.action, pb.ADMIN_ACTION_UNSPECIFIED),
        name=peer.name,
        fqdns=[
            pb.FQDNSelector(match_name=f.match_name, match_pattern=f.match_pattern)
            for f in peer.fqdns
        ],
        dns=[
            pb.FQDNSelector(match_name=f.match_name, match_pattern=f.match_pattern)
            for f in peer.dns
        ],
    )


def rule_pb(rule: Rule) -> pb.Rule:
    updated = Timestamp()
    if rule.updated_at:
        updated.FromNanoseconds(int(rule.updated_at * 1e9))
    return pb.Rule(
        name=rule.key,
        namespace=rule.namespace,
        endpoint_selector=None if rule.host else _selector_pb(rule.endpoint_selector),
        node_selector=(None if rule.node_selector is None else _selector_pb(rule.node_selector)),
        ingress=[_peer_pb(p) for p in rule.ingress],
        ingress_deny=[_peer_pb(p) for p in rule.ingress_deny],
        egress=[_peer_pb(p) for p in rule.egress],
        egress_deny=[_peer_pb(p) for p in rule.egress_deny],
        enforce_ingress=rule.enforce_ingress,
        enforce_egress=rule.enforce_egress,
        description=rule.description,
        labels=dict(rule.labels),
        revision=rule.revision,
        updated_at=updated if rule.updated_at else None,
        tier=_TIER_PB[rule.tier],
        priority=rule.priority,
        source=rule_source_pb(rule.source),
    )


def rule_source_pb(source: RuleSource) -> pb.RuleSource | None:
    if not source.kubernetes:
        return None
    return pb.RuleSource(kind=source.kind, namespace=source.namespace, name=source.name)


# --- policies and the ipcache ---


def _entry_pb(e: PolicyEntry) -> pb.PolicyEntry:
    return pb.PolicyEntry(
        identity=e.identity,
        port=e.port,
        end_port=e.end_port,
        protocol=int(e.protocol),  # type: ignore[arg-type]
        direction=int(e.direction),  # type: ignore[arg-type]
        verdict=int(e.verdict),  # type: ignore[arg-type]
        derived_from=e.derived_from,
        port_name=e.port_name,
    )


def content_bytes(c: PolicyContent) -> bytes:
    """A ResolvedPolicy without identity and revision, serialized."""
    return pb.ResolvedPolicy(
        ingress_enforced=c.ingress_enforced,
        egress_enforced=c.egress_enforced,
        entries=[_entry_pb(e) for e in c.entries],
        error=c.error,
        prefix_entries=[_prefix_pb(e) for e in c.prefix_entries],
        ingress_rules=c.ingress_rules,
        egress_rules=c.egress_rules,
        dns_proxy=c.dns_proxy,
        dns_rules=c.dns_rules,
    ).SerializeToString()


_DIRECTION_PB = {
    Direction.INGRESS: pb.DIRECTION_INGRESS,
    Direction.EGRESS: pb.DIRECTION_EGRESS,
}
_PROTOCOL_PB = {
    Protocol.ANY: pb.PROTOCOL_ANY,
    Protocol.ICMP: pb.PROTOCOL_ICMP,
    Protocol.TCP: pb.PROTOCOL_TCP,
    Protocol.UDP: pb.PROTOCOL_UDP,
    Protocol.SCTP: pb.PROTOCOL_SCTP,
    Protocol.ICMPV6: pb.PROTOCOL_ICMPV6,
}


def _prefix_pb(e: PrefixEntry) -> pb.PrefixEntry:
    return pb.PrefixEntry(
        prefix=str(e.prefix),
        direction=_DIRECTION_PB[e.direction],
        ports=[
            pb.PortProtocol(port=p, end_port=end, protocol=_PROTOCOL_PB[proto])
            for p, end, proto in e.ports
            if isinstance(p, int)  # flatten keeps no named ports
        ],
        derived_from=e.derived_from,
    )


class ContentCache:
    """Serialized policy contents by content object: identities that share
    a signature share one content, so each is encoded once. An entry lives
    as long as its content does (a weak reference: a content the resolver
    dropped takes its bytes with it), so the cache holds the contents in
    use and no more; `size` only bounds it further (least recently used
    go first)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._cache: OrderedDict[int, tuple[weakref.ref[PolicyContent], bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, c: PolicyContent) -> bytes:
        key = id(c)
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is c:
            self._cache.move_to_end(key)
            return hit[1]
        raw = content_bytes(c)
        self._cache[key] = (weakref.ref(c, self._forget(key)), raw)
        if len(self._cache) > self.size:
            self._cache.popitem(last=False)
        return raw

    def _forget(self, key: int) -> Callable[[weakref.ref[PolicyContent]], None]:
        cache = self._cache

        def forget(ref: weakref.ref[PolicyContent]) -> None:
            # Only the entry of this very reference: the id may already
            # belong to a newer content's entry.
            hit = cache.get(key)
            if hit is not None and hit[0] is ref:
                del cache[key]

        return forget


def policy_pb(policy: ResolvedPolicy, cache: ContentCache | None = None) -> pb.ResolvedPolicy:
    c = policy.content
    raw = cache.get(c) if cache is not None else content_bytes(c)
    out = pb.ResolvedPolicy.FromString(raw)
    out.identity = policy.identity
    out.revision = policy.revision
    return out


def ip_entry_pb(e: IPEntry) -> pb.IPCacheEntry:
    return pb.IPCacheEntry(
        prefix=e.prefix,
        identity=e.identity,
        node=e.node,
        host_ip=e.host_ip,
        source=e.source,
        revision=e.revision,
        named_ports=[
            pb.NamedPort(name=p.name, port=p.port, protocol=pb.Protocol.ValueType(p.protocol))
            for p in e.named_ports
        ],
    )


class Same:
    """A key part that is one object (compared by identity, hashed by id:
    a resolved content's own hash walks all of it). It keeps the object
    alive while the key is cached, so the id cannot be reused meanwhile."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Same) and other.obj is self.obj


IPCacheKey = tuple[IPEntry, int]
PolicyKey = tuple[int, int, Hashable]


class IPCacheMessages:
    """WatchIPCache's messages (serve_watch's WatchMessages); an UPSERT is
    built once for every stream (cache: the entry and the revision of its
    change, each prefix's newest)."""

    def __init__(self, cache: MessageCache[IPCacheKey, pb.IPCacheEvent], counters: WatchCounters):
        self.cache = cache
        self.counters = counters

    def reset(self, revision: int) -> pb.IPCacheEvent:
        return pb.IPCacheEvent(kind=pb.EVENT_KIND_RESET, revision=revision)

    async def upsert(self, change: Change[str, IPEntry]) -> pb.IPCacheEvent:
        assert change.record is not None
        key = (change.record, change.revision)
        event = self.cache.get(key)
        if event is None:
            event = pb.IPCacheEvent(
                kind=pb.EVENT_KIND_UPSERT,
                revision=change.revision,
                entry=ip_entry_pb(change.record),
            )
            self.cache.put(key, event)
            self.counters.built["ipcache"] += 1
        return event

    async def delete(self, change: Change[str, IPEntry]) -> pb.IPCacheEvent:
        # A DELETE names the prefix only.
        return pb.IPCacheEvent(
            kind=pb.EVENT_KIND_DELETE,
            revision=change.revision,
            entry=pb.IPCacheEntry(prefix=change.key),
        )

    def synced(self, revision: int) -> pb.IPCacheEvent:
        return pb.IPCacheEvent(kind=pb.EVENT_KIND_SYNCED, revision=revision)


def batch_ipcache_events(events: list[pb.IPCacheEvent]) -> pb.IPCacheEvent:
    """A BATCH message of events, at the revision of the last."""
    return pb.IPCacheEvent(kind=pb.EVENT_KIND_BATCH, revision=events[-1].revision, events=events)


# WatchIPCache with batch_events: changes gather for 0.1 s after some were
# sent (a burst of pod starts is a few messages per stream, not one each; a
# lone change still goes at once).
IPCACHE_BATCHING = Batching(
    wrap=batch_ipcache_events, size=lambda event: event.ByteSize(), linger=0.1
)


def ipcache_slot(key: IPCacheKey) -> str:
    return key[0].prefix


class PolicyMessages:
    """WatchPolicy's messages; an UPSERT (an identity's resolved policy at
    the revision of the change that sent it) is built once for every node
    that holds the identity (cache: identity, revision, content object)."""

    def __init__(
        self,
        cache: MessageCache[PolicyKey, pb.PolicyEvent],
        contents: ContentCache,
        commit_time: Callable[[int], float],
        counters: WatchCounters,
    ) -> None:
        self.cache = cache
        self.contents = contents
        self.commit_time = commit_time
        self.counters = counters

    def reset(self, revision: int) -> pb.PolicyEvent:
        return pb.PolicyEvent(kind=pb.EVENT_KIND_RESET, revision=revision)

    async def upsert(self, change: Change[int, PolicyContent]) -> pb.PolicyEvent:
        content = change.record
        assert content is not None
        key = (change.key, change.revision, Same(content))
        event = self.cache.get(key)
        if event is None:
            event = policy_event_pb(
                change.key,
                change.revision,
                content,
                self.commit_time(change.revision),
                self.contents,
            )
            self.cache.put(key, event)
            self.counters.built["policy"] += 1
        return event

    async def delete(self, change: Change[int, PolicyContent]) -> pb.PolicyEvent:
        return pb.PolicyEvent(
            kind=pb.EVENT_KIND_DELETE, identity=change.key, revision=change.revision
        )

    def synced(self, revision: int) -> pb.PolicyEvent:
        return pb.PolicyEvent(kind=pb.EVENT_KIND_SYNCED, revision=revision)


def policy_slot(key: PolicyKey) -> int:
    return key[0]


def policy_event_pb(
    identity: int,
    revision: int,
    content: PolicyContent,
    revision_time: float = 0.0,
    cache: ContentCache | None = None,
) -> pb.PolicyEvent:
    """An UPSERT of an identity's resolved policy; revision_time: Unix time
    the revision was committed (0: unknown)."""
    out = pb.PolicyEvent(kind=pb.EVENT_KIND_UPSERT, identity=identity, revision=revision)
    out.policy.MergeFromString(cache.get(content) if cache is not None else content_bytes(content))
    out.policy.identity = identity
    out.policy.revision = revision
    if revision_time:
        out.policy.revision_time.FromNanoseconds(int(revision_time * 1e9))
    return out


def host_policy_event_pb(host: HostPolicy, cache: ContentCache | None = None) -> pb.HostPolicyEvent:
    out = pb.HostPolicyEvent(
        revision=host.revision, node_labels=dict(host.node_labels), rules=list(host.rules)
    )
    if host.content is not None:
        c = host.content
        out.policy.MergeFromString(cache.get(c) if cache is not None else content_bytes(c))
        out.policy.identity = HOST_IDENTITY
        out.policy.revision = host.revision
    return out


# --- CIDR groups ---


def cidr_group_from_pb(group: pb.CIDRGroup) -> CIDRGroup:
    return make_cidr_group(group.name, group.cidrs, group.labels)


def cidr_group_pb(group: CIDRGroup) -> pb.CIDRGroup:
    return pb.CIDRGroup(
        name=group.name,
        cidrs=group.cidrs,
        labels=dict(group.labels),
        revision=group.revision,
        source=rule_source_pb(group.source),
    )


# --- FQDN cache ---


# A node's clock may run ahead of the policy service's, not by this much: a
# lookup further ahead is refused (its expiry would be too).
MAX_LOOKUP_AHEAD_S = 3600


def _timestamp(seconds: float) -> Timestamp:
    out = Timestamp()
    out.FromNanoseconds(int(seconds * 1e9))
    return out


def fqdn_entry_from_pb(e: pb.FQDNCacheEntry, node: str, path: str, now: float) -> FqdnEntry:
    """A cache entry of node's (validated; InvalidArgument naming the field)."""
    if e.node and e.node != node:
        raise InvalidArgument(f"must be empty or the request's node {node!r}", field=f"{path}.node")
    try:
        lookup = e.lookup.ToNanoseconds() / 1e9 if e.HasField("lookup") else now
    except ValueError:  # outside what a Timestamp may hold
        raise InvalidArgument("is not a valid timestamp", field=f"{path}.lookup") from None
    if lookup <= 0:
        raise InvalidArgument("must be after the epoch", field=f"{path}.lookup")
    if lookup > now + MAX_LOOKUP_AHEAD_S:
        raise InvalidArgument(
            f"is more than {MAX_LOOKUP_AHEAD_S} s ahead of this service's clock",
            field=f"{path}.lookup",
        )
    ttl = check_fqdn_ttl(e.ttl, f"{path}.ttl")
    return FqdnEntry(
        node=node,
        endpoint=check_fqdn_endpoint(e.endpoint, f"{path}.endpoint"),
        name=check_fqdn_name(e.name, f"{path}.name"),
        ips=check_fqdn_ips(e.ips, f"{path}.ips"),
        ttl=ttl,
        expires=lookup + ttl,
        lookup=lookup,
    )


def fqdn_entry_pb(e: FqdnEntry) -> pb.FQDNCacheEntry:
    return pb.FQDNCacheEntry(
        node=e.node,
        endpoint=e.endpoint,
        name=e.name,
        ips=list(e.ips),
        ttl=e.ttl,
        lookup=_timestamp(e.lookup),
        expires=_timestamp(e.expires),
        revision=e.revision,
    )


def fqdn_selection_pb(s: Selection) -> pb.FQDNSelection:
    selector = (
        pb.FQDNSelector(match_pattern=s.key) if "*" in s.key else pb.FQDNSelector(match_name=s.key)
    )
    return pb.FQDNSelection(
        selector=selector,
        names=[pb.FQDNName(name=n, ips=list(ips)) for n, ips in s.names.items()],
        identities=list(s.identities),
        rules=list(s.rules),
    )


def config_pb(v: ConfigView) -> pb.RuntimeConfig:
    return pb.RuntimeConfig(
        node=v.node,
        options=[
            pb.ConfigOption(
                name=spec.name,
                value=value,
                default=spec.default,
                mutable=spec.mutable,
                allowed=spec.allowed,
                source=source,
                description=spec.description,
            )
            for spec, value, source in v.options()
        ],
        cluster=v.cluster,
        node_overrides=v.overrides,
        cluster_revision=v.cluster_revision,
        node_revision=v.node_revision,
    )


def config_event_pb(e: ConfigEvent) -> pb.ConfigEvent:
    return pb.ConfigEvent(
        kind=_EVENT_KINDS[e.kind], scope=e.scope, values=e.values or {}, revision=e.revision
    )
