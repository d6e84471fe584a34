"""flagella-cni: the CNI plugin, a client of its node's datapath (over the
node's unix socket), which relays each invocation to the endpoint service.

What the plugin and the endpoint service's CNI handling (flagella.endpoint.cni)
share: the spec's versions, error codes and error object. Standard library
only and cheap to import: the plugin starts once per CNI operation."""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Mapping
    from typing import Any

SPEC_VERSION = "1.1.0"
SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")

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

# Where the node's datapath serves the plugin (the network config's "socket").
DEFAULT_SOCKET = "/run/flagella/cni.sock"


# The longest msg or details of an error, in characters: they quote what
# they refuse, which may be megabytes (the error travels in a gRPC message).
MAX_MESSAGE = 1000


def _bounded(text: str) -> str:
    cut = len(text) - MAX_MESSAGE
    return text if cut <= 0 else f"{text[:MAX_MESSAGE]}... ({cut} more characters)"


class CniError(Exception):
    def __init__(self, code: int, msg: str, details: str = "") -> None:
        msg, details = _bounded(msg), _bounded(details)
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.details = details

    def to_json(self, cni_version: str) -> dict[str, Any]:
        out: dict[str, Any] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out


def config_object(stdin: bytes, loads: Callable[[bytes], Any]) -> dict[str, Any]:
    """The network configuration, a JSON object (loads: the plugin's
    json stand-in, or json.loads)."""
    try:
        raw = loads(stdin or b"{}")
    except (ValueError, UnicodeDecodeError) as exc:
        raise CniError(DECODING_FAILURE, f"network config: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CniError(DECODING_FAILURE, "network config: not a JSON object")
    return raw


def socket_of(raw: Mapping[str, Any]) -> str:
    """The node's socket the network configuration names."""
    path = raw.get("socket", DEFAULT_SOCKET)
    if not isinstance(path, str) or not path.startswith("/"):
        raise CniError(INVALID_NETWORK_CONFIG, "network config: socket must be an absolute path")
    return path


#: The longest timeout a network configuration may give, in seconds.
MAX_TIMEOUT_S = 3600


def timeout_of(value: object) -> float | None:
    """The network config's timeout in seconds, if it is one: a number
    (not a bool) in (0, MAX_TIMEOUT_S]; NaN, infinity and 1e400 are not."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    # Compared before float(): an int of 400 digits does not fit one.
    return float(value) if 0 < value <= MAX_TIMEOUT_S else None


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def check_version(raw: Mapping[str, Any], command: str) -> str:
    """The network config's cniVersion, if this plugin speaks it (for this
    command: GC and STATUS came with 1.1.0)."""
    version = raw.get("cniVersion")
    if not isinstance(version, str) or not version:
        raise CniError(INVALID_NETWORK_CONFIG, "network config: cniVersion is missing")
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            INCOMPATIBLE_VERSION,
            f"cniVersion {version} is not supported (supported: {', '.join(SUPPORTED_VERSIONS)})",
        )
    if command in ("GC", "STATUS") and version_tuple(version) < (1, 1, 0):
        raise CniError(INCOMPATIBLE_VERSION, f"{command} needs cniVersion 1.1.0, got {version}")
    return version


def requested_version(raw: object) -> str:
    """The cniVersion the runtime asked for, if readable and supported (for
    error replies); the spec's version otherwise."""
    version = raw.get("cniVersion") if isinstance(raw, dict) else None
    return version if version in SUPPORTED_VERSIONS else SPEC_VERSION


def version_result(cni_version: str) -> dict[str, Any]:
    return {
        "cniVersion": cni_version or SPEC_VERSION,
        "supportedVersions": list(SUPPORTED_VERSIONS),
    }
