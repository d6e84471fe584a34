"""python -m flagella.endpoint: run the endpoint service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common.kubestatus import health_report
from flagella.common.leader import Election
from flagella.common.server import FatalError, Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.common.sync import EtcdSource, Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.endpoint.cnirun import CniRunner
from flagella.endpoint.config import EndpointConfig
from flagella.endpoint.kube import EndpointWatchers, KubeReader
from flagella.endpoint.metrics import CniLatency, EndpointCollector
from flagella.endpoint.model import Endpoint
from flagella.endpoint.peers import DatapathPeers, IpamPeer, PeerHealth, PolicyPeer
from flagella.endpoint.service import EndpointService, Settings
from flagella.endpoint.servicer import EndpointServicer
from flagella.endpoint.status import CniStatus
from flagella.endpoint.store import ENDPOINTS, EndpointCodec, EndpointStore

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
        cfg: EndpointConfig = runtime.config
        self.runtime = runtime
        self.config = cfg
        self.tasks: TaskGroup = runtime.tasks
        self.etcd = runtime.etcd()
        self.probes = Probes(runtime.readiness, runtime.tasks)
        ipam_channel = runtime.channel(cfg.ipam_address, "ipam")
        policy_channel = runtime.channel(cfg.policy_address, "policy")
        self.ipam = IpamPeer(ipam_channel)
        # Its reader answers once start() made the API client.
        self.kube_reader = KubeReader() if cfg.kubeconfig else None
        self.service = EndpointService(
            EndpointStore(self.etcd),
            self.ipam,
            PolicyPeer(policy_channel),
            DatapathPeers(runtime.channel),
            pod_labels=self.kube_reader,
            settings=Settings(
                reservation_s=cfg.reservation_seconds,
                policy_wait_s=cfg.policy_wait_seconds,
                dns_nameservers=cfg.dns_nameserver,
                dns_search=cfg.dns_search,
            ),
            fault_hook=fault_hook(cfg.fault_injection) if cfg.fault_injection else None,
        )
        self.kube: EndpointWatchers | None = None
        self.status = CniStatus(
            runtime.readiness,
            {"ipam": PeerHealth(ipam_channel), "policy": PeerHealth(policy_channel)},
        )
        # etcd's endpoints, for the metrics and the Kubernetes watchers.
        self.endpoints: Table[str, Endpoint] = Table("endpoints", log_size=LOCAL_LOG_SIZE)
        runtime.metrics.registry.register(EndpointCollector(self.endpoints))
        latency = CniLatency(runtime.metrics.registry)
        self.servicer = EndpointServicer(
            self.service,
            self.status,
            CniRunner(self.service, self.status, latency.observe),
            runtime.debuginfo(),
        )
        # Nodes delete and check only the endpoints on them.
        runtime.authorizer.resolvers["endpoint"] = self.servicer.node_of

    def register(self, server: grpc.aio.Server) -> None:
        endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        # The node mirror fills in the background; until it is synced, node
        # lookups go to ipam.
        self.tasks.supervise("node-watch", self.ipam.follow_nodes)
        await self.runtime.etcd_connected(self.etcd)
        self.probes.add("etcd", self.etcd.connect)
        source = EtcdSource(
            self.etcd, self.endpoints, EndpointCodec(), prefix=ENDPOINTS, name="endpoints"
        )
        self.tasks.spawn("endpoints-table", source.run())
        self.runtime.phase_ends_with("first_sync", self.endpoints.wait_initialized())
        with self.runtime.phase("restore"):
            await self.service.restore()
        interval = self.config.gc_interval_seconds
        if interval > 0:
            self.tasks.supervise("endpoint-sweep", lambda: self.service.sweep_loop(interval))
        if self.kube_reader is not None:
            await self._follow_kubernetes(self.kube_reader)

    async def _follow_kubernetes(self, reader: KubeReader) -> None:
        cfg = self.config
        self.kube = EndpointWatchers(
            self.service, self.etcd, cfg.kubeconfig, self.endpoints, reader
        )
        try:
            await self.kube.connect()
        except Exception as exc:
            raise FatalError(f"cannot use --kubeconfig {cfg.kubeconfig}: {exc}") from exc
        self.kube.start(self.tasks, Election.of(cfg), health_report(self.runtime.readiness))

    async def stop(self) -> None:
        # The runtime stopped the tasks (node watch, sweep, probes, watchers) already.
        if self.kube is not None:
            await self.kube.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("endpoint", EndpointConfig, EndpointApp)


if __name__ == "__main__":
    sys.exit(main())
