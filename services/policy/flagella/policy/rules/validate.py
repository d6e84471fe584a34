"""Field checks shared by the document parsers and the proto API. Every
error is an InvalidArgument whose field is the path into the request or
document, e.g. ``spec.ingress[0].toPorts[0].ports[0].port``."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence

from flagella.common.errors import InvalidArgument
from flagella.common.portnames import port_name_error
from flagella.policy.identities import IPNetwork
from flagella.policy.labels import (
    DEFAULT_SOURCE,
    SOURCE_CIDR,
    LabelError,
    check_key,
    check_value,
    split_label,
)
from flagella.policy.rules.model import (
    ICMP_PROTOCOLS,
    ICMP_TYPE_PORT,
    CIDRSpec,
    PortSpec,
    Protocol,
    Rule,
    SelectorSpec,
)
from flagella.policy.selector import Entity

MAX_RULES_PER_PUT = 100
MAX_GROUP_CIDRS = 1000

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
    """A CIDR (or a bare IP: its full-length prefix). Host bits are masked
    (10.244.0.108/4 is 0.0.0.0/4), as Kubernetes and Cilium read it;
    `masked_cidr` says when that happened."""
    if not isinstance(text, str) or not text:
        raise fail(path, "expected a CIDR such as 10.0.0.0/8")
    try:
        if "/" not in text:
            addr = ipaddress.ip_address(text)
            return ipaddress.ip_network(f"{addr}/{addr.max_prefixlen}")
        return ipaddress.ip_network(text, strict=False)
    except ValueError as exc:
        raise fail(path, f"{text!r} is not a valid CIDR ({exc})") from None


def masked_cidr(text: str, path: str, warnings: list[str] | None) -> str:
    """The CIDR as stored: the text itself, or, when it has host bits set,
    the network without them (with a warning naming the field)."""
    net = parse_network(text, path)
    if "/" not in text or ipaddress.ip_interface(text).ip == net.network_address:
        return text
    if warnings is not None:
        warnings.append(f"{path}: {text} has host bits set; read as {net}")
    return str(net)


def check_cidr(
    spec: CIDRSpec,
    path: str,
    *,
    cidr_field: str,
    except_field: str,
    group_field: str = "cidrGroupRef",
    warnings: list[str] | None = None,
) -> CIDRSpec:
    """Checks a CIDR and its excepts (each inside the CIDR, after masking)
    and returns it with host bits masked (a warning per masked field). A
    group reference: the group's name, and excepts that are CIDRs (the
    group's CIDRs are known at resolution time only: each except applies
    to the group's CIDRs it lies inside)."""
    if spec.group:
        check_name(spec.group, f"{path}.{group_field}")
        group_excepts = tuple(
            masked_cidr(text, f"{path}.{except_field}[{i}]", warnings)
            for i, text in enumerate(spec.excepts)
        )
        return CIDRSpec("", group_excepts, spec.group)
    cidr_path = f"{path}.{cidr_field}" if cidr_field else path
    cidr = masked_cidr(spec.cidr, cidr_path, warnings)
    net = parse_network(cidr, cidr_path)
    excepts = []
    for i, text in enumerate(spec.excepts):
        p = f"{path}.{except_field}[{i}]"
        excepts.append(masked_cidr(text, p, warnings))
        exc_net = parse_network(excepts[-1], p)
        if exc_net.version != net.version or not exc_net.subnet_of(net):  # type: ignore[arg-type]
            raise fail(p, f"{text} is not inside {net}")
    return CIDRSpec(cidr, tuple(excepts))


def check_port(spec: PortSpec, path: str, *, end_field: str = "endPort") -> None:
    if spec.protocol in ICMP_PROTOCOLS:
        # The port of an ICMP entry is ICMP_TYPE_PORT | type (model.icmp_port).
        if spec.name:
            raise fail(f"{path}.port", f"{spec.protocol.name} takes no port name")
        if spec.end_port:
            raise fail(f"{path}.{end_field}", f"{spec.protocol.name} takes no port range")
        if spec.port and not ICMP_TYPE_PORT <= spec.port <= ICMP_TYPE_PORT | 0xFF:
            raise fail(f"{path}.port", f"{spec.protocol.name} takes an ICMP type, not a port")
        return
    if spec.name:
        check_named_port(spec, path, end_field=end_field)
        return
    if not 0 <= spec.port <= 65535:
        raise fail(f"{path}.port", f"port {spec.port} out of range (0-65535)")
    if spec.end_port:
        if not 0 <= spec.end_port <= 65535:
            raise fail(f"{path}.{end_field}", f"end port {spec.end_port} out of range (0-65535)")
        if spec.port == 0:
            raise fail(f"{path}.{end_field}", "a port range needs a start port")
        if spec.end_port < spec.port:
            raise fail(f"{path}.{end_field}", f"end port {spec.end_port} is below port {spec.port}")


def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def check_unique(found: Sequence[tuple[str, Rule]]) -> None:
    if len(found) > MAX_RULES_PER_PUT:
        raise InvalidArgument(
            f"{len(found)} rules in one put; at most {MAX_RULES_PER_PUT}", field="document"
        )
    seen: set[str] = set()
    for path, rule in found:
        if rule.key in seen:
            raise fail(join(path, "metadata.name"), f"rule {rule.key!r} appears twice")
        seen.add(rule.key)


def check_named_port(spec: PortSpec, path: str, *, end_field: str = "endPort") -> None:
    reason = port_name_error(spec.name)
    if reason:
        raise fail(f"{path}.port", f"invalid named port: {reason}")
    if spec.port:
        raise fail(f"{path}.port", "a named port has no number")
    if spec.end_port:
        raise fail(f"{path}.{end_field}", "a port range cannot start at a named port")
    if spec.protocol is Protocol.ICMP:
        raise fail(f"{path}.protocol", "ICMP takes no port")
