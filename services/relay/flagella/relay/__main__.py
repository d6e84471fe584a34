"""python -m flagella.relay: run the relay service."""

from __future__ import annotations

import sys

import grpc

from flagella.api.relay.v1 import relay_pb2, relay_pb2_grpc
from flagella.common.server import FatalError, Runtime
from flagella.common.server import main as serve_main
from flagella.common.sync import Table
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.relay.config import RelayConfig
from flagella.relay.metrics import RelayCollector
from flagella.relay.peers import Datapaths, Names, node_source
from flagella.relay.service import NodeInfo, Relay
from flagella.relay.servicer import RelayServicer
from flagella.relay.ui import FlowsPage


class RelayApp:
    service_names = (relay_pb2.DESCRIPTOR.services_by_name["RelayService"].full_name,)

    def __init__(self, runtime: Runtime[RelayConfig]) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.nodes: Table[str, NodeInfo] = Table("ipam nodes", log_size=LOCAL_LOG_SIZE)
        self.datapaths = Datapaths(runtime.channel)
        self.relay = Relay(self.nodes, self.datapaths, self.config.settings)
        self.page: FlowsPage | None = None
        if self.config.ui_listen:
            names = Names(
                runtime.channel(self.config.endpoint_address, "endpoint"),
                runtime.channel(self.config.policy_address, "policy"),
                runtime.channel(self.config.lb_address, "lb"),
            )
            self.page = FlowsPage(
                self.relay, names, self.config.ui_listen, self.config.ui_allowed_hosts
            )
        page = self.page
        runtime.metrics.registry.register(
            RelayCollector(self.relay, lambda: page.clients if page else 0)
        )

    def register(self, server: grpc.aio.Server) -> None:
        relay_pb2_grpc.add_RelayServiceServicer_to_server(
            RelayServicer(self.relay, self.runtime.debuginfo()), server
        )

    async def start(self) -> None:
        # Serving does not wait for the registry: a request does, briefly,
        # and answers UNAVAILABLE naming ipam when it is away.
        source = node_source(self.runtime.channel(self.config.ipam_address, "ipam"), self.nodes)
        tasks = self.runtime.tasks
        tasks.spawn("ipam-nodes", source.run())
        tasks.spawn("probe-nodes", self.relay.probe(self.config.node_probe_interval))
        self.runtime.phase_ends_with("first_sync", self.nodes.wait_initialized())
        if self.page is not None:
            try:
                await self.page.start()
            except OSError as exc:
                raise FatalError(
                    f"cannot serve the flows page on {self.page.address}: {exc}"
                ) from exc

    async def stop(self) -> None:
        # The runtime's tasks have stopped; end the nodes' flow streams now
        # rather than when the runtime closes every channel after this.
        if self.page is not None:
            await self.page.stop()
        await self.datapaths.close()


def main() -> int:
    return serve_main("relay", RelayConfig, RelayApp)


if __name__ == "__main__":
    sys.exit(main())
