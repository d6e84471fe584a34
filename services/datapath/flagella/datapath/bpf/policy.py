"""The policy map: per-endpoint entries in one LPM trie.

Key bits, in order: peer identity, endpoint id, direction (always full),
then protocol and destination port (may be cut). An entry covers:

- prefix 104: every protocol and port of (peer, endpoint, direction);
- prefix 112: every port of one protocol;
- prefix 112+n: the ports whose first n bits equal the key's port.

A port range is expanded into the fewest aligned prefixes covering it
exactly (1024-2047 is one entry; 80-90 is four). "Any protocol" with a port
becomes TCP, UDP and SCTP entries. ICMP entries match the ICMP type as the
port. Peer identity 0 means any peer; the datapath looks up the peer's
identity and identity 0 and combines both results:

    a deny in either -> POLICY_DENY; an allow in either -> allowed;
    else an L4_ONLY marker in either -> POLICY_L4; else POLICY_L3.

Deny over allow within one lookup is made true here: an allow whose port
set lies inside a deny of the same (peer, direction) is not written (the
LPM would return the longer allow). The L4_ONLY marker is written at
prefix 104 for a peer that has allow entries but no 104 entry, so a packet
on another port of an allowed peer drops with POLICY_L4.

Budget: at most MapSizes.policy_per_endpoint keys per endpoint after
expansion (Cilium: 16384); beyond it nothing is written and
PolicyBudgetExceeded is raised (the endpoint keeps its previous policy or
stays not ready: never open).
"""

from __future__ import annotations

import collections
import functools
import socket
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.layout import MapSpec
from flagella.datapath.bpf.maps import BpfMap, MapFullError
from flagella.datapath.bpf.prefixpolicy import PrefixPolicy, PrefixPortsExceeded, PrefixRule
from flagella.datapath.bpf.prefixpolicy import expand as expand_prefixes
from flagella.datapath.bpf.tables import Endpoints

_ANY_PROTO_PORTS = (L.PROTO_TCP, L.PROTO_UDP, L.PROTO_SCTP)

# (identity, direction, proto, port base, prefixlen)
PolicyKeyTuple = tuple[int, int, int, int, int]


class PolicyBudgetExceeded(MapFullError):
    """An endpoint's policy needs more entries than its budget (needed: the
    keys it needs, 0 when unknown: too many port ranges at one prefix)."""

    def __init__(self, message: str, *, needed: int = 0) -> None:
        super().__init__(28, message)  # ENOSPC
        self.needed = needed


@dataclass(frozen=True)
class PolicyEntry:
    """One resolved policy entry (flagella.policy.v1.PolicyEntry)."""

    identity: int  # peer; 0: any
    direction: L.Direction
    verdict: L.Verdict = L.Verdict.ALLOW
    protocol: int = 0  # 0: any
    port: int = 0  # 0: any port
    end_port: int = 0  # inclusive end of a range; 0: port only
    cookie: int = 0
    # A named port, resolved to numbers before it reaches the map
    # (flagella.datapath.namedports).
    port_name: str = ""


# Expansions Policy keeps: each can be up to the policy budget of keys
# (~200 bytes a key), and applies of the same entries come together.
EXPANDED_KEPT = 4


@functools.lru_cache(maxsize=4096)
def _port_prefixes(lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    return tuple(port_prefixes(lo, hi))


def port_prefixes(lo: int, hi: int) -> list[tuple[int, int]]:
    """The aligned (base, bits) blocks covering lo..hi exactly."""
    if not 0 <= lo <= hi <= 0xFFFF:
        raise ValueError(f"bad port range {lo}-{hi}")
    out = []
    while lo <= hi:
        size = lo & -lo if lo else 1 << 16
        while lo + size - 1 > hi:
            size >>= 1
        out.append((lo, 16 - size.bit_length() + 1))
        lo += size
    return out


def _validate(e: PolicyEntry) -> None:
    if e.port_name:
        raise ValueError(f"policy entry {e}: named port not resolved")
    if e.direction not in (L.Direction.INGRESS, L.Direction.EGRESS):
        raise ValueError(f"policy entry {e}: direction must be ingress or egress")
    if e.verdict not in (L.Verdict.ALLOW, L.Verdict.DENY):
        raise ValueError(f"policy entry {e}: verdict must be allow or deny")
    if not 0 <= e.protocol <= 255:
        raise ValueError(f"policy entry {e}: bad protocol")
    if not 0 <= e.port <= 0xFFFF or not 0 <= e.end_port <= 0xFFFF:
        raise ValueError(f"policy entry {e}: bad port")
    if e.end_port and e.end_port < e.port:
        raise ValueError(f"policy entry {e}: end_port below port")
    if not 0 <= e.identity <= 0xFFFFFFFF:
        raise ValueError(f"policy entry {e}: bad identity")


def expand(entries: Iterable[PolicyEntry]) -> dict[PolicyKeyTuple, tuple[int, int]]:
    """Entries -> {key tuple: (verdict, cookie)}, with deny over allow and
    the L4 markers applied (see the module documentation)."""
    out: dict[PolicyKeyTuple, tuple[int, int]] = {}

    def put(key: PolicyKeyTuple, verdict: int, cookie: int) -> None:
        cur = out.get(key)
        if cur is None or (verdict == L.Verdict.DENY and cur[0] != L.Verdict.DENY):
            out[key] = (verdict, cookie)

    for e in entries:
        _validate(e)
        d = int(e.direction)
        if e.port == 0 and e.end_port == 0:
            if e.protocol == 0:
                put((e.identity, d, 0, 0, L.POLICY_PREFIX_L3), e.verdict, e.cookie)
            else:
                put((e.identity, d, e.protocol, 0, L.POLICY_PREFIX_PROTO), e.verdict, e.cookie)
            continue
        hi = e.end_port or e.port
        protos = _ANY_PROTO_PORTS if e.protocol == 0 else (e.protocol,)
        for proto in protos:
            for base, bits in _port_prefixes(e.port, hi):
                put((e.identity, d, proto, base, L.POLICY_PREFIX_PROTO + bits), e.verdict, e.cookie)

    denies = {k for k, v in out.items() if v[0] == L.Verdict.DENY}
    if denies:  # (most policies have none: no allow to look at)
        for key in [k for k, v in out.items() if v[0] == L.Verdict.ALLOW]:
            if _covered(key, denies):
                del out[key]

    peers = {(k[0], k[1]) for k, v in out.items() if v[0] == L.Verdict.ALLOW}
    for ident, d in peers:
        l3 = (ident, d, 0, 0, L.POLICY_PREFIX_L3)
        if l3 not in out:
            out[l3] = (L.Verdict.L4_ONLY, 0)
    return out


def _covered(key: PolicyKeyTuple, denies: set[PolicyKeyTuple]) -> bool:
    ident, d, proto, base, plen = key
    if (ident, d, 0, 0, L.POLICY_PREFIX_L3) in denies:
        return True
    if plen <= L.POLICY_PREFIX_L3:
        return False
    if (ident, d, proto, 0, L.POLICY_PREFIX_PROTO) in denies and plen > L.POLICY_PREFIX_PROTO:
        return True
    for bits in range(1, plen - L.POLICY_PREFIX_PROTO):
        mask = (0xFFFF << (16 - bits)) & 0xFFFF
        if (ident, d, proto, base & mask, L.POLICY_PREFIX_PROTO + bits) in denies:
            return True
    return False


def policy_key(endpoint_id: int, key: PolicyKeyTuple) -> L.PolicyKey:
    ident, d, proto, base, plen = key
    return L.PolicyKey(
        prefixlen=plen,
        identity=ident,
        ep_id=endpoint_id,
        dir=d,
        proto=proto,
        dport=L.port_be(base),
    )


# L.PolicyKey and L.PolicyValue as struct layouts: a rule over 250 peers is
# 500 keys on each of 250 endpoints, and a ctypes object per key and value
# cost more than the rest of the write (tests/unit/test_bpf_layout.py
# checks them against the ctypes classes).
_POLICY_KEY = struct.Struct("<IIQBBHI")
_POLICY_VALUE = struct.Struct("<B3xI")


def policy_key_bytes(endpoint_id: int, key: PolicyKeyTuple) -> bytes:
    """bytes(policy_key(endpoint_id, key)), packed directly."""
    ident, d, proto, base, plen = key
    return _POLICY_KEY.pack(plen, ident, endpoint_id, d, proto, socket.htons(base), 0)


def policy_value_bytes(verdict: int, cookie: int) -> bytes:
    return _POLICY_VALUE.pack(verdict, cookie)


def _key_tuple(k: L.PolicyKey) -> PolicyKeyTuple:
    return (k.identity, k.dir, k.proto, L.port_host(k.dport), k.prefixlen)


class Policy(BpfMap[L.PolicyKey, L.PolicyValue]):
    """Policy entries of every local endpoint (see the module docs)."""

    def __init__(
        self,
        spec: MapSpec,
        fd: int,
        pin_path: str,
        endpoints: Endpoints,
        budget: int,
        *,
        prefixes: PrefixPolicy,
    ) -> None:
        super().__init__(spec, fd, pin_path)
        self._endpoints = endpoints
        self.budget = budget
        self.prefixes = prefixes
        # endpoint id -> {key tuple: (verdict, cookie)} as in the map; read
        # back from the pinned map, so it survives a restart.
        self._index: dict[int, dict[PolicyKeyTuple, tuple[int, int]]] = {}
        for k, v in self.items():
            self._index.setdefault(k.ep_id, {})[_key_tuple(k)] = (v.verdict, v.cookie)
        # The last expansions by their entries: the endpoints of a node
        # often have the same entries (a namespace's rule over its pods).
        self._expanded: collections.OrderedDict[
            tuple[PolicyEntry, ...], dict[PolicyKeyTuple, tuple[int, int]]
        ] = collections.OrderedDict()

    def _expand(self, entries: Sequence[PolicyEntry]) -> dict[PolicyKeyTuple, tuple[int, int]]:
        """expand(entries), the same dict for the same entries (not to be
        changed by the caller)."""
        key = tuple(entries)
        desired = self._expanded.get(key)
        if desired is None:
            desired = self._expanded[key] = expand(key)
            if len(self._expanded) > EXPANDED_KEPT:
                self._expanded.popitem(last=False)
        else:
            self._expanded.move_to_end(key)
        return desired

    def apply(
        self,
        endpoint_id: int,
        entries: Sequence[PolicyEntry],
        revision: int,
        ingress_enforced: bool = True,
        egress_enforced: bool = True,
        *,
        prefixes: Sequence[PrefixRule] = (),
        audit: bool = False,
        dns_proxy: bool = False,
    ) -> int:
        """Replaces the endpoint's entries, then marks its policy realized
        at revision (traffic flows from then on). Entries are written
        before stale ones are removed, denies first. Returns the number of
        map keys the endpoint now has. Only addresses already in the
        endpoints map are marked ready: call it after endpoints.upsert()
        (a new address of an endpoint inherits the state of its others).
        prefixes: Kubernetes ipBlocks over peer addresses (prefixpolicy);
        audit: policy audit mode (what the policy drops passes, reported)."""
        desired = self._expand(entries)
        try:
            desired_prefixes = expand_prefixes(prefixes)
        except PrefixPortsExceeded as exc:
            raise PolicyBudgetExceeded(f"endpoint {endpoint_id}: {exc}") from None
        total = len(desired) + len(desired_prefixes)
        if total > self.budget:
            raise PolicyBudgetExceeded(
                f"endpoint {endpoint_id}: {total} policy entries, budget {self.budget}",
                needed=total,
            )
        self._write(endpoint_id, desired)
        self.prefixes.write(endpoint_id, desired_prefixes)
        self._endpoints.set_policy_state(
            endpoint_id,
            revision,
            ingress_enforced,
            egress_enforced,
            prefix_policy=bool(desired_prefixes),
            audit=audit,
            dns_proxy=dns_proxy,
        )
        return total

    def _write(self, endpoint_id: int, desired: dict[PolicyKeyTuple, tuple[int, int]]) -> None:
        current = self._index.setdefault(endpoint_id, {})
        get = current.get
        changed = [(key, value) for key, value in desired.items() if get(key) != value]
        deny = L.Verdict.DENY
        if any(value[0] == deny for _, value in changed):
            changed.sort(key=lambda kv: kv[1][0] != deny)  # stable: denies first
        # One syscall per 4096 keys (in order: denies first): a rule over
        # 250 peers is 500 keys per endpoint, on every endpoint it selects.
        pack_key, pack_value = _POLICY_KEY.pack, _POLICY_VALUE.pack
        htons = socket.htons
        keys = [
            pack_key(plen, ident, endpoint_id, d, proto, htons(base), 0)
            for (ident, d, proto, base, plen), _ in changed
        ]
        values = [pack_value(verdict, cookie) for _, (verdict, cookie) in changed]
        try:
            self.update_batch_raw(keys, values)
        except OSError:
            # Part of it may be in: the index follows the map (a rare path).
            for key, _ in changed:
                v = self.get(policy_key(endpoint_id, key))
                if v is None:
                    current.pop(key, None)
                else:
                    current[key] = (v.verdict, v.cookie)
            raise
        current.update(changed)
        if len(current) > len(desired):  # (else every key is desired)
            for key in [k for k in current if k not in desired]:
                self.delete(policy_key(endpoint_id, key))
                del current[key]

    def lockdown(self, endpoint_id: int, revision: int) -> int:
        """Deny all, both directions (an over-budget policy, as Cilium's
        policy-map overflow lockdown): the endpoint's keys and prefix
        entries go, it is marked ready, enforced both ways, with a new
        generation (established connections are judged again, and cut).
        Host -> pod stays allowed by the config (allow-localhost)."""
        return self.apply(endpoint_id, (), revision, True, True)

    def apply_host(self, entries: Sequence[PolicyEntry]) -> int:
        """Replaces the host endpoint's entries (L.HOST_EP_ID; the host
        firewall's flags in the config say what is enforced). Same budget
        and order as apply(); returns the number of keys."""
        desired = expand(entries)
        if len(desired) > self.budget:
            raise PolicyBudgetExceeded(
                f"host policy: {len(desired)} policy entries, budget {self.budget}",
                needed=len(desired),
            )
        self._write(L.HOST_EP_ID, desired)
        return len(desired)

    def clear_endpoint(self, endpoint_id: int) -> int:
        """Removes every entry of the endpoint (its traffic is then judged
        by its flags: remove the endpoint or mark it not ready first)."""
        current = self._index.pop(endpoint_id, {})
        for key in current:
            self.delete(policy_key(endpoint_id, key))
        return len(current) + self.prefixes.clear_endpoint(endpoint_id)

    def entry_count(self, endpoint_id: int) -> int:
        return len(self._index.get(endpoint_id, {}))

    def endpoint_ids(self) -> list[int]:
        return [ep for ep, keys in self._index.items() if keys]

    def keys_of(self, endpoint_id: int) -> dict[PolicyKeyTuple, tuple[int, int]]:
        return dict(self._index.get(endpoint_id, {}))

    def verdict(
        self, endpoint_id: int, peer: int, direction: L.Direction, proto: int, port: int
    ) -> int:
        """What the datapath would decide for a new connection: 0 (allowed)
        or the drop reason (same algorithm as policy_check in C)."""
        results = []
        for ident in (peer, 0):
            k = L.PolicyKey(
                prefixlen=L.POLICY_PREFIX_FULL,
                identity=ident,
                ep_id=endpoint_id,
                dir=int(direction),
                proto=proto,
                dport=L.port_be(port),
            )
            v = self.get(k)
            results.append(v.verdict if v is not None else 0)
        if L.Verdict.DENY in results:
            return int(L.DropReason.POLICY_DENY)
        if L.Verdict.ALLOW in results:
            return 0
        if L.Verdict.L4_ONLY in results:
            return int(L.DropReason.POLICY_L4)
        return int(L.DropReason.POLICY_L3)
