"""Node health, as Cilium's cilium-health: each datapath listens on a TCP
port of its node (`--health-port`, 4240 as Cilium) and connects to every
other node's listener each interval, on the node's first registered
address: reachable or not, the connect time as latency, the error. A peer
that does not answer is reported here and stays in the routes and ipcache
until the node registry drops it (its lease)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from flagella.datapath.routes import NodeRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerHealth:
    node: str
    ip: str
    reachable: bool
    latency_s: float  # the TCP connect's duration (0 when unreachable)
    error: str
    probed_at: float  # Unix time


class NodeHealth:
    def __init__(
        self,
        local_node: str,
        nodes: Callable[[], Mapping[str, NodeRecord]],
        *,
        port: int,
        interval: float,
    ) -> None:
        self.local_node = local_node
        self.nodes = nodes
        self.port = port
        self.interval = interval
        self.peers: dict[str, PeerHealth] = {}

    async def serve(self) -> None:
        """The listener peers probe: accepts and closes."""

        async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(answer, port=self.port)
        async with server:
            await server.serve_forever()

    async def probe(self, node: NodeRecord) -> PeerHealth:
        ip = node.ips[0]
        start = time.monotonic()
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(ip, self.port), timeout=self.interval
            )
        except (OSError, TimeoutError) as exc:
            error = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            return PeerHealth(node.name, ip, False, 0.0, error, time.time())
        latency = time.monotonic() - start
        writer.close()
        return PeerHealth(node.name, ip, True, latency, "", time.time())

    async def probe_all(self) -> None:
        peers = [n for name, n in self.nodes().items() if name != self.local_node and n.ips]
        results = await asyncio.gather(*(self.probe(n) for n in peers))
        previous = self.peers
        self.peers = {p.node: p for p in results}
        for p in results:
            before = previous.get(p.node)
            if before is not None and before.reachable != p.reachable:
                log.warning(
                    "node reachability changed",
                    extra={"peer": p.node, "reachable": p.reachable, "error": p.error},
                )

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)
