"""gRPC handlers of flagella.ipam.v1: proto <-> domain and validation.

Syntax is checked here (InvalidArgument naming the request field); what
depends on state (unknown node, IP outside the node's range, family not
enabled, pool full ...) is decided by the service.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

from google.protobuf import duration_pb2, timestamp_pb2

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.config import parse_host_port
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import InvalidArgument
from flagella.common.sync import Batching, Change, MessageCache, serve_watch
from flagella.ipam.model import (
    AddressType,
    Allocation,
    Family,
    Mode,
    Node,
    NodeAddress,
    NodeRegistration,
    Owner,
)
from flagella.ipam.pool import IPAddress, IPNetwork
from flagella.ipam.service import MAX_LEASE_TTL, IpamService

# The context argument of every handler (grpc.aio.ServicerContext).
Context = Any

# Kubernetes node names: a lowercase RFC 1123 subdomain.
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# CNI container ids: alphanumerics, then also '_', '.', '-'.
_CONTAINER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_MAX_IFNAME = 15  # IFNAMSIZ - 1

_FAMILY_FROM_PB: dict[int, Family] = {
    ipam_pb2.FAMILY_IPV4: Family.IPV4,
    ipam_pb2.FAMILY_IPV6: Family.IPV6,
}
_FAMILY_TO_PB = {Family.IPV4: ipam_pb2.FAMILY_IPV4, Family.IPV6: ipam_pb2.FAMILY_IPV6}
_ADDRESS_FROM_PB = {
    ipam_pb2.NodeAddress.TYPE_INTERNAL_IP: AddressType.INTERNAL_IP,
    ipam_pb2.NodeAddress.TYPE_EXTERNAL_IP: AddressType.EXTERNAL_IP,
}
_ADDRESS_TO_PB = {v: k for k, v in _ADDRESS_FROM_PB.items()}
_MODE_TO_PB = {
    Mode.CLUSTER_POOL: ipam_pb2.MODE_CLUSTER_POOL,
    Mode.HOST_SCOPE: ipam_pb2.MODE_HOST_SCOPE,
}


# --- proto -> domain ---


def node_name(value: str, field: str) -> str:
    if not value:
        raise InvalidArgument("is required", field=field)
    if len(value) > 253 or not _NODE_NAME.match(value):
        raise InvalidArgument(
            f"{value!r} is not a valid node name (a lowercase RFC 1123 subdomain)", field=field
        )
    return value


def optional_node_name(value: str, field: str) -> str | None:
    return node_name(value, field) if value else None


def owner_of(msg: ipam_pb2.Owner, field: str) -> Owner:
    if not msg.container_id:
        raise InvalidArgument("is required", field=f"{field}.container_id")
    if len(msg.container_id) > 256 or not _CONTAINER_ID.match(msg.container_id):
        raise InvalidArgument(
            f"{msg.container_id!r} is not a valid container id "
            "(letters, digits, then also '_', '.', '-'; at most 256)",
            field=f"{field}.container_id",
        )
    ifname = msg.ifname
    if not ifname:
        raise InvalidArgument("is required", field=f"{field}.ifname")
    if (
        len(ifname.encode()) > _MAX_IFNAME
        or ifname in (".", "..")
        or any(c in ifname for c in "/:")
        or any(c.isspace() for c in ifname)
    ):
        raise InvalidArgument(
            f"{ifname!r} is not a valid interface name (at most {_MAX_IFNAME} bytes, "
            "no '/', ':' or whitespace)",
            field=f"{field}.ifname",
        )
    if len(msg.pod) > 512:
        raise InvalidArgument("is longer than 512 characters", field=f"{field}.pod")
    return Owner(msg.container_id, ifname, msg.pod)


def required_owner(request: Any, field: str = "owner") -> Owner:
    if not request.HasField(field):
        raise InvalidArgument("is required", field=field)
    return owner_of(getattr(request, field), field)


def ip_of(value: str, field: str) -> IPAddress:
    if not value:
        raise InvalidArgument("is required", field=field)
    try:
        return ipaddress.ip_address(value)
    except ValueError:
        raise InvalidArgument(f"{value!r} is not a valid IP address", field=field) from None


def cidr_of(value: str, field: str) -> IPNetwork:
    try:
        return ipaddress.ip_network(value, strict=True)
    except ValueError as exc:
        raise InvalidArgument(f"{value!r} is not a valid CIDR ({exc})", field=field) from None


def family_of(value: int, field: str) -> Family:
    family = _FAMILY_FROM_PB.get(value)
    if family is None:
        raise InvalidArgument(f"{value} is not a family (FAMILY_IPV4 or FAMILY_IPV6)", field=field)
    return family


def seconds_of(d: duration_pb2.Duration, field: str) -> float:
    value = d.seconds + d.nanos / 1e9
    if value < 0:
        raise InvalidArgument("must not be negative", field=field)
    return value


def registration_of(request: ipam_pb2.RegisterNodeRequest) -> NodeRegistration:
    name = node_name(request.name, "name")
    addresses: list[NodeAddress] = []
    for i, addr in enumerate(request.addresses):
        kind = _ADDRESS_FROM_PB.get(addr.type)
        if kind is None:
            raise InvalidArgument(
                "must be TYPE_INTERNAL_IP or TYPE_EXTERNAL_IP", field=f"addresses[{i}].type"
            )
        ip = ip_of(addr.ip, f"addresses[{i}].ip")
        # Other nodes route or tunnel to the node's internal IP of a family:
        # two would leave them to guess.
        if kind is AddressType.INTERNAL_IP and any(
            a.type is kind and ipaddress.ip_address(a.ip).version == ip.version for a in addresses
        ):
            raise InvalidArgument(
                f"{ip} is a second IPv{ip.version} internal IP (one per family)",
                field=f"addresses[{i}].ip",
            )
        addresses.append(NodeAddress(kind, str(ip)))
    if request.datapath_address:
        try:
            parse_host_port(request.datapath_address)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="datapath_address") from None
    cidrs = tuple(cidr_of(c, f"pod_cidrs[{i}]") for i, c in enumerate(request.pod_cidrs))
    for key in request.labels:
        if not key or len(key) > 317:
            raise InvalidArgument(f"label key {key!r} is empty or too long", field="labels")
    ttl = 0
    if request.HasField("lease_ttl"):
        ttl = math.ceil(seconds_of(request.lease_ttl, "lease_ttl"))
        if not 2 <= ttl <= MAX_LEASE_TTL:
            raise InvalidArgument(
                f"must be between 2 s and {MAX_LEASE_TTL} s (got {ttl} s)", field="lease_ttl"
            )
    return NodeRegistration(
        name=name,
        addresses=tuple(addresses),
        datapath_address=request.datapath_address,
        pod_cidrs=cidrs,
        labels=dict(request.labels),
        lease_ttl=ttl,
    )


# --- domain -> proto ---


def _timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(round(t * 1e9))
    return ts


def node_pb(node: Node) -> ipam_pb2.Node:
    return ipam_pb2.Node(
        name=node.name,
        addresses=[
            ipam_pb2.NodeAddress(type=_ADDRESS_TO_PB[a.type], ip=a.ip) for a in node.addresses
        ],
        datapath_address=node.datapath_address,
        pod_cidrs=[str(c) for c in node.pod_cidrs],
        labels=node.labels,
        lease_ttl=duration_pb2.Duration(seconds=node.lease_ttl),
        registered_at=_timestamp(node.registered_at),
        revision=node.revision,
        id=node.id,
    )


def allocation_pb(a: Allocation) -> ipam_pb2.Allocation:
    msg = ipam_pb2.Allocation(
        ip=str(a.ip),
        family=_FAMILY_TO_PB[a.family],
        node=a.node,
        owner=ipam_pb2.Owner(
            container_id=a.owner.container_id, ifname=a.owner.ifname, pod=a.owner.pod
        ),
        cidr=str(a.cidr),
        allocated_at=_timestamp(a.allocated_at),
        revision=a.revision,
    )
    if a.expires_at is not None:
        msg.expires_at.CopyFrom(_timestamp(a.expires_at))
    return msg


def allocations_pb(allocations: Iterable[Allocation]) -> list[ipam_pb2.Allocation]:
    return [allocation_pb(a) for a in allocations]


def _node_event(
    kind: ipam_pb2.NodeEvent.Kind.ValueType, revision: int, node: ipam_pb2.Node | None = None
) -> ipam_pb2.NodeEvent:
    return ipam_pb2.NodeEvent(kind=kind, revision=revision, node=node)


class NodeEvents:
    """The messages of WatchNodes (serve_watch streams them); an UPSERT is
    built once for every stream (cache: by node and revision)."""

    def __init__(self, cache: MessageCache[tuple[str, int], ipam_pb2.NodeEvent]) -> None:
        self.cache = cache

    def reset(self, revision: int) -> ipam_pb2.NodeEvent:
        return _node_event(ipam_pb2.NodeEvent.KIND_RESET, revision)

    async def upsert(self, change: Change[str, Node]) -> ipam_pb2.NodeEvent:
        assert change.record is not None
        key = (change.key, change.revision)
        event = self.cache.get(key)
        if event is None:
            event = _node_event(
                ipam_pb2.NodeEvent.KIND_UPSERT, change.revision, node_pb(change.record)
            )
            self.cache.put(key, event)
        return event

    async def delete(self, change: Change[str, Node]) -> ipam_pb2.NodeEvent:
        # A DELETE names the node only.
        node = ipam_pb2.Node(name=change.key)
        return _node_event(ipam_pb2.NodeEvent.KIND_DELETE, change.revision, node)

    def synced(self, revision: int) -> ipam_pb2.NodeEvent:
        return _node_event(ipam_pb2.NodeEvent.KIND_SYNCED, revision)


def batch_node_events(events: list[ipam_pb2.NodeEvent]) -> ipam_pb2.NodeEvent:
    """A KIND_BATCH message of events, at the revision of the last."""
    return ipam_pb2.NodeEvent(
        kind=ipam_pb2.NodeEvent.KIND_BATCH, revision=events[-1].revision, events=events
    )


# WatchNodes with batch_events: node changes gather for 0.1 s (a node's
# routes can wait that long; at 1,000 nodes, one message per registration
# per stream was 1.5 million messages in seven minutes of nodes joining).
NODE_BATCHING = Batching(wrap=batch_node_events, size=lambda event: event.ByteSize(), linger=0.1)


class IpamServicer(ipam_pb2_grpc.IpamServiceServicer):
    def __init__(self, service: IpamService, debuginfo: Debuginfo | None = None) -> None:
        self.debuginfo = debuginfo
        self.service = service
        # WatchNodes' UPSERT messages, shared by every stream: each node's newest.
        self.node_events: MessageCache[tuple[str, int], ipam_pb2.NodeEvent] = MessageCache(
            4 << 20, slot=lambda key: key[0]
        )

    # --- node registry ---

    async def RegisterNode(
        self, request: ipam_pb2.RegisterNodeRequest, context: Context
    ) -> ipam_pb2.RegisterNodeResponse:
        node = await self.service.register_node(registration_of(request))
        return ipam_pb2.RegisterNodeResponse(node=node_pb(node))

    async def RenewNode(
        self, request: ipam_pb2.RenewNodeRequest, context: Context
    ) -> ipam_pb2.RenewNodeResponse:
        ttl = await self.service.renew_node(node_name(request.name, "name"))
        return ipam_pb2.RenewNodeResponse(remaining=duration_pb2.Duration(seconds=ttl))

    async def DeregisterNode(
        self, request: ipam_pb2.DeregisterNodeRequest, context: Context
    ) -> ipam_pb2.DeregisterNodeResponse:
        await self.service.deregister_node(
            node_name(request.name, "name"), release_cidrs=request.release_cidrs
        )
        return ipam_pb2.DeregisterNodeResponse()

    async def GetNode(self, request: ipam_pb2.GetNodeRequest, context: Context) -> ipam_pb2.Node:
        return node_pb(await self.service.get_node(node_name(request.name, "name")))

    async def ListNodes(
        self, request: ipam_pb2.ListNodesRequest, context: Context
    ) -> ipam_pb2.ListNodesResponse:
        nodes, revision = await self.service.list_nodes()
        return ipam_pb2.ListNodesResponse(nodes=[node_pb(n) for n in nodes], revision=revision)

    async def WatchNodes(
        self, request: ipam_pb2.WatchNodesRequest, context: Context
    ) -> AsyncIterator[ipam_pb2.NodeEvent]:
        since = request.since_revision
        if since < 0:
            raise InvalidArgument("must not be negative", field="since_revision")
        feed = await self.service.watch_nodes(since)
        heartbeat = self.service.settings.watch_heartbeat
        async for msg in serve_watch(
            feed,
            NodeEvents(self.node_events),
            since=since,
            heartbeat=heartbeat,
            batching=NODE_BATCHING if request.batch_events else None,
        ):
            yield msg

    # --- allocation ---

    async def Allocate(
        self, request: ipam_pb2.AllocateRequest, context: Context
    ) -> ipam_pb2.AllocateResponse:
        node = node_name(request.node, "node")
        owner = required_owner(request)
        families = [family_of(f, f"families[{i}]") for i, f in enumerate(request.families)]
        expiration = seconds_of(request.expiration, "expiration")
        allocations = await self.service.allocate(node, owner, families, expiration=expiration)
        return ipam_pb2.AllocateResponse(allocations=allocations_pb(allocations))

    async def AllocateIP(
        self, request: ipam_pb2.AllocateIPRequest, context: Context
    ) -> ipam_pb2.AllocateIPResponse:
        node = node_name(request.node, "node")
        ip = ip_of(request.ip, "ip")
        owner = required_owner(request)
        expiration = seconds_of(request.expiration, "expiration")
        allocation = await self.service.allocate_ip(node, ip, owner, expiration=expiration)
        return ipam_pb2.AllocateIPResponse(allocation=allocation_pb(allocation))

    async def CommitAllocation(
        self, request: ipam_pb2.CommitAllocationRequest, context: Context
    ) -> ipam_pb2.CommitAllocationResponse:
        node = node_name(request.node, "node")
        owner = required_owner(request)
        allocations = await self.service.commit(node, owner)
        return ipam_pb2.CommitAllocationResponse(allocations=allocations_pb(allocations))

    async def Release(
        self, request: ipam_pb2.ReleaseRequest, context: Context
    ) -> ipam_pb2.ReleaseResponse:
        node = node_name(request.node, "node")
        target = request.WhichOneof("target")
        if target == "ip":
            ip = ip_of(request.ip, "ip")
            released = await self.service.release_ip(node, ip, force=request.force)
        elif target == "owner":
            released = await self.service.release_owner(node, owner_of(request.owner, "owner"))
        else:
            raise InvalidArgument("set ip or owner", field="target")
        return ipam_pb2.ReleaseResponse(released=allocations_pb(released))

    async def ListAllocations(
        self, request: ipam_pb2.ListAllocationsRequest, context: Context
    ) -> ipam_pb2.ListAllocationsResponse:
        node = optional_node_name(request.node, "node")
        family = (
            family_of(request.family, "family")
            if request.family != ipam_pb2.FAMILY_UNSPECIFIED
            else None
        )
        allocations, revision = await self.service.list_allocations(node, family)
        return ipam_pb2.ListAllocationsResponse(
            allocations=allocations_pb(allocations), revision=revision
        )

    async def Reconcile(
        self, request: ipam_pb2.ReconcileRequest, context: Context
    ) -> ipam_pb2.ReconcileResponse:
        node = node_name(request.node, "node")
        valid = [owner_of(o, f"valid_owners[{i}]") for i, o in enumerate(request.valid_owners)]
        released = await self.service.reconcile(node, valid)
        return ipam_pb2.ReconcileResponse(released=allocations_pb(released))

    async def GetStatus(
        self, request: ipam_pb2.GetStatusRequest, context: Context
    ) -> ipam_pb2.IpamStatus:
        status = await self.service.status()
        u64 = (1 << 64) - 1
        return ipam_pb2.IpamStatus(
            mode=_MODE_TO_PB[status.mode],
            cluster_cidrs=[str(c) for c in status.cluster_cidrs],
            node_mask_size_v4=status.node_mask_size_v4,
            node_mask_size_v6=status.node_mask_size_v6,
            pools=[
                ipam_pb2.PoolUsage(
                    node=p.node,
                    cidr=str(p.cidr),
                    allocated=p.allocated,
                    capacity=min(p.capacity, u64),
                )
                for p in status.pools
            ],
        )

    async def GetNodeIds(
        self, request: ipam_pb2.GetNodeIdsRequest, context: Context
    ) -> ipam_pb2.GetNodeIdsResponse:
        ids = await self.service.node_ids()
        return ipam_pb2.GetNodeIdsResponse(
            ids=[ipam_pb2.NodeId(id=i, node=name, ips=list(ips)) for i, name, ips in ids]
        )

    async def GetDebuginfo(
        self, request: ipam_pb2.GetDebuginfoRequest, context: Context
    ) -> ipam_pb2.Debuginfo:
        state = {
            "status": await self.GetStatus(ipam_pb2.GetStatusRequest(), context),
            "nodes": await self.ListNodes(ipam_pb2.ListNodesRequest(), context),
        }
        return answer(self.debuginfo, ipam_pb2.Debuginfo(), state)
