"""gRPC handlers of flagella.relay.v1: proto <-> domain and validation."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.relay.v1 import relay_pb2, relay_pb2_grpc
from flagella.common.debuginfo import Debuginfo, answer
from flagella.common.errors import InvalidArgument
from flagella.relay.service import Event, Lost, NodeStatus, NodeView, Relay

pb = relay_pb2


def _state(connected: bool | None) -> pb.NodeState.ValueType:
    if connected is None:
        return pb.NODE_STATE_UNSPECIFIED
    return pb.NODE_STATE_CONNECTED if connected else pb.NODE_STATE_UNAVAILABLE


def response(event: Event) -> relay_pb2.ObserveResponse:
    if isinstance(event, NodeStatus):
        status = pb.NodeStatusEvent(
            node=event.node, state=_state(event.connected), message=event.message
        )
        return pb.ObserveResponse(node_status=status)
    if isinstance(event, Lost):
        return pb.ObserveResponse(lost=pb.LostEvent(node=event.node, count=event.count))
    return pb.ObserveResponse(flow=event)


def node_pb(v: NodeView) -> relay_pb2.Node:
    return pb.Node(
        name=v.name,
        state=_state(v.connected),
        address=v.address,
        last_error=v.last_error,
        flows_seen=v.flows_seen,
    )


def check_filter(f: datapath_pb2.ObserveFlowsRequest) -> None:
    """What the relay relies on; the datapaths check the rest."""
    if f.port > 65535:
        raise InvalidArgument(f"{f.port} is not a port", field="filter.port")
    if f.protocol > 255:
        raise InvalidArgument(f"{f.protocol} is not an IP protocol", field="filter.protocol")


class RelayServicer(relay_pb2_grpc.RelayServiceServicer):
    def __init__(self, relay: Relay, debuginfo: Debuginfo | None = None) -> None:
        self.relay = relay
        self.debuginfo = debuginfo

    async def ObserveFlows(
        self, request: relay_pb2.ObserveRequest, context: Any
    ) -> AsyncIterator[relay_pb2.ObserveResponse]:
        check_filter(request.filter)
        for i, glob in enumerate(request.nodes):
            if not glob.strip():
                raise InvalidArgument("empty node name", field=f"nodes[{i}]")
        async for event in self.relay.observe(request.filter, tuple(request.nodes)):
            yield response(event)

    async def GetNodes(
        self, request: relay_pb2.GetNodesRequest, context: Any
    ) -> pb.GetNodesResponse:
        return pb.GetNodesResponse(nodes=[node_pb(v) for v in self.relay.node_views()])

    async def GetDebuginfo(
        self, request: datapath_pb2.GetDebuginfoRequest, context: Any
    ) -> datapath_pb2.Debuginfo:
        state = {"nodes": await self.GetNodes(relay_pb2.GetNodesRequest(), context)}
        return answer(self.debuginfo, datapath_pb2.Debuginfo(), state)
