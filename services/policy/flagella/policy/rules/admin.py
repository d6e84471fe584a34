"""AdminNetworkPolicy and BaselineAdminNetworkPolicy
(policy.networking.k8s.io/v1alpha1, sig-network's network-policy-api),
translated into cluster-wide rules of the admin and baseline tiers
(Rule.tier); resolve.py and tiers.py evaluate them around the
NetworkPolicy tier."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flagella.policy.rules.fields import Doc, parse_metadata
from flagella.policy.rules.k8s import k8s_label_selector, namespace_selector
from flagella.policy.rules.model import (
    ADMIN_ACTIONS,
    ADMIN_MAX_GRESS_RULES,
    ADMIN_MAX_PRIORITY,
    BASELINE_ACTIONS,
    BASELINE_NAME,
    TIER_ADMIN,
    TIER_BASELINE,
    PeerSpec,
    PortSpec,
    Protocol,
    Rule,
    SelectorSpec,
)
from flagella.policy.rules.validate import fail, join

API_VERSION = "policy.networking.k8s.io/v1alpha1"
_PROTOCOLS = {"TCP": Protocol.TCP, "UDP": Protocol.UDP, "SCTP": Protocol.SCTP}
_MAX_PEERS = 100
_MAX_RULE_NAME = 100


def _pods(value: Any, path: str) -> SelectorSpec:
    """{namespaceSelector, podSelector}: both required, as upstream."""
    obj = Doc.mapping(value, path)
    Doc.only(obj, path, ("namespaceSelector", "podSelector"))
    for key in ("namespaceSelector", "podSelector"):
        if key not in obj:
            raise fail(f"{path}.{key}", "required")
    ns = namespace_selector(
        k8s_label_selector(obj["namespaceSelector"] or {}, f"{path}.namespaceSelector")
    )
    pod = k8s_label_selector(obj["podSelector"] or {}, f"{path}.podSelector")
    return SelectorSpec(
        tuple(sorted(pod.match_labels + ns.match_labels)),
        pod.match_expressions + ns.match_expressions,
    )


def _one_of(obj: Mapping[str, Any], path: str, keys: tuple[str, ...]) -> str:
    present = [k for k in keys if k in obj]
    if len(present) != 1:
        raise fail(path, f"exactly one of {', '.join(keys)} is required")
    return present[0]


def _subject(value: Any, path: str) -> SelectorSpec:
    obj = Doc.mapping(value, path)
    Doc.only(obj, path, ("namespaces", "pods"))
    key = _one_of(obj, path, ("namespaces", "pods"))
    if key == "pods":
        return _pods(obj["pods"], f"{path}.pods")
    return namespace_selector(k8s_label_selector(obj["namespaces"] or {}, f"{path}.namespaces"))


def _peer(value: Any, path: str, egress: bool) -> SelectorSpec:
    obj = Doc.mapping(value, path)
    kinds = ("namespaces", "pods", "nodes", "networks") if egress else ("namespaces", "pods")
    Doc.only(obj, path, kinds)
    key = _one_of(obj, path, kinds)
    if key in ("nodes", "networks"):
        # Nodes carry no labels in flagella's identities, and networks
        # would need prefix entries of their own tier: refused, not
        # ignored (ignoring a Deny would open what it closes).
        raise fail(f"{path}.{key}", f"{key} peers are not supported by flagella")
    if key == "pods":
        return _pods(obj["pods"], f"{path}.pods")
    return namespace_selector(k8s_label_selector(obj["namespaces"] or {}, f"{path}.namespaces"))


def _port_value(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise fail(path, f"expected a port number 1-65535, got {value!r}")
    return value


def _protocol(obj: Mapping[str, Any], path: str) -> Protocol:
    name = Doc.string(obj.get("protocol", "TCP"), f"{path}.protocol")
    if name not in _PROTOCOLS:
        raise fail(f"{path}.protocol", f"unknown protocol {name!r} (TCP, UDP, SCTP)")
    return _PROTOCOLS[name]


def _ports(value: Any, path: str) -> tuple[PortSpec, ...]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw, p)
        Doc.only(obj, p, ("portNumber", "namedPort", "portRange"))
        key = _one_of(obj, p, ("portNumber", "namedPort", "portRange"))
        if key == "namedPort":
            # A name's number is known per endpoint in the datapath only;
            # the tiers are evaluated over port numbers here.
            raise fail(f"{p}.namedPort", "named ports in admin network policies are not supported")
        kp = f"{p}.{key}"
        spec = Doc.mapping(obj[key], kp)
        if key == "portNumber":
            Doc.only(spec, kp, ("protocol", "port"))
            if "port" not in spec:
                raise fail(f"{kp}.port", "required")
            out.append(PortSpec(_port_value(spec["port"], f"{kp}.port"), 0, _protocol(spec, kp)))
            continue
        Doc.only(spec, kp, ("protocol", "start", "end"))
        for f in ("start", "end"):
            if f not in spec:
                raise fail(f"{kp}.{f}", "required")
        start = _port_value(spec["start"], f"{kp}.start")
        end = _port_value(spec["end"], f"{kp}.end")
        if end <= start:
            raise fail(f"{kp}.end", f"end {end} must be greater than start {start}")
        out.append(PortSpec(start, end, _protocol(spec, kp)))
    return tuple(out)


def _gress(value: Any, path: str, egress: bool, actions: tuple[str, ...]) -> tuple[PeerSpec, ...]:
    items = Doc.seq(value, path)
    if len(items) > ADMIN_MAX_GRESS_RULES:
        raise fail(path, f"at most {ADMIN_MAX_GRESS_RULES} rules, got {len(items)}")
    peer_field = "to" if egress else "from"
    out = []
    for i, raw in enumerate(items):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw, p)
        Doc.only(obj, p, ("name", "action", peer_field, "ports"))
        name = Doc.string(obj.get("name", ""), f"{p}.name")
        if len(name) > _MAX_RULE_NAME:
            raise fail(f"{p}.name", f"at most {_MAX_RULE_NAME} characters")
        if "action" not in obj:
            raise fail(f"{p}.action", "required")
        action = Doc.string(obj["action"], f"{p}.action")
        if action not in actions:
            raise fail(f"{p}.action", f"unknown action {action!r} ({', '.join(actions)})")
        peers = Doc.seq(obj.get(peer_field), f"{p}.{peer_field}")
        if not 1 <= len(peers) <= _MAX_PEERS:
            raise fail(f"{p}.{peer_field}", f"1 to {_MAX_PEERS} peers required")
        endpoints = tuple(_peer(x, f"{p}.{peer_field}[{j}]", egress) for j, x in enumerate(peers))
        ports = _ports(obj.get("ports"), f"{p}.ports")
        out.append(
            PeerSpec(
                endpoints=endpoints, to_ports=(ports,) if ports else (), action=action, name=name
            )
        )
    return tuple(out)


def parse_admin_network_policy(
    obj: Mapping[str, Any], path: str, *, baseline: bool = False
) -> Rule:
    """An AdminNetworkPolicy (baseline False) or a
    BaselineAdminNetworkPolicy: cluster-scoped, one rule of the tier."""
    kind = "BaselineAdminNetworkPolicy" if baseline else "AdminNetworkPolicy"
    Doc.only(obj, path, ("apiVersion", "kind", "metadata", "spec", "status"))
    name, namespace, labels = parse_metadata(obj, path)
    mp = join(path, "metadata")
    if namespace:
        raise fail(f"{mp}.namespace", f"a {kind} is cluster-scoped")
    if baseline and name != BASELINE_NAME:
        raise fail(f"{mp}.name", f"a {kind} is a singleton named {BASELINE_NAME!r}")
    sp = join(path, "spec")
    spec = Doc.mapping(obj.get("spec"), sp)
    allowed = ("subject", "ingress", "egress") + (() if baseline else ("priority",))
    Doc.only(spec, sp, allowed)
    priority = 0
    if not baseline:
        if "priority" not in spec:
            raise fail(f"{sp}.priority", "required")
        priority = spec["priority"]
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not 0 <= priority <= ADMIN_MAX_PRIORITY
        ):
            raise fail(f"{sp}.priority", f"priority {priority!r} out of range (0-1000)")
    if "subject" not in spec:
        raise fail(f"{sp}.subject", "required")
    actions = BASELINE_ACTIONS if baseline else ADMIN_ACTIONS
    return Rule(
        name=name,
        endpoint_selector=_subject(spec["subject"], f"{sp}.subject"),
        ingress=_gress(spec.get("ingress"), f"{sp}.ingress", False, actions),
        egress=_gress(spec.get("egress"), f"{sp}.egress", True, actions),
        description=f"Kubernetes {kind} {name}",
        labels=labels,
        tier=TIER_BASELINE if baseline else TIER_ADMIN,
        priority=priority,
    )


def check_admin_rule(rule: Rule, path: str) -> None:
    """What the document parser guarantees, for a rule given as a proto
    (PutRules): fields named as the proto names them."""
    peers = (("ingress", rule.ingress), ("egress", rule.egress))
    denies = (("ingress_deny", rule.ingress_deny), ("egress_deny", rule.egress_deny))
    if not rule.tier:
        for fld, items in (*peers, *denies):
            for i, p in enumerate(items):
                if p.action:
                    raise fail(
                        f"{path}.{fld}[{i}].action", "only rules of an admin tier have actions"
                    )
        return
    baseline = rule.tier == TIER_BASELINE
    if rule.namespace:
        raise fail(f"{path}.namespace", "admin tiers are cluster-wide")
    if baseline and rule.name != BASELINE_NAME:
        raise fail(f"{path}.name", f"the baseline is a singleton named {BASELINE_NAME!r}")
    if baseline and rule.priority:
        raise fail(f"{path}.priority", "the baseline has no priority")
    if not 0 <= rule.priority <= ADMIN_MAX_PRIORITY:
        raise fail(f"{path}.priority", f"priority {rule.priority} out of range (0-1000)")
    for fld, items in denies:
        if items:
            raise fail(f"{path}.{fld}", "admin tiers say Deny with an action")
    if rule.enforce_ingress or rule.enforce_egress:
        raise fail(f"{path}.enforce_ingress", "admin tiers enforce no direction")
    actions = BASELINE_ACTIONS if baseline else ADMIN_ACTIONS
    for fld, items in peers:
        if len(items) > ADMIN_MAX_GRESS_RULES:
            raise fail(f"{path}.{fld}", f"at most {ADMIN_MAX_GRESS_RULES} rules")
        for i, p in enumerate(items):
            pp = f"{path}.{fld}[{i}]"
            if p.action not in actions:
                raise fail(f"{pp}.action", f"one of {', '.join(actions)} is required")
            if not p.endpoints or p.cidrs or p.entities or p.requires:
                raise fail(f"{pp}.endpoints", "admin peers are endpoint selectors only")
            for j, pr in enumerate(p.to_ports):
                for k, port in enumerate(pr):
                    where = f"{pp}.to_ports[{j}].ports[{k}]"
                    if port.name:
                        raise fail(f"{where}.name", "named ports in admin tiers are not supported")
                    if port.protocol not in _PROTOCOLS.values() or not port.port:
                        raise fail(where, "a port number with TCP, UDP or SCTP is required")
