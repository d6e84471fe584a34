"""The rule model (FlagellaNetworkPolicy, the core of CiliumNetworkPolicy),
parsing of YAML/JSON documents (FlagellaNetworkPolicy, CiliumNetworkPolicy,
CiliumClusterwideNetworkPolicy, Kubernetes NetworkPolicy, List), the
Kubernetes NetworkPolicy translation, the JSON form stored in etcd, and
compilation into selectors and clauses for resolution.

Every validation error is an InvalidArgument whose field is the path into
the document, e.g. ``spec.ingress[0].toPorts[0].ports[0].port``.
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from flagella.common.errors import InvalidArgument
from flagella.policy.identities import IPNetwork
from flagella.policy.labels import (
    DEFAULT_SOURCE,
    NAMESPACE_KEY,
    NAMESPACE_LABELS_PREFIX,
    SOURCE_ANY,
    SOURCE_CIDR,
    SOURCE_RESERVED,
    LabelError,
    check_key,
    check_value,
    split_label,
)
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


class Protocol(enum.IntEnum):
    ANY = 0
    ICMP = 1
    TCP = 6
    UDP = 17
    SCTP = 132


# ANY on a given port means each of these (Cilium expands it the same way).
PORT_PROTOCOLS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)


class Direction(enum.IntEnum):
    INGRESS = 1
    EGRESS = 2


class Verdict(enum.IntEnum):
    ALLOW = 1
    DENY = 2


# --- the model ---


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


@dataclass(frozen=True, slots=True)
class CIDRSpec:
    cidr: str
    excepts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One peer clause: who (endpoints, CIDRs, entities) on which ports. With
    ports only it means any peer on those ports; entirely empty it selects
    nothing (and still makes the direction default-deny)."""

    endpoints: tuple[SelectorSpec, ...] = ()
    cidrs: tuple[CIDRSpec, ...] = ()
    entities: tuple[Entity, ...] = ()
    to_ports: tuple[tuple[PortSpec, ...], ...] = ()


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
    # Set by the store.
    revision: int = 0
    create_revision: int = 0
    updated_at: float = 0.0

    @property
    def key(self) -> str:
        """The unique name: namespace/name, or name for a cluster-wide rule."""
        return f"{self.namespace}/{self.name}" if self.namespace else self.name

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
        )


MAX_RULES_PER_PUT = 100

# --- validation helpers (shared by the document and proto paths) ---

_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_NAMESPACE_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ENTITY_NAMES = {e.value: e for e in Entity}
PROTOCOL_NAMES = {
    "TCP": Protocol.TCP,
    "UDP": Protocol.UDP,
    "SCTP": Protocol.SCTP,
    "ANY": Protocol.ANY,
}


def fail(path: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, field=path or "document")


def check_name(value: str, path: str) -> None:
    if not value:
        raise fail(path, "required")
    if not _NAME_RE.match(value):
        raise fail(path, f"{value!r} is not a valid name (lowercase DNS subdomain)")


def check_namespace(value: str, path: str) -> None:
    if value and not _NAMESPACE_RE.match(value):
        raise fail(path, f"{value!r} is not a valid namespace (lowercase DNS label)")


def selector_key(text: str, path: str) -> tuple[str, str]:
    """(source, key) of a selector key: "app" is k8s:app, "reserved:host",
    "any:app" matches any source."""
    source, key, value = split_label(text)
    if value:
        raise fail(path, f"invalid selector key {text!r}: '=' is not allowed")
    source = source or DEFAULT_SOURCE
    if source == SOURCE_CIDR:
        raise fail(path, "cidr labels cannot be selected here: use fromCIDR/toCIDR")
    try:
        check_key(key)
    except LabelError as exc:
        raise fail(path, str(exc)) from None
    return source, key


def check_label_value(value: str, path: str) -> None:
    try:
        check_value(value)
    except LabelError as exc:
        raise fail(path, str(exc)) from None


def check_selector(spec: SelectorSpec, path: str, *, labels_path: str, exprs_path: str) -> None:
    for key, value in spec.match_labels:
        selector_key(key, f"{path}.{labels_path}[{key}]" if path else labels_path)
        check_label_value(value, f"{path}.{labels_path}[{key}]")
    for i, expr in enumerate(spec.match_expressions):
        p = f"{path}.{exprs_path}[{i}]"
        selector_key(expr.key, f"{p}.key")
        if expr.operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise fail(
                f"{p}.operator",
                f"unknown operator {expr.operator!r} (In, NotIn, Exists, DoesNotExist)",
            )
        if expr.operator in ("In", "NotIn") and not expr.values:
            raise fail(f"{p}.values", f"operator {expr.operator} needs at least one value")
        if expr.operator in ("Exists", "DoesNotExist") and expr.values:
            raise fail(f"{p}.values", f"operator {expr.operator} takes no values")
        for j, value in enumerate(expr.values):
            check_label_value(value, f"{p}.values[{j}]")


def parse_network(text: str, path: str) -> IPNetwork:
    if not isinstance(text, str) or not text:
        raise fail(path, "expected a CIDR such as 10.0.0.0/8")
    try:
        if "/" not in text:
            addr = ipaddress.ip_address(text)
            return ipaddress.ip_network(f"{addr}/{addr.max_prefixlen}")
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        raise fail(path, f"{text!r} is not a valid CIDR ({exc})") from None


def check_cidr(spec: CIDRSpec, path: str, *, cidr_field: str, except_field: str) -> None:
    net = parse_network(spec.cidr, f"{path}.{cidr_field}" if cidr_field else path)
    for i, text in enumerate(spec.excepts):
        p = f"{path}.{except_field}[{i}]"
        exc_net = parse_network(text, p)
        if exc_net.version != net.version or not exc_net.subnet_of(net):  # type: ignore[arg-type]
            raise fail(p, f"{text} is not inside {net}")


def check_port(spec: PortSpec, path: str, *, end_field: str = "endPort") -> None:
    if not 0 <= spec.port <= 65535:
        raise fail(f"{path}.port", f"port {spec.port} out of range (0-65535)")
    if spec.end_port:
        if not 0 <= spec.end_port <= 65535:
            raise fail(f"{path}.{end_field}", f"end port {spec.end_port} out of range (0-65535)")
        if spec.port == 0:
            raise fail(f"{path}.{end_field}", "a port range needs a start port")
        if spec.end_port < spec.port:
            raise fail(f"{path}.{end_field}", f"end port {spec.end_port} is below port {spec.port}")
    if spec.protocol is Protocol.ICMP and (spec.port or spec.end_port):
        raise fail(f"{path}.protocol", "ICMP takes no port")


# --- documents ---


class _Doc:
    """Typed access to a parsed YAML/JSON object with paths for errors."""

    @staticmethod
    def mapping(value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise fail(path, f"expected an object, got {_type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise fail(path, f"keys must be strings, got {key!r}")
        return value

    @staticmethod
    def seq(value: Any, path: str) -> Sequence[Any]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise fail(path, f"expected a list, got {_type_name(value)}")
        return value

    @staticmethod
    def string(value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise fail(path, f"expected a string, got {_type_name(value)}")
        return value

    @staticmethod
    def only(obj: Mapping[str, Any], path: str, allowed: Iterable[str], **hints: str) -> None:
        allowed = set(allowed)
        for key in obj:
            if key not in allowed:
                hint = hints.get(key.replace("-", "_"), "")
                where = f"{path}.{key}" if path else key
                raise fail(where, f"unknown field{': ' + hint if hint else ''}")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _selector_doc(value: Any, path: str) -> SelectorSpec:
    obj = _Doc.mapping(value if value is not None else {}, path)
    _Doc.only(obj, path, ("matchLabels", "matchExpressions"))
    labels_raw = _Doc.mapping(obj.get("matchLabels") or {}, _join(path, "matchLabels"))
    labels = []
    for key, raw_value in labels_raw.items():
        p = f"{_join(path, 'matchLabels')}[{key}]"
        if isinstance(raw_value, bool | int | float):
            raise fail(p, f"label values must be strings, got {_type_name(raw_value)}")
        labels.append((key, _Doc.string("" if raw_value is None else raw_value, p)))
    exprs = []
    for i, raw in enumerate(_Doc.seq(obj.get("matchExpressions"), _join(path, "matchExpressions"))):
        p = f"{_join(path, 'matchExpressions')}[{i}]"
        e = _Doc.mapping(raw, p)
        _Doc.only(e, p, ("key", "operator", "values"))
        if "key" not in e:
            raise fail(f"{p}.key", "required")
        if "operator" not in e:
            raise fail(f"{p}.operator", "required")
        values = tuple(
            _Doc.string(v, f"{p}.values[{j}]")
            for j, v in enumerate(_Doc.seq(e.get("values"), f"{p}.values"))
        )
        exprs.append(
            Expression(
                _Doc.string(e["key"], f"{p}.key"),
                _Doc.string(e["operator"], f"{p}.operator"),
                values,
            )
        )
    spec = SelectorSpec(tuple(sorted(labels)), tuple(exprs))
    check_selector(spec, path, labels_path="matchLabels", exprs_path="matchExpressions")
    return spec


def _port_number(value: Any, path: str) -> int:
    if isinstance(value, bool):
        raise fail(path, "expected a port number")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.isdigit():
            return int(value)
        if value:
            raise fail(path, f"named port {value!r} is not supported; use a number")
    raise fail(path, f"expected a port number, got {_type_name(value)}")


def _ports_doc(value: Any, path: str, *, default_protocol: Protocol) -> tuple[PortSpec, ...]:
    out = []
    for i, raw in enumerate(_Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = _Doc.mapping(raw, p)
        _Doc.only(obj, p, ("port", "endPort", "protocol"))
        port = _port_number(obj["port"], f"{p}.port") if obj.get("port") is not None else 0
        end = _port_number(obj["endPort"], f"{p}.endPort") if obj.get("endPort") is not None else 0
        proto = default_protocol
        if obj.get("protocol") is not None:
            name = _Doc.string(obj["protocol"], f"{p}.protocol")
            if name.upper() not in PROTOCOL_NAMES:
                raise fail(f"{p}.protocol", f"unknown protocol {name!r} (TCP, UDP, SCTP, ANY)")
            proto = PROTOCOL_NAMES[name.upper()]
        spec = PortSpec(port, end, proto)
        check_port(spec, p)
        out.append(spec)
    return tuple(out)


def _cidr_list(value: Any, path: str) -> list[CIDRSpec]:
    out = []
    for i, raw in enumerate(_Doc.seq(value, path)):
        p = f"{path}[{i}]"
        text = _Doc.string(raw, p)
        parse_network(text, p)
        out.append(CIDRSpec(text))
    return out


def _cidr_set(value: Any, path: str) -> list[CIDRSpec]:
    out = []
    for i, raw in enumerate(_Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = _Doc.mapping(raw, p)
        _Doc.only(obj, p, ("cidr", "except"), cidrGroupRef="CIDR groups are not supported")
        if "cidr" not in obj:
            raise fail(f"{p}.cidr", "required")
        spec = CIDRSpec(
            _Doc.string(obj["cidr"], f"{p}.cidr"),
            tuple(
                _Doc.string(e, f"{p}.except[{j}]")
                for j, e in enumerate(_Doc.seq(obj.get("except"), f"{p}.except"))
            ),
        )
        check_cidr(spec, p, cidr_field="cidr", except_field="except")
        out.append(spec)
    return out


def _entities(value: Any, path: str) -> tuple[Entity, ...]:
    out = []
    for i, raw in enumerate(_Doc.seq(value, path)):
        name = _Doc.string(raw, f"{path}[{i}]")
        if name not in ENTITY_NAMES:
            raise fail(
                f"{path}[{i}]",
                f"unknown entity {name!r} ({', '.join(sorted(ENTITY_NAMES))})",
            )
        out.append(ENTITY_NAMES[name])
    return tuple(out)


_UNSUPPORTED_PEER = {
    "fromRequires": "fromRequires is not supported",
    "toRequires": "toRequires is not supported",
    "toFQDNs": "FQDN rules are not supported",
    "toServices": "toServices is not supported",
    "fromGroups": "groups are not supported",
    "toGroups": "groups are not supported",
    "fromNodes": "node selectors are not supported",
    "toNodes": "node selectors are not supported",
    "icmps": "ICMP type rules are not supported; use protocol ICMP in the proto API",
    "authentication": "authentication is not supported",
}


def _peer_doc(value: Any, path: str, direction: Direction) -> PeerSpec:
    obj = _Doc.mapping(value if value is not None else {}, path)
    pre = "from" if direction is Direction.INGRESS else "to"
    fields = (f"{pre}Endpoints", f"{pre}CIDR", f"{pre}CIDRSet", f"{pre}Entities", "toPorts")
    _Doc.only(obj, path, fields, **_UNSUPPORTED_PEER)
    endpoints = tuple(
        _selector_doc(raw, f"{path}.{pre}Endpoints[{i}]")
        for i, raw in enumerate(_Doc.seq(obj.get(f"{pre}Endpoints"), f"{path}.{pre}Endpoints"))
    )
    cidrs = _cidr_list(obj.get(f"{pre}CIDR"), f"{path}.{pre}CIDR")
    cidrs += _cidr_set(obj.get(f"{pre}CIDRSet"), f"{path}.{pre}CIDRSet")
    entities = _entities(obj.get(f"{pre}Entities"), f"{path}.{pre}Entities")
    to_ports = []
    for i, raw in enumerate(_Doc.seq(obj.get("toPorts"), f"{path}.toPorts")):
        p = f"{path}.toPorts[{i}]"
        pr = _Doc.mapping(raw, p)
        _Doc.only(
            pr,
            p,
            ("ports",),
            rules="L7 rules are not supported",
            originatingTLS="TLS interception is not supported",
            terminatingTLS="TLS interception is not supported",
            serverNames="server names are not supported",
            listener="listeners are not supported",
        )
        to_ports.append(_ports_doc(pr.get("ports"), f"{p}.ports", default_protocol=Protocol.ANY))
    return PeerSpec(endpoints, tuple(cidrs), entities, tuple(to_ports))


def _metadata(obj: Mapping[str, Any], path: str) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    meta = _Doc.mapping(obj.get("metadata"), _join(path, "metadata"))
    mp = _join(path, "metadata")
    name = _Doc.string(meta.get("name", ""), f"{mp}.name")
    check_name(name, f"{mp}.name")
    namespace = meta.get("namespace") or ""
    namespace = _Doc.string(namespace, f"{mp}.namespace")
    check_namespace(namespace, f"{mp}.namespace")
    labels = _Doc.mapping(meta.get("labels") or {}, f"{mp}.labels")
    pairs = tuple(sorted((k, _Doc.string(v, f"{mp}.labels[{k}]")) for k, v in labels.items()))
    return name, namespace, pairs


def parse_flagella_policy(obj: Mapping[str, Any], path: str, *, cluster_wide: bool = False) -> Rule:
    """A FlagellaNetworkPolicy (or CiliumNetworkPolicy /
    CiliumClusterwideNetworkPolicy, same fields)."""
    _Doc.only(obj, path, ("apiVersion", "kind", "metadata", "spec", "status"))
    name, namespace, labels = _metadata(obj, path)
    if cluster_wide:
        namespace = ""
    sp = _join(path, "spec")
    if "spec" not in obj:
        raise fail(sp, "required")
    spec = _Doc.mapping(obj["spec"], sp)
    _Doc.only(
        spec,
        sp,
        ("endpointSelector", "ingress", "ingressDeny", "egress", "egressDeny", "description"),
        nodeSelector="node selectors (host policies) are not supported",
        enableDefaultDeny="enableDefaultDeny is not supported",
        labels="rule labels go in metadata.labels",
    )
    if "endpointSelector" not in spec:
        raise fail(f"{sp}.endpointSelector", "required")
    selector = _selector_doc(spec["endpointSelector"], f"{sp}.endpointSelector")

    def peers(fld: str, direction: Direction) -> tuple[PeerSpec, ...]:
        return tuple(
            _peer_doc(raw, f"{sp}.{fld}[{i}]", direction)
            for i, raw in enumerate(_Doc.seq(spec.get(fld), f"{sp}.{fld}"))
        )

    description = _Doc.string(spec.get("description") or "", f"{sp}.description")
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
    )


# --- Kubernetes NetworkPolicy ---

K8S_NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _k8s_label_selector(value: Any, path: str) -> SelectorSpec:
    """A Kubernetes LabelSelector; its keys are plain label keys."""
    spec = _selector_doc(value, path)
    for key, _ in spec.match_labels:
        if ":" in key:
            raise fail(f"{path}.matchLabels[{key}]", f"invalid label key {key!r}")
    for i, expr in enumerate(spec.match_expressions):
        if ":" in expr.key:
            raise fail(f"{path}.matchExpressions[{i}].key", f"invalid label key {expr.key!r}")
    return spec


def _namespace_selector(ns: SelectorSpec) -> SelectorSpec:
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


def _k8s_peer(raw: Any, path: str) -> tuple[SelectorSpec | None, CIDRSpec | None]:
    obj = _Doc.mapping(raw, path)
    _Doc.only(obj, path, ("podSelector", "namespaceSelector", "ipBlock"))
    if "ipBlock" in obj:
        if "podSelector" in obj or "namespaceSelector" in obj:
            raise fail(
                f"{path}.ipBlock", "ipBlock cannot be combined with pod or namespace selectors"
            )
        bp = f"{path}.ipBlock"
        block = _Doc.mapping(obj["ipBlock"], bp)
        _Doc.only(block, bp, ("cidr", "except"))
        if "cidr" not in block:
            raise fail(f"{bp}.cidr", "required")
        spec = CIDRSpec(
            _Doc.string(block["cidr"], f"{bp}.cidr"),
            tuple(
                _Doc.string(e, f"{bp}.except[{j}]")
                for j, e in enumerate(_Doc.seq(block.get("except"), f"{bp}.except"))
            ),
        )
        check_cidr(spec, bp, cidr_field="cidr", except_field="except")
        return None, spec
    if "podSelector" not in obj and "namespaceSelector" not in obj:
        raise fail(path, "a peer needs podSelector, namespaceSelector or ipBlock")
    pod = _k8s_label_selector(obj.get("podSelector") or {}, f"{path}.podSelector")
    if "namespaceSelector" not in obj:
        return pod, None  # same namespace: added when compiled
    ns = _namespace_selector(
        _k8s_label_selector(obj.get("namespaceSelector") or {}, f"{path}.namespaceSelector")
    )
    return (
        SelectorSpec(
            tuple(sorted(pod.match_labels + ns.match_labels)),
            pod.match_expressions + ns.match_expressions,
        ),
        None,
    )


def _k8s_rules(value: Any, path: str, peer_field: str) -> tuple[PeerSpec, ...]:
    out = []
    for i, raw in enumerate(_Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = _Doc.mapping(raw if raw is not None else {}, p)
        _Doc.only(obj, p, (peer_field, "ports"))
        ports = _ports_doc(obj.get("ports"), f"{p}.ports", default_protocol=Protocol.TCP)
        for j, port in enumerate(ports):
            if port.protocol is Protocol.ANY:
                raise fail(f"{p}.ports[{j}].protocol", "must be TCP, UDP or SCTP")
        to_ports = (ports,) if ports else ()
        raw_peers = _Doc.seq(obj.get(peer_field), f"{p}.{peer_field}")
        if not raw_peers:
            # No peers: every source/destination, inside or outside.
            out.append(PeerSpec(entities=(Entity.ALL,), to_ports=to_ports))
            continue
        endpoints: list[SelectorSpec] = []
        cidrs: list[CIDRSpec] = []
        for j, peer in enumerate(raw_peers):
            sel, cidr = _k8s_peer(peer, f"{p}.{peer_field}[{j}]")
            if sel is not None:
                endpoints.append(sel)
            if cidr is not None:
                cidrs.append(cidr)
        out.append(PeerSpec(tuple(endpoints), tuple(cidrs), (), to_ports))
    return tuple(out)


def parse_k8s_network_policy(obj: Mapping[str, Any], path: str) -> Rule:
    """Translates a networking.k8s.io/v1 NetworkPolicy as Cilium does."""
    _Doc.only(obj, path, ("apiVersion", "kind", "metadata", "spec", "status"))
    name, namespace, labels = _metadata(obj, path)
    namespace = namespace or "default"
    sp = _join(path, "spec")
    spec = _Doc.mapping(obj.get("spec"), sp)
    _Doc.only(spec, sp, ("podSelector", "policyTypes", "ingress", "egress"))
    if "podSelector" not in spec:
        raise fail(f"{sp}.podSelector", "required")
    selector = _k8s_label_selector(spec.get("podSelector") or {}, f"{sp}.podSelector")
    ingress = _k8s_rules(spec.get("ingress"), f"{sp}.ingress", "from")
    egress = _k8s_rules(spec.get("egress"), f"{sp}.egress", "to")
    if "policyTypes" in spec and spec["policyTypes"] is not None:
        types = set()
        for i, raw in enumerate(_Doc.seq(spec["policyTypes"], f"{sp}.policyTypes")):
            t = _Doc.string(raw, f"{sp}.policyTypes[{i}]")
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
        labels=tuple(sorted({*labels, ("io.flagella.policy.derived-from", "NetworkPolicy")})),
    )


_KINDS: dict[tuple[str, str], Callable[[Mapping[str, Any], str], Rule]] = {
    ("flagella.io/v1", "FlagellaNetworkPolicy"): parse_flagella_policy,
    ("cilium.io/v2", "CiliumNetworkPolicy"): parse_flagella_policy,
    ("cilium.io/v2", "CiliumClusterwideNetworkPolicy"): lambda o, p: parse_flagella_policy(
        o, p, cluster_wide=True
    ),
    ("networking.k8s.io/v1", "NetworkPolicy"): parse_k8s_network_policy,
}


def _object(value: Any, path: str, out: list[tuple[str, Rule]]) -> None:
    obj = _Doc.mapping(value, path)
    kind = obj.get("kind")
    api = obj.get("apiVersion")
    if kind == "List" or (isinstance(kind, str) and kind.endswith("List") and "items" in obj):
        for i, item in enumerate(_Doc.seq(obj.get("items"), _join(path, "items"))):
            _object(item, f"{_join(path, 'items')}[{i}]", out)
        return
    parser = _KINDS.get((api, kind)) if isinstance(api, str) and isinstance(kind, str) else None
    if parser is None:
        where = _join(path, "kind") if "kind" in obj else _join(path, "apiVersion")
        raise fail(
            where,
            f"apiVersion {api!r} kind {kind!r} is neither a FlagellaNetworkPolicy "
            "(flagella.io/v1) nor a Kubernetes NetworkPolicy (networking.k8s.io/v1)",
        )
    out.append((path, parser(obj, path)))


_BaseLoader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _StrictLoader(_BaseLoader):  # type: ignore[misc]
    """Safe YAML that refuses a key given twice in one mapping (PyYAML would
    silently keep the last one, e.g. of two policies pasted together)."""


def _strict_mapping(loader: Any, node: Any, deep: bool = False) -> Any:
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:
            continue  # unhashable: construct_mapping reports it
        if duplicate:
            raise yaml.constructor.ConstructorError(
                "while constructing a mapping",
                node.start_mark,
                f"duplicate key {key!r}",
                key_node.start_mark,
            )
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def parse_document(text: str) -> list[Rule]:
    """Every rule in a YAML or JSON document (several YAML documents, a
    List, or a top-level list of objects). Validates everything; raises
    InvalidArgument naming the path of the first problem."""
    try:
        docs = [d for d in yaml.load_all(text, Loader=_StrictLoader) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise InvalidArgument(
            f"not valid YAML or JSON{where}: {problem}", field="document"
        ) from None
    if not docs:
        raise InvalidArgument("no policy in the document", field="document")
    found: list[tuple[str, Rule]] = []
    for i, doc in enumerate(docs):
        prefix = f"[{i}]" if len(docs) > 1 else ""
        if isinstance(doc, list):
            for j, item in enumerate(doc):
                _object(item, f"{prefix}[{j}]", found)
        else:
            _object(doc, prefix, found)
    check_unique(found)
    return [rule for _, rule in found]


def check_unique(found: Sequence[tuple[str, Rule]]) -> None:
    if len(found) > MAX_RULES_PER_PUT:
        raise InvalidArgument(
            f"{len(found)} rules in one put; at most {MAX_RULES_PER_PUT}", field="document"
        )
    seen: set[str] = set()
    for path, rule in found:
        if rule.key in seen:
            raise fail(_join(path, "metadata.name"), f"rule {rule.key!r} appears twice")
        seen.add(rule.key)


# --- stored form (JSON in etcd) ---


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
            {"cidr": c.cidr, **({"except": list(c.excepts)} if c.excepts else {})} for c in p.cidrs
        ]
    if p.entities:
        out["entities"] = [e.value for e in p.entities]
    if p.to_ports:
        out["toPorts"] = [
            [{"port": x.port, "endPort": x.end_port, "protocol": x.protocol.name} for x in pr]
            for pr in p.to_ports
        ]
    return out


def rule_to_json(rule: Rule) -> bytes:
    doc = {
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
        tuple(CIDRSpec(c["cidr"], tuple(c.get("except", ()))) for c in d.get("cidrs", ())),
        tuple(Entity(e) for e in d.get("entities", ())),
        tuple(
            tuple(PortSpec(x["port"], x["endPort"], Protocol[x["protocol"]]) for x in pr)
            for pr in d.get("toPorts", ())
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
        revision=revision,
        create_revision=create_revision,
        updated_at=float(d.get("updatedAt", 0.0)),
    )


# --- compilation: selectors and clauses for resolution ---

PortKey = tuple[int, int, Protocol]  # (port, end_port, protocol)


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


def _expand_ports(to_ports: tuple[tuple[PortSpec, ...], ...]) -> tuple[PortKey, ...]:
    specs = [p for pr in to_ports for p in pr]
    if not specs:
        return ((0, 0, Protocol.ANY),)
    out: set[PortKey] = set()
    for p in specs:
        end = p.end_port if p.end_port > p.port else 0
        if p.protocol is Protocol.ANY and p.port:
            out.update((p.port, end, proto) for proto in PORT_PROTOCOLS)
        else:
            out.add((p.port, end, p.protocol))
    return tuple(sorted(out))


def compile_rule(rule: Rule) -> CompiledRule:
    ns = rule.namespace
    clauses: list[Clause] = []
    prefixes: set[IPNetwork] = set()
    groups = (
        ("ingress", rule.ingress, Direction.INGRESS, Verdict.ALLOW),
        ("ingressDeny", rule.ingress_deny, Direction.INGRESS, Verdict.DENY),
        ("egress", rule.egress, Direction.EGRESS, Verdict.ALLOW),
        ("egressDeny", rule.egress_deny, Direction.EGRESS, Verdict.DENY),
    )
    for name, peers, direction, verdict in groups:
        for i, peer in enumerate(peers):
            sels: list[Selector] = [peer_selector(s, ns) for s in peer.endpoints]
            for c in peer.cidrs:
                net = parse_network(c.cidr, "")
                excepts = tuple(sorted({parse_network(e, "") for e in c.excepts}, key=str))
                prefixes.add(net)
                prefixes.update(excepts)
                sels.append(CIDRSelector(net, excepts))
            for entity in peer.entities:
                sels.append(WILDCARD if entity is Entity.ALL else EntitySelector(entity))
            if not sels and peer.to_ports:
                sels.append(WILDCARD)
            if WILDCARD in sels:
                sels = [WILDCARD]
            clauses.append(
                Clause(
                    rule=rule.key,
                    direction=direction,
                    verdict=verdict,
                    selectors=tuple(dict.fromkeys(sels)),
                    ports=_expand_ports(peer.to_ports),
                    where=f"{name}[{i}]",
                )
            )
    subject = subject_selector(rule.endpoint_selector, ns)
    return CompiledRule(
        key=rule.key,
        rule=rule,
        subject=subject,
        selects_reserved=subject.names_source(SOURCE_RESERVED),
        enforces_ingress=bool(rule.ingress or rule.ingress_deny or rule.enforce_ingress),
        enforces_egress=bool(rule.egress or rule.egress_deny or rule.enforce_egress),
        clauses=tuple(clauses),
        peer_selectors=frozenset(s for c in clauses for s in c.selectors if s is not WILDCARD),
        prefixes=frozenset(p for p in prefixes if p.prefixlen > 0),
    )
