"""The relay's peers over gRPC: ipam's node registry (a table fed by its
WatchNodes stream) and each node's datapath (ObserveFlows, health)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.backoff import Backoff
from flagella.common.peers import calling
from flagella.common.sync import StreamSource, Table
from flagella.relay.service import NodeInfo


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
