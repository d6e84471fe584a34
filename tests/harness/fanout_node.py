"""Node subscribers for the fan-out benchmark: one process running many
light "nodes", each with its own node certificate, registered in the node
registry as a datapath registers (lease renewed), and following every
stream a datapath follows (ipam's WatchNodes; policy's WatchIPCache,
WatchPolicy and WatchHostPolicy for its node; lb's WatchServices with the
Maglev tables), decoded with the datapath's own codecs into dicts. Nothing
touches the kernel.

Run as `python -m harness.fanout_node` (cwd or PYTHONPATH: tests/). It reads
JSON lines on stdin and writes JSON lines on stdout:

- first line in: {"ipam": ADDR, "policy": ADDR, "lb": ADDR, "nodes":
  [{"name": N, "ip": IP, "bundle": DIR}, ...]}; out, once every node is
  registered and every stream synced: {"ready": COUNT}
- {"expect": ID, "kind": "rule"|"service"|"ipcache", ...}: out at once
  {"armed": ID}; then, when every node has it (a node that had it already
  counts at once): {"seen": ID, "times": [unix time per node]}
- end of input: every stream closed, {"stopped": COUNT}, exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc
from opentelemetry import trace

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.api.lb.v1 import lb_pb2, lb_pb2_grpc
from flagella.api.policy.v1 import policy_pb2, policy_pb2_grpc
from flagella.common import addresses, tls
from flagella.common.backoff import Backoff
from flagella.common.keepalive import Keepalive
from flagella.common.logs import setup_logging
from flagella.common.sync import StreamCodec, StreamSource
from flagella.common.sync.stream import OpenStream
from flagella.common.tasks import TaskGroup
from flagella.datapath.handlers import IPCacheEntryCodec, PolicyCodec, ServicesCodec
from flagella.datapath.node import NodeRegistration
from flagella.datapath.routes import NodeRoutesCodec

log = logging.getLogger("fanout-node")

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
OnRecord = Callable[[str, Any, Any], None]
JOIN_BATCH = 25


class DictSink(Generic[K, R]):
    """A stream's state as a plain dict (what a datapath's table holds),
    telling on_record(kind, key, record) of every record it takes."""

    def __init__(self, kind: str, on_record: OnRecord) -> None:
        self.kind = kind
        self.on_record = on_record
        self.records: dict[K, R] = {}
        self.revision = 0
        self.live = False

    def get(self, key: K) -> R | None:
        return self.records.get(key)

    def replace(self, records: Iterable[tuple[K, R, int]], revision: int) -> None:
        self.records = {k: r for k, r, _ in records}
        self.revision = revision
        for k, r in self.records.items():
            self.on_record(self.kind, k, r)

    def commit(self, updates: Iterable[tuple[K, R | None, int]], revision: int) -> None:
        for k, r, _ in updates:
            if r is None:
                self.records.pop(k, None)
            else:
                self.records[k] = r
                self.on_record(self.kind, k, r)
        self.revision = revision

    def advance(self, revision: int) -> None:
        self.revision = max(self.revision, revision)

    def set_live(self, live: bool, reason: str = "") -> None:
        self.live = live


@dataclass
class Expectation:
    """A change every node must see: matches(key, record) of its kind."""

    id: int
    kind: str
    matches: Callable[[Any, Any], bool]
    times: dict[str, float] = field(default_factory=dict)


def expectation(msg: dict[str, Any]) -> Expectation:
    kind = msg["kind"]
    if kind == "rule":
        port = int(msg["port"])
        return Expectation(
            msg["expect"], "policy", lambda _k, r: any(e.port == port for e in r.entries)
        )
    if kind == "service":
        port = int(msg["port"])
        return Expectation(
            msg["expect"], "services", lambda _k, r: any(b.port == port for b in r.backends)
        )
    if kind == "ipcache":
        prefix = str(msg["prefix"])
        return Expectation(msg["expect"], "ipcache", lambda k, _r: k == prefix)
    raise ValueError(f"unknown expectation kind {kind!r}")


class Node:
    """One subscriber: a node's identity and its streams."""

    def __init__(self, spec: dict[str, str], peers: dict[str, str], on_record: OnRecord) -> None:
        self.name = spec["name"]
        self.ip = spec["ip"]
        files = tls.TlsFiles(tls.TlsPaths.in_dir(spec["bundle"]))
        keepalive = Keepalive().client_options()
        self.channels: dict[str, grpc.aio.Channel] = {}
        for svc in ("ipam", "policy", "lb"):
            peer = addresses.target(peers[svc], svc)
            options = [*addresses.channel_options(peer), *keepalive]
            self.channels[svc] = tls.secure_channel(peer.target, files, options=options)
        self.on_record = on_record
        self.sources: list[StreamSource[Any, Any]] = []
        self.sinks: dict[str, DictSink[Any, Any]] = {}
        self.registration: NodeRegistration | None = None
        self.host_policy: policy_pb2.HostPolicyEvent | None = None
        self.host_synced = asyncio.Event()

    def _on(self, kind: str, key: Any, record: Any) -> None:
        self.on_record(self.name, kind, (key, record))

    def _stream(
        self,
        tasks: TaskGroup,
        kind: str,
        open_stream: OpenStream,
        codec: StreamCodec[Any, Any, Any],
        *,
        acknowledges_resume: bool = True,
    ) -> None:
        sink: DictSink[Any, Any] = DictSink(kind, self._on)
        self.sinks[kind] = sink
        source: StreamSource[Any, Any] = StreamSource(
            f"{self.name}/{kind}",
            open_stream,
            sink,
            codec,
            acknowledges_resume=acknowledges_resume,
        )
        self.sources.append(source)
        tasks.supervise(f"{self.name}-{kind}", source.run)

    def start(self, tasks: TaskGroup) -> None:
        ipam: Any = ipam_pb2_grpc.IpamServiceStub(self.channels["ipam"])
        policy: Any = policy_pb2_grpc.PolicyServiceStub(self.channels["policy"])
        lb: Any = lb_pb2_grpc.LoadBalancerServiceStub(self.channels["lb"])
        request = ipam_pb2.RegisterNodeRequest(
            name=self.name,
            addresses=[
                ipam_pb2.NodeAddress(type=ipam_pb2.NodeAddress.TYPE_INTERNAL_IP, ip=self.ip)
            ],
        )

        async def registered(_node: ipam_pb2.Node) -> None:
            return None

        reg = self.registration = NodeRegistration(
            ipam, request, trace.get_tracer("fanout"), on_registered=registered
        )
        tasks.supervise(f"{self.name}-registration", reg.run)
        self._stream(
            tasks,
            "nodes",
            lambda since: ipam.WatchNodes(
                ipam_pb2.WatchNodesRequest(since_revision=since, batch_events=True)
            ),
            NodeRoutesCodec(),
        )
        self._stream(
            tasks,
            "ipcache",
            lambda since: policy.WatchIPCache(
                policy_pb2.WatchIPCacheRequest(since_revision=since, batch_events=True)
            ),
            IPCacheEntryCodec(),
            acknowledges_resume=False,
        )
        self._stream(
            tasks,
            "policy",
            lambda since: policy.WatchPolicy(
                policy_pb2.WatchPolicyRequest(node=self.name, since_revision=since)
            ),
            PolicyCodec(),
            acknowledges_resume=False,
        )
        self._stream(
            tasks,
            "services",
            lambda since: lb.WatchServices(
                lb_pb2.WatchServicesRequest(
                    since_revision=since, include_maglev_tables=True, batch_events=True
                )
            ),
            ServicesCodec((self.ip,)),
        )
        tasks.supervise(f"{self.name}-host-policy", lambda: self._host_policy(policy))

    async def _host_policy(self, policy: Any) -> None:
        """The node's host policy, kept whole as the datapath keeps it."""
        backoff = Backoff(0.2, 5.0)
        while True:
            try:
                call = policy.WatchHostPolicy(policy_pb2.WatchHostPolicyRequest(node=self.name))
                async for event in call:
                    self.host_policy = event
                    self.host_synced.set()
                    backoff.reset()
            except grpc.aio.AioRpcError as exc:
                log.warning("host policy stream broke", extra={"reason": exc.details()})
            await backoff.wait()

    async def registered(self) -> None:
        assert self.registration is not None
        await self.registration.registered.wait()

    async def ready(self) -> None:
        await self.registered()
        for source in self.sources:
            await source.synced.wait()
        await self.host_synced.wait()

    async def close(self) -> None:
        for ch in self.channels.values():
            await ch.close()


class Worker:
    def __init__(self, config: dict[str, Any], out: Callable[[dict[str, Any]], None]) -> None:
        peers = {svc: config[svc] for svc in ("ipam", "policy", "lb")}
        self.nodes = [Node(spec, peers, self.saw) for spec in config["nodes"]]
        self.out = out
        self.pending: list[Expectation] = []

    def saw(self, node: str, kind: str, item: tuple[Any, Any]) -> None:
        if not self.pending:
            return
        now = time.time()
        key, record = item
        for exp in list(self.pending):
            if exp.kind != kind or node in exp.times or not exp.matches(key, record):
                continue
            exp.times[node] = now
            if len(exp.times) == len(self.nodes):
                self.pending.remove(exp)
                self.out({"seen": exp.id, "times": sorted(exp.times.values())})

    async def run(self, lines: asyncio.StreamReader) -> None:
        async with TaskGroup("fanout-nodes") as tasks:
            # JOIN_BATCH nodes registering at a time: nodes join a cluster
            # over minutes (a whole worker's at once timed out on ipam's
            # RegisterNode: see docs/SCALE.md).
            for k in range(0, len(self.nodes), JOIN_BATCH):
                batch = self.nodes[k : k + JOIN_BATCH]
                for node in batch:
                    node.start(tasks)
                await asyncio.gather(*(n.registered() for n in batch))
            await asyncio.gather(*(n.ready() for n in self.nodes))
            self.out({"ready": len(self.nodes)})
            while line := await lines.readline():
                exp = expectation(json.loads(line))
                self.pending.append(exp)
                self.out({"armed": exp.id})
                # A node that holds it already (a node added later) has it.
                for node in self.nodes:
                    for item in list(node.sinks[exp.kind].records.items()):
                        self.saw(node.name, exp.kind, item)
        for node in self.nodes:
            await node.close()
        self.out({"stopped": len(self.nodes)})


def _out(msg: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(msg) + "\n")
    sys.stdout.flush()


async def main() -> None:
    loop = asyncio.get_running_loop()
    lines = asyncio.StreamReader(limit=1 << 24)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(lines), sys.stdin)
    config = json.loads(await lines.readline())
    await Worker(config, _out).run(lines)


if __name__ == "__main__":
    setup_logging("fanout-node", "warning")
    asyncio.run(main())
