"""`icmps` clauses of flagella and Cilium policies: ICMP and ICMPv6 types
by number or by Cilium's CamelCase names (the IANA message names)."""

from __future__ import annotations

from typing import Any

from flagella.policy.rules.fields import Doc
from flagella.policy.rules.model import PortSpec, Protocol, icmp_port
from flagella.policy.rules.validate import fail

ICMPV4_TYPES = {
    "EchoReply": 0,
    "DestinationUnreachable": 3,
    "Redirect": 5,
    "Echo": 8,
    "EchoRequest": 8,
    "RouterAdvertisement": 9,
    "RouterSelection": 10,
    "TimeExceeded": 11,
    "ParameterProblem": 12,
    "Timestamp": 13,
    "TimestampReply": 14,
    "Photuris": 40,
    "ExtendedEchoRequest": 42,
    "ExtendedEchoReply": 43,
}

ICMPV6_TYPES = {
    "DestinationUnreachable": 1,
    "PacketTooBig": 2,
    "TimeExceeded": 3,
    "ParameterProblem": 4,
    "EchoRequest": 128,
    "EchoReply": 129,
    "MulticastListenerQuery": 130,
    "MulticastListenerReport": 131,
    "MulticastListenerDone": 132,
    "RouterSolicitation": 133,
    "RouterAdvertisement": 134,
    "NeighborSolicitation": 135,
    "NeighborAdvertisement": 136,
    "RedirectMessage": 137,
    "RouterRenumbering": 138,
    "ICMPNodeInformationQuery": 139,
    "ICMPNodeInformationResponse": 140,
    "InverseNeighborDiscoverySolicitation": 141,
    "InverseNeighborDiscoveryAdvertisement": 142,
    "HomeAgentAddressDiscoveryRequest": 144,
    "HomeAgentAddressDiscoveryReply": 145,
    "MobilePrefixSolicitation": 146,
    "MobilePrefixAdvertisement": 147,
    "DuplicateAddressRequestCodeSuffix": 157,
    "DuplicateAddressConfirmationCodeSuffix": 158,
    "ExtendedEchoRequest": 160,
    "ExtendedEchoReply": 161,
}

_FAMILIES = {"IPv4": (Protocol.ICMP, ICMPV4_TYPES), "IPv6": (Protocol.ICMPV6, ICMPV6_TYPES)}


def _icmp_type(raw: Any, path: str, names: dict[str, int], family: str) -> int:
    if isinstance(raw, bool):
        raise fail(path, "expected an ICMP type (0-255) or its name")
    if isinstance(raw, int):
        number = raw
    elif isinstance(raw, str) and raw.isdigit():
        number = int(raw)
    elif isinstance(raw, str):
        if raw not in names:
            raise fail(path, f"unknown {family} ICMP type name {raw!r} ({', '.join(names)})")
        return names[raw]
    else:
        raise fail(path, "expected an ICMP type (0-255) or its name")
    if not 0 <= number <= 255:
        raise fail(path, f"ICMP type {number} out of range (0-255)")
    return number


def parse_icmps(value: Any, path: str) -> tuple[PortSpec, ...]:
    """`icmps: [{fields: [{type, family}]}]` as port entries of the ICMP
    protocols (family IPv4 by default, as Cilium)."""
    out: list[PortSpec] = []
    for i, raw in enumerate(Doc.seq(value, path)):
        p = f"{path}[{i}]"
        rule = Doc.mapping(raw, p)
        Doc.only(rule, p, ("fields",))
        fields = Doc.seq(rule.get("fields"), f"{p}.fields")
        if not fields:
            raise fail(f"{p}.fields", "at least one ICMP field is needed")
        for j, raw_field in enumerate(fields):
            fp = f"{p}.fields[{j}]"
            field = Doc.mapping(raw_field, fp)
            Doc.only(field, fp, ("type", "family"))
            family = Doc.string(field.get("family") or "IPv4", f"{fp}.family")
            if family not in _FAMILIES:
                raise fail(f"{fp}.family", f"unknown family {family!r} (IPv4, IPv6)")
            protocol, names = _FAMILIES[family]
            if "type" not in field:
                raise fail(f"{fp}.type", "required")
            icmp_type = _icmp_type(field["type"], f"{fp}.type", names, family)
            out.append(PortSpec(icmp_port(icmp_type), 0, protocol))
    return tuple(out)
