"""The relay's peers over gRPC: ipam's node registry (a table fed by its
WatchNodes stream), each node's datapath (ObserveFlows, health), and, for
the web page's flows, the endpoint and policy services' pods and labels."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common import flows as hubble
from flagella.common.backoff import Backoff
from flagella.common.errors import FlagellaError
from flagella.common.peers import calling
from flagella.common.sync import StreamSource, Table
from flagella.relay.service import NodeInfo

log = logging.getLogger(__name__)
CALL_TIMEOUT = 5.0


class NodeCodec:
    """WatchNodes events -> NodeInfo; a node with no datapath is left out."""

    def key(self, event: ipam_pb2.NodeEvent) -> str:
        return event.node.name

    def decode(self, event: ipam_pb2.NodeEvent) -> NodeInfo | None:
        if not event.node.datapath_address:
            return None
        return NodeInfo(event.node.name, event.node.datapath_address)


def node_source(
    channel: grpc.aio.Channel, table: Table[str, NodeInfo]
) -> StreamSource[str, NodeInfo]:
    """Keeps table in step with ipam's registry (run() until cancelled;
    a broken stream resumes after a backoff)."""
    stub = ipam_pb2_grpc.IpamServiceStub(channel)

    async def watch(since: int) -> AsyncIterator[ipam_pb2.NodeEvent]:
        async for event in stub.WatchNodes(ipam_pb2.WatchNodesRequest(since_revision=since)):
            yield event

    return StreamSource("ipam nodes", watch, table, NodeCodec(), backoff=Backoff(0.1, 5.0))


class Datapaths:
    """Every node's datapath, a channel per address (runtime.channel)."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel]) -> None:
        self._channel = channel
        self._channels: dict[str, grpc.aio.Channel] = {}

    def _for(self, node: NodeInfo) -> grpc.aio.Channel:
        ch = self._channels.get(node.address)
        if ch is None:
            ch = self._channels[node.address] = self._channel(node.address)
        return ch

    async def close(self) -> None:
        """Close every node's channel (the streams on them end)."""
        channels, self._channels = self._channels, {}
        for ch in channels.values():
            await ch.close()

    async def check(self, node: NodeInfo, timeout: float) -> None:
        stub: Any = health_pb2_grpc.HealthStub(self._for(node))  # untyped stubs
        with calling(f"datapath of node {node.name} at {node.address}"):
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)

    async def flows(
        self, node: NodeInfo, request: datapath_pb2.ObserveFlowsRequest, timeout: float | None
    ) -> AsyncIterator[datapath_pb2.Flow]:
        stub = datapath_pb2_grpc.DatapathServiceStub(self._for(node))
        with calling(f"datapath of node {node.name} at {node.address}"):
            async for f in stub.ObserveFlows(request, timeout=timeout):
                yield f


class Names:
    """Pods (endpoint service), identity labels (policy service) and
    services by frontend (lb service) that name the ends of the page's
    flows, as `flagella observe` names them (flagella.common.flows),
    loaded with the relay's own rights when a flow names an end it does
    not know, at most once a second. A failed load
    keeps the last directory (its flows show identities) and says why in
    `error`."""

    def __init__(
        self,
        endpoint: grpc.aio.Channel,
        policy: grpc.aio.Channel,
        lb: grpc.aio.Channel,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoint = endpoint_pb2_grpc.EndpointServiceStub(endpoint)
        self._policy = policy_pb2_grpc.PolicyServiceStub(policy)
        self._lb = lb_pb2_grpc.LoadBalancerServiceStub(lb)
        self._clock = clock
        self._lock = asyncio.Lock()
        self._loaded = -hubble.REFRESH_SECONDS
        self.directory = hubble.Directory()
        self.error = ""

    def _stale(self, f: datapath_pb2.Flow | None) -> bool:
        if f is None:
            return self._clock() - self._loaded >= hubble.REFRESH_SECONDS
        return hubble.stale(self.directory, f, self._loaded, self._clock())

    async def of(self, f: datapath_pb2.Flow | None = None) -> hubble.Directory:
        """The directory to name f's ends with (None: a fresh one)."""
        if self._stale(f):
            async with self._lock:
                if self._stale(f):  # not when another reader just loaded it
                    await self._load()
        return self.directory

    async def _load(self) -> None:
        self._loaded = self._clock()
        try:
            with calling("endpoint service"):
                eps = await self._endpoint.ListEndpoints(
                    endpoint_pb2.ListEndpointsRequest(), timeout=CALL_TIMEOUT
                )
            with calling("policy service"):
                ids = await self._policy.ListIdentities(
                    policy_pb2.ListIdentitiesRequest(), timeout=CALL_TIMEOUT
                )
            with calling("lb service"):
                svcs = await self._lb.ListServices(
                    lb_pb2.ListServicesRequest(), timeout=CALL_TIMEOUT
                )
        except FlagellaError as exc:
            if exc.details != self.error:
                log.warning("cannot name the flows' ends", extra={"reason": exc.details})
            self.error = exc.details
            return
        self.error = ""
        self.directory = hubble.directory(eps.endpoints, ids.identities, svcs.services)
