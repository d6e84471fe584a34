"""healthCheckNodePort: what an outside load balancer asks each node about an
externalTrafficPolicy Local service, as kube-proxy and Cilium answer it.

Every node listens on the service's health check port (TCP, its node
addresses) and answers any HTTP GET with a JSON body naming the service and
its local endpoint count: 200 when the node has an active local backend,
503 otherwise (the load balancer then sends it no traffic, which this node
would drop). Services naming the same port (the ports of one Kubernetes
Service) share it: their local backends count once per address.

The desired listeners follow the node's services table (the lb's
WatchServices stream): a port opens when a service names it and closes
when none does; a port that cannot be bound (in use) is logged and tried
again at the next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flagella.common.sync import Table
from flagella.datapath.bpf.lb import BACKEND_ACTIVE, Service

log = logging.getLogger(__name__)

# Read at most this much of a request (the answer does not depend on it).
MAX_REQUEST = 8192
READ_TIMEOUT = 5.0


@dataclass(frozen=True)
class PortState:
    """What one health check port answers."""

    namespace: str
    name: str
    local_endpoints: int


def desired(services: Iterable[Service]) -> dict[int, PortState]:
    """Health check port -> its answer, from the node's services: the
    Kubernetes Service a flagella service comes from ("ns/name:port" ->
    ns, name) and its active local backends' distinct addresses."""
    names: dict[int, tuple[str, str]] = {}
    addresses: dict[int, set[str]] = {}
    for svc in services:
        port = svc.health_check_port
        if not port:
            continue
        namespace, _, rest = svc.name.rpartition("/")
        names.setdefault(port, (namespace, rest.split(":", 1)[0]))
        local = addresses.setdefault(port, set())
        local.update(b.address for b in svc.backends if b.local and b.state == BACKEND_ACTIVE)
    return {port: PortState(ns, name, len(addresses[port])) for port, (ns, name) in names.items()}


def answer(state: PortState) -> bytes:
    """The HTTP response kube-proxy's health server gives."""
    healthy = state.local_endpoints > 0
    body = json.dumps(
        {
            "service": {"namespace": state.namespace, "name": state.name},
            "localEndpoints": state.local_endpoints,
            "serviceProxyHealthy": True,
        }
    ).encode()
    status = "200 OK" if healthy else "503 Service Unavailable"
    head = (
        f"HTTP/1.1 {status}\r\n"
        "Content-Type: application/json\r\n"
        "X-Content-Type-Options: nosniff\r\n"
        f"X-Load-Balancing-Endpoint-Weight: {state.local_endpoints}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + body


class HealthCheckServers:
    """The node's health check listeners, kept to the services table."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.addresses = list(addresses)
        self.state: dict[int, PortState] = {}
        self.servers: dict[int, asyncio.Server] = {}

    async def follow(self, services: Table[int, Service]) -> None:
        """Until cancelled: after each batch of the table, the listeners it
        asks for."""
        # Services with a health check port, as of the last apply: a batch
        # that touches none of them, and brings none, changes nothing (most
        # batches: the whole table is not walked for them).
        with_port: set[int] = set()
        try:
            async for batch in services.subscribe():
                if not batch.snapshot and not any(
                    c.key in with_port or (c.record is not None and c.record.health_check_port)
                    for c in batch.changes
                ):
                    continue
                items = [(sid, svc) for sid, svc in services.items() if svc.health_check_port]
                with_port = {sid for sid, _ in items}
                await self.apply(desired(svc for _, svc in items))
        finally:
            await self.close()

    async def apply(self, want: Mapping[int, PortState]) -> None:
        self.state = dict(want)
        for port in sorted(set(self.servers) - set(want)):
            await self._stop(port)
        for port in sorted(set(want) - set(self.servers)):
            try:
                self.servers[port] = await asyncio.start_server(
                    self._serve,
                    host=self.addresses or None,
                    port=port,
                    reuse_address=True,
                    limit=MAX_REQUEST,
                )
            except OSError as exc:
                log.warning(
                    "health check node port not served",
                    extra={"port": port, "reason": str(exc)},
                )
            else:
                log.info("health check node port served", extra={"port": port})

    async def close(self) -> None:
        for port in list(self.servers):
            await self._stop(port)

    async def _stop(self, port: int) -> None:
        server = self.servers.pop(port)
        server.close()
        with contextlib.suppress(Exception):
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        try:
            # The request line and headers (whatever they ask, the answer is
            # the port's).
            with contextlib.suppress(asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            state = self.state.get(port)
            if state is not None:
                writer.write(answer(state))
                await writer.drain()
        except (OSError, TimeoutError):
            pass  # the client went away
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
