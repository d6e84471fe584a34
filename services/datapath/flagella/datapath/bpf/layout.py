"""Map layouts: ctypes mirrors of bpf/layout.h, constants, and the encoders
and decoders between map entries and named fields.

Every map entry decodes to ``dict[str, str]`` (what DumpMap returns). The
loader checks the compiled key/value sizes and the field offsets against
these classes; any change here is a layout change (see LAYOUT_VERSION).
"""

from __future__ import annotations

import ctypes
import enum
import hashlib
import ipaddress
import socket
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from flagella.datapath.bpf import syscall

# Bump on any change of bpf/layout.h semantics. The pin folder name also
# carries a hash of the ctypes layouts and map definitions, so a change of
# sizes or fields always gets a new folder even if this is forgotten.
# 2: Maglev as a hash of maps; NodePort conntrack and NAT.
# 3: tunnel mode: the ipcache's tunnel endpoint and flags, the tunnel device in
#    the config; the frags map (IP fragments tracked).
# 4: prefix_policy (Kubernetes ipBlocks over addresses), EP_F_PREFIX_POLICY.
# 5: drop reasons renumbered as Cilium's (metrics map keys carry them); host
#    firewall: host_safe, CFG_HOST_*, the host conntrack scopes.
# 6: flow events carry the TCP flags and the ICMP type (Hubble's l4).
LAYOUT_VERSION = 6


class DropReason(enum.IntEnum):
    """flagella.datapath.v1.DropReason (same numbers)."""

    UNSPECIFIED = 0
    POLICY_L3 = 133
    POLICY_L4 = 230
    POLICY_DENY = 181
    POLICY_NOT_READY = 165
    NO_BACKEND = 158
    SOURCE_RANGE = 177
    CT_INSERT_FAILED = 155
    CT_INVALID = 135
    NAT_FAILED = 167
    INVALID_PACKET = 134
    INVALID_SOURCE_IP = 132
    UNSUPPORTED_L3 = 139
    UNKNOWN_ENDPOINT = 152
    FIB_LOOKUP_FAILED = 169
    REDIRECT_FAILED = 231
    FRAG_NOT_SUPPORTED = 175
    UNKNOWN_NODE = 232
    NO_TUNNEL_ENDPOINT = 160
    TTL_EXCEEDED = 196


# metrics: reason 0 counts forwarded packets; (direction 0, 255) counts
# events the ring buffer had no room for.
REASON_FORWARDED = 0
REASON_HOST_SAFETY = 1  # the host policy's safety set let it through
METRIC_EVENTS_LOST = 255


class Direction(enum.IntEnum):
    """flagella.datapath.v1.FlowDirection / policy.v1.Direction."""

    UNSPECIFIED = 0
    INGRESS = 1  # into the pod
    EGRESS = 2  # out of the pod


class FlowType(enum.IntEnum):
    UNSPECIFIED = 0
    DROP = 1
    POLICY_VERDICT = 2
    TRACE = 3
    HOST_SAFETY = 4  # a host connection let through by the safety set


class FlowVerdict(enum.IntEnum):
    UNSPECIFIED = 0
    FORWARDED = 1
    DROPPED = 2
    AUDIT = 4  # policy audit mode: would be dropped, let through


class Verdict(enum.IntEnum):
    """Policy map verdicts (policy.v1.Verdict plus the L4 marker)."""

    ALLOW = 1
    DENY = 2
    L4_ONLY = 3


class Identity(enum.IntEnum):
    """Reserved identities, as Cilium."""

    UNKNOWN = 0
    HOST = 1
    WORLD = 2
    UNMANAGED = 3
    HEALTH = 4
    INIT = 5
    REMOTE_NODE = 6


LOCAL_IDENTITY_SCOPE = 1 << 24  # node-local CIDR identities start here

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_ICMPV6 = 58
PROTO_SCTP = 132

TC_ACT_OK = 0
TC_ACT_SHOT = 2
TC_ACT_REDIRECT = 7

# endpoint flags
EP_F_POLICY_READY = 1 << 0
EP_F_INGRESS_ENFORCED = 1 << 1
EP_F_EGRESS_ENFORCED = 1 << 2
EP_F_PREFIX_POLICY = 1 << 3
# Additive (no layout bump): programs without it ignore it and enforce.
EP_F_AUDIT = 1 << 4
EP_F_DNS_PROXY = 1 << 12

# service flags
SVC_F_NODEPORT = 1 << 0
SVC_F_MAGLEV = 1 << 1
SVC_F_AFFINITY = 1 << 2
SVC_F_SOURCE_RANGE = 1 << 3
SVC_F_EXT_LOCAL = 1 << 4
SVC_SCOPE_ALL = 0
SVC_SCOPE_LOCAL = 1
BACKEND_ACTIVE = 1  # lb.v1.BackendState.BACKEND_STATE_ACTIVE
MAGLEV_SIZE_INDEX = 0  # index of M in a Maglev table; slot s is at 1 + s

# conntrack
CT_SCOPE_EGRESS = 0
CT_SCOPE_INGRESS = 1
CT_SCOPE_SERVICE = 2
CT_SCOPE_NODEPORT = 3
CT_SCOPE_HOST_OUT = 4
CT_SCOPE_HOST_IN = 5
CT_F_SEEN_NON_SYN = 1 << 0
CT_F_TX_CLOSING = 1 << 1
CT_F_RX_CLOSING = 1 << 2
CT_F_REPLY_SEEN = 1 << 3
NAT_OUT = 0
NAT_IN = 1
NAT_F_NODEPORT = 1 << 0

# config flags
CFG_MASQUERADE4 = 1 << 0
CFG_MASQUERADE6 = 1 << 1
CFG_ALLOW_HOST = 1 << 2
CFG_VERDICT_EVENTS = 1 << 3
CFG_DROP_EVENTS = 1 << 4
CFG_TUNNEL = 1 << 5
CFG_HOST_POLICY = 1 << 6
CFG_HOST_INGRESS = 1 << 7
CFG_HOST_EGRESS = 1 << 8
CFG_VERDICT_ENFORCED = 1 << 9

# Host firewall: the host endpoint's id in the policy map and in flows
# (endpoint ids are below 16^12), and the safety set's key scopes.
HOST_EP_ID = 0xFFFF_FFFF_FFFF_FFFF
SAFE_REMOTE = 0  # a control-plane server: (address, port)
SAFE_LOCAL_PORT = 1  # a server of this node the control plane calls: its port
SAFE_ANY_PORT = 2  # a port on any node (health probes)
# ipcache flags
IPC_F_CLUSTER = 1 << 0

POLICY_PREFIX_L3 = 104
POLICY_PREFIX_PROTO = 112
POLICY_PREFIX_FULL = 128
ICMP_TYPE_PORT = 0x100  # an ICMP packet's key port: ICMP_TYPE_PORT | type

_SCOPE_NAMES = {
    CT_SCOPE_EGRESS: "egress",
    CT_SCOPE_INGRESS: "ingress",
    CT_SCOPE_SERVICE: "service",
    CT_SCOPE_NODEPORT: "nodeport",
    CT_SCOPE_HOST_OUT: "host-out",
    CT_SCOPE_HOST_IN: "host-in",
}
_NAT_NAMES = {NAT_OUT: "out", NAT_IN: "in"}
_PROTO_NAMES = {
    0: "any",
    PROTO_ICMP: "icmp",
    PROTO_TCP: "tcp",
    PROTO_UDP: "udp",
    PROTO_ICMPV6: "icmpv6",
    PROTO_SCTP: "sctp",
}


# --- addresses ---


class V6Addr(ctypes.Union):
    _fields_ = [("u8", ctypes.c_uint8 * 16), ("u32", ctypes.c_uint32 * 4)]


_V4_MAPPED = b"\x00" * 10 + b"\xff\xff"


def ip_bytes(ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> bytes:
    """16 bytes: IPv6 as is, IPv4 v4-mapped."""
    if isinstance(ip, str):
        # inet_pton first (a few times faster than ipaddress, which it agrees
        # with on what it accepts); ipaddress for the rest (scoped IPv6) and
        # for its ValueError on bad input.
        try:
            return _V4_MAPPED + socket.inet_pton(socket.AF_INET, ip)
        except OSError:
            pass
        if ":" in ip and "%" not in ip:
            try:
                return socket.inet_pton(socket.AF_INET6, ip)
            except OSError:
                pass
    addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    if isinstance(addr, ipaddress.IPv4Address):
        return _V4_MAPPED + addr.packed
    return addr.packed


def ip_family(ip: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> int:
    addr = ipaddress.ip_address(ip) if isinstance(ip, str) else ip
    return 4 if isinstance(addr, ipaddress.IPv4Address) else 6


def bytes_ip(raw: bytes) -> str:
    """The address of 16 bytes (v4-mapped shown as IPv4)."""
    if raw[:12] == _V4_MAPPED:
        return str(ipaddress.IPv4Address(raw[12:16]))
    return str(ipaddress.IPv6Address(raw))


def set_addr(target: V6Addr, ip: str) -> None:
    ctypes.memmove(ctypes.addressof(target), ip_bytes(ip), 16)


def get_addr(source: V6Addr) -> str:
    return bytes_ip(bytes(source.u8))


def addr_family(source: V6Addr) -> str:
    """ "ipv4" (v4-mapped) or "ipv6", without decoding the address."""
    return "ipv4" if bytes(source.u8)[:12] == _V4_MAPPED else "ipv6"


def _set_bytes(target: ctypes.Array[ctypes.c_uint8], raw: bytes) -> None:
    ctypes.memmove(ctypes.addressof(target), raw, len(raw))


def mac_bytes(mac: str) -> bytes:
    parts = mac.split(":") if mac else []
    if len(parts) != 6:
        raise ValueError(f"bad MAC address {mac!r}")
    return bytes(int(p, 16) for p in parts)


def mac_str(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def port_be(port: int) -> int:
    """A host-order port as the u16 whose memory holds it in network order."""
    return socket.htons(port)


def port_host(raw: int) -> int:
    return socket.ntohs(raw)


def proto_name(proto: int) -> str:
    return _PROTO_NAMES.get(proto, str(proto))


# --- structs (mirrors of bpf/layout.h) ---


class EndpointKey(ctypes.Structure):
    _fields_ = [("addr", V6Addr)]


class EndpointInfo(ctypes.Structure):
    _fields_ = [
        ("ep_id", ctypes.c_uint64),
        ("policy_revision", ctypes.c_uint64),
        ("ifindex", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("policy_gen", ctypes.c_uint32),
        ("mac", ctypes.c_uint8 * 6),
        ("node_mac", ctypes.c_uint8 * 6),
        ("pad", ctypes.c_uint32),
    ]


class IPCacheKey(ctypes.Structure):
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("addr", ctypes.c_uint8 * 16),
        ("pad", ctypes.c_uint8 * 3),
    ]


class IPCacheValue(ctypes.Structure):
    _fields_ = [
        ("identity", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("tunnel_ip", ctypes.c_uint8 * 4),  # IPv4, network order
        ("pad", ctypes.c_uint32),
    ]


class PolicyKey(ctypes.Structure):
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("ep_id", ctypes.c_uint64),
        ("dir", ctypes.c_uint8),
        ("proto", ctypes.c_uint8),
        ("dport", ctypes.c_uint16),
        ("pad", ctypes.c_uint32),
    ]


class PolicyValue(ctypes.Structure):
    _fields_ = [
        ("verdict", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
        ("cookie", ctypes.c_uint32),
    ]


# prefix_policy: (dir, family, pad, ep_id) always full, then the address.
PREFIX_POLICY_KEY_BITS = 96
PREFIX_POLICY_PORTS = 16


class PrefixPolicyKey(ctypes.Structure):
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("dir", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
        ("ep_id", ctypes.c_uint64),
        ("addr", ctypes.c_uint8 * 16),
    ]


class PrefixPort(ctypes.Structure):
    _fields_ = [
        ("lo", ctypes.c_uint16),
        ("hi", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class PrefixPolicyValue(ctypes.Structure):
    _fields_ = [
        ("count", ctypes.c_uint32),
        ("ports", PrefixPort * PREFIX_POLICY_PORTS),
    ]


class SvcKey(ctypes.Structure):
    _fields_ = [
        ("addr", V6Addr),
        ("dport", ctypes.c_uint16),
        ("slot", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class SvcValue(ctypes.Structure):
    _fields_ = [
        ("backend_id", ctypes.c_uint32),
        ("count", ctypes.c_uint32),
        ("rev_nat_id", ctypes.c_uint32),
        ("service_id", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("affinity_timeout", ctypes.c_uint32),
        ("maglev_size", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class U32(ctypes.Structure):
    """A bare __u32 key or value, with a name for DumpMap."""

    _fields_ = [("value", ctypes.c_uint32)]


class BackendValue(ctypes.Structure):
    _fields_ = [
        ("addr", V6Addr),
        ("port", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("state", ctypes.c_uint8),
        ("pad", ctypes.c_uint32),
    ]


class RevNatValue(ctypes.Structure):
    _fields_ = [("addr", V6Addr), ("port", ctypes.c_uint16), ("pad", ctypes.c_uint16)]


class AffinityKey(ctypes.Structure):
    _fields_ = [("client", V6Addr), ("service_id", ctypes.c_uint32)]


class AffinityValue(ctypes.Structure):
    _fields_ = [
        ("last_used", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class SrcRangeKey(ctypes.Structure):
    _fields_ = [
        ("prefixlen", ctypes.c_uint32),
        ("service_id", ctypes.c_uint32),
        ("family", ctypes.c_uint8),
        ("addr", ctypes.c_uint8 * 16),
        ("pad", ctypes.c_uint8 * 3),
    ]


class CtKey(ctypes.Structure):
    _fields_ = [
        ("saddr", V6Addr),
        ("daddr", V6Addr),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class CtEntry(ctypes.Structure):
    _fields_ = [
        ("expires", ctypes.c_uint64),
        ("backend_id", ctypes.c_uint32),
        ("rev_nat_id", ctypes.c_uint32),
        ("policy_gen", ctypes.c_uint32),
        ("identity", ctypes.c_uint32),
        ("flags", ctypes.c_uint16),
        ("pad", ctypes.c_uint16),
        ("pad2", ctypes.c_uint32),
    ]


class NatValue(ctypes.Structure):
    _fields_ = [
        ("addr", V6Addr),
        ("port", ctypes.c_uint16),
        ("flags", ctypes.c_uint16),
        ("rev_nat_id", ctypes.c_uint32),
        ("expires", ctypes.c_uint64),
    ]


class FragKey(ctypes.Structure):
    _fields_ = [
        ("saddr", V6Addr),
        ("daddr", V6Addr),
        ("id", ctypes.c_uint32),  # network order
        ("proto", ctypes.c_uint8),
        ("pad", ctypes.c_uint8 * 3),
    ]


class FragValue(ctypes.Structure):
    _fields_ = [
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("icmp_type", ctypes.c_uint8),
        ("echo", ctypes.c_uint8),
        ("pad", ctypes.c_uint16),
    ]


class HostSafeKey(ctypes.Structure):
    _fields_ = [
        ("addr", V6Addr),
        ("port", ctypes.c_uint16),  # network order
        ("proto", ctypes.c_uint8),
        ("scope", ctypes.c_uint8),
    ]


class DpConfig(ctypes.Structure):
    _fields_ = [
        ("node_ip4", V6Addr),
        ("node_ip6", V6Addr),
        ("flags", ctypes.c_uint32),
        ("nat_port_min", ctypes.c_uint16),
        ("nat_port_max", ctypes.c_uint16),
        ("tunnel_ifindex", ctypes.c_uint32),
        ("tunnel_port", ctypes.c_uint16),  # network order
        ("dns_proxy_port", ctypes.c_uint16),  # host order; 0: none
    ]


class MetricsValue(ctypes.Structure):
    _fields_ = [("packets", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class FlowEvent(ctypes.Structure):
    _fields_ = [
        ("ts", ctypes.c_uint64),
        ("ep_id", ctypes.c_uint64),
        ("src_identity", ctypes.c_uint32),
        ("dst_identity", ctypes.c_uint32),
        ("ifindex", ctypes.c_uint32),
        ("type", ctypes.c_uint8),
        ("verdict", ctypes.c_uint8),
        ("reason", ctypes.c_uint8),
        ("direction", ctypes.c_uint8),
        ("proto", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
        ("sport", ctypes.c_uint16),
        ("dport", ctypes.c_uint16),
        ("tcp_flags", ctypes.c_uint8),
        ("icmp_type", ctypes.c_uint8),
        ("saddr", V6Addr),
        ("daddr", V6Addr),
    ]


# --- decoders: one entry -> named fields ---

Fields = dict[str, str]


def _flags(value: int, names: Mapping[int, str]) -> str:
    return ",".join(name for bit, name in names.items() if value & bit) or "-"


_EP_FLAGS = {
    EP_F_POLICY_READY: "policy-ready",
    EP_F_INGRESS_ENFORCED: "ingress-enforced",
    EP_F_EGRESS_ENFORCED: "egress-enforced",
    EP_F_PREFIX_POLICY: "prefix-policy",
    EP_F_AUDIT: "audit",
}
_SVC_FLAGS = {
    SVC_F_NODEPORT: "nodeport",
    SVC_F_MAGLEV: "maglev",
    SVC_F_AFFINITY: "affinity",
    SVC_F_SOURCE_RANGE: "source-ranges",
    SVC_F_EXT_LOCAL: "external-local",
}
_CT_FLAGS = {
    CT_F_SEEN_NON_SYN: "seen-non-syn",
    CT_F_TX_CLOSING: "tx-closing",
    CT_F_RX_CLOSING: "rx-closing",
    CT_F_REPLY_SEEN: "reply-seen",
}
_CFG_FLAGS = {
    CFG_MASQUERADE4: "masquerade4",
    CFG_MASQUERADE6: "masquerade6",
    CFG_ALLOW_HOST: "allow-host",
    CFG_VERDICT_EVENTS: "verdict-events",
    CFG_DROP_EVENTS: "drop-events",
    CFG_TUNNEL: "tunnel",
    CFG_HOST_POLICY: "host-policy",
    CFG_HOST_INGRESS: "host-ingress",
    CFG_HOST_EGRESS: "host-egress",
    CFG_VERDICT_ENFORCED: "verdict-enforced",
}


def prefix_of(family: int, raw: bytes, bits: int) -> str:
    """CIDR text of an LPM (family, 16-byte address, address bits) entry."""
    if family == 4:
        plen = max(0, bits - 96)
        net4 = ipaddress.IPv4Network((raw[12:16], plen), strict=False)
        return str(net4)
    net6 = ipaddress.IPv6Network((raw, bits), strict=False)
    return str(net6)


def prefix_bits(cidr: str) -> tuple[int, bytes, int]:
    """(family, 16-byte address, bits over the 16 bytes) of a CIDR or IP."""
    net = ipaddress.ip_network(cidr, strict=False)
    if isinstance(net, ipaddress.IPv4Network):
        return 4, _V4_MAPPED + net.network_address.packed, 96 + net.prefixlen
    return 6, net.network_address.packed, net.prefixlen


def decode_endpoint_key(k: EndpointKey) -> Fields:
    return {"ip": get_addr(k.addr)}


def decode_endpoint_info(v: EndpointInfo) -> Fields:
    return {
        "endpoint_id": str(v.ep_id),
        "ifindex": str(v.ifindex),
        "identity": str(v.identity),
        "flags": _flags(v.flags, _EP_FLAGS),
        "policy_revision": str(v.policy_revision),
        "policy_gen": str(v.policy_gen),
        "mac": mac_str(bytes(v.mac)),
        "node_mac": mac_str(bytes(v.node_mac)),
    }


def decode_ipcache_key(k: IPCacheKey) -> Fields:
    return {"prefix": prefix_of(k.family, bytes(k.addr), k.prefixlen - 8)}


def decode_ipcache_value(v: IPCacheValue) -> Fields:
    out = {"identity": str(v.identity), "flags": _flags(v.flags, {IPC_F_CLUSTER: "cluster"})}
    if any(v.tunnel_ip):
        out["tunnel_ip"] = str(ipaddress.IPv4Address(bytes(v.tunnel_ip)))
    return out


def policy_port_range(k: PolicyKey) -> tuple[int, int]:
    """(first, last) port covered by a policy key; (0, 0) for every port."""
    if k.prefixlen <= POLICY_PREFIX_PROTO:
        return 0, 0
    bits = k.prefixlen - POLICY_PREFIX_PROTO
    base = port_host(k.dport)
    span = 1 << (16 - bits)
    return base, base + span - 1


def decode_policy_key(k: PolicyKey) -> Fields:
    lo, hi = policy_port_range(k)
    any_proto = k.prefixlen <= POLICY_PREFIX_L3
    return {
        "endpoint_id": str(k.ep_id),
        "identity": str(k.identity),
        "direction": Direction(k.dir).name.lower() if k.dir in (1, 2) else str(k.dir),
        "protocol": "any" if any_proto else proto_name(k.proto),
        "port": "any" if hi == 0 else (str(lo) if lo == hi else f"{lo}-{hi}"),
        "prefixlen": str(k.prefixlen),
    }


def decode_policy_value(v: PolicyValue) -> Fields:
    name = Verdict(v.verdict).name.lower() if v.verdict in (1, 2, 3) else str(v.verdict)
    return {"verdict": name, "cookie": str(v.cookie)}


def decode_prefix_policy_key(k: PrefixPolicyKey) -> Fields:
    return {
        "endpoint_id": str(k.ep_id),
        "direction": Direction(k.dir).name.lower() if k.dir in (1, 2) else str(k.dir),
        "prefix": prefix_of(k.family, bytes(k.addr), k.prefixlen - PREFIX_POLICY_KEY_BITS),
    }


def decode_prefix_policy_value(v: PrefixPolicyValue) -> Fields:
    ports = []
    for r in v.ports[: min(v.count, PREFIX_POLICY_PORTS)]:
        span = f"{r.lo}" if r.lo == r.hi else f"{r.lo}-{r.hi}"
        if (r.lo, r.hi) == (0, 0xFFFF):
            span = "any"
        ports.append(f"{proto_name(r.proto) if r.proto else 'any'}/{span}")
    return {"allows": ",".join(ports) or "nothing"}


def decode_svc_key(k: SvcKey) -> Fields:
    return {
        "address": get_addr(k.addr),
        "port": str(port_host(k.dport)),
        "protocol": proto_name(k.proto),
        "slot": str(k.slot),
        "scope": "local" if k.scope == SVC_SCOPE_LOCAL else "all",
    }


def decode_svc_value(v: SvcValue) -> Fields:
    return {
        "backend_id": str(v.backend_id),
        "count": str(v.count),
        "rev_nat_id": str(v.rev_nat_id),
        "service_id": str(v.service_id),
        "flags": _flags(v.flags, _SVC_FLAGS),
        "affinity_timeout": str(v.affinity_timeout),
        "maglev_size": str(v.maglev_size),
    }


def _decode_u32(name: str) -> Callable[[U32], Fields]:
    def dec(v: U32) -> Fields:
        return {name: str(v.value)}

    return dec


def decode_backend_value(v: BackendValue) -> Fields:
    return {
        "address": get_addr(v.addr),
        "port": str(port_host(v.port)),
        "protocol": proto_name(v.proto),
        "state": str(v.state),
    }


def decode_revnat_value(v: RevNatValue) -> Fields:
    return {"address": get_addr(v.addr), "port": str(port_host(v.port))}


def decode_affinity_key(k: AffinityKey) -> Fields:
    return {"client": get_addr(k.client), "service_id": str(k.service_id)}


def decode_affinity_value(v: AffinityValue) -> Fields:
    return {"backend_id": str(v.backend_id), "last_used_ns": str(v.last_used)}


def decode_srcrange_key(k: SrcRangeKey) -> Fields:
    return {
        "service_id": str(k.service_id),
        "cidr": prefix_of(k.family, bytes(k.addr), k.prefixlen - 40),
    }


def _tuple_fields(k: CtKey) -> Fields:
    return {
        "src": get_addr(k.saddr),
        "dst": get_addr(k.daddr),
        "sport": str(port_host(k.sport)),
        "dport": str(port_host(k.dport)),
        "protocol": proto_name(k.proto),
    }


def decode_ct_key(k: CtKey) -> Fields:
    out = _tuple_fields(k)
    out["scope"] = _SCOPE_NAMES.get(k.scope, str(k.scope))
    return out


def decode_ct_entry(v: CtEntry) -> Fields:
    return {
        "expires_ns": str(v.expires),
        "backend_id": str(v.backend_id),
        "rev_nat_id": str(v.rev_nat_id),
        "policy_gen": str(v.policy_gen),
        "identity": str(v.identity),
        "flags": _flags(v.flags, _CT_FLAGS),
    }


def decode_nat_key(k: CtKey) -> Fields:
    out = _tuple_fields(k)
    out["direction"] = _NAT_NAMES.get(k.scope, str(k.scope))
    return out


_NAT_FLAGS = {NAT_F_NODEPORT: "nodeport"}


def decode_nat_value(v: NatValue) -> Fields:
    out = {
        "address": get_addr(v.addr),
        "port": str(port_host(v.port)),
        "expires_ns": str(v.expires),
        "flags": _flags(v.flags, _NAT_FLAGS),
    }
    if v.rev_nat_id:
        out["rev_nat_id"] = str(v.rev_nat_id)
    return out


def decode_frag_key(k: FragKey) -> Fields:
    return {
        "src": get_addr(k.saddr),
        "dst": get_addr(k.daddr),
        "id": str(socket.ntohl(k.id)),
        "proto": str(k.proto),
    }


def decode_frag_value(v: FragValue) -> Fields:
    return {"sport": str(port_host(v.sport)), "dport": str(port_host(v.dport))}


def decode_config(v: DpConfig) -> Fields:
    return {
        "node_ip4": get_addr(v.node_ip4) if any(v.node_ip4.u8) else "",
        "node_ip6": get_addr(v.node_ip6) if any(v.node_ip6.u8) else "",
        "flags": _flags(v.flags, _CFG_FLAGS),
        "nat_port_min": str(v.nat_port_min),
        "nat_port_max": str(v.nat_port_max),
        "tunnel_ifindex": str(v.tunnel_ifindex),
        "tunnel_port": str(port_host(v.tunnel_port)),
    }


def decode_metrics_key(k: U32) -> Fields:
    direction, reason = divmod(k.value, 256)
    name = {
        0: "forwarded",
        REASON_HOST_SAFETY: "host-safety",
        METRIC_EVENTS_LOST: "events-lost",
    }.get(reason, "")
    if not name:
        try:
            name = DropReason(reason).name.lower()
        except ValueError:
            name = str(reason)
    dname = Direction(direction).name.lower() if direction in (0, 1, 2) else str(direction)
    return {"direction": dname, "reason": name, "code": str(reason)}


_SAFE_SCOPES = {SAFE_REMOTE: "remote", SAFE_LOCAL_PORT: "local-port", SAFE_ANY_PORT: "any-port"}


def decode_host_safe_key(k: HostSafeKey) -> Fields:
    return {
        "scope": _SAFE_SCOPES.get(k.scope, str(k.scope)),
        "addr": get_addr(k.addr) if any(k.addr.u8) else "",
        "port": str(port_host(k.port)),
        "proto": _PROTO_NAMES.get(k.proto, str(k.proto)),
    }


def decode_metrics_value(v: MetricsValue) -> Fields:
    return {"packets": str(v.packets), "bytes": str(v.bytes)}


# --- map specifications ---


@dataclass(frozen=True)
class MapSizes:
    """max_entries of the sized maps (the layout hash includes them)."""

    endpoints: int = 4096
    ipcache: int = 512 * 1024
    policy: int = 256 * 1024
    prefix_policy: int = 64 * 1024
    services: int = 64 * 1024
    backends: int = 64 * 1024
    revnat: int = 64 * 1024
    maglev: int = 64 * 1024  # services with a Maglev table (one inner array each)
    affinity: int = 64 * 1024
    srcrange: int = 16 * 1024
    ct: int = 256 * 1024
    snat: int = 128 * 1024
    frags: int = 8192  # datagrams in flight as fragments (Cilium's default)
    host_safe: int = 256  # the host policy's safety set
    events_bytes: int = 1 << 20
    # Per-endpoint budget of policy entries after range expansion (Cilium:
    # 16384 per endpoint policy map). Not part of the map layout.
    policy_per_endpoint: int = field(default=16384, compare=False)


@dataclass(frozen=True)
class MapSpec:
    name: str
    map_type: int
    key: type[ctypes.Structure] | None
    value: type[ctypes.Structure] | None
    max_entries: int
    flags: int
    decode_key: Callable[[ctypes.Structure], Fields] | None
    decode_value: Callable[[ctypes.Structure], Fields] | None
    # Map-in-map: the template every inner map must match (its max_entries
    # is a placeholder when it carries F_INNER_MAP).
    inner: MapSpec | None = None

    @property
    def key_size(self) -> int:
        return ctypes.sizeof(self.key) if self.key is not None else 0

    @property
    def value_size(self) -> int:
        return ctypes.sizeof(self.value) if self.value is not None else 0

    @property
    def type_name(self) -> str:
        return syscall.MAP_TYPE_NAMES.get(self.map_type, str(self.map_type))


def map_specs(sizes: MapSizes) -> tuple[MapSpec, ...]:
    """Every map of the datapath, as the C declares them (names equal)."""
    s = syscall
    d = _decoder

    return (
        MapSpec("endpoints", s.MAP_TYPE_HASH, EndpointKey, EndpointInfo, sizes.endpoints, 0,
                d(decode_endpoint_key), d(decode_endpoint_info)),
        MapSpec("ipcache", s.MAP_TYPE_LPM_TRIE, IPCacheKey, IPCacheValue, sizes.ipcache,
                s.F_NO_PREALLOC, d(decode_ipcache_key), d(decode_ipcache_value)),
        MapSpec("policy", s.MAP_TYPE_LPM_TRIE, PolicyKey, PolicyValue, sizes.policy,
                s.F_NO_PREALLOC, d(decode_policy_key), d(decode_policy_value)),
        MapSpec("prefix_policy", s.MAP_TYPE_LPM_TRIE, PrefixPolicyKey, PrefixPolicyValue,
                sizes.prefix_policy, s.F_NO_PREALLOC, d(decode_prefix_policy_key),
                d(decode_prefix_policy_value)),
        MapSpec("services", s.MAP_TYPE_HASH, SvcKey, SvcValue, sizes.services, 0,
                d(decode_svc_key), d(decode_svc_value)),
        MapSpec("backends", s.MAP_TYPE_HASH, U32, BackendValue, sizes.backends, 0,
                d(_decode_u32("backend_id")), d(decode_backend_value)),
        MapSpec("revnat", s.MAP_TYPE_HASH, U32, RevNatValue, sizes.revnat, 0,
                d(_decode_u32("rev_nat_id")), d(decode_revnat_value)),
        MapSpec("maglev", s.MAP_TYPE_HASH_OF_MAPS, U32, U32, sizes.maglev, s.F_NO_PREALLOC,
                d(_decode_u32("service_id")), d(_decode_u32("map_id")),
                inner=MAGLEV_INNER),
        MapSpec("affinity", s.MAP_TYPE_LRU_HASH, AffinityKey, AffinityValue, sizes.affinity, 0,
                d(decode_affinity_key), d(decode_affinity_value)),
        MapSpec("srcrange", s.MAP_TYPE_LPM_TRIE, SrcRangeKey, U32, sizes.srcrange,
                s.F_NO_PREALLOC, d(decode_srcrange_key), d(_decode_u32("allowed"))),
        MapSpec("ct", s.MAP_TYPE_LRU_HASH, CtKey, CtEntry, sizes.ct, 0,
                d(decode_ct_key), d(decode_ct_entry)),
        MapSpec("snat", s.MAP_TYPE_LRU_HASH, CtKey, NatValue, sizes.snat, 0,
                d(decode_nat_key), d(decode_nat_value)),
        MapSpec("frags", s.MAP_TYPE_LRU_HASH, FragKey, FragValue, sizes.frags, 0,
                d(decode_frag_key), d(decode_frag_value)),
        MapSpec("host_safe", s.MAP_TYPE_HASH, HostSafeKey, U32, sizes.host_safe, 0,
                d(decode_host_safe_key), d(_decode_u32("on"))),
        MapSpec("config", s.MAP_TYPE_ARRAY, U32, DpConfig, 1, 0,
                d(_decode_u32("index")), d(decode_config)),
        MapSpec("metrics", s.MAP_TYPE_PERCPU_ARRAY, U32, MetricsValue, 768, 0,
                d(decode_metrics_key), d(decode_metrics_value)),
        MapSpec("events", s.MAP_TYPE_RINGBUF, None, None, sizes.events_bytes, 0, None, None),
    )  # fmt: skip


def _decoder(fn: Callable[..., Fields]) -> Callable[[ctypes.Structure], Fields]:
    return fn


# One service's Maglev table: index -> backend id, index 0 holding M.
MAGLEV_INNER = MapSpec(
    "maglev_inner",
    syscall.MAP_TYPE_ARRAY,
    U32,
    U32,
    1,
    syscall.F_INNER_MAP,
    _decoder(_decode_u32("index")),
    _decoder(_decode_u32("backend_id")),
)


def layout_version(sizes: MapSizes) -> str:
    """Name of the pin folder of this layout: v<LAYOUT_VERSION>-<hash>."""
    h = hashlib.sha256()
    for spec in map_specs(sizes):
        h.update(
            f"{spec.name}:{spec.map_type}:{spec.max_entries}:{spec.flags}:"
            f"{_describe(spec.key)}:{_describe(spec.value)};".encode()
        )
        if spec.inner is not None:
            i = spec.inner
            h.update(
                f"inner:{i.map_type}:{i.flags}:{_describe(i.key)}:{_describe(i.value)};".encode()
            )
    h.update(_describe(FlowEvent).encode())
    return f"v{LAYOUT_VERSION}-{h.hexdigest()[:10]}"


def _describe(cls: type[ctypes.Structure] | type[ctypes.Union] | None) -> str:
    if cls is None:
        return "-"
    parts = []
    for f in cls._fields_:
        name, ctype = f[0], f[1]
        offset = getattr(cls, name).offset
        parts.append(f"{name}@{offset}:{ctypes.sizeof(ctype)}")
    return f"{cls.__name__}({','.join(parts)})/{ctypes.sizeof(cls)}"


# --- the Maglev hash (same as tuple_hash in bpf/datapath.c) ---


def _mix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    h ^= h >> 16
    return h


def maglev_hash(src: str, dst: str, sport: int, dport: int, proto: int) -> int:
    """Hash of a connection as the datapath computes it for Maglev (the
    frontend address and port, before DNAT)."""
    words = struct.unpack("<4I", ip_bytes(src)) + struct.unpack("<4I", ip_bytes(dst))
    h = 0x9E3779B9
    for w in words:
        h = _mix32(h ^ w)
    ports = (port_be(sport) << 16) | port_be(dport)
    h = _mix32(h ^ ports)
    return _mix32(h ^ proto)


def maglev_slot(src: str, dst: str, sport: int, dport: int, proto: int, *, size: int) -> int:
    return maglev_hash(src, dst, sport, dport, proto) % size
