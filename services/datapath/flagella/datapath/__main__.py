"""python -m flagella.datapath: run the datapath service of this node."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.server import Runtime
from flagella.common.server import main as serve_main
from flagella.datapath.config import DatapathConfig
from flagella.datapath.node import NodeRegistration
from flagella.datapath.service import DatapathService
from flagella.datapath.servicer import DatapathServicer


class DatapathApp:
    service_names = (datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name,)

    def __init__(self, runtime: Runtime[DatapathConfig]) -> None:
        self.runtime = runtime
        self.service = DatapathService(runtime.config)
        self.registration: NodeRegistration | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def register(self, server: grpc.aio.Server) -> None:
        datapath_pb2_grpc.add_DatapathServiceServicer_to_server(
            DatapathServicer(self.service),  # type: ignore[abstract]  # RPCs land with issue #5
            server,
        )

    async def start(self) -> None:
        cfg = self.runtime.config
        if cfg.ipam_address:
            request = ipam_pb2.RegisterNodeRequest(
                name=cfg.node_name,
                addresses=[
                    ipam_pb2.NodeAddress(type=ipam_pb2.NodeAddress.TYPE_INTERNAL_IP, ip=ip)
                    for ip in cfg.node_ip
                ],
                datapath_address=cfg.advertise_address or cfg.listen,
            )
            self.registration = NodeRegistration(
                ipam_pb2_grpc.IpamServiceStub(self.runtime.channel(cfg.ipam_address)),
                request,
                self.runtime.tracing.tracer("flagella.datapath"),
                on_registered=self.service.set_node,
            )
            self._tasks.append(
                asyncio.create_task(self.registration.run(), name="node-registration")
            )
            # Not ready before the node is registered: its pod CIDRs come from ipam.
            await self.registration.registered.wait()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def main() -> int:
    return serve_main("datapath", DatapathConfig, DatapathApp)


if __name__ == "__main__":
    sys.exit(main())
