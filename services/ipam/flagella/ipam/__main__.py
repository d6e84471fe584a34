"""python -m flagella.ipam: run the ipam service."""

from __future__ import annotations

import ipaddress
import sys

import grpc

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.server import FatalError, Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.ipam.config import IpamConfig
from flagella.ipam.metrics import IpamCollector
from flagella.ipam.model import Mode
from flagella.ipam.service import IpamService, Settings
from flagella.ipam.servicer import IpamServicer
from flagella.ipam.store import IpamStore


def settings_of(cfg: IpamConfig) -> Settings:
    return Settings(
        mode=Mode(cfg.mode),
        cluster_cidrs=tuple(ipaddress.ip_network(c) for c in cfg.cluster_cidr),
        node_mask_size_v4=cfg.node_mask_size_v4,
        node_mask_size_v6=cfg.node_mask_size_v6,
        default_lease_ttl=cfg.node_lease_ttl,
        expiry_check_interval=cfg.expiry_check_interval,
    )


class IpamApp:
    service_names = (ipam_pb2.DESCRIPTOR.services_by_name["IpamService"].full_name,)

    def __init__(self, runtime: Runtime[IpamConfig]) -> None:
        self.config: IpamConfig = runtime.config
        self.runtime = runtime
        self.etcd = runtime.etcd()
        self.probes = Probes(runtime.readiness, runtime.tasks)
        store = IpamStore(self.etcd, runtime.tasks, watch_history=runtime.config.watch_history)
        self.service = IpamService(store, settings_of(self.config), tasks=runtime.tasks)
        runtime.metrics.registry.register(IpamCollector(self.service))

    def register(self, server: grpc.aio.Server) -> None:
        ipam_pb2_grpc.add_IpamServiceServicer_to_server(
            IpamServicer(self.service, self.runtime.debuginfo()), server
        )

    async def start(self) -> None:
        cfg = self.config
        if cfg.mode == Mode.HOST_SCOPE.value and cfg.kubeconfig:
            from flagella.ipam.kube import KubeNodeCidrs

            try:
                self.service.kube = KubeNodeCidrs.from_kubeconfig(
                    cfg.kubeconfig,
                    timeout=cfg.etcd_timeout,
                    invalid=self.service.invalid_annotation,
                )
            except ValueError as exc:
                raise FatalError(f"--kubeconfig: {exc}") from exc
        await self.runtime.etcd_connected(self.etcd)
        self.probes.add("etcd", self.etcd.connect)
        with self.runtime.phase("first_sync"):
            await self.service.start()

    async def stop(self) -> None:
        # The runtime stopped the tasks (probes, watches, sweep) already.
        await self.service.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("ipam", IpamConfig, IpamApp)


if __name__ == "__main__":
    sys.exit(main())
