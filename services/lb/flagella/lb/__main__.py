"""python -m flagella.lb: run the lb service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.common.etcd import Etcd
from flagella.common.server import Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.lb.config import LbConfig
from flagella.lb.service import LbService
from flagella.lb.servicer import LbServicer
from flagella.lb.store import LbStore


class LbApp:
    service_names = (lb_pb2.DESCRIPTOR.services_by_name["LoadBalancerService"].full_name,)

    def __init__(self, runtime: Runtime[LbConfig]) -> None:
        cfg = runtime.config
        self.etcd = Etcd(cfg.etcd_endpoints, timeout=cfg.etcd_timeout)
        self.probes = Probes(runtime.readiness)
        self.service = LbService(LbStore(self.etcd))

    def register(self, server: grpc.aio.Server) -> None:
        lb_pb2_grpc.add_LoadBalancerServiceServicer_to_server(
            LbServicer(self.service),  # type: ignore[abstract]  # RPCs land with their issue
            server,
        )

    async def start(self) -> None:
        await self.etcd.wait_connected()
        self.probes.add("etcd", self.etcd.current_revision)

    async def stop(self) -> None:
        await self.probes.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("lb", LbConfig, LbApp)


if __name__ == "__main__":
    sys.exit(main())
