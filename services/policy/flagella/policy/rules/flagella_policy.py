"""FlagellaNetworkPolicy documents (and CiliumNetworkPolicy /
CiliumClusterwideNetworkPolicy, which have the same fields)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flagella.policy.rules.fields import (
    Doc,
    parse_cidr_spec,
    parse_metadata,
    parse_ports,
    parse_selector,
)
from flagella.policy.rules.fqdn import (
    DNS_EGRESS_ONLY,
    DNS_PORT_ONLY,
    has_dns_port,
    parse_dns_rules,
)
from flagella.policy.rules.fqdn import parse_selectors as parse_fqdn_selectors
from flagella.policy.rules.icmp import parse_icmps
from flagella.policy.rules.model import (
    CIDRSpec,
    Direction,
    FQDNSelector,
    PeerSpec,
    Protocol,
    Rule,
    SelectorSpec,
)
from flagella.policy.rules.services import parse_to_services
from flagella.policy.rules.validate import (
    ENTITY_NAMES,
    check_cidr,
    fail,
    join,
    masked_cidr,
)
from flagella.policy.selector import Entity


def _cidr_list(value: Any, path: str, warnings: list[str] | None) -> list[CIDRSpec]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        out.append(CIDRSpec(masked_cidr(Doc.string(raw, p), p, warnings)))
    return out


def _cidr_set(value: Any, path: str, warnings: list[str] | None) -> list[CIDRSpec]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw, p)
        Doc.only(
            obj,
            p,
            ("cidr", "cidrGroupRef", "except"),
            cidrGroupSelector="CIDR group selectors are not supported; use cidrGroupRef",
        )
        if ("cidr" in obj) == ("cidrGroupRef" in obj):
            raise fail(f"{p}.cidr", "give exactly one of cidr and cidrGroupRef")
        if "cidrGroupRef" in obj:
            excepts = tuple(
                Doc.string(e, f"{p}.except[{j}]")
                for j, e in enumerate(Doc.seq(obj.get("except"), f"{p}.except"))
            )
            spec = CIDRSpec("", excepts, Doc.string(obj["cidrGroupRef"], f"{p}.cidrGroupRef"))
            out.append(
                check_cidr(spec, p, cidr_field="cidr", except_field="except", warnings=warnings)
            )
        else:
            out.append(parse_cidr_spec(obj, p, warnings))
    return out


def _entities(value: Any, path: str) -> tuple[Entity, ...]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        name = Doc.string(raw, f"{path}[{i}]")
        if name not in ENTITY_NAMES:
            raise fail(
                f"{path}[{i}]",
                f"unknown entity {name!r} ({', '.join(sorted(ENTITY_NAMES))})",
            )
        out.append(ENTITY_NAMES[name])
    return tuple(out)


_UNSUPPORTED_PEER = {
    "toFQDNs": "toFQDNs is an egress field",
    "toServices": "toServices is an egress field",
    "fromGroups": "groups are not supported",
    "toGroups": "groups are not supported",
    "fromNodes": "node selectors are not supported",
    "toNodes": "node selectors are not supported",
    "authentication": "authentication is not supported",
}


# Backend addresses are prefix entries, which only ever allow (an identity's
# deny beats them; nothing denies by address): a deny cannot be exact.
_DENY_SERVICES = (
    "toServices cannot deny: a service's backends are matched by address, and "
    "addresses only allow; deny their pods by toEndpoints instead"
)


# As Cilium: a name's addresses are learned from the answers the proxy lets
# through, so they can only be allowed.
_DENY_FQDNS = "toFQDNs cannot deny; deny the addresses by toCIDR or the lookups by DNS rules"


def _peer_doc(
    value: Any, path: str, direction: Direction, warnings: list[str] | None, *, deny: bool = False
) -> PeerSpec:
    obj = Doc.mapping(value if value is not None else {}, path)
    pre = "from" if direction is Direction.INGRESS else "to"
    fields: tuple[str, ...] = (
        f"{pre}Endpoints",
        f"{pre}CIDR",
        f"{pre}CIDRSet",
        f"{pre}Entities",
        f"{pre}Requires",
        "toPorts",
        "icmps",
    )
    if direction is Direction.EGRESS and not deny:
        fields += ("toServices", "toFQDNs")
    hints = dict(_UNSUPPORTED_PEER)
    if deny:
        hints["toServices"] = _DENY_SERVICES
        hints["toFQDNs"] = _DENY_FQDNS
    Doc.only(obj, path, fields, **hints)
    endpoints = tuple(
        parse_selector(raw, f"{path}.{pre}Endpoints[{i}]")
        for i, raw in enumerate(Doc.seq(obj.get(f"{pre}Endpoints"), f"{path}.{pre}Endpoints"))
    )
    cidrs = _cidr_list(obj.get(f"{pre}CIDR"), f"{path}.{pre}CIDR", warnings)
    cidrs += _cidr_set(obj.get(f"{pre}CIDRSet"), f"{path}.{pre}CIDRSet", warnings)
    entities = _entities(obj.get(f"{pre}Entities"), f"{path}.{pre}Entities")
    to_ports = []
    dns: list[FQDNSelector] = []
    for i, raw in enumerate(Doc.seq(obj.get("toPorts"), f"{path}.toPorts")):
        p = f"{path}.toPorts[{i}]"
        pr = Doc.mapping(raw, p)
        Doc.only(
            pr,
            p,
            ("ports", "rules"),
            originatingTLS="TLS interception is not supported",
            terminatingTLS="TLS interception is not supported",
            serverNames="server names are not supported",
            listener="listeners are not supported",
        )
        to_ports.append(parse_ports(pr.get("ports"), f"{p}.ports", default_protocol=Protocol.ANY))
        if "rules" in pr:
            # DNS rules (the only L7 rules): egress allow clauses, port 53.
            if direction is not Direction.EGRESS or deny:
                raise fail(f"{p}.rules", DNS_EGRESS_ONLY)
            if not has_dns_port(to_ports[-1]):
                raise fail(f"{p}.rules", DNS_PORT_ONLY)
            dns += parse_dns_rules(pr["rules"], f"{p}.rules")
    # ICMP types join the clause's ports: the clause allows (or denies) both.
    if icmps := parse_icmps(obj.get("icmps"), f"{path}.icmps"):
        to_ports.append(icmps)
    requires = tuple(
        parse_selector(raw, f"{path}.{pre}Requires[{i}]")
        for i, raw in enumerate(Doc.seq(obj.get(f"{pre}Requires"), f"{path}.{pre}Requires"))
    )
    services = parse_to_services(obj.get("toServices"), f"{path}.toServices")
    fqdns = parse_fqdn_selectors(obj.get("toFQDNs"), f"{path}.toFQDNs")
    return PeerSpec(
        endpoints,
        tuple(cidrs),
        entities,
        tuple(to_ports),
        requires,
        services,
        fqdns=fqdns,
        dns=tuple(dict.fromkeys(dns)),
    )


def parse_flagella_policy(
    obj: Mapping[str, Any],
    path: str,
    *,
    cluster_wide: bool = False,
    warnings: list[str] | None = None,
) -> Rule:
    """A FlagellaNetworkPolicy (or CiliumNetworkPolicy /
    CiliumClusterwideNetworkPolicy, same fields). CIDRs with host bits are
    masked, with a warning appended to warnings."""
    Doc.only(obj, path, ("apiVersion", "kind", "metadata", "spec", "status"))
    name, namespace, labels = parse_metadata(obj, path)
    if cluster_wide:
        namespace = ""
    sp = join(path, "spec")
    if "spec" not in obj:
        raise fail(sp, "required")
    spec = Doc.mapping(obj["spec"], sp)
    Doc.only(
        spec,
        sp,
        (
            "endpointSelector",
            "nodeSelector",
            "ingress",
            "ingressDeny",
            "egress",
            "egressDeny",
            "description",
        ),
        enableDefaultDeny="enableDefaultDeny is not supported",
        labels="rule labels go in metadata.labels",
    )
    node_selector = None
    if "nodeSelector" in spec:
        # A host policy (Cilium's rule: cluster-wide, and nodes or pods,
        # never both).
        if "endpointSelector" in spec:
            raise fail(f"{sp}.nodeSelector", "give endpointSelector or nodeSelector, not both")
        if namespace:
            raise fail(
                f"{sp}.nodeSelector",
                "a nodeSelector (host policy) needs a cluster-wide rule "
                "(no metadata.namespace; CiliumClusterwideNetworkPolicy)",
            )
        node_selector = parse_selector(spec["nodeSelector"], f"{sp}.nodeSelector")
        selector = SelectorSpec()
    elif "endpointSelector" not in spec:
        raise fail(f"{sp}.endpointSelector", "required (or nodeSelector for a host policy)")
    else:
        selector = parse_selector(spec["endpointSelector"], f"{sp}.endpointSelector")

    def peers(fld: str, direction: Direction) -> tuple[PeerSpec, ...]:
        return tuple(
            _peer_doc(raw, f"{sp}.{fld}[{i}]", direction, warnings, deny=fld.endswith("Deny"))
            for i, raw in enumerate(Doc.seq(spec.get(fld), f"{sp}.{fld}"))
        )

    description = Doc.string(spec.get("description") or "", f"{sp}.description")
    return Rule(
        name=name,
        namespace=namespace,
        endpoint_selector=selector,
        ingress=peers("ingress", Direction.INGRESS),
        ingress_deny=peers("ingressDeny", Direction.INGRESS),
        egress=peers("egress", Direction.EGRESS),
        egress_deny=peers("egressDeny", Direction.EGRESS),
        description=description,
        labels=labels,
        node_selector=node_selector,
    )
