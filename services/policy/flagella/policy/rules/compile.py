"""Compilation of a rule for resolution: its subject selector and one
clause (selectors, ports, verdict) per peer."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from flagella.policy.identities import IPNetwork
from flagella.policy.labels import (
    DEFAULT_SOURCE,
    NAMESPACE_KEY,
    SOURCE_ANY,
    SOURCE_FQDN,
    SOURCE_RESERVED,
)
from flagella.policy.rules.model import (
    ACTION_DENY,
    K8S_DERIVED_LABEL,
    PORT_PROTOCOLS,
    CIDRSpec,
    Direction,
    PortSpec,
    Protocol,
    Rule,
    SelectorSpec,
    Verdict,
)
from flagella.policy.rules.services import ServiceInfo, backend_prefixes
from flagella.policy.rules.validate import parse_network, selector_key
from flagella.policy.selector import (
    WILDCARD,
    CIDRSelector,
    Entity,
    EntitySelector,
    LabelSelector,
    Op,
    Requirement,
    Selector,
)

# (port, end_port, protocol); the port is a str for a named port (end_port
# 0), which stays symbolic: the datapath resolves it per endpoint.
PortKey = tuple[int | str, int, Protocol]
# A Kubernetes ipBlock: its CIDR and excepts.
Block = tuple[IPNetwork, tuple[IPNetwork, ...]]


@dataclass(frozen=True, slots=True)
class Clause:
    """One peer clause of one rule, ready to expand into entries."""

    rule: str
    direction: Direction
    verdict: Verdict
    selectors: tuple[Selector, ...]
    ports: tuple[PortKey, ...]
    # Position in the rule, for traces: e.g. "ingress[0]".
    where: str = ""
    # Its selectors from from/toEndpoints: the ones fromRequires/toRequires
    # narrow (Cilium leaves entities and CIDRs alone).
    endpoint_selectors: frozenset[Selector] = frozenset()
    # With --k8s-ipblock-mode=kubernetes, the clause's ipBlocks when the rule
    # is a Kubernetes NetworkPolicy: they match addresses, pods and nodes
    # included (also in selectors, as strict CIDR selectors); and the host
    # prefixes of its toServices backends (by address only).
    blocks: tuple[Block, ...] = ()
    # An (Baseline)AdminNetworkPolicy gress rule: Allow, Deny or Pass
    # (verdict is then DENY for Deny, ALLOW otherwise); "" elsewhere.
    action: str = ""


@dataclass(frozen=True)
class CompiledRule:
    key: str
    rule: Rule
    subject: LabelSelector
    # May select reserved identities (its selector names a reserved: key).
    selects_reserved: bool
    enforces_ingress: bool
    enforces_egress: bool
    clauses: tuple[Clause, ...]
    peer_selectors: frozenset[Selector] = field(default_factory=frozenset)
    prefixes: frozenset[IPNetwork] = field(default_factory=frozenset)
    # The CIDR groups it references (recompiled when one changes).
    groups: frozenset[str] = field(default_factory=frozenset)
    # fromRequires / toRequires of all its clauses, by direction.
    requires: tuple[tuple[Direction, LabelSelector], ...] = ()
    # A Kubernetes NetworkPolicy with ipBlocks: what it resolves to depends
    # on --k8s-ipblock-mode.
    has_ipblocks: bool = False
    # It has toServices: recompiled when the lb services change.
    has_services: bool = False
    # A host policy: subject is its nodeSelector, matched against nodes'
    # host labels (hostpolicy.py), never against identities.
    host: bool = False
    # Rule.tier and Rule.priority: "" is the NetworkPolicy tier; admin
    # tiers neither enforce a direction nor feed the NetworkPolicy tier's
    # entries (tiers.py evaluates them).
    tier: str = ""
    priority: int = 0
    # toFQDNs selectors (FQDNSelector.key): the addresses learned for
    # matching names get CIDR identities carrying fqdn:<key> labels.
    fqdns: frozenset[str] = field(default_factory=frozenset)
    # rules.dns (FQDNSelector.key): the names its endpoints may look up.
    dns: frozenset[str] = field(default_factory=frozenset)

    def requirements(self, direction: Direction) -> tuple[LabelSelector, ...]:
        return tuple(sel for d, sel in self.requires if d is direction)


def _requirements(spec: SelectorSpec) -> list[Requirement]:
    reqs = []
    for key, value in spec.match_labels:
        source, k = selector_key(key, "")
        reqs.append(Requirement(source, k, Op.IN, (value,)))
    for e in spec.match_expressions:
        source, k = selector_key(e.key, "")
        reqs.append(Requirement(source, k, Op(e.operator), tuple(sorted(set(e.values)))))
    return reqs


def subject_selector(spec: SelectorSpec, namespace: str) -> LabelSelector:
    """A rule's endpointSelector; a namespaced rule only selects endpoints
    of its namespace (the namespace label is set, overriding any other)."""
    reqs = _requirements(spec)
    if namespace:
        reqs = [
            r
            for r in reqs
            if not (r.key == NAMESPACE_KEY and r.source in (DEFAULT_SOURCE, SOURCE_ANY))
        ]
        reqs.append(Requirement(DEFAULT_SOURCE, NAMESPACE_KEY, Op.IN, (namespace,)))
    return LabelSelector.of(reqs)


def peer_selector(spec: SelectorSpec, namespace: str) -> LabelSelector:
    """A from/toEndpoints selector, scoped as Cilium scopes it: in a
    namespaced rule, to the rule's namespace unless the selector names a
    namespace itself or a reserved label; in a cluster-wide rule an empty
    selector means every endpoint of the cluster (every pod namespace)."""
    sel = LabelSelector.of(_requirements(spec))
    if sel.names_source(SOURCE_RESERVED) or sel.has_key(NAMESPACE_KEY):
        return sel
    if namespace:
        return LabelSelector.of(
            [*sel.requirements, Requirement(DEFAULT_SOURCE, NAMESPACE_KEY, Op.IN, (namespace,))]
        )
    if sel.is_empty:
        return LabelSelector.of([Requirement(DEFAULT_SOURCE, NAMESPACE_KEY, Op.EXISTS)])
    return sel


def fqdn_selector(key: str) -> LabelSelector:
    """A toFQDNs selector: the identities labelled fqdn:<key> (the learned
    addresses of the names it matches)."""
    return LabelSelector.of([Requirement(SOURCE_FQDN, key, Op.IN, ("",))])


def _expand_ports(to_ports: tuple[tuple[PortSpec, ...], ...]) -> tuple[PortKey, ...]:
    specs = [p for pr in to_ports for p in pr]
    if not specs:
        return ((0, 0, Protocol.ANY),)
    out: set[PortKey] = set()
    for p in specs:
        if p.name:
            protos = PORT_PROTOCOLS if p.protocol is Protocol.ANY else (p.protocol,)
            out.update((p.name, 0, proto) for proto in protos)
            continue
        end = p.end_port if p.end_port > p.port else 0
        if p.protocol is Protocol.ANY and p.port:
            out.update((p.port, end, proto) for proto in PORT_PROTOCOLS)
        else:
            out.add((p.port, end, p.protocol))
    return tuple(sorted(out, key=_port_order))


def _port_order(k: PortKey) -> tuple[int, int, str, int, int]:
    port = k[0]
    if isinstance(port, str):
        return (1, 0, port, k[1], k[2])
    return (0, port, "", k[1], k[2])


def _cidr_selectors(
    spec: CIDRSpec, groups: Mapping[str, tuple[IPNetwork, ...]], prefixes: set[IPNetwork]
) -> list[Selector]:
    """A CIDR (or every CIDR of a group) minus the exceptions inside it."""
    excepts = [parse_network(e, "") for e in spec.excepts]
    nets = groups.get(spec.group, ()) if spec.group else (parse_network(spec.cidr, ""),)
    out: list[Selector] = []
    for net in nets:
        inside = tuple(
            sorted(
                {e for e in excepts if e.version == net.version and e.subnet_of(net)},  # type: ignore[arg-type]
                key=str,
            )
        )
        prefixes.add(net)
        prefixes.update(inside)
        out.append(CIDRSelector(net, inside))
    return out


def compile_rule(
    rule: Rule,
    cidr_groups: Mapping[str, tuple[IPNetwork, ...]] | None = None,
    *,
    k8s_ipblocks: bool = True,
    services: Sequence[ServiceInfo] = (),
) -> CompiledRule:
    """cidr_groups: the CIDRs of each CIDR group, as they are now (a
    reference to a group not there selects nothing). k8s_ipblocks:
    --k8s-ipblock-mode=kubernetes (Kubernetes NetworkPolicy ipBlocks match
    addresses); off, Cilium's semantics. services: the lb services as they
    are now (toServices selects their backends' addresses)."""
    group_nets = cidr_groups or {}
    ns = rule.namespace
    kubernetes = K8S_DERIVED_LABEL in rule.labels
    # A Kubernetes NetworkPolicy's ipBlocks match addresses (blocks: the
    # resolved policy's prefix entries), pods and nodes included; their
    # prefixes get no CIDR identities (each would be one more peer of every
    # CIDR rule around it), so their CIDR selectors are strict.
    by_address = kubernetes and k8s_ipblocks
    clauses: list[Clause] = []
    prefixes: set[IPNetwork] = set()
    requires: dict[tuple[Direction, LabelSelector], None] = {}
    groups = (
        ("ingress", rule.ingress, Direction.INGRESS, Verdict.ALLOW),
        ("ingressDeny", rule.ingress_deny, Direction.INGRESS, Verdict.DENY),
        ("egress", rule.egress, Direction.EGRESS, Verdict.ALLOW),
        ("egressDeny", rule.egress_deny, Direction.EGRESS, Verdict.DENY),
    )
    for name, peers, direction, verdict in groups:
        for i, peer in enumerate(peers):
            sels: list[Selector] = [peer_selector(s, ns) for s in peer.endpoints]
            endpoint_sels = frozenset(sels)
            requires.update(((direction, peer_selector(s, ns)), None) for s in peer.requires)
            blocks: list[Block] = []
            for c in peer.cidrs:
                if c.group or not (by_address and verdict is Verdict.ALLOW):
                    sels += _cidr_selectors(c, group_nets, prefixes)
                    continue
                net = parse_network(c.cidr, "")
                excepts = tuple(sorted({parse_network(e, "") for e in c.excepts}, key=str))
                sels.append(CIDRSelector(net, excepts, strict=True))
                blocks.append((net, excepts))
            for entity in peer.entities:
                sels.append(WILDCARD if entity is Entity.ALL else EntitySelector(entity))
            # toFQDNs: parsing allows it in egress allow clauses only.
            if verdict is Verdict.ALLOW:
                sels += [fqdn_selector(f.key) for f in peer.fqdns]
            # toServices: each backend by address (parsing allows it in
            # egress allow clauses only).
            if peer.services and verdict is Verdict.ALLOW:
                blocks += [(a, ()) for a in backend_prefixes(peer.services, ns, services)]
            # Ports alone mean any peer; a peer clause whose CIDR groups
            # are empty or missing, or whose services have no backends (or
            # do not exist), selects nothing (never any peer).
            if (
                not (peer.endpoints or peer.cidrs or peer.entities or peer.services or peer.fqdns)
                and peer.to_ports
            ):
                sels.append(WILDCARD)
            if WILDCARD in sels:
                sels = [WILDCARD]
            clause_verdict = verdict
            if peer.action:
                clause_verdict = Verdict.DENY if peer.action == ACTION_DENY else Verdict.ALLOW
            clauses.append(
                Clause(
                    rule=rule.key,
                    direction=direction,
                    verdict=clause_verdict,
                    selectors=tuple(dict.fromkeys(sels)),
                    ports=_expand_ports(peer.to_ports),
                    where=f"{name}[{i}]",
                    endpoint_selectors=endpoint_sels,
                    blocks=tuple(dict.fromkeys(blocks)),
                    action=peer.action,
                )
            )
    if rule.node_selector is not None:
        subject = subject_selector(rule.node_selector, "")
    else:
        subject = subject_selector(rule.endpoint_selector, ns)
    np_tier = not rule.tier
    return CompiledRule(
        key=rule.key,
        rule=rule,
        subject=subject,
        selects_reserved=subject.names_source(SOURCE_RESERVED),
        enforces_ingress=np_tier
        and bool(rule.ingress or rule.ingress_deny or rule.enforce_ingress),
        enforces_egress=np_tier and bool(rule.egress or rule.egress_deny or rule.enforce_egress),
        clauses=tuple(clauses),
        peer_selectors=frozenset(s for c in clauses for s in c.selectors if s is not WILDCARD),
        prefixes=frozenset(p for p in prefixes if p.prefixlen > 0),
        groups=frozenset(c.group for p in rule.peers() for c in p.cidrs if c.group),
        requires=tuple(requires),
        has_ipblocks=kubernetes and any(p.cidrs for p in (*rule.ingress, *rule.egress)),
        has_services=any(p.services for p in rule.peers()),
        host=rule.host,
        tier=rule.tier,
        priority=rule.priority,
        fqdns=frozenset(f.key for p in rule.egress for f in p.fqdns),
        dns=frozenset(f.key for p in rule.egress for f in p.dns),
    )
