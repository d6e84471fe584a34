"""python -m flagella.ipam: run the ipam service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.etcd import Etcd
from flagella.common.server import Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.ipam.config import IpamConfig
from flagella.ipam.service import IpamService
from flagella.ipam.servicer import IpamServicer
from flagella.ipam.store import IpamStore


class IpamApp:
    service_names = (ipam_pb2.DESCRIPTOR.services_by_name["IpamService"].full_name,)

    def __init__(self, runtime: Runtime[IpamConfig]) -> None:
        cfg = runtime.config
        self.etcd = Etcd(cfg.etcd_endpoints, timeout=cfg.etcd_timeout)
        self.probes = Probes(runtime.readiness)
        self.service = IpamService(IpamStore(self.etcd))

    def register(self, server: grpc.aio.Server) -> None:
        ipam_pb2_grpc.add_IpamServiceServicer_to_server(
            IpamServicer(self.service),  # type: ignore[abstract]  # RPCs land with their issue
            server,
        )

    async def start(self) -> None:
        await self.etcd.wait_connected()
        self.probes.add("etcd", self.etcd.current_revision)

    async def stop(self) -> None:
        await self.probes.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("ipam", IpamConfig, IpamApp)


if __name__ == "__main__":
    sys.exit(main())
