"""The endpoint service's peers over gRPC: ipam, policy, the datapath of each
node. Adapters from the service's protocols (service.py) to the generated
stubs. (The Kubernetes API, for pod labels, is flagella.endpoint.kube.)"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common.backoff import Backoff
from flagella.common.errors import NotFound, Unavailable
from flagella.common.peers import calling
from flagella.common.portnames import NamedPort
from flagella.common.sync import StreamSource
from flagella.endpoint.model import Endpoint
from flagella.endpoint.nodes import NodeMirror
from flagella.endpoint.service import Allocated, NodeInfo, RealizedEndpoint, SetupResult

log = logging.getLogger(__name__)

CALL_TIMEOUT = 10.0


def _duration(seconds: float) -> Duration:
    d = Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def node_info(node: ipam_pb2.Node) -> NodeInfo:
    internal = [a.ip for a in node.addresses if a.type == ipam_pb2.NodeAddress.TYPE_INTERNAL_IP]
    return NodeInfo(
        name=node.name,
        datapath_address=node.datapath_address,
        host_ip=internal[0] if internal else "",
        pod_cidrs=tuple(node.pod_cidrs),
    )


class NodeInfoCodec:
    """WatchNodes events -> the mirror's NodeInfo records."""

    def key(self, event: ipam_pb2.NodeEvent) -> str:
        return event.node.name

    def decode(self, event: ipam_pb2.NodeEvent) -> NodeInfo:
        return node_info(event.node)


class IpamPeer:
    def __init__(self, channel: grpc.aio.Channel, mirror: NodeMirror | None = None) -> None:
        self.stub = ipam_pb2_grpc.IpamServiceStub(channel)
        # Filled by follow_nodes(); without it every lookup asks ipam.
        self.mirror = mirror or NodeMirror()
        # Kept across restarts of follow_nodes(): it resumes where it was.
        self.node_source: StreamSource[str, NodeInfo] = StreamSource(
            "ipam nodes", self._watch_nodes, self.mirror.table, NodeInfoCodec()
        )

    async def node(self, name: str) -> NodeInfo:
        info = self.mirror.get(name)
        if info is None:
            try:
                with calling("ipam"):
                    node = await self.stub.GetNode(
                        ipam_pb2.GetNodeRequest(name=name), timeout=CALL_TIMEOUT
                    )
            except NotFound as exc:
                if await self._has_cidrs(name):
                    # Its lease lapsed: its datapath is restarting (and
                    # registers again when up). Try again later, not never.
                    raise Unavailable(
                        f"node {name}'s registration lapsed (its datapath is restarting?): "
                        "try again"
                    ) from exc
                raise exc from None
            info = node_info(node)
        if not info.datapath_address:
            raise Unavailable(f"node {name} has no datapath registered")
        return info

    async def _has_cidrs(self, name: str) -> bool:
        """Whether ipam knows the node: it keeps a node's pod CIDRs (and
        allocations) when its lease lapses; a node that never registered
        has none (NOT_FOUND)."""
        try:
            with calling("ipam"):
                await self.stub.ListAllocations(
                    ipam_pb2.ListAllocationsRequest(node=name), timeout=CALL_TIMEOUT
                )
        except NotFound:
            return False
        return True

    async def follow_nodes(self, max_backoff: float = 5.0) -> None:
        """Keep the node mirror in step with ipam's registry, until
        cancelled; a broken stream is resumed (after a backoff) from the
        last revision the mirror was synced at."""
        self.node_source.backoff = Backoff(0.1, max_backoff)
        await self.node_source.run()

    async def _watch_nodes(self, since: int) -> AsyncIterator[ipam_pb2.NodeEvent]:
        async for event in self.stub.WatchNodes(ipam_pb2.WatchNodesRequest(since_revision=since)):
            yield event

    async def allocate(
        self, node: str, container_id: str, ifname: str, pod: str, expiration_s: float
    ) -> list[Allocated]:
        with calling("ipam"):
            resp = await self.stub.Allocate(
                ipam_pb2.AllocateRequest(
                    node=node,
                    owner=ipam_pb2.Owner(container_id=container_id, ifname=ifname, pod=pod),
                    expiration=_duration(expiration_s),
                ),
                timeout=CALL_TIMEOUT,
            )
        return [Allocated(a.ip, a.cidr) for a in resp.allocations]

    async def commit(self, node: str, container_id: str, ifname: str) -> None:
        with calling("ipam"):
            await self.stub.CommitAllocation(
                ipam_pb2.CommitAllocationRequest(
                    node=node, owner=ipam_pb2.Owner(container_id=container_id, ifname=ifname)
                ),
                timeout=CALL_TIMEOUT,
            )

    async def release(self, node: str, container_id: str, ifname: str) -> None:
        with calling("ipam"):
            await self.stub.Release(
                ipam_pb2.ReleaseRequest(
                    node=node, owner=ipam_pb2.Owner(container_id=container_id, ifname=ifname)
                ),
                timeout=CALL_TIMEOUT,
            )

    async def reconcile(self, node: str, valid: Sequence[tuple[str, str]]) -> list[str]:
        with calling("ipam"):
            resp = await self.stub.Reconcile(
                ipam_pb2.ReconcileRequest(
                    node=node,
                    valid_owners=[
                        ipam_pb2.Owner(container_id=cid, ifname=ifname) for cid, ifname in valid
                    ],
                ),
                timeout=CALL_TIMEOUT,
            )
        return [a.ip for a in resp.released]

    async def held(self, node: str) -> dict[str, tuple[str, str]]:
        with calling("ipam"):
            resp = await self.stub.ListAllocations(
                ipam_pb2.ListAllocationsRequest(node=node), timeout=CALL_TIMEOUT
            )
        return {a.ip: (a.owner.container_id, a.owner.ifname) for a in resp.allocations}

    async def claim(self, node: str, ip: str, container_id: str, ifname: str, pod: str) -> None:
        owner = ipam_pb2.Owner(container_id=container_id, ifname=ifname, pod=pod)
        with calling("ipam"):
            await self.stub.AllocateIP(
                ipam_pb2.AllocateIPRequest(node=node, ip=ip, owner=owner), timeout=CALL_TIMEOUT
            )


class PeerHealth:
    """A peer's gRPC health (the standard Check of its whole server)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub: Any = health_pb2_grpc.HealthStub(channel)

    async def problem(self) -> str | None:
        try:
            resp = await self.stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.aio.AioRpcError as exc:
            return f"unreachable: {exc.code().name}"
        if resp.status != health_pb2.HealthCheckResponse.SERVING:
            return "not serving"
        return None


def k8s_labels(labels: dict[str, str]) -> list[policy_pb2.Label]:
    """Identity labels as the policy service takes them: k8s, unless the
    key names its source ("container:key": a custom label)."""
    out = []
    for k, v in sorted(labels.items()):
        source, sep, key = k.partition(":")
        if sep:
            out.append(policy_pb2.Label(source=source, key=key, value=v))
        else:
            out.append(policy_pb2.Label(source="k8s", key=k, value=v))
    return out


class PolicyPeer:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.stub = policy_pb2_grpc.PolicyServiceStub(channel)

    async def allocate_identity(
        self, labels: dict[str, str], node: str, owner: str
    ) -> tuple[int, int]:
        with calling("policy"):
            resp = await self.stub.AllocateIdentity(
                policy_pb2.AllocateIdentityRequest(
                    labels=k8s_labels(labels), node=node, owner=owner
                ),
                timeout=CALL_TIMEOUT,
            )
        return int(resp.identity.id), int(resp.identity.revision)

    async def release_identity(self, identity: int, node: str, owner: str) -> None:
        with calling("policy"):
            await self.stub.ReleaseIdentity(
                policy_pb2.ReleaseIdentityRequest(id=identity, node=node, owner=owner),
                timeout=CALL_TIMEOUT,
            )

    async def labels_of(self, identity: int) -> set[tuple[str, str, str]]:
        with calling("policy"):
            resp = await self.stub.GetIdentity(
                policy_pb2.GetIdentityRequest(id=identity), timeout=CALL_TIMEOUT
            )
        return {(lb.source, lb.key, lb.value) for lb in resp.labels}

    async def identity_of(self, labels: dict[str, str]) -> int:
        try:
            with calling("policy"):
                ident = await self.stub.GetIdentity(
                    policy_pb2.GetIdentityRequest(
                        labels=policy_pb2.LabelList(labels=k8s_labels(labels))
                    ),
                    timeout=CALL_TIMEOUT,
                )
        except NotFound:
            return 0
        return int(ident.id)

    async def upsert_ipcache(
        self,
        prefix: str,
        identity: int,
        node: str,
        host_ip: str,
        named_ports: Sequence[NamedPort] = (),
    ) -> None:
        with calling("policy"):
            await self.stub.UpsertIPCache(
                policy_pb2.UpsertIPCacheRequest(
                    entry=policy_pb2.IPCacheEntry(
                        prefix=prefix,
                        identity=identity,
                        node=node,
                        host_ip=host_ip,
                        source="endpoint",
                        named_ports=[
                            policy_pb2.NamedPort(
                                name=p.name,
                                port=p.port,
                                protocol=policy_pb2.Protocol.ValueType(p.protocol),
                            )
                            for p in named_ports
                        ],
                    )
                ),
                timeout=CALL_TIMEOUT,
            )

    async def delete_ipcache(self, prefix: str, identity: int) -> None:
        with calling("policy"):
            await self.stub.DeleteIPCache(
                policy_pb2.DeleteIPCacheRequest(prefix=prefix, expected_identity=identity),
                timeout=CALL_TIMEOUT,
            )


def datapath_named_ports(ports: Sequence[NamedPort]) -> list[datapath_pb2.NamedPort]:
    return [datapath_pb2.NamedPort(name=p.name, port=p.port, protocol=p.protocol) for p in ports]


class DatapathPeers:
    """The datapath of whichever node an endpoint is on, one channel each."""

    def __init__(self, open_channel: Callable[[str], grpc.aio.Channel]) -> None:
        self.open_channel = open_channel
        self._stubs: dict[str, Any] = {}

    def _stub(self, address: str) -> datapath_pb2_grpc.DatapathServiceAsyncStub:
        if address not in self._stubs:
            self._stubs[address] = datapath_pb2_grpc.DatapathServiceStub(self.open_channel(address))
        stub: datapath_pb2_grpc.DatapathServiceAsyncStub = self._stubs[address]
        return stub

    async def setup(self, address: str, ep: Endpoint, pod_cidrs: Sequence[str]) -> SetupResult:
        with calling("datapath"):
            resp = await self._stub(address).SetupEndpoint(
                datapath_pb2.SetupEndpointRequest(
                    endpoint_id=ep.id,
                    container_id=ep.container_id,
                    netns_path=ep.netns_path,
                    ifname=ep.ifname,
                    addresses=ep.addresses,
                    mtu=ep.mtu,
                    identity=ep.identity,
                    pod_cidrs=list(pod_cidrs),
                    named_ports=datapath_named_ports(ep.named_ports),
                    options=ep.options,
                ),
                timeout=CALL_TIMEOUT,
            )
        return SetupResult(
            host_ifname=resp.host_interface.name,
            host_mac=resp.host_interface.mac,
            container_mac=resp.container_interface.mac,
            mtu=resp.container_interface.mtu,
            addresses=tuple(resp.addresses),
            gateways=tuple(resp.gateways),
            routes=tuple((r.dst, r.gw) for r in resp.routes),
        )

    async def teardown(self, address: str, ep: Endpoint) -> None:
        with calling("datapath"):
            await self._stub(address).TeardownEndpoint(
                datapath_pb2.TeardownEndpointRequest(
                    endpoint_id=ep.id, netns_path=ep.netns_path, ifname=ep.ifname
                ),
                timeout=CALL_TIMEOUT,
            )

    async def update_identity(self, address: str, endpoint_id: int, identity: int) -> None:
        with calling("datapath"):
            await self._stub(address).UpdateEndpoint(
                datapath_pb2.UpdateEndpointRequest(endpoint_id=endpoint_id, identity=identity),
                timeout=CALL_TIMEOUT,
            )

    async def update_named_ports(
        self, address: str, endpoint_id: int, named_ports: Sequence[NamedPort]
    ) -> None:
        with calling("datapath"):
            await self._stub(address).UpdateEndpoint(
                datapath_pb2.UpdateEndpointRequest(
                    endpoint_id=endpoint_id,
                    named_ports=datapath_pb2.NamedPorts(ports=datapath_named_ports(named_ports)),
                ),
                timeout=CALL_TIMEOUT,
            )

    async def update_options(self, address: str, endpoint_id: int, options: dict[str, str]) -> None:
        with calling("datapath"):
            await self._stub(address).UpdateEndpoint(
                datapath_pb2.UpdateEndpointRequest(
                    endpoint_id=endpoint_id,
                    options=datapath_pb2.EndpointOptions(values=options),
                ),
                timeout=CALL_TIMEOUT,
            )

    async def wait_policy(
        self, address: str, endpoint_id: int, min_revision: int, timeout: float
    ) -> int:
        with calling("datapath"):
            resp = await self._stub(address).WaitForPolicy(
                datapath_pb2.WaitForPolicyRequest(
                    endpoint_id=endpoint_id, min_revision=min_revision, timeout=_duration(timeout)
                ),
                timeout=timeout + CALL_TIMEOUT,
            )
        return int(resp.realized_revision)

    async def list_endpoints(self, address: str) -> list[RealizedEndpoint]:
        with calling("datapath"):
            resp = await self._stub(address).ListEndpoints(
                datapath_pb2.ListEndpointsRequest(), timeout=CALL_TIMEOUT
            )
        return [
            RealizedEndpoint(e.endpoint_id, e.container_id, e.ifname, e.netns_path, e.identity)
            for e in resp.endpoints
        ]
