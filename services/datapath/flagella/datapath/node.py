"""This node in the ipam node registry: register at start (which assigns the
node's pod CIDRs), keep the registration's lease renewed, register again if
it expired while ipam or etcd was away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from opentelemetry import trace

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.backoff import Backoff, retry

log = logging.getLogger(__name__)

OnRegistered = Callable[[ipam_pb2.Node], Awaitable[None]]


class NodeRegistration:
    def __init__(
        self,
        stub: ipam_pb2_grpc.IpamServiceAsyncStub,
        request: ipam_pb2.RegisterNodeRequest,
        tracer: trace.Tracer,
        *,
        on_registered: OnRegistered,
        call_timeout: float = 20.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.stub = stub
        self.request = request
        self.tracer = tracer
        self.on_registered = on_registered
        # RegisterNode's deadline: long, because a registration the client
        # gives up on may still complete on a busy ipam, and the retry is
        # another registration sent to every node's WatchNodes (with 1,000
        # nodes at 5 s, a storm that fed itself).
        self.call_timeout = call_timeout
        self.backoff = backoff or Backoff(0.2, 5.0)
        self.node: ipam_pb2.Node | None = None
        self.registered = asyncio.Event()

    async def register(self) -> ipam_pb2.Node:
        with self.tracer.start_as_current_span(
            "datapath.register_node", attributes={"flagella.node": self.request.name}
        ):
            resp = await self.stub.RegisterNode(self.request, timeout=self.call_timeout)
        log.info(
            "node registered",
            extra={"node": resp.node.name, "pod_cidrs": list(resp.node.pod_cidrs)},
        )
        return resp.node

    async def run(self) -> None:
        """Register, then renew every third of the lease TTL, forever."""
        while True:
            node = await retry(
                self.register,
                what="node registration (ipam RegisterNode)",
                retry_on=(grpc.aio.AioRpcError,),
                backoff=self.backoff,
            )
            self.backoff.reset()
            self.node = node
            await self.on_registered(node)
            self.registered.set()
            await self._renew_until_lost(max(node.lease_ttl.ToSeconds(), 2))

    async def _renew_until_lost(self, ttl: int) -> None:
        """Returns when the registration is gone and must be made again."""
        interval = ttl / 3
        while True:
            await asyncio.sleep(interval)
            try:
                # Until the next renewal is due: one ipam answers late still
                # keeps the lease (at 5 s, renewals a busy ipam would have
                # answered were cancelled, and leases ran out).
                await self.stub.RenewNode(
                    ipam_pb2.RenewNodeRequest(name=self.request.name), timeout=max(interval, 5.0)
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    log.warning("node registration expired; registering again")
                    return
                # ipam or etcd away: keep forwarding traffic, keep trying.
                log.warning("node renewal failed", extra={"reason": exc.details()})
