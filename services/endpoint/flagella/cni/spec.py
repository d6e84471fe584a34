"""The CNI specification (1.1.0) as flagella-cni needs it: the environment and
network configuration of an invocation, validated, and results and errors in
the spec's JSON shapes (down-converted for older cniVersions). Pure: no I/O
beyond what it is given, no gRPC."""

from __future__ import annotations

import _socket
import os

from flagella.cni import cnijson as json

# Typing names only for the type checker: the plugin starts once per CNI
# operation, and importing typing and dataclasses costs more than parsing
# (so does the json module: flagella.cni.cnijson stands in for it).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

SPEC_VERSION = "1.1.0"
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
COMMANDS = ("ADD", "DEL", "CHECK", "VERSION", "GC", "STATUS")

# Error codes of the spec.
INCOMPATIBLE_VERSION = 1
UNSUPPORTED_FIELD = 2
UNKNOWN_CONTAINER = 3
INVALID_ENVIRONMENT = 4
IO_FAILURE = 5
DECODING_FAILURE = 6
INVALID_NETWORK_CONFIG = 7
TRY_AGAIN_LATER = 11
PLUGIN_NOT_AVAILABLE = 50
# Plugin-specific codes start at 100.
ENDPOINT_FAILED = 100

DEFAULT_ENDPOINT_ADDRESS = "unix:/run/flagella/endpoint.sock"


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def to_json(self, cni_version: str) -> dict[str, Any]:
        out: dict[str, Any] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


class _Record:
    """A frozen record with value equality (what dataclasses would give,
    without their import cost)."""

    __slots__: tuple[str, ...] = ()
    # The fields in order (positional arguments, repr).
    _fields: tuple[str, ...] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = self._fields
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__} takes {len(names)} fields")
        values = dict(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in names or key in values:
                raise TypeError(f"{type(self).__name__}: bad or repeated field {key!r}")
            values[key] = value
        missing = [n for n in names if n not in values]
        if missing:
            raise TypeError(f"{type(self).__name__}: missing {', '.join(missing)}")
        for name in names:
            object.__setattr__(self, name, values[name])

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen")

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, n) for n in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Record)
        return self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields if n != "raw")
        return f"{type(self).__name__}({fields})"


class Attachment(_Record):
    _fields = ("container_id", "ifname")
    __slots__ = _fields
    container_id: str
    ifname: str


class NetConf(_Record):
    """The network configuration on stdin, with flagella's own fields."""

    _fields = (
        "cni_version",
        "name",
        "type",
        "endpoint_address",
        "node",
        "mtu",
        "timeout",
        "resolve_labels_from_kubernetes",
        "labels",
        "prev_result",
        "valid_attachments",
        "raw",
    )
    __slots__ = _fields
    cni_version: str
    name: str
    type: str
    endpoint_address: str
    node: str
    mtu: int
    timeout: float
    resolve_labels_from_kubernetes: bool
    labels: dict[str, str]
    prev_result: dict[str, Any] | None
    valid_attachments: tuple[Attachment, ...]
    raw: dict[str, Any]


class Invocation(_Record):
    _fields = ("command", "container_id", "netns", "ifname", "args", "conf")
    __slots__ = _fields
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


def parse_netconf(stdin: bytes, command: str) -> NetConf:
    try:
        raw = json.loads(stdin or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CniError(DECODING_FAILURE, f"network config: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CniError(DECODING_FAILURE, "network config: not a JSON object")
    version = raw.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_NETWORK_CONFIG, "network config: cniVersion is missing")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            INCOMPATIBLE_VERSION,
            f"cniVersion {version} is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})",
        )
    if command in ("GC", "STATUS") and _version_tuple(version) < (1, 1, 0):
        raise CniError(INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0, got {version}")
    if command == "VERSION":
        return NetConf(version, "", "", "", "", 0, 0.0, False, {}, None, (), raw)
    name = _require_str(raw, "name")
    plugin_type = _require_str(raw, "type")

    endpoint = raw.get("endpoint", DEFAULT_ENDPOINT_ADDRESS)
    if not isinstance(endpoint, str) or not endpoint:
        raise CniError(INVALID_NETWORK_CONFIG, "network config: endpoint must be an address string")
    node = raw.get("node") or _socket.gethostname()
    if not isinstance(node, str):
        raise CniError(INVALID_NETWORK_CONFIG, "network config: node must be a string")
    mtu = raw.get("mtu", 1500)
    if not isinstance(mtu, int) or isinstance(mtu, bool) or not 576 <= mtu <= 65535:
        raise CniError(INVALID_NETWORK_CONFIG, f"network config: mtu {mtu!r} is not in 576..65535")
    timeout = raw.get("timeout", 30)
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise CniError(INVALID_NETWORK_CONFIG, "network config: timeout must be a positive number")
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
        endpoint_address=endpoint,
        node=node,
        mtu=mtu,
        timeout=float(timeout),
        resolve_labels_from_kubernetes=k8s,
        labels=labels,
        prev_result=prev,
        valid_attachments=tuple(attachments),
        raw=raw,
    )


def parse_invocation(environ: Mapping[str, str], stdin: bytes) -> Invocation:
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
    if command in ("ADD", "CHECK") and not os.path.exists(netns):
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
    if _version_tuple(cni_version) < (1, 0, 0):
        ips = []
        for ip in result.get("ips", []):
            version = "6" if ":" in ip["address"] else "4"
            ips.append({"version": version, **ip})
        out["ips"] = ips
    return out


def version_result(cni_version: str) -> dict[str, Any]:
    return {
        "cniVersion": cni_version or SPEC_VERSION,
        "supportedVersions": list(SUPPORTED_VERSIONS),
    }


def requested_version(stdin: bytes) -> str:
    """The cniVersion the runtime asked for, if readable and supported (for
    error replies); the spec's version otherwise."""
    try:
        version = json.loads(stdin).get("cniVersion")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return SPEC_VERSION
    return version if version in SUPPORTED_VERSIONS else SPEC_VERSION
