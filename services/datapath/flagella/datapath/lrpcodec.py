"""Local redirect policies as the datapath reads them from the lb's
WatchLrps stream (flagella.datapath.lrp applies them): the policy, its
selector over a pod's labels, its ports."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flagella.api.lb.v1 import lb_pb2

log = logging.getLogger(__name__)

NAMESPACE_LABEL = "io.kubernetes.pod.namespace"


@dataclass(frozen=True, slots=True)
class Port:
    name: str
    port: int
    protocol: int  # 6 or 17


@dataclass(frozen=True)
class Redirect:
    """A policy as this node needs it."""

    namespace: str
    name: str
    address: str  # addressMatcher ("" for a serviceMatcher)
    service: str  # serviceMatcher: the service's name in namespace
    frontend_ports: tuple[Port, ...]
    match_labels: tuple[tuple[str, str], ...]
    match_expressions: tuple[tuple[str, str, frozenset[str]], ...]
    backend_ports: tuple[Port, ...]

    def selects(self, labels: Mapping[str, str]) -> bool:
        """Whether a pod with these labels is one of its backends: in the
        policy's namespace, and matched by the selector (a key without a
        source, `app`, matches the label of any source)."""
        if labels.get(NAMESPACE_LABEL) != self.namespace:
            return False
        for key, value in self.match_labels:
            if labels.get(key) != value:
                return False
        for key, op, values in self.match_expressions:
            present = key in labels
            if op == "In" and (not present or labels[key] not in values):
                return False
            if op == "NotIn" and present and labels[key] in values:
                return False
            if op == "Exists" and not present:
                return False
            if op == "DoesNotExist" and present:
                return False
        return True


def _ports(ports: Iterable[lb_pb2.LrpPort]) -> tuple[Port, ...]:
    return tuple(Port(p.name, p.port, int(p.protocol) or 6) for p in ports)


class LrpCodec:
    """WatchLrps events -> namespace/name: the policy."""

    def key(self, event: lb_pb2.LrpEvent) -> str:
        return f"{event.lrp.namespace}/{event.lrp.name}"

    def decode(self, event: lb_pb2.LrpEvent) -> Redirect | None:
        p = event.lrp
        fe = p.redirect_frontend
        matcher = fe.WhichOneof("matcher")
        sel = p.redirect_backend.local_endpoint_selector
        if matcher is None or not (sel.match_labels or sel.match_expressions):
            log.warning("local redirect policy not usable", extra={"lrp": self.key(event)})
            return None
        return Redirect(
            namespace=p.namespace,
            name=p.name,
            address=fe.address_matcher.ip if matcher == "address_matcher" else "",
            service=fe.service_matcher.service_name if matcher == "service_matcher" else "",
            frontend_ports=_ports(
                fe.address_matcher.to_ports
                if matcher == "address_matcher"
                else fe.service_matcher.to_ports
            ),
            match_labels=tuple(sorted(sel.match_labels.items())),
            match_expressions=tuple(
                (r.key, r.operator, frozenset(r.values)) for r in sel.match_expressions
            ),
            backend_ports=_ports(p.redirect_backend.to_ports),
        )


def backend_port(fe: Port, backends: tuple[Port, ...]) -> Port | None:
    """The backend port of a frontend port: the one of its name, or the
    only one (as the lb validated it: flagella.lb.lrp.backend_port_for)."""
    named = [b for b in backends if fe.name and b.name == fe.name]
    if named:
        return named[0]
    return backends[0] if len(backends) == 1 else None
