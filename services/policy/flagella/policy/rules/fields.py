"""What the document formats share: typed access to a parsed YAML/JSON
object with paths for errors, and the pieces both FlagellaNetworkPolicy and
Kubernetes NetworkPolicy have (metadata, label selectors, ports)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flagella.policy.rules.model import CIDRSpec, Expression, PortSpec, Protocol, SelectorSpec
from flagella.policy.rules.validate import (
    PROTOCOL_NAMES,
    check_cidr,
    check_name,
    check_namespace,
    check_port,
    check_selector,
    fail,
    join,
)


class Doc:
    """Typed access to a parsed YAML/JSON object with paths for errors."""

    @staticmethod
    def mapping(value: Any, path: str) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise fail(path, f"expected an object, got {type_name(value)}")
        for key in value:
            if not isinstance(key, str):
                raise fail(path, f"keys must be strings, got {key!r}")
        return value

    @staticmethod
    def seq(value: Any, path: str) -> Sequence[Any]:
        if value is None:
            return ()
        if not isinstance(value, list):
            raise fail(path, f"expected a list, got {type_name(value)}")
        return value

    @staticmethod
    def string(value: Any, path: str) -> str:
        if not isinstance(value, str):
            raise fail(path, f"expected a string, got {type_name(value)}")
        return value

    @staticmethod
    def only(obj: Mapping[str, Any], path: str, allowed: Iterable[str], **hints: str) -> None:
        allowed = set(allowed)
        for key in obj:
            if key not in allowed:
                hint = hints.get(key.replace("-", "_"), "")
                where = f"{path}.{key}" if path else key
                raise fail(where, f"unknown field{': ' + hint if hint else ''}")


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def parse_selector(value: Any, path: str) -> SelectorSpec:
    obj = Doc.mapping(value if value is not None else {}, path)
    Doc.only(obj, path, ("matchLabels", "matchExpressions"))
    labels_raw = Doc.mapping(obj.get("matchLabels") or {}, join(path, "matchLabels"))
    labels = []
    for key, raw_value in labels_raw.items():
        p = f"{join(path, 'matchLabels')}[{key}]"
        if isinstance(raw_value, bool | int | float):
            raise fail(p, f"label values must be strings, got {type_name(raw_value)}")
        labels.append((key, Doc.string("" if raw_value is None else raw_value, p)))
    exprs = []
    for i, raw in enumerate(Doc.seq(obj.get("matchExpressions"), join(path, "matchExpressions"))):
        p = f"{join(path, 'matchExpressions')}[{i}]"
        e = Doc.mapping(raw, p)
        Doc.only(e, p, ("key", "operator", "values"))
        if "key" not in e:
            raise fail(f"{p}.key", "required")
        if "operator" not in e:
            raise fail(f"{p}.operator", "required")
        values = tuple(
            Doc.string(v, f"{p}.values[{j}]")
            for j, v in enumerate(Doc.seq(e.get("values"), f"{p}.values"))
        )
        exprs.append(
            Expression(
                Doc.string(e["key"], f"{p}.key"),
                Doc.string(e["operator"], f"{p}.operator"),
                values,
            )
        )
    spec = SelectorSpec(tuple(sorted(labels)), tuple(exprs))
    check_selector(spec, path, labels_path="matchLabels", exprs_path="matchExpressions")
    return spec


def parse_cidr_spec(obj: Mapping[str, Any], path: str, warnings: list[str] | None) -> CIDRSpec:
    """A {cidr, except} object (a CIDRSet entry, a Kubernetes ipBlock),
    checked, host bits masked (a warning each)."""
    if "cidr" not in obj:
        raise fail(f"{path}.cidr", "required")
    spec = CIDRSpec(
        Doc.string(obj["cidr"], f"{path}.cidr"),
        tuple(
            Doc.string(e, f"{path}.except[{j}]")
            for j, e in enumerate(Doc.seq(obj.get("except"), f"{path}.except"))
        ),
    )
    return check_cidr(spec, path, cidr_field="cidr", except_field="except", warnings=warnings)


def _port_number(value: Any, path: str) -> int | str:
    """A number, or a port name (a string that is not all digits; checked
    by check_port)."""
    if isinstance(value, bool):
        raise fail(path, "expected a port number or name")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if value.isdigit():
            return int(value)
        if value:
            return value
    raise fail(path, f"expected a port number or name, got {type_name(value)}")


def parse_ports(value: Any, path: str, *, default_protocol: Protocol) -> tuple[PortSpec, ...]:
    out = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        obj = Doc.mapping(raw, p)
        Doc.only(obj, p, ("port", "endPort", "protocol"))
        port = _port_number(obj["port"], f"{p}.port") if obj.get("port") is not None else 0
        end = 0
        if obj.get("endPort") is not None:
            end_raw = _port_number(obj["endPort"], f"{p}.endPort")
            if isinstance(end_raw, str):
                raise fail(f"{p}.endPort", "expected a port number")
            end = end_raw
        proto = default_protocol
        if obj.get("protocol") is not None:
            name = Doc.string(obj["protocol"], f"{p}.protocol")
            if name.upper() not in PROTOCOL_NAMES:
                raise fail(f"{p}.protocol", f"unknown protocol {name!r} (TCP, UDP, SCTP, ANY)")
            proto = PROTOCOL_NAMES[name.upper()]
        spec = (
            PortSpec(0, end, proto, name=port)
            if isinstance(port, str)
            else PortSpec(port, end, proto)
        )
        check_port(spec, p)
        out.append(spec)
    return tuple(out)


def parse_metadata(
    obj: Mapping[str, Any], path: str
) -> tuple[str, str, tuple[tuple[str, str], ...]]:
    meta = Doc.mapping(obj.get("metadata"), join(path, "metadata"))
    mp = join(path, "metadata")
    name = Doc.string(meta.get("name", ""), f"{mp}.name")
    check_name(name, f"{mp}.name")
    namespace = meta.get("namespace") or ""
    namespace = Doc.string(namespace, f"{mp}.namespace")
    check_namespace(namespace, f"{mp}.namespace")
    labels = Doc.mapping(meta.get("labels") or {}, f"{mp}.labels")
    pairs = tuple(sorted((k, Doc.string(v, f"{mp}.labels[{k}]")) for k, v in labels.items()))
    return name, namespace, pairs
