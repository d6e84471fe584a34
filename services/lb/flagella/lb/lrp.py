"""Local redirect policies (Cilium's CiliumLocalRedirectPolicy): the domain
model, its JSON form in etcd, and its validation (every error names the
field by its path in the request, under `lrp.`).

A policy redirects a frontend (an address and ports, or a service of the
policy's namespace by name) to pods of that namespace selected by labels,
on the client's own node only. The lb service stores and streams policies;
each datapath picks its own local backends (docs/lb.md, "Local redirect
policy").
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flagella.common.errors import InvalidArgument
from flagella.common.portnames import port_name_error
from flagella.lb import selector as sel
from flagella.lb.ciliumdoc import cilium_object, doc_list, doc_object
from flagella.lb.model import Protocol
from flagella.lb.selector import Requirement
from flagella.lb.validation import NAMESPACE_RE, SHORT_NAME_RE, check_ip, check_port

MAX_PORTS = 32
MAX_DESCRIPTION = 1024


@dataclass(frozen=True, slots=True)
class LrpPort:
    name: str
    port: int
    protocol: Protocol


@dataclass(frozen=True)
class Lrp:
    """A local redirect policy, validated and canonical. Exactly one of
    address (addressMatcher) and service (serviceMatcher) is set."""

    namespace: str
    name: str
    address: str = ""
    service: str = ""
    frontend_ports: tuple[LrpPort, ...] = ()
    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()
    backend_ports: tuple[LrpPort, ...] = ()
    description: str = ""
    # "api", or "kubernetes" (a CiliumLocalRedirectPolicy: flagella.lb.lrpk8s).
    source: str = "api"
    # etcd mod revision (not stored in the value).
    revision: int = field(default=0, compare=False)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def to_json(self) -> bytes:
        def ports(ps: Sequence[LrpPort]) -> list[dict[str, Any]]:
            return [{"name": p.name, "port": p.port, "protocol": p.protocol.value} for p in ps]

        doc = {
            "namespace": self.namespace,
            "name": self.name,
            "address": self.address,
            "service": self.service,
            "frontend_ports": ports(self.frontend_ports),
            "match_labels": dict(self.match_labels),
            "match_expressions": sel.requirements_to_doc(self.match_expressions),
            "backend_ports": ports(self.backend_ports),
            "description": self.description,
        }
        if self.source != "api":
            doc["source"] = self.source
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int = 0) -> Lrp:
        doc = json.loads(raw)

        def ports(items: Sequence[Mapping[str, Any]]) -> tuple[LrpPort, ...]:
            return tuple(LrpPort(p["name"], int(p["port"]), Protocol(p["protocol"])) for p in items)

        return cls(
            namespace=doc["namespace"],
            name=doc["name"],
            address=doc.get("address", ""),
            service=doc.get("service", ""),
            frontend_ports=ports(doc.get("frontend_ports", ())),
            match_labels=tuple(sorted(doc.get("match_labels", {}).items())),
            match_expressions=sel.requirements_from_doc(doc.get("match_expressions", ())),
            backend_ports=ports(doc.get("backend_ports", ())),
            description=doc.get("description", ""),
            source=doc.get("source", "api"),
            revision=revision,
        )


# --- validation ---


@dataclass(frozen=True)
class RawLrp:
    """A request's policy as plain values (protocols already decoded; None:
    unspecified, which means TCP)."""

    namespace: str
    name: str
    matcher: str  # "address_matcher", "service_matcher" or "" (none given)
    address: str = ""
    service: str = ""
    service_namespace: str = ""
    frontend_ports: Sequence[tuple[str, int, Protocol | None]] = ()
    match_labels: Mapping[str, str] = field(default_factory=dict)
    match_expressions: Sequence[tuple[str, str, Sequence[str]]] = ()
    backend_ports: Sequence[tuple[str, int, Protocol | None]] = ()
    skip_redirect_from_backend: bool = False
    description: str = ""
    has_backend: bool = True
    has_selector: bool = True
    source: str = "api"


def validate_key(namespace: str, name: str, prefix: str = "lrp.") -> None:
    if not NAMESPACE_RE.match(namespace):
        raise InvalidArgument(
            f"{namespace!r} is not a namespace (lowercase letters, digits and '-', at most 63)",
            field=f"{prefix}namespace",
        )
    if not SHORT_NAME_RE.match(name) or ":" in name or "/" in name:
        raise InvalidArgument(
            f"{name!r} is not a policy name (lowercase letters, digits, '-', '.', at most 253)",
            field=f"{prefix}name",
        )


def _ports(
    items: Sequence[tuple[str, int, Protocol | None]], path: str, *, required: bool
) -> tuple[LrpPort, ...]:
    if required and not items:
        raise InvalidArgument("at least one port is required", field=path)
    if len(items) > MAX_PORTS:
        raise InvalidArgument(f"at most {MAX_PORTS} ports", field=path)
    out: list[LrpPort] = []
    for i, (name, port, protocol) in enumerate(items):
        at = f"{path}[{i}]"
        if name and (why := port_name_error(name)):
            raise InvalidArgument(why, field=f"{at}.name")
        if len(items) > 1 and not name:
            raise InvalidArgument("ports must be named when there are several", field=f"{at}.name")
        p = LrpPort(name, check_port(port, f"{at}.port"), protocol or Protocol.TCP)
        for q in out:
            if name and q.name == name:
                raise InvalidArgument(f"port name {name!r} is used twice", field=f"{at}.name")
            if (q.port, q.protocol) == (p.port, p.protocol):
                raise InvalidArgument(
                    f"{p.port}/{p.protocol.value} is listed twice", field=f"{at}.port"
                )
        out.append(p)
    return tuple(out)


def backend_port_for(fe: LrpPort, backends: Sequence[LrpPort]) -> LrpPort | None:
    """The backend port a frontend port goes to: the one of its name, or the
    only one. None: no such port."""
    if fe.name:
        named = [b for b in backends if b.name == fe.name]
        if named:
            return named[0]
    return backends[0] if len(backends) == 1 else None


def build_lrp(raw: RawLrp) -> Lrp:
    """Validate raw into a canonical Lrp. Raises InvalidArgument naming the
    field."""
    validate_key(raw.namespace, raw.name)
    if len(raw.description) > MAX_DESCRIPTION:
        raise InvalidArgument(f"at most {MAX_DESCRIPTION} characters", field="lrp.description")
    if raw.skip_redirect_from_backend:
        raise InvalidArgument(
            "not supported: the backends' own traffic to the frontend would be redirected too",
            field="lrp.skip_redirect_from_backend",
        )
    fe_path = "lrp.redirect_frontend"
    address = service = ""
    if raw.matcher == "address_matcher":
        path = f"{fe_path}.address_matcher"
        address = str(check_ip(raw.address, f"{path}.ip"))
        fe_ports = _ports(raw.frontend_ports, f"{path}.to_ports", required=True)
    elif raw.matcher == "service_matcher":
        path = f"{fe_path}.service_matcher"
        if raw.service_namespace not in ("", raw.namespace):
            raise InvalidArgument(
                f"must be the policy's namespace {raw.namespace!r}", field=f"{path}.namespace"
            )
        if not SHORT_NAME_RE.match(raw.service) or ":" in raw.service:
            raise InvalidArgument(
                f"{raw.service!r} is not a service name", field=f"{path}.service_name"
            )
        service = raw.service
        fe_ports = _ports(raw.frontend_ports, f"{path}.to_ports", required=False)
    else:
        raise InvalidArgument("give exactly one of address_matcher, service_matcher", field=fe_path)
    be_path = "lrp.redirect_backend"
    if not raw.has_backend:
        raise InvalidArgument("a backend is required", field=be_path)
    if not raw.has_selector:
        raise InvalidArgument("a selector is required", field=f"{be_path}.local_endpoint_selector")
    # An empty selector would take every pod of the namespace.
    labels, exprs = sel.build_selector(
        raw.match_labels,
        raw.match_expressions,
        f"{be_path}.local_endpoint_selector",
        required=True,
    )
    be_ports = _ports(raw.backend_ports, f"{be_path}.to_ports", required=True)
    for i, fe in enumerate(fe_ports):
        be = backend_port_for(fe, be_ports)
        if be is None:
            raise InvalidArgument(
                f"no backend port named {fe.name!r}",
                field=f"{fe_path}.{raw.matcher}.to_ports[{i}].name",
            )
        if be.protocol is not fe.protocol:
            raise InvalidArgument(
                f"backend port {be.name or be.port} is {be.protocol.value}, "
                f"the frontend's is {fe.protocol.value}",
                field=f"{be_path}.to_ports[{be_ports.index(be)}].protocol",
            )
    return Lrp(
        namespace=raw.namespace,
        name=raw.name,
        address=address,
        service=service,
        frontend_ports=fe_ports,
        match_labels=labels,
        match_expressions=exprs,
        backend_ports=be_ports,
        description=raw.description,
        source=raw.source,
    )


# --- Cilium's document ---

_PROTOCOL_NAMES = {"TCP": Protocol.TCP, "UDP": Protocol.UDP}


def _doc_ports(value: Any, path: str) -> list[tuple[str, int, Protocol | None]]:
    out: list[tuple[str, int, Protocol | None]] = []
    for i, item in enumerate(doc_list(value, path)):
        p = doc_object(item, f"{path}[{i}]")
        try:
            port = int(p.get("port", 0))  # a string in Cilium's schema
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(
                f"{p.get('port')!r} is not a port number", field=f"{path}[{i}].port"
            ) from None
        proto = str(p.get("protocol") or "TCP").upper()
        if proto not in _PROTOCOL_NAMES:
            raise InvalidArgument(
                f"{p.get('protocol')!r} is not TCP or UDP", field=f"{path}[{i}].protocol"
            )
        out.append((str(p.get("name") or ""), port, _PROTOCOL_NAMES[proto]))
    return out


def raw_from_cilium(doc: Any, *, source: str = "api") -> RawLrp:
    """A CiliumLocalRedirectPolicy object (cilium.io/v2, as YAML or JSON
    decodes it) as plain values; its structure's errors name the field by
    the document's path, the values' by the policy's (build_lrp)."""
    meta, spec = cilium_object(doc, "CiliumLocalRedirectPolicy")
    fe = doc_object(spec.get("redirectFrontend"), "document.spec.redirectFrontend")
    given = [k for k in ("addressMatcher", "serviceMatcher") if k in fe]
    if len(given) > 1:
        raise InvalidArgument(
            "give exactly one of addressMatcher, serviceMatcher",
            field="document.spec.redirectFrontend",
        )
    matcher = doc_object(
        fe.get(given[0]) if given else None,
        f"document.spec.redirectFrontend.{given[0] if given else ''}",
    )
    be_doc = spec.get("redirectBackend")
    be = doc_object(be_doc, "document.spec.redirectBackend")
    sel_doc = be.get("localEndpointSelector")
    labels, exprs = sel.selector_from_doc(
        sel_doc, "document.spec.redirectBackend.localEndpointSelector"
    )
    fe_path = f"document.spec.redirectFrontend.{given[0] if given else ''}.toPorts"
    return RawLrp(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta.get("name") or ""),
        matcher={"addressMatcher": "address_matcher", "serviceMatcher": "service_matcher"}.get(
            given[0] if given else "", ""
        ),
        address=str(matcher.get("ip") or ""),
        service=str(matcher.get("serviceName") or ""),
        service_namespace=str(matcher.get("namespace") or ""),
        frontend_ports=_doc_ports(matcher.get("toPorts"), fe_path),
        match_labels=labels,
        match_expressions=exprs,
        backend_ports=_doc_ports(be.get("toPorts"), "document.spec.redirectBackend.toPorts"),
        skip_redirect_from_backend=bool(spec.get("skipRedirectFromBackend", False)),
        description=str(spec.get("description") or ""),
        has_backend=be_doc is not None,
        has_selector=sel_doc is not None,
        source=source,
    )
