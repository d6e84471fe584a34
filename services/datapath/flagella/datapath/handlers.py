"""Control-plane watch streams -> desired state of the datapath's maps.

Each handler follows the snapshot/delta contract (follow.py): during a
snapshot (RESET..SYNCED) it collects, at SYNCED it replaces the desired
state wholesale (the reconciler prunes what the kernel has beyond it), and
deltas afterwards change single keys.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common.reconcile import Reconciler
from flagella.datapath.bpf import Backend, Frontend, Service, frontend_rev_nat_id
from flagella.datapath.bpf.layout import Direction, Verdict
from flagella.datapath.bpf.policy import PolicyEntry
from flagella.datapath.service import DatapathService, IdentityPolicy

log = logging.getLogger(__name__)

AFFINITY_DEFAULT_S = 10800


def _prefix(p: str) -> str:
    """ipcache keys: a bare IP becomes a host prefix."""
    return str(ipaddress.ip_network(p, strict=False))


class IPCacheHandler:
    def __init__(self, rec: Reconciler[str, int]) -> None:
        self.rec = rec
        self._snapshot: dict[str, int] | None = None

    async def reset(self) -> None:
        self._snapshot = {}

    async def upsert(self, event: Any) -> None:
        entry: policy_pb2.IPCacheEntry = event.entry
        if self._snapshot is not None:
            self._snapshot[_prefix(entry.prefix)] = entry.identity
        else:
            self.rec.upsert(_prefix(entry.prefix), entry.identity)

    async def delete(self, event: Any) -> None:
        prefix = _prefix(event.entry.prefix)
        if self._snapshot is not None:
            self._snapshot.pop(prefix, None)
        else:
            self.rec.delete(prefix)

    async def synced(self, revision: int) -> None:
        if self._snapshot is not None:
            self.rec.replace_all(self._snapshot)
            self._snapshot = None


DIRECTIONS = {
    policy_pb2.DIRECTION_INGRESS: Direction.INGRESS,
    policy_pb2.DIRECTION_EGRESS: Direction.EGRESS,
}
VERDICTS = {policy_pb2.VERDICT_ALLOW: Verdict.ALLOW, policy_pb2.VERDICT_DENY: Verdict.DENY}


def identity_policy(p: policy_pb2.ResolvedPolicy) -> IdentityPolicy:
    return IdentityPolicy(
        identity=p.identity,
        revision=p.revision,
        ingress_enforced=p.ingress_enforced,
        egress_enforced=p.egress_enforced,
        entries=tuple(
            PolicyEntry(
                identity=e.identity,
                direction=DIRECTIONS[e.direction],
                verdict=VERDICTS[e.verdict],
                protocol=int(e.protocol),
                port=e.port,
                end_port=e.end_port,
            )
            for e in p.entries
            if e.direction in DIRECTIONS and e.verdict in VERDICTS
        ),
    )


class PolicyHandler:
    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc
        self._snapshot: dict[int, IdentityPolicy] | None = None

    async def reset(self) -> None:
        self._snapshot = {}

    async def upsert(self, event: Any) -> None:
        pol = identity_policy(event.policy)
        if event.policy.error:
            log.warning(
                "policy over budget: enforcing it fail-closed",
                extra={"identity": pol.identity, "reason": event.policy.error},
            )
        if self._snapshot is not None:
            self._snapshot[pol.identity] = pol
        else:
            self.svc.set_identity_policy(pol, pol.identity)

    async def delete(self, event: Any) -> None:
        identity = event.identity or event.policy.identity
        if self._snapshot is not None:
            self._snapshot.pop(identity, None)
        else:
            self.svc.set_identity_policy(None, identity)

    async def synced(self, revision: int) -> None:
        if self._snapshot is not None:
            self.svc.resync_policies(self._snapshot)
            self._snapshot = None
        await self.svc.policy_synced(revision)
        self.svc.streams_synced["policy"] = True


def bpf_service(
    svc: lb_pb2.Service, table: lb_pb2.MaglevTable | None, node_ips: tuple[str, ...]
) -> Service:
    proto = int(svc.frontend.protocol)
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
                    ip, svc.node_port, proto, frontend_rev_nat_id(svc.rev_nat_id, i), nodeport=True
                )
            )
    affinity = 0
    if svc.session_affinity.type == lb_pb2.SessionAffinity.TYPE_CLIENT_IP:
        affinity = int(svc.session_affinity.timeout.ToSeconds()) or AFFINITY_DEFAULT_S
    maglev = svc.algorithm == lb_pb2.ALGORITHM_MAGLEV
    return Service(
        service_id=svc.id,
        frontends=tuple(frontends),
        backends=tuple(
            Backend(b.id, b.address, b.port, proto, int(b.state) or 1) for b in svc.backends
        ),
        maglev=maglev and table is not None and bool(table.backend_ids),
        maglev_table=tuple(table.backend_ids) if maglev and table is not None else (),
        affinity_timeout=affinity,
        source_ranges=tuple(svc.source_ranges),
    )


class ServicesHandler:
    def __init__(self, svc: DatapathService, node_ips: tuple[str, ...]) -> None:
        self.svc = svc
        self.node_ips = node_ips
        self._snapshot: dict[int, Service] | None = None

    async def reset(self) -> None:
        self._snapshot = {}

    async def upsert(self, event: Any) -> None:
        table = event.maglev_table if event.HasField("maglev_table") else None
        try:
            service = bpf_service(event.service, table, self.node_ips)
        except ValueError as exc:
            log.warning(
                "service not programmable",
                extra={"service": event.service.name, "reason": str(exc)},
            )
            return
        if self._snapshot is not None:
            self._snapshot[service.service_id] = service
            return
        rev = self.svc.services.upsert(service.service_id, service)
        if event.removed_backend_ids:
            await self.svc.services.wait_until_reconciled(rev, timeout=10)
            await self.svc.writer.run(self.svc.bpf.remove_backends, list(event.removed_backend_ids))

    async def delete(self, event: Any) -> None:
        if self._snapshot is not None:
            self._snapshot.pop(event.service.id, None)
            return
        rev = self.svc.services.delete(event.service.id)
        if event.removed_backend_ids:
            await self.svc.services.wait_until_reconciled(rev, timeout=10)
            await self.svc.writer.run(self.svc.bpf.remove_backends, list(event.removed_backend_ids))

    async def synced(self, revision: int) -> None:
        if self._snapshot is not None:
            self.svc.services.replace_all(self._snapshot)
            self._snapshot = None
        self.svc.streams_synced["services"] = True
