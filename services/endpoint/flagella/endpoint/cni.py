"""The CNI specification (1.1.0) as the endpoint service runs it for the
flagella-cni plugin (whose invocations each node's datapath relays): the
environment and network configuration of an invocation, validated, and
results and errors in the spec's JSON shapes (down-converted for older
cniVersions). Pure: no I/O beyond what it is given, no gRPC."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flagella.cni import (
    DECODING_FAILURE,
    INVALID_ENVIRONMENT,
    INVALID_NETWORK_CONFIG,
    MAX_TIMEOUT_S,
    SPEC_VERSION,
    CniError,
    check_version,
    config_object,
    socket_of,
    timeout_of,
    version_tuple,
)
from flagella.cni import requested_version as _requested_version
from flagella.common.portnames import NamedPort, check_named_ports

COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "GC", "STATUS")
# Fields of older flagella network configs that no longer mean anything: the
# plugin talks only to its node's datapath, which names the node itself.
RETIRED_FIELDS = {
    "endpoint": "flagella-cni talks only to its node's datapath (field socket)",
    "node": "the node is the one whose datapath serves the plugin's socket",
}


@dataclass(frozen=True)
class Attachment:
    container_id: str
    ifname: str


@dataclass(frozen=True)
class NetConf:
    """The network configuration on stdin, with flagella's own fields."""

    cni_version: str
    name: str
    type: str
    mtu: int
    timeout: float
    resolve_labels_from_kubernetes: bool
    labels: dict[str, str]
    # args.cni.namedPorts: the pod's named ports when not from Kubernetes.
    named_ports: tuple[NamedPort, ...]
    prev_result: dict[str, Any] | None
    valid_attachments: tuple[Attachment, ...]
    raw: dict[str, Any] = field(repr=False)


@dataclass(frozen=True)
class Invocation:
    command: str
    container_id: str
    netns: str
    ifname: str
    args: dict[str, str]
    conf: NetConf

    @property
    def pod_name(self) -> str:
        return self.args.get("K8S_POD_NAME", "")

    @property
    def pod_namespace(self) -> str:
        return self.args.get("K8S_POD_NAMESPACE", "")


def parse_cni_args(raw: str) -> dict[str, str]:
    """CNI_ARGS: "K1=V1;K2=V2"."""
    out: dict[str, str] = {}
    for part in raw.split(";"):
        if not part:
            continue
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise CniError(
                INVALID_ENVIRONMENT, f"CNI_ARGS: malformed pair {part!r} (want KEY=VALUE)"
            )
        out[key] = value
    return out


def _require_str(obj: Mapping[str, Any], key: str, where: str = "") -> str:
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise CniError(
            INVALID_NETWORK_CONFIG, f"network config: {where}{key} must be a non-empty string"
        )
    return value


def _named_ports(raw: Any) -> tuple[NamedPort, ...]:
    """args.cni.namedPorts: [{name, port, protocol}] (protocol TCP when
    absent), validated as Kubernetes validates container ports."""
    where = "network config: args.cni.namedPorts"
    if not isinstance(raw, list):
        raise CniError(INVALID_NETWORK_CONFIG, f"{where} must be a list")
    items: list[tuple[str, int, str]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise CniError(INVALID_NETWORK_CONFIG, f"{where}[{i}] must be an object")
        unknown = sorted(set(item) - {"name", "port", "protocol"})
        if unknown:
            raise CniError(INVALID_NETWORK_CONFIG, f"{where}[{i}].{unknown[0]}: unknown field")
        name, port, protocol = item.get("name"), item.get("port"), item.get("protocol", "TCP")
        if not isinstance(name, str):
            raise CniError(INVALID_NETWORK_CONFIG, f"{where}[{i}].name must be a string")
        if not isinstance(port, int) or isinstance(port, bool):
            raise CniError(INVALID_NETWORK_CONFIG, f"{where}[{i}].port must be a number")
        if not isinstance(protocol, str):
            raise CniError(INVALID_NETWORK_CONFIG, f"{where}[{i}].protocol must be a string")
        items.append((name, port, protocol))
    ports, field_, reason = check_named_ports(items)
    if field_:
        raise CniError(INVALID_NETWORK_CONFIG, f"{where}{field_}: {reason}")
    return tuple(ports)


def parse_netconf(stdin: bytes, command: str) -> NetConf:
    raw = config_object(stdin, json.loads)
    version = check_version(raw, command)
    if command == "VERSION":
        return NetConf(version, "", "", 0, 0.0, False, {}, (), None, (), raw)
    name = _require_str(raw, "name")
    plugin_type = _require_str(raw, "type")

    for key, why in RETIRED_FIELDS.items():
        if key in raw:
            raise CniError(
                INVALID_NETWORK_CONFIG, f"network config: {key} is not used any more: {why}"
            )
    socket_of(raw)  # the plugin found its node's socket there
    mtu = raw.get("mtu", 1500)
    if not isinstance(mtu, int) or isinstance(mtu, bool) or not 576 <= mtu <= 65535:
        raise CniError(INVALID_NETWORK_CONFIG, f"network config: mtu {mtu!r} is not in 576..65535")
    timeout = timeout_of(raw.get("timeout", 30))
    if timeout is None:
        raise CniError(
            INVALID_NETWORK_CONFIG,
            f"network config: timeout must be a number of seconds in (0, {MAX_TIMEOUT_S}]",
        )
    k8s = raw.get("kubernetes", False)
    if not isinstance(k8s, bool):
        raise CniError(INVALID_NETWORK_CONFIG, "network config: kubernetes must be true or false")

    labels: dict[str, str] = {}
    args = raw.get("args", {})
    cni_args = args.get("cni", {}) if isinstance(args, dict) else None
    if not isinstance(cni_args, dict):
        raise CniError(INVALID_NETWORK_CONFIG, "network config: args.cni must be an object")
    raw_labels = cni_args.get("labels", {})
    if not isinstance(raw_labels, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in raw_labels.items()
    ):
        raise CniError(
            INVALID_NETWORK_CONFIG, "network config: args.cni.labels must map strings to strings"
        )
    labels.update(raw_labels)
    named_ports = _named_ports(cni_args.get("namedPorts", []))

    prev = raw.get("prevResult")
    if prev is not None and not isinstance(prev, dict):
        raise CniError(DECODING_FAILURE, "network config: prevResult must be an object")

    attachments: list[Attachment] = []
    if command == "GC":
        valid = raw.get("cni.dev/valid-attachments", [])
        if not isinstance(valid, list):
            raise CniError(
                INVALID_NETWORK_CONFIG, "network config: cni.dev/valid-attachments must be a list"
            )
        for i, item in enumerate(valid):
            if not isinstance(item, dict):
                raise CniError(
                    INVALID_NETWORK_CONFIG,
                    f"network config: cni.dev/valid-attachments[{i}] must be an object",
                )
            attachments.append(
                Attachment(
                    _require_str(item, "containerID", f"cni.dev/valid-attachments[{i}]."),
                    _require_str(item, "ifname", f"cni.dev/valid-attachments[{i}]."),
                )
            )
    return NetConf(
        cni_version=version,
        name=name,
        type=plugin_type,
        mtu=mtu,
        timeout=timeout,
        resolve_labels_from_kubernetes=k8s,
        labels=labels,
        named_ports=named_ports,
        prev_result=prev,
        valid_attachments=tuple(attachments),
        raw=raw,
    )


def parse_invocation(environ: Mapping[str, str], stdin: bytes, *, netns_exists: bool) -> Invocation:
    """netns_exists: whether CNI_NETNS exists on the plugin's node (which
    only the node can tell)."""
    command = environ.get("CNI_COMMAND", "")
    if command not in COMMANDS:
        raise CniError(
            INVALID_ENVIRONMENT,
            f"CNI_COMMAND {command!r} is not one of {', '.join(COMMANDS)}"
            if command
            else "CNI_COMMAND is not set",
        )
    conf = parse_netconf(stdin, command)
    container_id = environ.get("CNI_CONTAINERID", "")
    netns = environ.get("CNI_NETNS", "")
    ifname = environ.get("CNI_IFNAME", "")
    required = {
        "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
        "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"),
        "DEL": ("CNI_CONTAINERID", "CNI_IFNAME"),
    }.get(command, ())
    missing = [name for name in required if not environ.get(name)]
    if missing:
        raise CniError(
            INVALID_ENVIRONMENT, f"{', '.join(missing)} not set (required for {command})"
        )
    if ifname and (len(ifname) > 15 or "/" in ifname or ifname in (".", "..") or " " in ifname):
        raise CniError(INVALID_ENVIRONMENT, f"CNI_IFNAME {ifname!r} is not a valid interface name")
    if command in ("ADD", "CHECK") and not netns_exists:
        raise CniError(INVALID_ENVIRONMENT, f"CNI_NETNS {netns} does not exist")
    if command == "CHECK" and conf.prev_result is None:
        raise CniError(INVALID_NETWORK_CONFIG, "network config: CHECK needs prevResult")
    return Invocation(
        command=command,
        container_id=container_id,
        netns=netns,
        ifname=ifname,
        args=parse_cni_args(environ.get("CNI_ARGS", "")),
        conf=conf,
    )


def convert_result(result: dict[str, Any], cni_version: str) -> dict[str, Any]:
    """A 1.x result in the shape cni_version expects."""
    out = {**result, "cniVersion": cni_version}
    if version_tuple(cni_version) < (1, 0, 0):
        ips = []
        for ip in result.get("ips", []):
            version = "6" if ":" in ip["address"] else "4"
            ips.append({"version": version, **ip})
        out["ips"] = ips
    return out


def requested_version(stdin: bytes) -> str:
    """The cniVersion the runtime asked for, if readable and supported (for
    error replies); the spec's version otherwise."""
    try:
        raw = json.loads(stdin)
    except (ValueError, UnicodeDecodeError):
        return SPEC_VERSION
    return _requested_version(raw)
