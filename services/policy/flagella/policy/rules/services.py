"""toServices: egress to the backends of services, by name or by label.

A toServices entry stands for the backend addresses of the services it
names, as the lb service holds them at resolution time: each address is a
host prefix of the clause (Clause.blocks), so the resolved policy allows it
by address (prefix entries, prefixes.py) whatever the backend's identity.
Policy applies after service translation (the datapath judges egress to a
ClusterIP at its backend), so allowing the backends allows the service.

Which services an entry selects (Cilium's matching): a Kubernetes Service is
one lb service per port and cluster IP ("ns/web:http", "ns/web:80:ipv6");
its name is the part of the lb name after the namespace and before the
first ":". k8sService matches that name; k8sServiceSelector matches the
service's labels. The namespace, when not given, is the rule's; in a
cluster-wide rule, any namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from flagella.policy.identities import IPNetwork
from flagella.policy.labels import DEFAULT_SOURCE, SOURCE_ANY
from flagella.policy.rules.fields import Doc, parse_selector
from flagella.policy.rules.model import SelectorSpec, ServicePeer
from flagella.policy.rules.validate import check_name, check_namespace, fail, selector_key


@dataclass(frozen=True, slots=True)
class ServiceInfo:
    """What toServices needs of one lb service."""

    namespace: str
    # The Kubernetes Service name (see the module docstring).
    name: str
    labels: tuple[tuple[str, str], ...] = ()
    # Host prefixes of its backends, every state (a terminating backend
    # keeps its connections).
    addresses: tuple[IPNetwork, ...] = ()


def service_name(lb_name: str) -> str:
    """The Kubernetes Service name of an lb service key."""
    return lb_name.rpartition("/")[2].partition(":")[0]


# --- parsing and checks ---


def check_service_peer(
    peer: ServicePeer, path: str, *, name_field: str, selector_field: str
) -> None:
    """Exactly one of name and selector; a valid name, namespace and
    selector (on Kubernetes labels: a service has no other)."""
    if bool(peer.name) == (peer.selector is not None):
        raise fail(path, f"give exactly one of {name_field} and {selector_field}")
    if peer.selector is None:
        check_name(peer.name, f"{path}.{name_field}")
    else:
        sel = peer.selector
        keys = [(f"matchLabels[{k}]", k) for k, _ in sel.match_labels]
        keys += [(f"matchExpressions[{i}].key", e.key) for i, e in enumerate(sel.match_expressions)]
        for where, key in keys:
            source, _ = selector_key(key, f"{path}.{selector_field}.{where}")
            if source not in (DEFAULT_SOURCE, SOURCE_ANY):
                raise fail(
                    f"{path}.{selector_field}.{where}",
                    f"services have Kubernetes labels only, not {source!r} ones",
                )


def parse_to_services(value: Any, path: str) -> tuple[ServicePeer, ...]:
    """A CiliumNetworkPolicy toServices list."""
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw, p)
        Doc.only(obj, p, ("k8sService", "k8sServiceSelector"))
        if ("k8sService" in obj) == ("k8sServiceSelector" in obj):
            raise fail(p, "give exactly one of k8sService and k8sServiceSelector")
        if "k8sService" in obj:
            sp = f"{p}.k8sService"
            svc = Doc.mapping(obj["k8sService"], sp)
            Doc.only(svc, sp, ("serviceName", "namespace"))
            name = Doc.string(svc.get("serviceName") or "", f"{sp}.serviceName")
            if not name:
                raise fail(f"{sp}.serviceName", "required")
            peer = ServicePeer(
                name=name, namespace=Doc.string(svc.get("namespace") or "", f"{sp}.namespace")
            )
            check_name(name, f"{sp}.serviceName")
        else:
            sp = f"{p}.k8sServiceSelector"
            svc = Doc.mapping(obj["k8sServiceSelector"], sp)
            Doc.only(svc, sp, ("selector", "namespace"))
            if "selector" not in svc:
                raise fail(f"{sp}.selector", "required")
            selector = parse_selector(svc["selector"], f"{sp}.selector")
            peer = ServicePeer(
                selector=selector,
                namespace=Doc.string(svc.get("namespace") or "", f"{sp}.namespace"),
            )
            check_service_peer(peer, sp, name_field="serviceName", selector_field="selector")
        check_namespace(peer.namespace, f"{sp}.namespace")
        out.append(peer)
    return tuple(out)


# --- matching ---


def _selects(spec: SelectorSpec, labels: Mapping[str, str]) -> bool:
    for key, value in spec.match_labels:
        if labels.get(selector_key(key, "")[1]) != value:
            return False
    for e in spec.match_expressions:
        key = selector_key(e.key, "")[1]
        present = key in labels
        ok = {
            "In": present and labels.get(key) in e.values,
            "NotIn": not present or labels.get(key) not in e.values,
            "Exists": present,
            "DoesNotExist": not present,
        }.get(e.operator, False)
        if not ok:
            return False
    return True


def matches(peer: ServicePeer, rule_namespace: str, svc: ServiceInfo) -> bool:
    namespace = peer.namespace or rule_namespace
    if namespace and svc.namespace != namespace:
        return False
    if peer.selector is None:
        return svc.name == peer.name
    return _selects(peer.selector, dict(svc.labels))


def backend_prefixes(
    peers: Iterable[ServicePeer], rule_namespace: str, services: Iterable[ServiceInfo]
) -> tuple[IPNetwork, ...]:
    """The backend addresses of the services the peers select, now."""
    peers = tuple(peers)
    found: set[IPNetwork] = set()
    for svc in services:
        if any(matches(p, rule_namespace, svc) for p in peers):
            found.update(svc.addresses)
    return tuple(sorted(found, key=lambda n: (n.version, n)))
