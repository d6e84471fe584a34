"""Control-plane watch streams -> desired state of the datapath's maps.

Each stream feeds a typed table (flagella.common.sync.StreamSource) through
a codec here, which translates its events into the datapath's own records
(prefix -> identity, identity -> IdentityPolicy, service id -> Service); the
table then drives a reconciler (flagella.common.sync.reconcile). What a
stream needs beyond desired state is here too: the policy stream's SYNCED
(the endpoints' policy realized at a revision), the backends a service
change removed.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common.portnames import NamedPort, port_name_error
from flagella.common.sync import Batch, Change, StreamSource
from flagella.common.sync.reconcile import Target
from flagella.datapath import namedports
from flagella.datapath.bpf import Backend, Frontend, Service, frontend_rev_nat_id
from flagella.datapath.bpf.layout import Direction, Verdict
from flagella.datapath.bpf.policy import PolicyEntry
from flagella.datapath.bpf.prefixpolicy import PrefixRule
from flagella.datapath.namedports import IPCacheValue
from flagella.datapath.service import DatapathService, IdentityPolicy

log = logging.getLogger(__name__)

AFFINITY_DEFAULT_S = 10800
K = TypeVar("K")


def _prefix(p: str) -> str:
    """ipcache keys: a bare IP becomes a host prefix."""
    return str(ipaddress.ip_network(p, strict=False))


class IPCacheCodec:
    """WatchIPCache events -> prefix: identity."""

    def key(self, event: policy_pb2.IPCacheEvent) -> str:
        try:
            return _prefix(event.entry.prefix)
        except ValueError:
            return event.entry.prefix  # decode() drops it

    def decode(self, event: policy_pb2.IPCacheEvent) -> int | None:
        try:
            _prefix(event.entry.prefix)
        except ValueError as exc:
            log.warning("ipcache entry not programmable", extra={"reason": str(exc)})
            return None
        return event.entry.identity


class IPCacheEntryCodec:
    """WatchIPCache events -> prefix: identity and the endpoint's named
    ports (what the datapath keeps: flagella.datapath.namedports)."""

    def __init__(self) -> None:
        self.identities = IPCacheCodec()

    def key(self, event: policy_pb2.IPCacheEvent) -> str:
        return self.identities.key(event)

    def decode(self, event: policy_pb2.IPCacheEvent) -> IPCacheValue | None:
        identity = self.identities.decode(event)
        if identity is None:
            return None
        ports = (
            NamedPort(p.name, p.port, int(p.protocol))
            for p in event.entry.named_ports
            if not port_name_error(p.name) and 0 < p.port <= 0xFFFF
        )
        return IPCacheValue(identity, tuple(sorted(ports)))


class Identities(Generic[K]):
    """A Target of identities fed by a table of IPCacheValues."""

    def __init__(self, target: Target[K, int]) -> None:
        self.target = target

    @property
    def revision(self) -> int:
        return self.target.revision

    def replace_all(self, items: dict[K, IPCacheValue]) -> int:
        return self.target.replace_all({k: v.identity for k, v in items.items()})

    def upsert(self, key: K, value: IPCacheValue) -> int:
        return self.target.upsert(key, value.identity)

    def delete(self, key: K) -> int:
        return self.target.delete(key)


DIRECTIONS = {
    policy_pb2.DIRECTION_INGRESS: Direction.INGRESS,
    policy_pb2.DIRECTION_EGRESS: Direction.EGRESS,
}
VERDICTS = {policy_pb2.VERDICT_ALLOW: Verdict.ALLOW, policy_pb2.VERDICT_DENY: Verdict.DENY}


EntryKey = tuple[int, int, int, int, int, int, str]


def identity_policy(
    p: policy_pb2.ResolvedPolicy, interned: dict[EntryKey, PolicyEntry] | None = None
) -> IdentityPolicy:
    """interned: entries already made, by their fields (the policies of a
    node's identities share most entries: a rule over 250 peers is the same
    250 entries in each of 250 policies), reused and added to."""
    made = {} if interned is None else interned
    out: list[PolicyEntry] = []
    for e in p.entries:
        key = (e.identity, e.direction, e.verdict, e.protocol, e.port, e.end_port, e.port_name)
        entry = made.get(key)
        if entry is None:
            if e.direction not in DIRECTIONS or e.verdict not in VERDICTS:
                continue
            entry = made[key] = PolicyEntry(
                identity=e.identity,
                direction=DIRECTIONS[e.direction],
                verdict=VERDICTS[e.verdict],
                protocol=int(e.protocol),
                port=e.port,
                end_port=e.end_port,
                port_name=e.port_name,
            )
        out.append(entry)
    entries = tuple(out)
    return IdentityPolicy(
        identity=p.identity,
        revision=p.revision,
        ingress_enforced=p.ingress_enforced,
        egress_enforced=p.egress_enforced,
        entries=entries,
        named=namedports.has_named(entries),
        named_egress=namedports.egress_peers(entries),
        prefixes=tuple(
            PrefixRule(
                prefix=e.prefix,
                direction=DIRECTIONS[e.direction],
                ports=tuple((int(x.protocol), x.port, x.end_port) for x in e.ports),
            )
            for e in p.prefix_entries
            if e.direction in DIRECTIONS
        ),
        revision_time=p.revision_time.ToNanoseconds() / 1e9 if p.HasField("revision_time") else 0.0,
        error=p.error,
        ingress_rules=tuple(p.ingress_rules),
        egress_rules=tuple(p.egress_rules),
        dns_proxy=p.dns_proxy,
        dns_rules=tuple(p.dns_rules),
    )


class PolicyCodec:
    """WatchPolicy events -> identity: its resolved policy."""

    # Interned entries beyond this many are dropped (all at once): ~4 MiB.
    INTERNED_MAX = 1 << 14

    def __init__(self) -> None:
        self.interned: dict[EntryKey, PolicyEntry] = {}

    def key(self, event: policy_pb2.PolicyEvent) -> int:
        return event.identity or event.policy.identity

    def decode(self, event: policy_pb2.PolicyEvent) -> IdentityPolicy:
        if len(self.interned) > self.INTERNED_MAX:
            self.interned.clear()
        pol = identity_policy(event.policy, self.interned)
        if event.policy.error:
            log.warning(
                "policy over budget: enforcing it fail-closed",
                extra={"identity": pol.identity, "reason": event.policy.error},
            )
        return pol


class IdentityPolicies:
    """The policy table onto the endpoints' policy reconciler: each local
    endpoint desires the policy of its identity."""

    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc

    @property
    def revision(self) -> int:
        return self.svc.policy.revision

    def replace_all(self, items: dict[int, IdentityPolicy]) -> int:
        self.svc.resync_policies(items)
        return self.revision

    def upsert(self, key: int, value: IdentityPolicy) -> int:
        self.svc.set_identity_policy(value, key)
        return self.revision

    def delete(self, key: int) -> int:
        self.svc.set_identity_policy(None, key)
        return self.revision


class PolicySynced:
    """After each batch of the policy table: the endpoints' policy is
    realized at the revision the stream is complete at (its last SYNCED;
    DatapathService.policy_synced)."""

    def __init__(
        self,
        policy_synced: Callable[[int], Awaitable[None]],
        source: StreamSource[int, IdentityPolicy],
    ) -> None:
        self.policy_synced = policy_synced
        self.source = source
        self.revision = 0

    async def __call__(self, batch: Batch[int, IdentityPolicy], revision: int) -> None:
        # Read before anything awaits: the batch just applied holds every
        # change up to the source's last SYNCED.
        synced = self.source.revision
        if synced > self.revision:
            self.revision = synced
            await self.policy_synced(synced)


def external_frontends(
    svc: lb_pb2.Service, proto: int, first_index: int, local_only: bool = False
) -> list[Frontend]:
    """A service's external addresses (LB-IPAM's, then its external IPs),
    answered on every node at the service's port and translated as a node
    port is (SNAT to the node when the backend is elsewhere; under
    externalTrafficPolicy Local, only this node's backends)."""
    family = ipaddress.ip_address(svc.frontend.address).version
    # LB-IPAM gives at most one address per family: the external IPs'
    # rev-NAT ids do not move when it comes or goes.
    numbered = [
        *((first_index + i, ip) for i, ip in enumerate(svc.load_balancer.ingress[:2])),
        *((first_index + 2 + i, ip) for i, ip in enumerate(svc.external_ips)),
    ]
    out: list[Frontend] = []
    for index, ip in numbered:
        if ipaddress.ip_address(ip).version != family:
            continue  # NAT46 not offered, as for node ports
        rev_nat = frontend_rev_nat_id(svc.rev_nat_id, index)
        out.append(
            Frontend(ip, svc.frontend.port, proto, rev_nat, nodeport=True, local_only=local_only)
        )
    return out


def bpf_service(
    svc: lb_pb2.Service,
    table: lb_pb2.MaglevTable | None,
    node_ips: tuple[str, ...],
    node_name: str = "",
) -> Service:
    """What the maps need of a service. A backend is this node's when its
    node is node_name (Cilium's test of an EndpointSlice's nodeName): what
    externalTrafficPolicy Local balances outside traffic over."""
    proto = int(svc.frontend.protocol)
    local_only = svc.external_traffic_policy == lb_pb2.TRAFFIC_POLICY_LOCAL
    frontends = [
        Frontend(
            svc.frontend.address, svc.frontend.port, proto, frontend_rev_nat_id(svc.rev_nat_id, 0)
        )
    ]
    if svc.type == lb_pb2.SERVICE_TYPE_NODE_PORT and svc.node_port:
        family = ipaddress.ip_address(svc.frontend.address).version
        for i, ip in enumerate(node_ips, start=1):
            # A node address of the other family would need the backends
            # translated across families (NAT46): not offered.
            if ipaddress.ip_address(ip).version != family:
                continue
            frontends.append(
                Frontend(
                    ip,
                    svc.node_port,
                    proto,
                    frontend_rev_nat_id(svc.rev_nat_id, i),
                    nodeport=True,
                    local_only=local_only,
                )
            )
    frontends += external_frontends(svc, proto, len(node_ips) + 1, local_only)
    affinity = 0
    if svc.session_affinity.type == lb_pb2.SessionAffinity.TYPE_CLIENT_IP:
        affinity = int(svc.session_affinity.timeout.ToSeconds()) or AFFINITY_DEFAULT_S
    maglev = svc.algorithm == lb_pb2.ALGORITHM_MAGLEV
    return Service(
        service_id=svc.id,
        frontends=tuple(frontends),
        backends=tuple(
            Backend(
                b.id,
                b.address,
                b.port,
                proto,
                int(b.state) or 1,
                local=bool(node_name) and b.node == node_name,
            )
            for b in svc.backends
        ),
        maglev=maglev and table is not None and bool(table.backend_ids),
        maglev_table=tuple(table.backend_ids) if maglev and table is not None else (),
        affinity_timeout=affinity,
        source_ranges=tuple(svc.source_ranges),
        name=svc.name,
        health_check_port=svc.health_check_node_port,
    )


class ServicesCodec:
    """WatchServices events -> service id: what the maps need of it."""

    def __init__(self, node_ips: tuple[str, ...], node_name: str = "") -> None:
        self.node_ips = node_ips
        self.node_name = node_name

    def key(self, event: lb_pb2.ServiceEvent) -> int:
        return event.service.id

    def decode(self, event: lb_pb2.ServiceEvent) -> Service | None:
        table = event.maglev_table if event.HasField("maglev_table") else None
        try:
            return bpf_service(event.service, table, self.node_ips, self.node_name)
        except ValueError as exc:
            log.warning(
                "service not programmable",
                extra={"service": event.service.name, "reason": str(exc)},
            )
            return None


def removed_backends(changes: Iterable[Change[int, Service]]) -> list[int]:
    """The backends the changes took out of their services (in the record
    before, not after), less any that a changed service uses now (an id
    freed and taken again)."""
    gone: set[int] = set()
    used: set[int] = set()
    for change in changes:
        after = {b.id for b in change.record.backends} if change.record else set()
        used |= after
        if change.prev is not None:
            gone |= {b.id for b in change.prev.backends} - after
    return sorted(gone - used)


class RemoveBackends:
    """After the services reconciler applied a batch of changes: the
    backends they removed go, with their conntrack and affinity entries."""

    def __init__(self, svc: DatapathService, *, timeout: float = 10.0) -> None:
        self.svc = svc
        self.timeout = timeout

    async def __call__(self, batch: Batch[int, Service], revision: int) -> None:
        if batch.snapshot:
            return
        gone = removed_backends(batch.changes)
        if not gone:
            return
        try:
            await self.svc.services.wait_until_reconciled(revision, timeout=self.timeout)
        except TimeoutError:
            # The lb took them out: they go even if a service still waits.
            log.warning(
                "services not applied before removing their backends",
                extra={"revision": revision, "backends": len(gone)},
            )
        await self.svc.writer.run(self.svc.bpf.remove_backends, gone)
