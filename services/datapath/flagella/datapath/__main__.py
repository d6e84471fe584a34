"""python -m flagella.datapath: run the datapath service of this node."""

from __future__ import annotations

import sys

import grpc

from flagella.api.datapath.v1 import datapath_pb2, datapath_pb2_grpc
from flagella.common.server import Runtime
from flagella.common.server import main as serve_main
from flagella.datapath.config import DatapathConfig
from flagella.datapath.service import DatapathService
from flagella.datapath.servicer import DatapathServicer


class DatapathApp:
    service_names = (datapath_pb2.DESCRIPTOR.services_by_name["DatapathService"].full_name,)

    def __init__(self, runtime: Runtime[DatapathConfig]) -> None:
        self.runtime = runtime
        self.service = DatapathService(runtime.config)

    def register(self, server: grpc.aio.Server) -> None:
        datapath_pb2_grpc.add_DatapathServiceServicer_to_server(
            DatapathServicer(self.service),  # type: ignore[abstract]  # RPCs land with issue #5
            server,
        )

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def main() -> int:
    return serve_main("datapath", DatapathConfig, DatapathApp)


if __name__ == "__main__":
    sys.exit(main())
