"""python -m flagella.endpoint: run the endpoint service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.endpoint.v1 import endpoint_pb2, endpoint_pb2_grpc
from flagella.common.etcd import Etcd
from flagella.common.server import Probes, Runtime
from flagella.common.server import main as serve_main
from flagella.endpoint.config import EndpointConfig
from flagella.endpoint.service import EndpointService
from flagella.endpoint.servicer import EndpointServicer
from flagella.endpoint.store import EndpointStore


class EndpointApp:
    service_names = (endpoint_pb2.DESCRIPTOR.services_by_name["EndpointService"].full_name,)

    def __init__(self, runtime: Runtime[EndpointConfig]) -> None:
        cfg = runtime.config
        self.etcd = Etcd(cfg.etcd_endpoints, timeout=cfg.etcd_timeout)
        self.probes = Probes(runtime.readiness)
        self.service = EndpointService(EndpointStore(self.etcd))

    def register(self, server: grpc.aio.Server) -> None:
        endpoint_pb2_grpc.add_EndpointServiceServicer_to_server(
            EndpointServicer(self.service),  # type: ignore[abstract]  # RPCs land with their issue
            server,
        )

    async def start(self) -> None:
        await self.etcd.wait_connected()
        self.probes.add("etcd", self.etcd.current_revision)

    async def stop(self) -> None:
        await self.probes.stop()
        await self.etcd.close()


def main() -> int:
    return serve_main("endpoint", EndpointConfig, EndpointApp)


if __name__ == "__main__":
    sys.exit(main())
