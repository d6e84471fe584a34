"""gRPC handlers of flagella.datapath.v1: proto <-> domain and validation."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import InvalidArgument
from flagella.common.portnames import NamedPort, check_named_ports, protocol_name
from flagella.common.runtimeconfig import validate_endpoint_options
from flagella.datapath import bgpservicer
from flagella.datapath.bgp.speaker import Speaker
from flagella.datapath.bpf.mapevents import UPDATE
from flagella.datapath.bpf.prefilter import MAX_ENTRIES, IPNetwork
from flagella.datapath.flows import FlowFilter, FlowRecord
from flagella.datapath.health import PeerHealth
from flagella.datapath.prefilter import PrefilterState, parse_cidrs
from flagella.datapath.service import (
    DatapathService,
    DecodedMapEvent,
    PolicyMapState,
    SetupRequest,
)
from flagella.datapath.state import EndpointRecord, HostPolicyState

MAX_WAIT_S = 300.0


def _seconds(value: Timestamp | Duration, field: str) -> float:
    """A timestamp's or duration's seconds; one outside the well-known
    type's range (nanos -1, seconds 2**63 - 1) is a bad argument."""
    try:
        return value.ToNanoseconds() / 1e9
    except ValueError as exc:
        raise InvalidArgument(str(exc), field=field) from None


def _map_info(m: Any, rec_by_map: dict[str, Any]) -> datapath_pb2.MapInfo:
    rec = rec_by_map.get(m.name)
    return datapath_pb2.MapInfo(
        name=m.name,
        pin_path=m.pin_path,
        type=m.type,
        key_size=m.key_size,
        value_size=m.value_size,
        max_entries=m.max_entries,
        entries=m.entries,
        pending=rec.pending if rec else 0,
        errors=rec.errors if rec else 0,
    )


def endpoint_to_proto(
    rec: EndpointRecord,
    realized: int | None,
    attached: bool,
    policy_map: PolicyMapState | None = None,
) -> datapath_pb2.DatapathEndpoint:
    pm = policy_map or PolicyMapState(0, 0)
    return datapath_pb2.DatapathEndpoint(
        endpoint_id=rec.endpoint_id,
        container_id=rec.container_id,
        netns_path=rec.netns_path,
        ifname=rec.ifname,
        host_ifname=rec.host_ifname,
        host_ifindex=rec.host_ifindex,
        mac=rec.mac,
        addresses=rec.addresses,
        identity=rec.identity,
        realized_policy_revision=realized or 0,
        programs_attached=attached,
        named_ports=[
            datapath_pb2.NamedPort(name=p.name, port=p.port, protocol=p.protocol)
            for p in rec.named_ports
        ],
        policy_overflow=pm.overflow,
        policy_map_entries=pm.entries,
        policy_map_desired=pm.desired,
        options=rec.options,
    )


def named_ports_of(ports: Iterable[datapath_pb2.NamedPort], field: str) -> tuple[NamedPort, ...]:
    out, where, reason = check_named_ports(
        [(p.name, p.port, protocol_name(p.protocol)) for p in ports]
    )
    if where:
        raise InvalidArgument(reason, field=f"{field}{where}")
    return tuple(out)


def flow_to_proto(f: FlowRecord, node: str) -> datapath_pb2.Flow:
    ts = Timestamp()
    ts.FromNanoseconds(int(f.time * 1e9))
    return datapath_pb2.Flow(
        time=ts,
        type=f.type,  # type: ignore[arg-type]
        verdict=f.verdict,  # type: ignore[arg-type]
        drop_reason=f.drop_reason,  # type: ignore[arg-type]
        direction=f.direction,  # type: ignore[arg-type]
        src_ip=f.src_ip,
        dst_ip=f.dst_ip,
        src_port=f.src_port,
        dst_port=f.dst_port,
        protocol=f.protocol,
        src_identity=f.src_identity,
        dst_identity=f.dst_identity,
        endpoint_id=f.endpoint_id,
        ifindex=f.ifindex,
        node=node,
        tcp_flags=f.tcp_flags,
        icmp_type=f.icmp_type,
        denied_by=f.denied_by,
        dns=None
        if f.dns is None
        else datapath_pb2.DNSRecord(
            query=f.dns.query,
            ips=f.dns.ips,
            ttl=f.dns.ttl,
            rcode=f.dns.rcode,
            qtypes=f.dns.qtypes,
        ),
    )


def map_event_to_proto(d: DecodedMapEvent) -> datapath_pb2.MapEvent:
    ev = d.event
    ts = Timestamp()
    ts.FromNanoseconds(ev.time_ns)
    return datapath_pb2.MapEvent(
        map=ev.map,
        seq=ev.seq,
        time=ts,
        action=(
            datapath_pb2.MAP_EVENT_ACTION_UPDATE
            if ev.action == UPDATE
            else datapath_pb2.MAP_EVENT_ACTION_DELETE
        ),
        key=d.key,
        value=d.value,
        outcome=datapath_pb2.MAP_EVENT_OUTCOME_OK
        if ev.ok
        else datapath_pb2.MAP_EVENT_OUTCOME_ERROR,
        errno=ev.errno,
        error=ev.error,
    )


def _host_policy_status(h: HostPolicyState) -> datapath_pb2.HostPolicyStatus:
    return datapath_pb2.HostPolicyStatus(
        present=h.present,
        revision=h.revision,
        ingress_enforced=h.ingress_enforced,
        egress_enforced=h.egress_enforced,
        entries=h.entries,
        rules=list(h.rules),
        node_labels=dict(h.node_labels),
        error=h.error,
        safety_entries=h.safety_entries,
    )


def _by_node(p: PeerHealth) -> str:
    return p.node


def _peer_health(p: PeerHealth) -> datapath_pb2.NodeHealth:
    latency = Duration()
    latency.FromNanoseconds(int(p.latency_s * 1e9))
    probed = Timestamp()
    probed.FromNanoseconds(int(p.probed_at * 1e9))
    return datapath_pb2.NodeHealth(
        node=p.node,
        ip=p.ip,
        reachable=p.reachable,
        latency=latency,
        error=p.error,
        probed_at=probed,
    )


class DatapathServicer(datapath_pb2_grpc.DatapathServiceServicer):
    def __init__(
        self,
        service: DatapathService,
        debuginfo: Debuginfo | None = None,
        *,
        bgp: Callable[[], Speaker | None] = lambda: None,
    ) -> None:
        self.service = service
        self.debuginfo = debuginfo
        # The BGP speaker, once made (none without an lb service).
        self.bgp = bgp

    async def SetupEndpoint(
        self, request: datapath_pb2.SetupEndpointRequest, context: Any
    ) -> datapath_pb2.SetupEndpointResponse:
        req = SetupRequest(
            endpoint_id=request.endpoint_id,
            container_id=request.container_id,
            netns_path=request.netns_path,
            ifname=request.ifname,
            addresses=tuple(request.addresses),
            mtu=request.mtu or 1500,
            identity=request.identity,
            pod_cidrs=tuple(request.pod_cidrs),
            named_ports=named_ports_of(request.named_ports, "named_ports"),
            options=tuple(sorted(request.options.items())),
        )
        validate_endpoint_options(request.options, "options")
        self.service.check_endpoint_spec(req)
        result, _ = await self.service.setup_endpoint(req)
        return datapath_pb2.SetupEndpointResponse(
            host_interface=datapath_pb2.InterfaceInfo(
                name=result.host.name,
                mac=result.host.mac,
                ifindex=result.host.ifindex,
                mtu=result.host.mtu,
            ),
            container_interface=datapath_pb2.InterfaceInfo(
                name=result.container.name,
                mac=result.container.mac,
                ifindex=result.container.ifindex,
                sandbox=result.container.sandbox,
                mtu=result.container.mtu,
            ),
            addresses=list(result.addresses),
            routes=[datapath_pb2.Route(dst=dst, gw=gw) for dst, gw in result.routes],
            gateways=list(result.gateways),
        )

    async def TeardownEndpoint(
        self, request: datapath_pb2.TeardownEndpointRequest, context: Any
    ) -> datapath_pb2.TeardownEndpointResponse:
        self.service.check_endpoint_id(request.endpoint_id)
        removed = await self.service.teardown_endpoint(
            request.endpoint_id, request.netns_path, request.ifname
        )
        return datapath_pb2.TeardownEndpointResponse(removed=removed)

    async def _describe(self, rec: EndpointRecord) -> datapath_pb2.DatapathEndpoint:
        attached = await self.service.attached(rec)
        svc = self.service
        ep = rec.endpoint_id
        return endpoint_to_proto(rec, svc.realized.get(ep), attached, svc.policy_maps.get(ep))

    async def UpdateEndpoint(
        self, request: datapath_pb2.UpdateEndpointRequest, context: Any
    ) -> datapath_pb2.DatapathEndpoint:
        ports = request.HasField("named_ports")
        if ports:
            named_ports = named_ports_of(request.named_ports.ports, "named_ports.ports")
        options = request.HasField("options")
        if options:
            validate_endpoint_options(request.options.values, "options.values")
        if request.identity or not (ports or options):
            if request.identity <= 0:
                raise InvalidArgument("must be positive", field="identity")
            rec = await self.service.update_identity(request.endpoint_id, request.identity)
        if ports:
            rec = await self.service.update_named_ports(request.endpoint_id, list(named_ports))
        if options:
            values = dict(request.options.values)
            rec = await self.service.update_options(request.endpoint_id, values)
        return await self._describe(rec)

    async def GetEndpoint(
        self, request: datapath_pb2.GetEndpointRequest, context: Any
    ) -> datapath_pb2.DatapathEndpoint:
        return await self._describe(self.service.get_endpoint(request.endpoint_id))

    async def ListEndpoints(
        self, request: datapath_pb2.ListEndpointsRequest, context: Any
    ) -> datapath_pb2.ListEndpointsResponse:
        records = sorted(self.service.endpoints.values(), key=lambda r: r.endpoint_id)
        return datapath_pb2.ListEndpointsResponse(
            endpoints=[await self._describe(r) for r in records]
        )

    async def WaitForPolicy(
        self, request: datapath_pb2.WaitForPolicyRequest, context: Any
    ) -> datapath_pb2.WaitForPolicyResponse:
        timeout = _seconds(request.timeout, "timeout") if request.HasField("timeout") else 0.0
        remaining = context.time_remaining()
        if timeout <= 0:
            timeout = remaining if remaining is not None else MAX_WAIT_S
        elif remaining is not None:
            timeout = min(timeout, remaining)
        revision = await self.service.wait_for_policy(
            request.endpoint_id, request.min_revision, min(timeout, MAX_WAIT_S)
        )
        return datapath_pb2.WaitForPolicyResponse(realized_revision=revision)

    async def ListMaps(
        self, request: datapath_pb2.ListMapsRequest, context: Any
    ) -> datapath_pb2.ListMapsResponse:
        recs = {r.name: r for r in self.service.reconciler_status()}
        return datapath_pb2.ListMapsResponse(
            maps=[_map_info(m, recs) for m in await self.service.map_status()]
        )

    async def DumpMap(
        self, request: datapath_pb2.DumpMapRequest, context: Any
    ) -> datapath_pb2.DumpMapResponse:
        if not request.name:
            raise InvalidArgument("is required", field="name")
        info, entries = await self.service.dump_map(request.name, request.limit)
        recs = {r.name: r for r in self.service.reconciler_status()}
        return datapath_pb2.DumpMapResponse(
            info=_map_info(info, recs),
            entries=[datapath_pb2.MapEntry(key=k, value=v) for k, v in entries],
        )

    async def GetStatus(
        self, request: datapath_pb2.GetStatusRequest, context: Any
    ) -> datapath_pb2.DatapathStatus:
        svc = self.service
        recs = {r.name: r for r in svc.reconciler_status()}
        programs = []
        for rec in sorted(svc.endpoints.values(), key=lambda r: r.endpoint_id):
            attached = await svc.attached(rec)
            programs.append(
                datapath_pb2.ProgramStatus(
                    name="from_container+to_container",
                    attach_point=f"{rec.host_ifname}/ingress+egress",
                    attached=attached,
                )
            )
        return datapath_pb2.DatapathStatus(
            node=svc.config.node_name,
            programs_loaded=True,
            programs=programs,
            maps=[_map_info(m, recs) for m in await svc.map_status()],
            reconcilers=[
                datapath_pb2.ReconcilerStatus(
                    name=r.name,
                    desired_revision=r.desired_revision,
                    realized_revision=r.realized_revision,
                    pending=r.pending,
                    errors=r.errors,
                    last_error=r.last_error,
                )
                for r in recs.values()
            ],
            streams_synced=svc.streams_synced,
            endpoints=len(svc.endpoints),
            peers=[_peer_health(p) for p in sorted(svc.health.peers.values(), key=_by_node)],
            host_policy=_host_policy_status(svc.host_policy),
            policy_map_max_entries=svc.config.policy_map_max_entries,
            policy_overflow_endpoints=svc.overflowing(),
            bgp=bgpservicer.speaker_to_proto(self.bgp()),
        )

    async def ObserveFlows(
        self, request: datapath_pb2.ObserveFlowsRequest, context: Any
    ) -> AsyncIterator[datapath_pb2.Flow]:
        flt = FlowFilter(
            verdicts=frozenset(int(v) for v in request.verdicts),
            drop_reasons=frozenset(int(r) for r in request.drop_reasons),
            endpoint_ids=frozenset(request.endpoint_ids),
            identities=frozenset(request.identities),
            ip=request.ip,
            port=request.port,
            protocol=request.protocol,
            directions=frozenset(int(d) for d in request.directions),
            since=_seconds(request.since, "since") if request.HasField("since") else 0.0,
        )
        node = self.service.config.node_name
        recent, live = self.service.observe(flt, request.last, request.follow)
        for f in recent:
            yield flow_to_proto(f, node)
        if live is not None:
            try:
                async for f in live:
                    yield flow_to_proto(f, node)
            finally:
                await live.aclose()

    # --- the XDP prefilter ---

    async def GetPrefilter(
        self, request: datapath_pb2.GetPrefilterRequest, context: Any
    ) -> datapath_pb2.Prefilter:
        return prefilter_to_proto(await self.service.prefilter.get())

    async def PatchPrefilter(
        self, request: datapath_pb2.PatchPrefilterRequest, context: Any
    ) -> datapath_pb2.Prefilter:
        cidrs = _prefilter_cidrs(request.cidrs)
        return prefilter_to_proto(await self.service.prefilter.patch(cidrs, request.revision))

    async def DeletePrefilter(
        self, request: datapath_pb2.DeletePrefilterRequest, context: Any
    ) -> datapath_pb2.Prefilter:
        cidrs = _prefilter_cidrs(request.cidrs)
        return prefilter_to_proto(await self.service.prefilter.delete(cidrs, request.revision))

    async def GetMapEvents(
        self, request: datapath_pb2.GetMapEventsRequest, context: Any
    ) -> AsyncIterator[datapath_pb2.MapEvent]:
        if not request.name:
            raise InvalidArgument("is required", field="name")
        async for d in self.service.map_events(request.name, request.follow):
            yield map_event_to_proto(d)

    async def GetDebuginfo(
        self, request: datapath_pb2.GetDebuginfoRequest, context: Any
    ) -> datapath_pb2.Debuginfo:
        status = await self.GetStatus(datapath_pb2.GetStatusRequest(), context)
        maps = [
            {
                "name": m.name,
                "type": m.type,
                "entries": m.entries,
                "max_entries": m.max_entries,
                "pressure": round(m.entries / m.max_entries, 4) if m.max_entries else 0.0,
            }
            for m in status.maps
        ]
        bpf = self.service.loaded
        state = {
            "status": status,
            "endpoints": await self.ListEndpoints(datapath_pb2.ListEndpointsRequest(), context),
            "maps": maps,
            "bpf": {"folder": str(bpf.folder), "layout": bpf.layout_version} if bpf else {},
            # Passwords are never in it (has_password only).
            "bgp": {
                "peers": await self.GetBgpPeers(datapath_pb2.GetBgpPeersRequest(), context),
                "route_policies": await self.GetBgpRoutePolicies(
                    datapath_pb2.GetBgpRoutePoliciesRequest(), context
                ),
            },
        }
        return answer(self.debuginfo, datapath_pb2.Debuginfo(), state)

    async def GetCgroupDumpMetadata(
        self, request: datapath_pb2.GetCgroupDumpMetadataRequest, context: Any
    ) -> datapath_pb2.CgroupDumpMetadata:
        root, pods = await self.service.cgroups()
        return datapath_pb2.CgroupDumpMetadata(
            cgroup_root=root,
            pods=[
                datapath_pb2.CgroupPod(
                    endpoint_id=p.endpoint_id,
                    container_id=p.container_id,
                    netns_path=p.netns_path,
                    addresses=list(p.addresses),
                    containers=[
                        datapath_pb2.CgroupContainer(
                            cgroup_id=c.cgroup_id, cgroup_path=c.path, pids=list(c.pids)
                        )
                        for c in p.containers
                    ],
                    error=p.error,
                )
                for p in pods
            ],
        )

    # --- BGP (flagella.datapath.bgp) ---

    async def GetBgpPeers(
        self, request: datapath_pb2.GetBgpPeersRequest, context: Any
    ) -> datapath_pb2.GetBgpPeersResponse:
        return await bgpservicer.get_peers(self.bgp())

    async def GetBgpRoutes(
        self, request: datapath_pb2.GetBgpRoutesRequest, context: Any
    ) -> datapath_pb2.GetBgpRoutesResponse:
        return await bgpservicer.get_routes(self.bgp(), request)

    async def GetBgpRoutePolicies(
        self, request: datapath_pb2.GetBgpRoutePoliciesRequest, context: Any
    ) -> datapath_pb2.GetBgpRoutePoliciesResponse:
        return await bgpservicer.get_route_policies(self.bgp())


def _prefilter_cidrs(texts: Sequence[str]) -> list[IPNetwork]:
    if not texts:
        raise InvalidArgument("at least one CIDR is required", field="cidrs")
    if len(texts) > MAX_ENTRIES:
        raise InvalidArgument(
            f"the prefilter holds at most {MAX_ENTRIES} CIDRs", field=f"cidrs[{MAX_ENTRIES}]"
        )
    return parse_cidrs(texts)


def prefilter_to_proto(state: PrefilterState) -> datapath_pb2.Prefilter:
    return datapath_pb2.Prefilter(
        revision=state.revision,
        entries=[
            datapath_pb2.PrefilterEntry(
                cidr=str(e.cidr), dropped_packets=e.packets, dropped_bytes=e.bytes
            )
            for e in state.entries
        ],
        devices=[
            datapath_pb2.PrefilterDevice(
                name=d.name, ifindex=d.ifindex, mode=d.mode, attached=d.attached
            )
            for d in state.devices
        ],
        max_entries=state.max_entries,
    )
