"""gRPC handlers of flagella.lb.v1: proto <-> domain and validation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, TypeVar

import grpc

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import FlagellaError, InvalidArgument, NotFound
from flagella.common.sync import Batching, Change, MessageCache, serve_watch
from flagella.lb.bgp import build_policy, validate_name
from flagella.lb.bgp import raw_from_cilium as raw_bgp_from_cilium
from flagella.lb.bgpservicer import BgpPolicyEvents, policy_to_proto, raw_policy
from flagella.lb.bgpstore import BgpPolicyStore
from flagella.lb.lbipam import (
    CONDITION_TYPE,
    Claimant,
    LbRequest,
    Pool,
    validate_pool,
    validate_request,
)
from flagella.lb.lbipam_store import Claim, LbIpam
from flagella.lb.lrp import build_lrp, raw_from_cilium, validate_key
from flagella.lb.lrpservicer import LrpEvents, lrp_to_proto, parse_document, raw_lrp
from flagella.lb.lrpstore import LrpStore
from flagella.lb.model import (
    Algorithm,
    BackendState,
    Frontend,
    Protocol,
    ServiceRecord,
    ServiceSpec,
    ServiceType,
    Source,
    TrafficPolicy,
)
from flagella.lb.service import LbService, WatchItem
from flagella.lb.validation import (
    MAX_BATCH,
    Limits,
    RawBackend,
    RawService,
    build_spec,
    check_batch,
    in_batch,
    lookup_name,
    validate_frontend,
)

pb = lb_pb2

_PROTOCOLS = {pb.PROTOCOL_TCP: Protocol.TCP, pb.PROTOCOL_UDP: Protocol.UDP}
_TYPES = {
    pb.SERVICE_TYPE_CLUSTER_IP: ServiceType.CLUSTER_IP,
    pb.SERVICE_TYPE_NODE_PORT: ServiceType.NODE_PORT,
}
_ALGORITHMS = {pb.ALGORITHM_RANDOM: Algorithm.RANDOM, pb.ALGORITHM_MAGLEV: Algorithm.MAGLEV}
_STATES = {
    pb.BACKEND_STATE_ACTIVE: BackendState.ACTIVE,
    pb.BACKEND_STATE_TERMINATING: BackendState.TERMINATING,
    pb.BACKEND_STATE_QUARANTINED: BackendState.QUARANTINED,
    pb.BACKEND_STATE_MAINTENANCE: BackendState.MAINTENANCE,
}
_POLICIES = {
    pb.TRAFFIC_POLICY_CLUSTER: TrafficPolicy.CLUSTER,
    pb.TRAFFIC_POLICY_LOCAL: TrafficPolicy.LOCAL,
}
_POLICY_PB = {v: k for k, v in _POLICIES.items()}
_PROTOCOL_PB = {v: k for k, v in _PROTOCOLS.items()}
_TYPE_PB = {v: k for k, v in _TYPES.items()}
_ALGORITHM_PB = {v: k for k, v in _ALGORITHMS.items()}
_STATE_PB = {v: k for k, v in _STATES.items()}


T = TypeVar("T")


def _enum(value: int, table: Mapping[Any, T], field: str, what: str) -> T | None:
    """The domain value of an enum field; None for UNSPECIFIED (0)."""
    if value == 0:
        return None
    try:
        return table[value]
    except KeyError:
        known = ", ".join(str(k) for k in sorted(table))
        raise InvalidArgument(f"{value} is not a known {what} ({known})", field=field) from None


def raw_from_proto(svc: lb_pb2.Service) -> RawService:
    """The request's service as plain values (enums checked)."""
    backends: list[RawBackend] = []
    # Output-only fields (ids, revision, source) are ignored, so that a
    # service read with GetService can be changed and upserted back.
    for i, b in enumerate(svc.backends):
        backends.append(
            RawBackend(
                address=b.address,
                port=b.port,
                weight=b.weight,
                state=_enum(b.state, _STATES, f"service.backends[{i}].state", "backend state"),
                node=b.node,
            )
        )
    aff = svc.session_affinity
    if aff.type not in (aff.TYPE_NONE, aff.TYPE_CLIENT_IP):
        raise InvalidArgument(
            f"{aff.type} is not a known affinity type", field="service.session_affinity.type"
        )
    timeout = (
        (aff.timeout.seconds, aff.timeout.nanos)
        if svc.HasField("session_affinity") and aff.HasField("timeout")
        else None
    )
    return RawService(
        name=svc.name,
        namespace=svc.namespace,
        frontend_address=svc.frontend.address,
        frontend_port=svc.frontend.port,
        protocol=_enum(svc.frontend.protocol, _PROTOCOLS, "service.frontend.protocol", "protocol"),
        type=_enum(svc.type, _TYPES, "service.type", "service type"),
        node_port=svc.node_port,
        backends=backends,
        algorithm=_enum(svc.algorithm, _ALGORITHMS, "service.algorithm", "algorithm"),
        maglev_table_size=svc.maglev_table_size,
        client_ip_affinity=aff.type == aff.TYPE_CLIENT_IP,
        affinity_timeout=timeout,
        source_ranges=list(svc.source_ranges),
        source=Source.API,
        labels=dict(svc.labels),
        external_traffic_policy=traffic_policy(svc.external_traffic_policy),
        external_ips=list(svc.external_ips),
        load_balancer=svc.HasField("load_balancer"),
        health_check_node_port=svc.health_check_node_port,
    )


def traffic_policy(value: int) -> TrafficPolicy:
    """externalTrafficPolicy (TRAFFIC_POLICY_CLUSTER, 0, is the default)."""
    try:
        return _POLICIES[value]  # type: ignore[index]
    except KeyError:
        known = ", ".join(str(k) for k in sorted(_POLICIES))
        raise InvalidArgument(
            f"{value} is not a known traffic policy ({known})",
            field="service.external_traffic_policy",
        ) from None


def frontend_from_proto(fe: lb_pb2.Frontend, field: str) -> Frontend:
    """A frontend to look up (GetService by frontend)."""
    protocol = _enum(fe.protocol, _PROTOCOLS, f"{field}.protocol", "protocol")
    return validate_frontend(fe.address, fe.port, protocol, field)


def lb_request_from_proto(svc: lb_pb2.Service, frontend_family: int) -> LbRequest | None:
    """The service's LoadBalancer request; None when it is not one."""
    if not svc.HasField("load_balancer"):
        return None
    lb = svc.load_balancer
    return validate_request(
        list(lb.requested_ips), lb.sharing_key, list(lb.families), frontend_family
    )


def claimant(rec: ServiceRecord, request: LbRequest) -> Claimant:
    ports = frozenset({(rec.frontend.protocol.value, rec.frontend.port)})
    return Claimant(rec.name, rec.namespace, dict(rec.labels), ports, request)


def service_to_proto(rec: ServiceRecord, claim: Claim | None = None) -> lb_pb2.Service:
    out = pb.Service(
        name=rec.name,
        namespace=rec.namespace,
        id=rec.id,
        rev_nat_id=rec.rev_nat_id,
        frontend=pb.Frontend(
            address=rec.frontend.address,
            port=rec.frontend.port,
            protocol=_PROTOCOL_PB[rec.frontend.protocol],
        ),
        type=_TYPE_PB[rec.type],
        node_port=rec.node_port,
        backends=[
            pb.Backend(
                id=b.id,
                address=b.address,
                port=b.port,
                weight=b.weight,
                state=_STATE_PB[b.state],
                node=b.node,
            )
            for b in rec.backends
        ],
        algorithm=_ALGORITHM_PB[rec.algorithm],
        source_ranges=list(rec.source_ranges),
        revision=rec.revision,
        source=rec.source.value,
        maglev_table_size=rec.maglev_table_size,
        labels=dict(rec.labels),
        external_traffic_policy=_POLICY_PB[rec.external_traffic_policy],
        external_ips=list(rec.external_ips),
        health_check_node_port=rec.health_check_node_port,
    )
    if rec.affinity is not None:
        out.session_affinity.type = pb.SessionAffinity.TYPE_CLIENT_IP
        out.session_affinity.timeout.seconds = rec.affinity.timeout_s
    if claim is not None:
        req = claim.claimant.request
        out.load_balancer.CopyFrom(
            pb.LoadBalancer(
                requested_ips=req.requested,
                sharing_key=req.sharing_key,
                families=req.families,
                ingress=claim.addresses,
                condition=pb.LbIpamCondition(
                    type=CONDITION_TYPE,
                    satisfied=claim.condition.satisfied,
                    reason=claim.condition.reason,
                    message=claim.condition.message,
                ),
            )
        )
    elif rec.external:
        # The watch stream's view: the addresses the datapaths serve.
        out.load_balancer.ingress.extend(rec.external)
    return out


def pool_to_proto(pool: Pool, used: int, conflict: str = "") -> lb_pb2.LbIpPool:
    blocks = []
    for b in pool.blocks:
        start, sep, stop = b.text.partition("-")
        blocks.append(pb.LbIpBlock(start=start, stop=stop) if sep else pb.LbIpBlock(cidr=b.text))
    return pb.LbIpPool(
        name=pool.name,
        blocks=blocks,
        service_selector=dict(pool.selector),
        disabled=pool.disabled,
        size=pool.size,
        used=used,
        source=pool.source,
        conflicting=bool(conflict),
        conflict_message=conflict,
    )


def table_to_proto(service_id: int, size: int, table: Sequence[int]) -> lb_pb2.MaglevTable:
    return pb.MaglevTable(service_id=service_id, size=size, backend_ids=table)


def event_to_proto(
    kind: lb_pb2.ServiceEvent.Kind.ValueType, item: WatchItem
) -> lb_pb2.ServiceEvent:
    ev = pb.ServiceEvent(
        kind=kind,
        revision=item.revision,
        removed_backend_ids=item.removed_backend_ids,
    )
    if item.record is not None:
        ev.service.CopyFrom(service_to_proto(item.record))
        if item.table is not None:
            ev.maglev_table.CopyFrom(
                table_to_proto(item.record.id, item.record.maglev_table_size, item.table)
            )
    elif item.deleted is not None:
        ev.service.name = item.deleted.name
        ev.service.id = item.deleted.id
        ev.service.rev_nat_id = item.deleted.rev_nat_id
    return ev


# UPSERT messages by service id, the change's revision, the revision of the
# record the watcher held before, and whether it carries a Maglev table (a
# Maglev table is ~40 KiB at M = 16,381, a service without one ~150 bytes).
EventCache = MessageCache[tuple[int, int, int, bool], lb_pb2.ServiceEvent]


class ServiceEvents:
    """The WatchServices messages of the table's changes (serve_watch's
    WatchMessages)."""

    def __init__(
        self, service: LbService, *, include_tables: bool, cache: EventCache | None = None
    ) -> None:
        self.service = service
        self.include_tables = include_tables
        self.cache = cache if cache is not None else EventCache(0)

    def reset(self, revision: int) -> lb_pb2.ServiceEvent:
        return pb.ServiceEvent(kind=pb.ServiceEvent.KIND_RESET, revision=revision)

    async def upsert(self, change: Change[int, ServiceRecord]) -> lb_pb2.ServiceEvent:
        prev, record = change.prev, change.record
        assert record is not None, "an upsert has its record"
        # Only a Maglev service's message differs with include_tables.
        with_table = self.include_tables and record.algorithm is Algorithm.MAGLEV
        key = (record.id, change.revision, -1 if prev is None else prev.revision, with_table)
        event = self.cache.get(key)
        if event is None:
            item = await self.service.watch_item(change, include_tables=self.include_tables)
            event = event_to_proto(pb.ServiceEvent.KIND_UPSERT, item)
            self.cache.put(key, event)
        return event

    async def delete(self, change: Change[int, ServiceRecord]) -> lb_pb2.ServiceEvent:
        item = await self.service.watch_item(change)
        return event_to_proto(pb.ServiceEvent.KIND_DELETE, item)

    def synced(self, revision: int) -> lb_pb2.ServiceEvent:
        return pb.ServiceEvent(kind=pb.ServiceEvent.KIND_SYNCED, revision=revision)


def batch_events(events: list[lb_pb2.ServiceEvent]) -> lb_pb2.ServiceEvent:
    """A KIND_BATCH message of events, at the revision of the last."""
    return pb.ServiceEvent(
        kind=pb.ServiceEvent.KIND_BATCH, revision=events[-1].revision, events=events
    )


# WatchServices with batch_events.
BATCHING = Batching(wrap=batch_events, size=lambda event: event.ByteSize())


class LbServicer(lb_pb2_grpc.LoadBalancerServiceServicer):
    def __init__(
        self,
        service: LbService,
        limits: Limits,
        lrps: LrpStore,
        *,
        heartbeat: float = 30.0,
        debuginfo: Debuginfo | None = None,
        ipam: LbIpam,
        bgp: BgpPolicyStore,
    ) -> None:
        self.service = service
        self.debuginfo = debuginfo
        self.limits = limits
        self.lrps = lrps
        self.ipam = ipam
        self.bgp = bgp
        # Seconds between SYNCED heartbeats on an idle WatchServices stream.
        self.heartbeat = heartbeat
        # What the WatchServices streams share: the newest message of each
        # service, with and without its Maglev table.
        self.events = EventCache(slot=lambda key: (key[0], key[3]))

    async def UpsertService(
        self, request: lb_pb2.UpsertServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.UpsertServiceResponse:
        if not request.HasField("service"):
            raise InvalidArgument("a service is required", field="service")
        spec = build_spec(raw_from_proto(request.service), self.limits)
        lb = lb_request_from_proto(request.service, spec.frontend.family)
        await self._check_lb_addresses(spec)
        record, created = await self.service.upsert(spec)
        record, claim = await self._claim(record, lb)
        return pb.UpsertServiceResponse(service=service_to_proto(record, claim), created=created)

    async def _check_lb_addresses(self, spec: ServiceSpec) -> None:
        await self.ipam.check_external_ips(spec.name, spec.external_frontends())

    async def _claim(
        self, record: ServiceRecord, lb: LbRequest | None
    ) -> tuple[ServiceRecord, Claim | None]:
        """LB-IPAM's answer for a stored service: its claim, or, no longer a
        LoadBalancer, its addresses freed; and the record as it is then
        (read again when its addresses changed)."""
        claim = None
        if lb is not None:
            claim = await self.ipam.claim(claimant(record, lb))
        elif await self.ipam.get(record.name) is not None:
            await self.ipam.release(record.name)
        if record.external != (claim.addresses if claim is not None else ()):
            record = await self.service.get_by_name(record.name)
        return record, claim

    async def UpsertServices(
        self, request: lb_pb2.UpsertServicesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.UpsertServicesResponse:
        if not request.services:
            raise InvalidArgument("at least one service is required", field="services")
        if len(request.services) > MAX_BATCH:
            raise InvalidArgument(
                f"{len(request.services)} services: at most {MAX_BATCH} per call", field="services"
            )
        specs = []
        lbs: list[LbRequest | None] = []
        for i, svc in enumerate(request.services):
            try:
                specs.append(build_spec(raw_from_proto(svc), self.limits))
                lbs.append(lb_request_from_proto(svc, specs[-1].frontend.family))
            except FlagellaError as exc:
                raise in_batch(exc, i) from None
        check_batch(specs)
        for i, spec in enumerate(specs):
            try:
                await self._check_lb_addresses(spec)
            except FlagellaError as exc:
                raise in_batch(exc, i) from None
        results = await self.service.upsert_many(specs)
        # One read of the claims for the batch: only LoadBalancer services
        # and former ones cost LB-IPAM a transaction.
        claims = await self.ipam.claims()
        out = []
        for (stored, created), lb in zip(results, lbs, strict=True):
            record, claim = stored, None
            if lb is not None or record.name in claims:
                record, claim = await self._claim(stored, lb)
            out.append(
                pb.UpsertServiceResponse(service=service_to_proto(record, claim), created=created)
            )
        return pb.UpsertServicesResponse(results=out)

    async def GetService(
        self, request: lb_pb2.GetServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.Service:
        by = request.WhichOneof("by")
        if by == "name":
            record = await self.service.get_by_name(lookup_name(request.name))
        elif by == "id":
            record = await self.service.get_by_id(request.id)
        elif by == "frontend":
            record = await self.service.get_by_frontend(
                frontend_from_proto(request.frontend, "frontend")
            )
        else:
            raise InvalidArgument("give one of name, id, frontend", field="by")
        return service_to_proto(record, await self.ipam.get(record.name))

    async def DeleteService(
        self, request: lb_pb2.DeleteServiceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.DeleteServiceResponse:
        lookup_name(request.name)
        deleted = await self.service.delete(request.name)
        if deleted:
            await self.ipam.release(request.name)
        return pb.DeleteServiceResponse(deleted=deleted)

    async def ListServices(
        self, request: lb_pb2.ListServicesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.ListServicesResponse:
        records, revision = await self.service.list_services(request.namespace)
        claims = await self.ipam.claims()
        return pb.ListServicesResponse(
            services=[service_to_proto(r, claims.get(r.name)) for r in records], revision=revision
        )

    async def WatchServices(
        self, request: lb_pb2.WatchServicesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[lb_pb2.ServiceEvent]:
        since = request.since_revision
        if since < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        events = ServiceEvents(
            self.service, include_tables=request.include_maglev_tables, cache=self.events
        )
        async for event in serve_watch(
            self.service.subscribe(since),
            events,
            since=since,
            heartbeat=self.heartbeat,
            batching=BATCHING if request.batch_events else None,
        ):
            yield event

    async def GetMaglevTable(
        self, request: lb_pb2.GetMaglevTableRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.MaglevTable:
        lookup_name(request.name)
        record, table = await self.service.maglev_table(request.name)
        return table_to_proto(record.id, record.maglev_table_size, table)

    async def GetDebuginfo(
        self, request: lb_pb2.GetDebuginfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.Debuginfo:
        state = {
            "services": await self.ListServices(pb.ListServicesRequest(), context),
            # Passwords left out, as every answer but the nodes' stream.
            "bgp_peering_policies": await self.ListBgpPeeringPolicies(
                pb.ListBgpPeeringPoliciesRequest(), context
            ),
        }
        return answer(self.debuginfo, pb.Debuginfo(), state)

    # --- local redirect policies (flagella.lb.lrp) ---

    async def CreateLrp(
        self, request: lb_pb2.CreateLrpRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.CreateLrpResponse:
        if request.document and request.HasField("lrp"):
            raise InvalidArgument("give lrp or document, not both", field="document")
        if request.document:
            raw = raw_from_cilium(parse_document(request.document))
        elif request.HasField("lrp"):
            raw = raw_lrp(request.lrp)
        else:
            raise InvalidArgument("a policy is required", field="lrp")
        lrp, created = await self.lrps.put(build_lrp(raw))
        return pb.CreateLrpResponse(lrp=lrp_to_proto(lrp), created=created)

    async def DeleteLrp(
        self, request: lb_pb2.DeleteLrpRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.DeleteLrpResponse:
        validate_key(request.namespace, request.name, prefix="")
        return pb.DeleteLrpResponse(deleted=await self.lrps.delete(request.namespace, request.name))

    async def GetLrp(
        self, request: lb_pb2.GetLrpRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.GetLrpResponse:
        if request.name:
            validate_key(request.namespace, request.name, prefix="")
            lrp = await self.lrps.get(request.namespace, request.name)
            if lrp is None:
                raise NotFound(
                    f"no local redirect policy {request.namespace}/{request.name}", field="name"
                )
            return pb.GetLrpResponse(lrps=[lrp_to_proto(lrp)], revision=lrp.revision)
        if request.namespace:
            validate_key(request.namespace, "x", prefix="")
        lrps, revision = await self.lrps.list(request.namespace)
        return pb.GetLrpResponse(lrps=[lrp_to_proto(r) for r in lrps], revision=revision)

    async def WatchLrps(
        self, request: lb_pb2.WatchLrpsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[lb_pb2.LrpEvent]:
        since = request.since_revision
        if since < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        async for event in serve_watch(
            self.lrps.subscribe(since), LrpEvents(), since=since, heartbeat=self.heartbeat
        ):
            yield event

    # --- LB-IPAM pools ---

    async def UpsertLbIpPool(
        self, request: lb_pb2.UpsertLbIpPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.UpsertLbIpPoolResponse:
        if not request.HasField("pool"):
            raise InvalidArgument("a pool is required", field="pool")
        p = request.pool
        pool = validate_pool(
            p.name,
            [(b.cidr, b.start, b.stop) for b in p.blocks],
            dict(p.service_selector),
            p.disabled,
        )
        created, used = await self.ipam.upsert_pool(pool)
        return pb.UpsertLbIpPoolResponse(pool=pool_to_proto(pool, used), created=created)

    async def DeleteLbIpPool(
        self, request: lb_pb2.DeleteLbIpPoolRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.DeleteLbIpPoolResponse:
        if not request.name:
            raise InvalidArgument("a pool name is required", field="name")
        return pb.DeleteLbIpPoolResponse(deleted=await self.ipam.delete_pool(request.name))

    async def ListLbIpPools(
        self, request: lb_pb2.ListLbIpPoolsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> lb_pb2.ListLbIpPoolsResponse:
        pools = await self.ipam.list_pools()
        return pb.ListLbIpPoolsResponse(
            pools=[pool_to_proto(p.pool, p.used, p.conflict) for p in pools]
        )

    # --- BGP peering policies (flagella.lb.bgp) ---

    async def UpsertBgpPeeringPolicy(
        self,
        request: lb_pb2.UpsertBgpPeeringPolicyRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> lb_pb2.UpsertBgpPeeringPolicyResponse:
        if request.document and request.HasField("policy"):
            raise InvalidArgument("give policy or document, not both", field="document")
        if request.document:
            raw = raw_bgp_from_cilium(parse_document(request.document))
        elif request.HasField("policy"):
            raw = raw_policy(request.policy)
        else:
            raise InvalidArgument("a policy is required", field="policy")
        for i, vr in enumerate(raw.virtual_routers):
            for j, n in enumerate(vr.neighbors):
                if n.auth_secret_ref:
                    raise InvalidArgument(
                        "a Secret reference is for Kubernetes objects; give the password",
                        field=f"policy.virtual_routers[{i}].neighbors[{j}].auth_secret_ref",
                    )
        policy, created = await self.bgp.put(build_policy(raw))
        return pb.UpsertBgpPeeringPolicyResponse(policy=policy_to_proto(policy), created=created)

    async def DeleteBgpPeeringPolicy(
        self,
        request: lb_pb2.DeleteBgpPeeringPolicyRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> lb_pb2.DeleteBgpPeeringPolicyResponse:
        validate_name(request.name, field="name")
        return pb.DeleteBgpPeeringPolicyResponse(deleted=await self.bgp.delete(request.name))

    async def ListBgpPeeringPolicies(
        self,
        request: lb_pb2.ListBgpPeeringPoliciesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> lb_pb2.ListBgpPeeringPoliciesResponse:
        policies, revision = await self.bgp.list()
        return pb.ListBgpPeeringPoliciesResponse(
            policies=[policy_to_proto(p) for p in policies], revision=revision
        )

    async def WatchBgpPeeringPolicies(
        self,
        request: lb_pb2.WatchBgpPeeringPoliciesRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[lb_pb2.BgpPeeringPolicyEvent]:
        since = request.since_revision
        if since < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        async for event in serve_watch(
            self.bgp.subscribe(since), BgpPolicyEvents(), since=since, heartbeat=self.heartbeat
        ):
            yield event
