"""Named container ports: Kubernetes' IANA_SVC_NAME rules for a port's name,
and the (name, number, protocol) a pod gives one. Shared by the endpoint
service (pods' ports), the policy service (rules naming them) and the
datapath (resolving rules against pods)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MAX_LENGTH = 15
# Lowercase alphanumerics and '-', starting and ending alphanumeric.
_CHARS = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")
_LETTER = re.compile(r"[a-z]")

# The protocols a container port may have (IP protocol numbers).
PROTOCOLS = {"TCP": 6, "UDP": 17, "SCTP": 132}


def port_name_error(name: str) -> str:
    """Why name is not a valid port name (IANA_SVC_NAME), or ""."""
    if not name:
        return "a port name must not be empty"
    if len(name) > MAX_LENGTH:
        return f"port name {name!r} is longer than {MAX_LENGTH} characters"
    if not _CHARS.match(name):
        return (
            f"port name {name!r} must be lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    if "--" in name:
        return f"port name {name!r} must not contain '--'"
    if not _LETTER.search(name):
        return f"port name {name!r} must contain at least one letter"
    return ""


@dataclass(frozen=True, slots=True, order=True)
class NamedPort:
    """A pod's named port: protocol is an IP protocol number (6, 17, 132)."""

    name: str
    port: int
    protocol: int = 6


def protocol_number(name: str) -> int | None:
    """TCP/UDP/SCTP (any case) -> its number; None for anything else."""
    return PROTOCOLS.get(name.upper())


def protocol_name(number: int) -> str:
    """6 -> "TCP"; 0 (a proto field left unset) -> "" (which means TCP)."""
    if number == 0:
        return ""
    for name, n in PROTOCOLS.items():
        if n == number:
            return name
    return str(number)


def check_named_ports(items: Sequence[tuple[str, int, str]]) -> tuple[list[NamedPort], str, str]:
    """(name, port, protocol name) items as given (CNI arguments, an API
    request) -> (named ports, "", "") or ([], field, reason) for the first
    bad one: field is "[i].name", "[i].port" or "[i].protocol". An empty
    protocol is TCP; names are unique within a pod."""
    out: list[NamedPort] = []
    seen: set[str] = set()
    for i, (name, port, protocol) in enumerate(items):
        reason = port_name_error(name)
        if reason:
            return [], f"[{i}].name", reason
        if name in seen:
            return [], f"[{i}].name", f"port name {name!r} appears twice"
        seen.add(name)
        if not 1 <= port <= 65535:
            return [], f"[{i}].port", f"port {port} is not in 1..65535"
        number = protocol_number(protocol or "TCP")
        if number is None:
            return [], f"[{i}].protocol", f"protocol {protocol!r} is not TCP, UDP or SCTP"
        out.append(NamedPort(name, port, number))
    return sorted(out), "", ""
