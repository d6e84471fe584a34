"""The prefix_policy map: Kubernetes ipBlocks over peer addresses.

One LPM trie for every endpoint, keyed (direction, family, endpoint) then
the peer address; the value lists the (protocol, port range) pairs allowed
for the addresses of the prefix. The policy service sends the entries
flattened (the longest prefix holding an address carries everything that
applies to it: an except is an entry of its own, allowing what other
blocks allow there, possibly nothing), so one lookup decides. The programs
consult it only for an endpoint flagged EP_F_PREFIX_POLICY, when the
identity lookups neither allowed nor denied a new connection: it can only
allow (Kubernetes policy has no deny; Cilium denies still win).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from dataclasses import dataclass

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.layout import MapSpec
from flagella.datapath.bpf.maps import BpfMap

# (direction, family, 16-byte address, address bits over 16 bytes)
PrefixKeyTuple = tuple[int, int, bytes, int]
# ((protocol, lo, hi), ...) in the value's order
PortsTuple = tuple[tuple[int, int, int], ...]

_ANY_PROTO_PORTS = (L.PROTO_TCP, L.PROTO_UDP, L.PROTO_SCTP)


class PrefixPortsExceeded(ValueError):
    """A prefix allows more (protocol, port range) pairs than its value
    holds (PREFIX_POLICY_PORTS)."""


@dataclass(frozen=True)
class PrefixRule:
    """One flattened prefix entry (flagella.policy.v1.PrefixEntry)."""

    prefix: str  # a CIDR
    direction: L.Direction
    # (protocol (0 any), port (0 any), end_port (0: port only)); () nothing
    ports: tuple[tuple[int, int, int], ...] = ()


def _ranges(ports: Iterable[tuple[int, int, int]]) -> PortsTuple:
    out: set[tuple[int, int, int]] = set()
    for proto, port, end in ports:
        if not 0 <= proto <= 255 or not 0 <= port <= 0xFFFF or not 0 <= end <= 0xFFFF:
            raise ValueError(f"bad prefix port {proto}/{port}-{end}")
        if end and end < port:
            raise ValueError(f"bad prefix port range {port}-{end}")
        lo, hi = (0, 0xFFFF) if port == 0 else (port, end or port)
        if proto == 0 and port:
            out.update((p, lo, hi) for p in _ANY_PROTO_PORTS)
        else:
            out.add((proto, lo, hi))
    return _collapse(out)


def _collapse(ranges: set[tuple[int, int, int]]) -> PortsTuple:
    if (0, 0, 0xFFFF) in ranges:
        return ((0, 0, 0xFFFF),)
    return tuple(sorted(ranges))


def expand(rules: Iterable[PrefixRule]) -> dict[PrefixKeyTuple, PortsTuple]:
    """Rules -> {key tuple: ports}; raises PrefixPortsExceeded or ValueError."""
    out: dict[PrefixKeyTuple, PortsTuple] = {}
    for r in rules:
        if r.direction not in (L.Direction.INGRESS, L.Direction.EGRESS):
            raise ValueError(f"prefix entry {r}: direction must be ingress or egress")
        family, raw, bits = L.prefix_bits(r.prefix)
        ports = _ranges(r.ports)
        key = (int(r.direction), family, raw, bits)
        if key in out:  # the same prefix twice: both allow
            ports = _collapse({*out[key], *ports})
        if len(ports) > L.PREFIX_POLICY_PORTS:
            raise PrefixPortsExceeded(
                f"prefix {r.prefix}: {len(ports)} port ranges, at most {L.PREFIX_POLICY_PORTS}"
            )
        out[key] = ports
    return out


def prefix_key(endpoint_id: int, key: PrefixKeyTuple) -> L.PrefixPolicyKey:
    d, family, raw, bits = key
    k = L.PrefixPolicyKey(
        prefixlen=L.PREFIX_POLICY_KEY_BITS + bits, dir=d, family=family, ep_id=endpoint_id
    )
    ctypes.memmove(ctypes.addressof(k.addr), raw, 16)
    return k


def prefix_value(ports: PortsTuple) -> L.PrefixPolicyValue:
    v = L.PrefixPolicyValue(count=len(ports))
    for i, (proto, lo, hi) in enumerate(ports):
        v.ports[i] = L.PrefixPort(lo=lo, hi=hi, proto=proto)
    return v


def _key_tuple(k: L.PrefixPolicyKey) -> PrefixKeyTuple:
    return (k.dir, k.family, bytes(k.addr), k.prefixlen - L.PREFIX_POLICY_KEY_BITS)


def _ports_tuple(v: L.PrefixPolicyValue) -> PortsTuple:
    n = min(v.count, L.PREFIX_POLICY_PORTS)
    return tuple((r.proto, r.lo, r.hi) for r in v.ports[:n])


class PrefixPolicy(BpfMap[L.PrefixPolicyKey, L.PrefixPolicyValue]):
    """Prefix entries of every local endpoint (see the module docs)."""

    def __init__(self, spec: MapSpec, fd: int, pin_path: str) -> None:
        super().__init__(spec, fd, pin_path)
        # endpoint id -> {key tuple: ports} as in the map (read back: a
        # restarted process replaces exactly what it finds).
        self._index: dict[int, dict[PrefixKeyTuple, PortsTuple]] = {}
        for k, v in self.items():
            self._index.setdefault(k.ep_id, {})[_key_tuple(k)] = _ports_tuple(v)

    def write(self, endpoint_id: int, desired: dict[PrefixKeyTuple, PortsTuple]) -> None:
        """New and changed entries, then stale ones deleted. Entries only
        allow: a wider one deleted last never opens more than old or new."""
        current = self._index.setdefault(endpoint_id, {})
        for key, ports in desired.items():
            if current.get(key) != ports:
                self.update(prefix_key(endpoint_id, key), prefix_value(ports))
                current[key] = ports
        for key in [k for k in current if k not in desired]:
            self.delete(prefix_key(endpoint_id, key))
            del current[key]

    def clear_endpoint(self, endpoint_id: int) -> int:
        current = self._index.pop(endpoint_id, {})
        for key in current:
            self.delete(prefix_key(endpoint_id, key))
        return len(current)

    def entry_count(self, endpoint_id: int) -> int:
        return len(self._index.get(endpoint_id, {}))

    def allows(
        self,
        endpoint_id: int,
        direction: L.Direction,
        address: str,
        proto: int,
        port: int,
    ) -> bool:
        """What prefix_allows in C decides for a peer address."""
        family, raw, _ = L.prefix_bits(address)
        k = prefix_key(endpoint_id, (int(direction), family, raw, 128))
        v = self.get(k)
        if v is None:
            return False
        return any(p in (0, proto) and lo <= port <= hi for p, lo, hi in _ports_tuple(v))
