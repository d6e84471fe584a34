"""Kubernetes NetworkPolicy (networking.k8s.io/v1), translated into a rule
as Cilium translates it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flagella.policy.labels import NAMESPACE_KEY, NAMESPACE_LABELS_PREFIX
from flagella.policy.rules.fields import (
    Doc,
    parse_cidr_spec,
    parse_metadata,
    parse_ports,
    parse_selector,
)
from flagella.policy.rules.model import (
    K8S_DERIVED_LABEL,
    CIDRSpec,
    Expression,
    PeerSpec,
    Protocol,
    Rule,
    SelectorSpec,
)
from flagella.policy.rules.validate import fail, join
from flagella.policy.selector import Entity

K8S_NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def k8s_label_selector(value: Any, path: str) -> SelectorSpec:
    """A Kubernetes LabelSelector; its keys are plain label keys."""
    spec = parse_selector(value, path)
    for key, _ in spec.match_labels:
        if ":" in key:
            raise fail(f"{path}.matchLabels[{key}]", f"invalid label key {key!r}")
    for i, expr in enumerate(spec.match_expressions):
        if ":" in expr.key:
            raise fail(f"{path}.matchExpressions[{i}].key", f"invalid label key {expr.key!r}")
    return spec


def namespace_selector(ns: SelectorSpec) -> SelectorSpec:
    """A Kubernetes namespaceSelector as requirements on the pod's
    namespace labels (io.cilium.k8s.namespace.labels.<key>); the namespace
    name label maps onto the namespace itself. Always requires the pod
    namespace label to exist, so no same-namespace scoping is added."""
    labels: list[tuple[str, str]] = []
    exprs: list[Expression] = [Expression(NAMESPACE_KEY, "Exists")]
    for key, value in ns.match_labels:
        if key == K8S_NAMESPACE_NAME_LABEL:
            labels.append((NAMESPACE_KEY, value))
        else:
            labels.append((NAMESPACE_LABELS_PREFIX + key, value))
    for e in ns.match_expressions:
        key = (
            NAMESPACE_KEY if e.key == K8S_NAMESPACE_NAME_LABEL else NAMESPACE_LABELS_PREFIX + e.key
        )
        exprs.append(Expression(key, e.operator, e.values))
    return SelectorSpec(tuple(labels), tuple(exprs))


def _k8s_peer(
    raw: Any, path: str, warnings: list[str] | None
) -> tuple[SelectorSpec | None, CIDRSpec | None]:
    obj = Doc.mapping(raw, path)
    Doc.only(obj, path, ("podSelector", "namespaceSelector", "ipBlock"))
    if "ipBlock" in obj:
        if "podSelector" in obj or "namespaceSelector" in obj:
            raise fail(
                f"{path}.ipBlock", "ipBlock cannot be combined with pod or namespace selectors"
            )
        bp = f"{path}.ipBlock"
        block = Doc.mapping(obj["ipBlock"], bp)
        Doc.only(block, bp, ("cidr", "except"))
        return None, parse_cidr_spec(block, bp, warnings)
    if "podSelector" not in obj and "namespaceSelector" not in obj:
        raise fail(path, "a peer needs podSelector, namespaceSelector or ipBlock")
    pod = k8s_label_selector(obj.get("podSelector") or {}, f"{path}.podSelector")
    if "namespaceSelector" not in obj:
        return pod, None  # same namespace: added when compiled
    ns = namespace_selector(
        k8s_label_selector(obj.get("namespaceSelector") or {}, f"{path}.namespaceSelector")
    )
    return (
        SelectorSpec(
            tuple(sorted(pod.match_labels + ns.match_labels)),
            pod.match_expressions + ns.match_expressions,
        ),
        None,
    )


def _k8s_rules(
    value: Any, path: str, peer_field: str, warnings: list[str] | None
) -> tuple[PeerSpec, ...]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw if raw is not None else {}, p)
        Doc.only(obj, p, (peer_field, "ports"))
        ports = parse_ports(obj.get("ports"), f"{p}.ports", default_protocol=Protocol.TCP)
        for j, port in enumerate(ports):
            if port.protocol is Protocol.ANY:
                raise fail(f"{p}.ports[{j}].protocol", "must be TCP, UDP or SCTP")
        to_ports = (ports,) if ports else ()
        raw_peers = Doc.seq(obj.get(peer_field), f"{p}.{peer_field}")
        if not raw_peers:
            # No peers: every source/destination, inside or outside.
            out.append(PeerSpec(entities=(Entity.ALL,), to_ports=to_ports))
            continue
        endpoints: list[SelectorSpec] = []
        cidrs: list[CIDRSpec] = []
        for j, peer in enumerate(raw_peers):
            sel, cidr = _k8s_peer(peer, f"{p}.{peer_field}[{j}]", warnings)
            if sel is not None:
                endpoints.append(sel)
            if cidr is not None:
                cidrs.append(cidr)
        out.append(PeerSpec(tuple(endpoints), tuple(cidrs), (), to_ports))
    return tuple(out)


def parse_k8s_network_policy(
    obj: Mapping[str, Any], path: str, *, warnings: list[str] | None = None
) -> Rule:
    """Translates a networking.k8s.io/v1 NetworkPolicy as Cilium does, but
    for ipBlocks, which keep Kubernetes' meaning (the rule's
    K8S_DERIVED_LABEL says so). CIDRs with host bits are masked, with a
    warning appended to warnings."""
    Doc.only(obj, path, ("apiVersion", "kind", "metadata", "spec", "status"))
    name, namespace, labels = parse_metadata(obj, path)
    namespace = namespace or "default"
    sp = join(path, "spec")
    spec = Doc.mapping(obj.get("spec"), sp)
    Doc.only(spec, sp, ("podSelector", "policyTypes", "ingress", "egress"))
    if "podSelector" not in spec:
        raise fail(f"{sp}.podSelector", "required")
    selector = k8s_label_selector(spec.get("podSelector") or {}, f"{sp}.podSelector")
    ingress = _k8s_rules(spec.get("ingress"), f"{sp}.ingress", "from", warnings)
    egress = _k8s_rules(spec.get("egress"), f"{sp}.egress", "to", warnings)
    if "policyTypes" in spec and spec["policyTypes"] is not None:
        types = set()
        for i, raw in enumerate(Doc.seq(spec["policyTypes"], f"{sp}.policyTypes")):
            t = Doc.string(raw, f"{sp}.policyTypes[{i}]")
            if t not in ("Ingress", "Egress"):
                raise fail(f"{sp}.policyTypes[{i}]", f"unknown policy type {t!r} (Ingress, Egress)")
            types.add(t)
    else:
        # Kubernetes' default: Ingress always, Egress when egress rules exist.
        types = {"Ingress"} | ({"Egress"} if egress else set())
    enforce_in = "Ingress" in types
    enforce_out = "Egress" in types
    return Rule(
        name=name,
        namespace=namespace,
        endpoint_selector=selector,
        ingress=ingress if enforce_in else (),
        egress=egress if enforce_out else (),
        enforce_ingress=enforce_in,
        enforce_egress=enforce_out,
        description=f"Kubernetes NetworkPolicy {namespace}/{name}",
        labels=tuple(sorted({*labels, K8S_DERIVED_LABEL})),
    )
