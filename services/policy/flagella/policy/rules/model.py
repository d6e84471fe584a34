"""The rule model: FlagellaNetworkPolicy, the core of CiliumNetworkPolicy, as
every input format (documents, the proto API) produces it and the store
keeps it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from flagella.policy.selector import Entity


class Protocol(enum.IntEnum):
    ANY = 0
    ICMP = 1
    TCP = 6
    UDP = 17
    ICMPV6 = 58
    SCTP = 132


# ANY on a given port means each of these (Cilium expands it the same way).
PORT_PROTOCOLS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)
ICMP_PROTOCOLS = (Protocol.ICMP, Protocol.ICMPV6)

# An ICMP type is matched as the port ICMP_TYPE_PORT | type, as the datapath
# keys ICMP packets: port 0 keeps meaning "every type" while type 0 (echo
# reply) stays expressible.
ICMP_TYPE_PORT = 0x100


def icmp_port(icmp_type: int) -> int:
    return ICMP_TYPE_PORT | icmp_type


def icmp_type_of(port: int) -> int | None:
    """The ICMP type an ICMP entry's port stands for; None: every type."""
    return port & 0xFF if port else None


class Direction(enum.IntEnum):
    INGRESS = 1
    EGRESS = 2


class Verdict(enum.IntEnum):
    ALLOW = 1
    DENY = 2


@dataclass(frozen=True, slots=True)
class Expression:
    key: str
    operator: str  # In, NotIn, Exists, DoesNotExist
    values: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SelectorSpec:
    """A label selector as written (keys without a source mean k8s)."""

    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Expression, ...] = ()


@dataclass(frozen=True, slots=True)
class PortSpec:
    port: int = 0
    end_port: int = 0
    protocol: Protocol = Protocol.ANY
    # A named container port (port is then 0): resolved where the pods'
    # ports are known (the datapath), not here.
    name: str = ""


@dataclass(frozen=True, slots=True)
class CIDRSpec:
    """A CIDR with exceptions, or (group set, cidr "") every CIDR of the
    named CIDR group as it is at resolution time (cidrGroupRef), each minus
    the exceptions inside it."""

    cidr: str
    excepts: tuple[str, ...] = ()
    group: str = ""


@dataclass(frozen=True, slots=True)
class RuleSource:
    """Where a rule comes from: the Kubernetes object it was translated
    from (kind, namespace, name; namespace "" for a cluster-scoped kind),
    or, with no kind, the API (`flagella policy import`, PutRules: "by
    hand"). The Kubernetes watchers write only rules of their kind; the API
    cannot change or delete those."""

    kind: str = ""
    namespace: str = ""
    name: str = ""

    @property
    def kubernetes(self) -> bool:
        return bool(self.kind)

    @property
    def object_key(self) -> str:
        """The object's key as the watchers' tables hold it: "namespace/name"."""
        return f"{self.namespace}/{self.name}"


BY_HAND = RuleSource()


@dataclass(frozen=True, slots=True)
class CIDRGroup:
    """A named set of CIDRs rules reference (CiliumCIDRGroup)."""

    name: str
    cidrs: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    revision: int = 0
    # The CiliumCIDRGroup object it was read from (kind set), or by hand.
    source: RuleSource = BY_HAND

    def content(self) -> tuple[object, ...]:
        """What the group says, without its revision."""
        return (self.cidrs, self.labels, self.source)


@dataclass(frozen=True, slots=True)
class ServicePeer:
    """A toServices entry: a service by name (k8sService) or, with a
    selector, every service whose labels it matches (k8sServiceSelector).
    It stands for the services' backend addresses as they are at
    resolution time (rules/services.py)."""

    name: str = ""
    selector: SelectorSpec | None = None
    # "" : the rule's namespace (a cluster-wide rule: any namespace).
    namespace: str = ""


@dataclass(frozen=True, slots=True)
class FQDNSelector:
    """A toFQDNs entry: one name, or a pattern (rules/fqdn.py), canonical
    (lowercase, no trailing dot)."""

    match_name: str = ""
    match_pattern: str = ""

    @property
    def key(self) -> str:
        """What it matches, as one string: the name, or the pattern (a name
        is a pattern without `*`). The fqdn: label of the identities of the
        addresses it selects."""
        return self.match_name or self.match_pattern


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One peer clause: who (endpoints, CIDRs, entities) on which ports. With
    ports only it means any peer on those ports; entirely empty it selects
    nothing (and still makes the direction default-deny)."""

    endpoints: tuple[SelectorSpec, ...] = ()
    cidrs: tuple[CIDRSpec, ...] = ()
    entities: tuple[Entity, ...] = ()
    to_ports: tuple[tuple[PortSpec, ...], ...] = ()
    # fromRequires / toRequires: label selectors every endpoint peer of
    # every rule selecting the same endpoint (in this direction) must also
    # match; they allow nothing by themselves.
    requires: tuple[SelectorSpec, ...] = ()
    # toServices (egress allow only).
    services: tuple[ServicePeer, ...] = ()
    # AdminNetworkPolicy tiers (Rule.tier set): the gress rule's action
    # (ACTION_*) and name; empty for every other rule.
    action: str = ""
    name: str = ""
    # toFQDNs (egress allow only): the addresses the names resolved to, as
    # the nodes' DNS proxies learned them.
    fqdns: tuple[FQDNSelector, ...] = ()
    # rules.dns of its toPorts (egress allow, port 53): the names its
    # endpoints may look up through the node's DNS proxy.
    dns: tuple[FQDNSelector, ...] = ()


# Rule.tier: "" for NetworkPolicies and flagella/Cilium rules (the
# NetworkPolicy tier); an AdminNetworkPolicy is evaluated before them, a
# BaselineAdminNetworkPolicy after them (resolve.py, tiers.py).
TIER_ADMIN = "admin"
TIER_BASELINE = "baseline"
ACTION_ALLOW = "Allow"
ACTION_DENY = "Deny"
ACTION_PASS = "Pass"
ADMIN_ACTIONS = (ACTION_ALLOW, ACTION_DENY, ACTION_PASS)
BASELINE_ACTIONS = (ACTION_ALLOW, ACTION_DENY)
ADMIN_MAX_PRIORITY = 1000
ADMIN_MAX_GRESS_RULES = 100
BASELINE_NAME = "default"


# The label of a rule translated from a Kubernetes NetworkPolicy: its CIDRs
# (ipBlocks) keep Kubernetes' meaning, every address inside them, pods and
# nodes included (unless the policy service runs with
# --k8s-ipblock-mode=cilium). Other rules' CIDRs select CIDR identities
# only (Cilium's semantics: addresses outside the cluster).
K8S_DERIVED_LABEL = ("io.flagella.policy.derived-from", "NetworkPolicy")


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    namespace: str = ""
    endpoint_selector: SelectorSpec = SelectorSpec()
    ingress: tuple[PeerSpec, ...] = ()
    ingress_deny: tuple[PeerSpec, ...] = ()
    egress: tuple[PeerSpec, ...] = ()
    egress_deny: tuple[PeerSpec, ...] = ()
    enforce_ingress: bool = False
    enforce_egress: bool = False
    description: str = ""
    labels: tuple[tuple[str, str], ...] = ()
    source: RuleSource = BY_HAND
    # A host policy (Cilium's nodeSelector, cluster-wide rules only): the
    # rule selects the host endpoint of the nodes whose labels match, not
    # pods (endpoint_selector is then empty and unused).
    node_selector: SelectorSpec | None = None
    # "", TIER_ADMIN or TIER_BASELINE; priority: an AdminNetworkPolicy's
    # (0-1000, lower first).
    tier: str = ""
    priority: int = 0
    # Set by the store.
    revision: int = 0
    create_revision: int = 0
    updated_at: float = 0.0

    @property
    def key(self) -> str:
        """The unique name: namespace/name, or name for a cluster-wide rule;
        a rule from Kubernetes is prefixed with its object's kind
        ("NetworkPolicy/shop/web"), which no name or namespace can start
        with (they are lowercase), so a NetworkPolicy, a
        CiliumNetworkPolicy and a rule imported by hand of the same name
        are three rules."""
        base = f"{self.namespace}/{self.name}" if self.namespace else self.name
        return f"{self.source.kind}/{base}" if self.source.kind else base

    @property
    def host(self) -> bool:
        """A host policy (selects nodes' host endpoints)."""
        return self.node_selector is not None

    def peers(self) -> tuple[PeerSpec, ...]:
        return (*self.ingress, *self.ingress_deny, *self.egress, *self.egress_deny)

    def content(self) -> Rule:
        """The rule without what the store sets, for comparisons."""
        return Rule(
            name=self.name,
            namespace=self.namespace,
            endpoint_selector=self.endpoint_selector,
            ingress=self.ingress,
            ingress_deny=self.ingress_deny,
            egress=self.egress,
            egress_deny=self.egress_deny,
            enforce_ingress=self.enforce_ingress,
            enforce_egress=self.enforce_egress,
            description=self.description,
            labels=self.labels,
            source=self.source,
            node_selector=self.node_selector,
            tier=self.tier,
            priority=self.priority,
        )
