"""python -m flagella.endpoint: run the endpoint service."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common.errors import FlagellaError
from flagella.common.etcd import Etcd
from flagella.common.server import Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.endpoint.config import EndpointConfig
from flagella.endpoint.peers import DatapathPeers, IpamPeer, KubernetesPodLabels, PolicyPeer
from flagella.endpoint.service import EndpointService, Settings
from flagella.endpoint.servicer import EndpointServicer
from flagella.endpoint.store import EndpointStore

log = logging.getLogger(__name__)


def fault_hook(spec: str) -> Callable[[str], Awaitable[None]]:
    """crash-after:STEP kills this process (SIGKILL) right after STEP of a
    create; pause-after:STEP:SECONDS waits there (for tests that kill a
    peer at that point)."""
    action, _, rest = spec.partition(":")
    at, _, seconds = rest.partition(":")

    async def hook(step: str) -> None:
        if step != at:
            return
        log.warning("fault injection", extra={"action": action, "step": step})
        if action == "crash-after":
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            await asyncio.sleep(float(seconds))

    return hook


class EndpointApp:
    service_names = (endpoint_pb2.DESCRIPTOR.services_by_name["EndpointService"].full_name,)

    def __init__(self, runtime: Runtime[EndpointConfig]) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.etcd = Etcd(cfg.etcd_endpoints, timeout=cfg.etcd_timeout)
        self.probes = Probes(runtime.readiness)
        self.ipam_channel = runtime.channel(cfg.ipam_address)
        self.policy_channel = runtime.channel(cfg.policy_address)
        self.ipam = IpamPeer(self.ipam_channel)
        self.service = EndpointService(
            EndpointStore(self.etcd),
            self.ipam,
            PolicyPeer(self.policy_channel),
            DatapathPeers(runtime.channel),
            pod_labels=KubernetesPodLabels(cfg.kubeconfig) if cfg.kubeconfig else None,
            settings=Settings(
                reservation_s=cfg.reservation_seconds,
                policy_wait_s=cfg.policy_wait_seconds,
                dns_nameservers=cfg.dns_nameserver,
                dns_search=cfg.dns_search,
            ),
            fault_hook=fault_hook(cfg.fault_injection) if cfg.fault_injection else None,
        )
        self._sweeper: asyncio.Task[None] | None = None
        self._node_watch: asyncio.Task[None] | None = None

    def register(self, server: grpc.aio.Server) -> None:
        endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(
            EndpointServicer(self.service, self.status), server
        )

    async def status(self) -> tuple[bool, dict[str, str]]:
        """CNI STATUS: can an ADD succeed now?"""
        deps: dict[str, str] = dict(self.runtime.readiness.reasons)
        for name, channel in (("ipam", self.ipam_channel), ("policy", self.policy_channel)):
            stub: Any = health_pb2_grpc.HealthStub(channel)
            try:
                resp = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.aio.AioRpcError as exc:
                deps[name] = f"unreachable: {exc.code().name}"
                continue
            if resp.status != health_pb2.HealthCheckResponse.SERVING:
                deps[name] = "not serving"
        return (self.runtime.readiness.serving and not deps), deps

    async def start(self) -> None:
        # The node mirror fills in the background; until it is synced, node
        # lookups go to ipam.
        self._node_watch = asyncio.create_task(self.ipam.follow_nodes(), name="node-watch")
        await self.etcd.wait_connected()
        self.probes.add("etcd", self.etcd.current_revision)
        await self.service.restore()
        interval = self.runtime.config.gc_interval_seconds
        if interval > 0:
            self._sweeper = asyncio.create_task(self._sweep(interval), name="endpoint-sweep")

    async def _sweep(self, interval: float) -> None:
        missing: dict[int, int] = {}
        while True:
            await asyncio.sleep(interval)
            try:
                removed = await self.service.sweep(missing)
            except FlagellaError as exc:
                log.warning("endpoint sweep failed", extra={"reason": exc.details})
                continue
            if removed:
                log.info("sweep removed endpoints", extra={"ids": [ep.id for ep in removed]})

    async def stop(self) -> None:
        for task in (self._sweeper, self._node_watch):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.probes.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("endpoint", EndpointConfig, EndpointApp)


if __name__ == "__main__":
    sys.exit(main())
