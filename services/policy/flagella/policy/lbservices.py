"""The lb services, followed for toServices: lb's WatchServices stream
(flagella.common.sync.StreamSource) into a table of what toServices needs
of each service (its namespace, name, labels and backend addresses).

Until the stream's first snapshot the table is empty, so toServices
selects nothing (closed); the policy service starts and is ready without
lb. A broken stream keeps the last services it had (backends do not
vanish from policy because lb restarts) and resumes where it left off.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Callable

import grpc

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.common.sync import StreamSource, Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.policy.identities import IPNetwork, parse_prefix
from flagella.policy.rules import ServiceInfo, service_name

log = logging.getLogger(__name__)


class ServiceCodec:
    """WatchServices events -> lb service name: ServiceInfo."""

    def key(self, event: lb_pb2.ServiceEvent) -> str:
        return event.service.name

    def decode(self, event: lb_pb2.ServiceEvent) -> ServiceInfo:
        svc = event.service
        addresses: set[IPNetwork] = set()
        for b in svc.backends:
            try:
                addresses.add(parse_prefix(b.address))
            except ValueError:
                # lb validates addresses; a bad one allows nothing.
                log.warning(
                    "backend address unreadable, left out of toServices",
                    extra={"service": svc.name, "address": b.address},
                )
        return ServiceInfo(
            namespace=svc.namespace,
            name=service_name(svc.name),
            labels=tuple(sorted(svc.labels.items())),
            addresses=tuple(sorted(addresses, key=lambda n: (n.version, n))),
        )


class LbServices:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = lb_pb2_grpc.LoadBalancerServiceStub(channel)

        def open_stream(since: int) -> AsyncIterable[lb_pb2.ServiceEvent]:
            return stub.WatchServices(
                lb_pb2.WatchServicesRequest(since_revision=since, batch_events=True)
            )

        self.table: Table[str, ServiceInfo] = Table("lb-services", log_size=LOCAL_LOG_SIZE)
        self.source = StreamSource("lb-services", open_stream, self.table, ServiceCodec())

    def infos(self) -> tuple[ServiceInfo, ...]:
        return tuple(info for _, info in self.table.items())

    def start(self, tasks: TaskGroup, on_change: Callable[[], None]) -> None:
        """Follows lb; on_change after every batch of service changes."""

        async def follow() -> None:
            async for _ in self.table.subscribe():
                on_change()

        tasks.supervise("lb-services-stream", self.source.run)
        tasks.supervise("lb-services-follow", follow)
