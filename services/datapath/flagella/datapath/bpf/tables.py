"""Domain wrappers of the node maps: endpoints, ipcache, config, metrics,
conntrack and masquerade (NAT)."""

from __future__ import annotations

import ctypes
import ipaddress
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.maps import BpfMap, PerCpuArray


def monotonic_ns() -> int:
    """The clock of bpf_ktime_get_ns()."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


# --- endpoints ---


@dataclass(frozen=True)
class EndpointState:
    """One local endpoint address as the endpoints map holds it."""

    ip: str
    endpoint_id: int
    ifindex: int
    identity: int
    mac: str
    node_mac: str
    flags: int
    policy_revision: int
    policy_gen: int

    @property
    def policy_ready(self) -> bool:
        return bool(self.flags & L.EP_F_POLICY_READY)


def _endpoint_state(k: L.EndpointKey, v: L.EndpointInfo) -> EndpointState:
    return EndpointState(
        ip=L.get_addr(k.addr),
        endpoint_id=v.ep_id,
        ifindex=v.ifindex,
        identity=v.identity,
        mac=L.mac_str(bytes(v.mac)),
        node_mac=L.mac_str(bytes(v.node_mac)),
        flags=v.flags,
        policy_revision=v.policy_revision,
        policy_gen=v.policy_gen,
    )


def endpoint_key(ip: str) -> L.EndpointKey:
    k = L.EndpointKey()
    L.set_addr(k.addr, ip)
    return k


class Endpoints(BpfMap[L.EndpointKey, L.EndpointInfo]):
    """cilium_lxc: local endpoint addresses. An endpoint's traffic is
    dropped (POLICY_NOT_READY) until Policy.apply() has run for it.

    Which keys each endpoint has is indexed (one walk of the map at first
    use, then kept by every write through this object: only this process
    writes the map), so that an endpoint's policy state is set without a
    walk of every endpoint's entries: on a dense node each policy apply
    walked all 250 endpoints' entries."""

    def __init__(self, spec: L.MapSpec, fd: int, pin_path: str) -> None:
        super().__init__(spec, fd, pin_path)
        # key bytes -> endpoint id, and endpoint id -> its key bytes; None
        # until first used.
        self._owner: dict[bytes, int] | None = None
        self._keys: dict[int, set[bytes]] = {}

    def _indexed(self) -> dict[int, set[bytes]]:
        if self._owner is None:
            self._owner, self._keys = {}, {}
            for k, v in self.items():
                self._own(bytes(k), v.ep_id)
        return self._keys

    def _own(self, raw: bytes, endpoint_id: int | None) -> None:
        """raw now belongs to endpoint_id (None: gone from the map)."""
        assert self._owner is not None
        before = self._owner.pop(raw, None)
        if before is not None:
            keys = self._keys.get(before)
            if keys is not None:
                keys.discard(raw)
                if not keys:
                    del self._keys[before]
        if endpoint_id is not None:
            self._owner[raw] = endpoint_id
            self._keys.setdefault(endpoint_id, set()).add(raw)

    def update(self, key: L.EndpointKey, value: L.EndpointInfo, flags: int = 0) -> None:
        super().update(key, value, flags)
        if self._owner is not None:
            self._own(bytes(key), value.ep_id)

    def delete(self, key: L.EndpointKey) -> bool:
        present = super().delete(key)
        if self._owner is not None:
            self._own(bytes(key), None)
        return present

    def update_batch_raw(self, keys: Sequence[bytes], values: Sequence[bytes]) -> int:
        try:
            return super().update_batch_raw(keys, values)
        finally:
            self._owner = None  # walked again at next use

    def _entries_of(self, endpoint_id: int) -> list[tuple[L.EndpointKey, L.EndpointInfo]]:
        """The endpoint's entries as the map has them now."""
        out = []
        for raw in sorted(self._indexed().get(endpoint_id, ())):
            k = L.EndpointKey.from_buffer_copy(raw)
            v = self.get(k)
            if v is not None and v.ep_id == endpoint_id:
                out.append((k, v))
        return out

    def upsert(
        self,
        endpoint_id: int,
        addresses: Iterable[str],
        *,
        ifindex: int,
        identity: int,
        mac: str,
        node_mac: str,
    ) -> None:
        """Writes one entry per address (bare IPs or CIDR notation). The
        policy state (ready flag, enforcement, revision) of the endpoint's
        existing entries is kept; a new endpoint starts not ready. An
        identity change keeps the state too: apply the new identity's
        policy with Policy.apply()."""
        ips = [a.split("/")[0] for a in addresses]
        existing = self.by_id(endpoint_id)
        flags = existing[0].flags if existing else 0
        revision = existing[0].policy_revision if existing else 0
        gen = existing[0].policy_gen if existing else 0
        for ip in ips:
            v = L.EndpointInfo(
                ep_id=endpoint_id,
                policy_revision=revision,
                ifindex=ifindex,
                identity=identity,
                flags=flags,
                policy_gen=gen,
            )
            ctypes.memmove(ctypes.addressof(v.mac), L.mac_bytes(mac), 6)
            ctypes.memmove(ctypes.addressof(v.node_mac), L.mac_bytes(node_mac), 6)
            self.update(endpoint_key(ip), v)
        for state in existing:
            if state.ip not in ips:
                self.delete(endpoint_key(state.ip))

    def remove(self, endpoint_id: int) -> int:
        """Deletes every address of the endpoint; returns how many."""
        return self.delete_many(endpoint_key(s.ip) for s in self.by_id(endpoint_id))

    def lookup(self, ip: str) -> EndpointState | None:
        k = endpoint_key(ip)
        v = self.get(k)
        return _endpoint_state(k, v) if v is not None else None

    def all(self) -> list[EndpointState]:
        return [_endpoint_state(k, v) for k, v in self.items()]

    def by_id(self, endpoint_id: int) -> list[EndpointState]:
        return [_endpoint_state(k, v) for k, v in self._entries_of(endpoint_id)]

    def realized_revision(self, endpoint_id: int) -> int | None:
        """Policy revision realized for the endpoint; None if not ready."""
        states = self.by_id(endpoint_id)
        if not states or not all(s.policy_ready for s in states):
            return None
        return min(s.policy_revision for s in states)

    def set_policy_state(
        self,
        endpoint_id: int,
        revision: int,
        ingress_enforced: bool,
        egress_enforced: bool,
        *,
        prefix_policy: bool = False,
        audit: bool = False,
        dns_proxy: bool = False,
    ) -> int:
        """Marks the endpoint's policy realized: ready, enforcement, revision,
        and a new policy generation (established connections are checked
        again against the new policy: audit switched off drops at once the
        connections only audit let through). Returns the entries updated."""
        n = 0
        for k, v in self._entries_of(endpoint_id):
            flags = L.EP_F_POLICY_READY
            if ingress_enforced:
                flags |= L.EP_F_INGRESS_ENFORCED
            if egress_enforced:
                flags |= L.EP_F_EGRESS_ENFORCED
            if prefix_policy:
                flags |= L.EP_F_PREFIX_POLICY
            if audit:
                flags |= L.EP_F_AUDIT
            if dns_proxy:
                flags |= L.EP_F_DNS_PROXY
            v.flags = flags
            v.policy_revision = revision
            v.policy_gen = (v.policy_gen + 1) & 0xFFFFFFFF
            self.update(k, v)
            n += 1
        return n

    def set_not_ready(self, endpoint_id: int) -> int:
        """Drops the endpoint's traffic again until its policy is applied."""
        n = 0
        for k, v in self._entries_of(endpoint_id):
            v.flags &= ~L.EP_F_POLICY_READY
            v.policy_gen = (v.policy_gen + 1) & 0xFFFFFFFF
            self.update(k, v)
            n += 1
        return n


# --- ipcache ---


def ipcache_key(prefix: str) -> L.IPCacheKey:
    family, raw, bits = L.prefix_bits(prefix)
    k = L.IPCacheKey(prefixlen=8 + bits, family=family)
    ctypes.memmove(ctypes.addressof(k.addr), raw, 16)
    return k


class IPCache(BpfMap[L.IPCacheKey, L.IPCacheValue]):
    """cilium_ipcache: IP/prefix -> identity (longest prefix wins; no match
    is world)."""

    def upsert(
        self, prefix: str, identity: int, *, tunnel_ip: str = "", cluster: bool = False
    ) -> None:
        """tunnel_ip: the node (IPv4) tunnel mode sends the prefix's traffic
        to; cluster: inside the cluster (never masqueraded)."""
        v = L.IPCacheValue(identity=identity, flags=L.IPC_F_CLUSTER if cluster else 0)
        if tunnel_ip:
            v.tunnel_ip[:] = list(ipaddress.IPv4Address(tunnel_ip).packed)
        self.update(ipcache_key(prefix), v)

    def remove(self, prefix: str) -> bool:
        return self.delete(ipcache_key(prefix))

    def lookup(self, ip: str) -> int:
        """The identity the datapath resolves for an address."""
        v = self.get(ipcache_key(ip))
        return v.identity if v is not None else int(L.Identity.WORLD)

    def entries(self) -> dict[str, int]:
        out = {}
        for k, v in self.items():
            out[L.decode_ipcache_key(k)["prefix"]] = v.identity
        return out


# --- config ---


@dataclass(frozen=True)
class NodeConfig:
    node_ip4: str = ""
    node_ip6: str = ""
    masquerade4: bool = False
    masquerade6: bool = False
    allow_host: bool = True
    verdict_events: bool = True
    # With verdict_events: only where the endpoint's policy is enforced in
    # the connection's direction (Cilium's policy-verdict filter).
    verdict_enforced_only: bool = False
    drop_events: bool = True
    nat_port_min: int = 61000
    nat_port_max: int = 65535
    # Tunnel mode: the VXLAN device pods of other nodes are reached through
    # (0: native routing, the host stack routes them), and its UDP port.
    tunnel_ifindex: int = 0
    tunnel_port: int = 0
    # Host firewall: a host policy is loaded, and the directions it enforces.
    host_policy: bool = False
    host_ingress: bool = False
    host_egress: bool = False
    # The DNS proxy's port (0: none; no pod's DNS is redirected).
    dns_proxy_port: int = 0


class Config(BpfMap[L.U32, L.DpConfig]):
    """The node's settings (one entry)."""

    def read(self) -> NodeConfig:
        v = self.get(L.U32(0)) or L.DpConfig()
        return NodeConfig(
            node_ip4=L.get_addr(v.node_ip4) if any(v.node_ip4.u8) else "",
            node_ip6=L.get_addr(v.node_ip6) if any(v.node_ip6.u8) else "",
            masquerade4=bool(v.flags & L.CFG_MASQUERADE4),
            masquerade6=bool(v.flags & L.CFG_MASQUERADE6),
            allow_host=bool(v.flags & L.CFG_ALLOW_HOST),
            verdict_events=bool(v.flags & L.CFG_VERDICT_EVENTS),
            verdict_enforced_only=bool(v.flags & L.CFG_VERDICT_ENFORCED),
            drop_events=bool(v.flags & L.CFG_DROP_EVENTS),
            nat_port_min=v.nat_port_min,
            nat_port_max=v.nat_port_max,
            tunnel_ifindex=v.tunnel_ifindex if v.flags & L.CFG_TUNNEL else 0,
            tunnel_port=L.port_host(v.tunnel_port) if v.flags & L.CFG_TUNNEL else 0,
            host_policy=bool(v.flags & L.CFG_HOST_POLICY),
            host_ingress=bool(v.flags & L.CFG_HOST_INGRESS),
            host_egress=bool(v.flags & L.CFG_HOST_EGRESS),
            dns_proxy_port=v.dns_proxy_port,
        )

    def write(self, cfg: NodeConfig) -> None:
        if not 0 < cfg.nat_port_min <= cfg.nat_port_max <= 65535:
            raise ValueError(f"bad NAT port range {cfg.nat_port_min}-{cfg.nat_port_max}")
        v = L.DpConfig(
            nat_port_min=cfg.nat_port_min,
            nat_port_max=cfg.nat_port_max,
            tunnel_ifindex=cfg.tunnel_ifindex,
            tunnel_port=socket.htons(cfg.tunnel_port),
            dns_proxy_port=cfg.dns_proxy_port,
        )
        if cfg.node_ip4:
            if L.ip_family(cfg.node_ip4) != 4:
                raise ValueError(f"node_ip4 {cfg.node_ip4} is not IPv4")
            L.set_addr(v.node_ip4, cfg.node_ip4)
        if cfg.node_ip6:
            if L.ip_family(cfg.node_ip6) != 6:
                raise ValueError(f"node_ip6 {cfg.node_ip6} is not IPv6")
            L.set_addr(v.node_ip6, cfg.node_ip6)
        flags = 0
        for on, bit in (
            (cfg.masquerade4, L.CFG_MASQUERADE4),
            (cfg.masquerade6, L.CFG_MASQUERADE6),
            (cfg.allow_host, L.CFG_ALLOW_HOST),
            (cfg.verdict_events, L.CFG_VERDICT_EVENTS),
            (cfg.verdict_events and cfg.verdict_enforced_only, L.CFG_VERDICT_ENFORCED),
            (cfg.drop_events, L.CFG_DROP_EVENTS),
            (cfg.tunnel_ifindex > 0, L.CFG_TUNNEL),
            (cfg.host_policy, L.CFG_HOST_POLICY),
            (cfg.host_policy and cfg.host_ingress, L.CFG_HOST_INGRESS),
            (cfg.host_policy and cfg.host_egress, L.CFG_HOST_EGRESS),
        ):
            if on:
                flags |= bit
        v.flags = flags
        self.update(L.U32(0), v)


# --- metrics ---


@dataclass(frozen=True)
class Counter:
    direction: L.Direction
    reason: int  # 0: forwarded; a DropReason; 255: events lost
    packets: int
    bytes: int


class Metrics(PerCpuArray[L.U32, L.MetricsValue]):
    """cilium_metrics: packets and bytes per (direction, reason)."""

    def counter(self, direction: L.Direction | int, reason: L.DropReason | int) -> Counter:
        v = self.get(L.U32(int(direction) * 256 + int(reason)))
        return Counter(
            L.Direction(direction), int(reason), v.packets if v else 0, v.bytes if v else 0
        )

    def drops(self, reason: L.DropReason | int, direction: L.Direction | int | None = None) -> int:
        dirs = [direction] if direction is not None else [L.Direction.INGRESS, L.Direction.EGRESS]
        return sum(self.counter(d, reason).packets for d in dirs)

    def forwarded(self, direction: L.Direction | int) -> int:
        return self.counter(direction, L.REASON_FORWARDED).packets

    def events_lost(self) -> int:
        return self.counter(L.Direction.UNSPECIFIED, L.METRIC_EVENTS_LOST).packets

    def nonzero(self) -> list[Counter]:
        out = []
        for k, v in self.items():
            if v.packets:
                d, r = divmod(k.value, 256)
                out.append(Counter(L.Direction(d), r, v.packets, v.bytes))
        return out


# --- conntrack and NAT ---


@dataclass(frozen=True)
class Tuple:
    src: str
    dst: str
    sport: int
    dport: int
    proto: int


def ct_key(t: Tuple, scope: int) -> L.CtKey:
    k = L.CtKey(sport=L.port_be(t.sport), dport=L.port_be(t.dport), proto=t.proto, scope=scope)
    L.set_addr(k.saddr, t.src)
    L.set_addr(k.daddr, t.dst)
    return k


def key_tuple(k: L.CtKey) -> Tuple:
    return Tuple(
        L.get_addr(k.saddr),
        L.get_addr(k.daddr),
        L.port_host(k.sport),
        L.port_host(k.dport),
        k.proto,
    )


@dataclass(frozen=True)
class CtGcResult:
    deleted: dict[str, int]
    alive: dict[str, int]


class Conntrack(BpfMap[L.CtKey, L.CtEntry]):
    """cilium_ct: one LRU map for every scope (egress, ingress, service)."""

    def lookup(self, t: Tuple, scope: int) -> L.CtEntry | None:
        return self.get(ct_key(t, scope))

    def gc(self, now_ns: int | None = None) -> int:
        """Deletes expired entries; returns how many."""
        return sum(self.gc_pass(now_ns).deleted.values())

    def gc_pass(self, now_ns: int | None = None) -> CtGcResult:
        """Deletes expired entries; what it deleted and left, per family."""
        now = monotonic_ns() if now_ns is None else now_ns
        result = CtGcResult({"ipv4": 0, "ipv6": 0}, {"ipv4": 0, "ipv6": 0})
        expired = []
        for k, v in self.items():
            family = L.addr_family(k.saddr)
            if v.expires <= now:
                expired.append((family, k))
            else:
                result.alive[family] += 1
        for family, k in expired:
            if self.delete(k):
                result.deleted[family] += 1
        return result

    def purge_backends(
        self, backend_ids: Iterable[int], targets: Iterable[tuple[str, int, int]] = ()
    ) -> int:
        """Deletes the service (and NodePort) entries that chose these
        backends (their next packet selects a live backend), and the
        client-side entries of connections translated to one of targets
        (address, port (0: any), protocol): a late answer of the removed
        backend is then no reply of the service's connection (it meets the
        client's ingress policy, untranslated) (Cilium #48288). Returns the
        connections re-balanced: the service and NodePort entries deleted."""
        ids = set(backend_ids)
        scopes = (L.CT_SCOPE_SERVICE, L.CT_SCOPE_NODEPORT)
        addrs: dict[tuple[str, int], set[int]] = {}
        for addr, port, proto in targets:
            addrs.setdefault((addr, proto), set()).add(port)

        def translated_to_target(k: L.CtKey, v: L.CtEntry) -> bool:
            if k.scope != L.CT_SCOPE_EGRESS or not v.rev_nat_id:
                return False
            ports = addrs.get((L.get_addr(k.daddr), k.proto))
            return ports is not None and (0 in ports or L.port_host(k.dport) in ports)

        balanced, translated = [], []
        for k, v in self.items():
            if k.scope in scopes and v.backend_id in ids:
                balanced.append(k)
            elif translated_to_target(k, v):
                translated.append(k)
        self.delete_many(translated)
        return self.delete_many(balanced)

    def entries(self, scope: int | None = None) -> list[tuple[Tuple, int, L.CtEntry]]:
        return [
            (key_tuple(k), k.scope, v) for k, v in self.items() if scope is None or k.scope == scope
        ]


class Nat(BpfMap[L.CtKey, L.NatValue]):
    """Masquerade state: NAT_OUT (pod tuple -> node address/port) and NAT_IN
    (reply tuple -> pod address/port)."""

    def gc(self, now_ns: int | None = None) -> int:
        now = monotonic_ns() if now_ns is None else now_ns
        doomed = []
        alive = 0
        for k, v in self.items():
            if v.expires <= now:
                doomed.append(k)
            else:
                alive += 1
        deleted = self.delete_many(doomed)
        self.stats.entries = alive
        return deleted

    def entries(self) -> list[tuple[Tuple, int, str, int]]:
        """(tuple, NAT_OUT/NAT_IN, translated address, translated port)."""
        return [
            (key_tuple(k), k.scope, L.get_addr(v.addr), L.port_host(v.port))
            for k, v in self.items()
        ]


@dataclass(frozen=True, order=True)
class SafeEntry:
    """One entry of the host policy's safety set: scope L.SAFE_*; addr
    only for SAFE_REMOTE; proto an IP protocol number."""

    scope: int
    port: int
    proto: int = L.PROTO_TCP
    addr: str = ""


class HostSafe(BpfMap[L.HostSafeKey, L.U32]):
    """The safety set: the node's traffic with its control plane, let
    through before any host policy."""

    @staticmethod
    def _key(e: SafeEntry) -> L.HostSafeKey:
        k = L.HostSafeKey(port=socket.htons(e.port), proto=e.proto, scope=e.scope)
        if e.addr:
            L.set_addr(k.addr, e.addr)
        return k

    def entries(self) -> set[SafeEntry]:
        return {
            SafeEntry(
                k.scope,
                L.port_host(k.port),
                k.proto,
                L.get_addr(k.addr) if any(k.addr.u8) else "",
            )
            for k, _ in self.items()
        }

    def replace(self, wanted: set[SafeEntry]) -> None:
        """Exactly wanted: new entries first, then the stale ones go."""
        current = self.entries()
        for e in sorted(wanted - current):
            self.update(self._key(e), L.U32(1))
        for e in sorted(current - wanted):
            self.delete(self._key(e))
