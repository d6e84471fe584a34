"""The JSON forms of a rule and of a CIDR group stored in etcd
(flagella/policy/v1/rules/..., flagella/policy/v1/cidrgroups/...)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flagella.policy.rules.model import (
    CIDRGroup,
    CIDRSpec,
    Expression,
    FQDNSelector,
    PeerSpec,
    PortSpec,
    Protocol,
    Rule,
    RuleSource,
    SelectorSpec,
    ServicePeer,
)
from flagella.policy.selector import Entity


def _selector_json(s: SelectorSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if s.match_labels:
        out["matchLabels"] = dict(s.match_labels)
    if s.match_expressions:
        out["matchExpressions"] = [
            {
                "key": e.key,
                "operator": e.operator,
                **({"values": list(e.values)} if e.values else {}),
            }
            for e in s.match_expressions
        ]
    return out


def _peer_json(p: PeerSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if p.endpoints:
        out["endpoints"] = [_selector_json(s) for s in p.endpoints]
    if p.cidrs:
        out["cidrs"] = [
            {
                **({"group": c.group} if c.group else {"cidr": c.cidr}),
                **({"except": list(c.excepts)} if c.excepts else {}),
            }
            for c in p.cidrs
        ]
    if p.entities:
        out["entities"] = [e.value for e in p.entities]
    if p.to_ports:
        out["toPorts"] = [[_port_json(x) for x in pr] for pr in p.to_ports]
    if p.requires:
        out["requires"] = [_selector_json(s) for s in p.requires]
    if p.services:
        out["services"] = [_service_json(s) for s in p.services]
    if p.action:
        out["action"] = p.action
    if p.name:
        out["name"] = p.name
    if p.fqdns:
        out["fqdns"] = [
            {"matchName": f.match_name} if f.match_name else {"matchPattern": f.match_pattern}
            for f in p.fqdns
        ]
    if p.dns:
        out["dns"] = [
            {"matchName": f.match_name} if f.match_name else {"matchPattern": f.match_pattern}
            for f in p.dns
        ]
    return out


def _service_json(s: ServicePeer) -> dict[str, Any]:
    out: dict[str, Any] = {"namespace": s.namespace} if s.namespace else {}
    if s.selector is None:
        out["name"] = s.name
    else:
        out["selector"] = _selector_json(s.selector)
    return out


def _service_from(d: Mapping[str, Any]) -> ServicePeer:
    sel = d.get("selector")
    return ServicePeer(
        name=d.get("name", ""),
        selector=None if sel is None else _selector_from(sel),
        namespace=d.get("namespace", ""),
    )


def _port_json(x: PortSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"port": x.port, "endPort": x.end_port, "protocol": x.protocol.name}
    if x.name:
        out["name"] = x.name  # absent for numbers: older rules read back the same
    return out


def rule_to_json(rule: Rule) -> bytes:
    doc: dict[str, Any] = {
        "name": rule.name,
        "namespace": rule.namespace,
        "endpointSelector": _selector_json(rule.endpoint_selector),
        "ingress": [_peer_json(p) for p in rule.ingress],
        "ingressDeny": [_peer_json(p) for p in rule.ingress_deny],
        "egress": [_peer_json(p) for p in rule.egress],
        "egressDeny": [_peer_json(p) for p in rule.egress_deny],
        "enforceIngress": rule.enforce_ingress,
        "enforceEgress": rule.enforce_egress,
        "description": rule.description,
        "labels": dict(rule.labels),
        "updatedAt": rule.updated_at,
    }
    if rule.node_selector is not None:
        # Absent for endpoint rules: older rules read back the same.
        doc["nodeSelector"] = _selector_json(rule.node_selector)
    if rule.tier:
        # Absent for the NetworkPolicy tier: older rules read back the same.
        doc["tier"] = rule.tier
        doc["priority"] = rule.priority
    _put_source(doc, rule.source)
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def _selector_from(d: Mapping[str, Any]) -> SelectorSpec:
    return SelectorSpec(
        tuple(sorted(d.get("matchLabels", {}).items())),
        tuple(
            Expression(e["key"], e["operator"], tuple(e.get("values", ())))
            for e in d.get("matchExpressions", ())
        ),
    )


def _peer_from(d: Mapping[str, Any]) -> PeerSpec:
    return PeerSpec(
        tuple(_selector_from(s) for s in d.get("endpoints", ())),
        tuple(
            CIDRSpec(c.get("cidr", ""), tuple(c.get("except", ())), c.get("group", ""))
            for c in d.get("cidrs", ())
        ),
        tuple(Entity(e) for e in d.get("entities", ())),
        tuple(
            tuple(
                PortSpec(x["port"], x["endPort"], Protocol[x["protocol"]], x.get("name", ""))
                for x in pr
            )
            for pr in d.get("toPorts", ())
        ),
        tuple(_selector_from(s) for s in d.get("requires", ())),
        tuple(_service_from(s) for s in d.get("services", ())),
        d.get("action", ""),
        d.get("name", ""),
        tuple(
            FQDNSelector(f.get("matchName", ""), f.get("matchPattern", ""))
            for f in d.get("fqdns", ())
        ),
        tuple(
            FQDNSelector(f.get("matchName", ""), f.get("matchPattern", ""))
            for f in d.get("dns", ())
        ),
    )


def rule_from_json(raw: bytes, *, revision: int = 0, create_revision: int = 0) -> Rule:
    d = json.loads(raw)
    return Rule(
        name=d["name"],
        namespace=d.get("namespace", ""),
        endpoint_selector=_selector_from(d.get("endpointSelector", {})),
        ingress=tuple(_peer_from(p) for p in d.get("ingress", ())),
        ingress_deny=tuple(_peer_from(p) for p in d.get("ingressDeny", ())),
        egress=tuple(_peer_from(p) for p in d.get("egress", ())),
        egress_deny=tuple(_peer_from(p) for p in d.get("egressDeny", ())),
        enforce_ingress=bool(d.get("enforceIngress", False)),
        enforce_egress=bool(d.get("enforceEgress", False)),
        description=d.get("description", ""),
        labels=tuple(sorted(d.get("labels", {}).items())),
        source=_source_from(d),
        tier=d.get("tier", ""),
        priority=int(d.get("priority", 0)),
        revision=revision,
        create_revision=create_revision,
        updated_at=float(d.get("updatedAt", 0.0)),
        node_selector=_selector_from(d["nodeSelector"]) if "nodeSelector" in d else None,
    )


def _put_source(doc: dict[str, Any], source: RuleSource) -> None:
    if source.kubernetes:
        # Absent for what was put by hand: what was stored before sources
        # existed reads back as what it was.
        doc["source"] = {"kind": source.kind, "namespace": source.namespace, "name": source.name}


def _source_from(d: Mapping[str, Any]) -> RuleSource:
    src = d.get("source") or {}
    return RuleSource(src.get("kind", ""), src.get("namespace", ""), src.get("name", ""))


def cidr_group_to_json(group: CIDRGroup) -> bytes:
    doc: dict[str, Any] = {"cidrs": list(group.cidrs), "labels": dict(group.labels)}
    _put_source(doc, group.source)
    return json.dumps(doc, sort_keys=True).encode()


def cidr_group_from_json(name: str, raw: bytes, *, revision: int = 0) -> CIDRGroup:
    d = json.loads(raw)
    return CIDRGroup(
        name=name,
        cidrs=tuple(d.get("cidrs", ())),
        labels=tuple(sorted(d.get("labels", {}).items())),
        revision=revision,
        source=_source_from(d),
    )
