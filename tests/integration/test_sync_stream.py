"""The sync layer across real gRPC: a server streams a table it mirrors
from a real etcd (serve_watch), a client mirrors the stream into its own
table (StreamSource). The client resumes after the server restarts without
a full resync while etcd still holds its revision; resyncs when the
revision was compacted; and ends equal to etcd whatever the server restarts
and writes in between."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.net import free_port

from flagella.api.ipam.v1 import ipam_pb2, ipam_pb2_grpc
from flagella.common.etcd import Etcd, KeyValue
from flagella.common.sync import Change, EtcdSource, StreamSource, Table, serve_watch
from flagella.common.tasks import TaskGroup

pytestmark = pytest.mark.integration

PREFIX = "sync/nodes/"


class NodeCodec:
    def key(self, key: str) -> str | None:
        return key[len(PREFIX) :] if key.startswith(PREFIX) else None

    def decode(self, key: str, kv: KeyValue) -> ipam_pb2.Node:
        node = ipam_pb2.Node.FromString(kv.value)
        node.revision = kv.mod_revision
        return node


class NodeMessages:
    def reset(self, revision: int) -> ipam_pb2.NodeEvent:
        return ipam_pb2.NodeEvent(kind=ipam_pb2.NodeEvent.KIND_RESET, revision=revision)

    async def upsert(self, change: Change[str, ipam_pb2.Node]) -> ipam_pb2.NodeEvent:
        return ipam_pb2.NodeEvent(
            kind=ipam_pb2.NodeEvent.KIND_UPSERT, node=change.record, revision=change.revision
        )

    async def delete(self, change: Change[str, ipam_pb2.Node]) -> ipam_pb2.NodeEvent:
        return ipam_pb2.NodeEvent(
            kind=ipam_pb2.NodeEvent.KIND_DELETE,
            node=ipam_pb2.Node(name=change.key),
            revision=change.revision,
        )

    def synced(self, revision: int) -> ipam_pb2.NodeEvent:
        return ipam_pb2.NodeEvent(kind=ipam_pb2.NodeEvent.KIND_SYNCED, revision=revision)


class StreamCodec:
    def key(self, event: ipam_pb2.NodeEvent) -> str:
        return event.node.name

    def decode(self, event: ipam_pb2.NodeEvent) -> ipam_pb2.Node:
        return event.node


class NodesServer(ipam_pb2_grpc.IpamServiceServicer):
    """A replica: its own table mirrored from etcd, served to watchers."""

    def __init__(self, etcd: Etcd, port: int) -> None:
        self.table: Table[str, ipam_pb2.Node] = Table("nodes", log_size=64)
        self.source = EtcdSource(etcd, self.table, NodeCodec(), prefix=PREFIX)
        self.port = port
        self.tasks = TaskGroup("server")
        self.server = grpc.aio.server()
        ipam_pb2_grpc.add_IpamServiceServicer_to_server(self, self.server)

    async def start(self) -> NodesServer:
        self.tasks.spawn("source", self.source.run())
        await self.table.wait_initialized(10)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(0)
        await self.tasks.stop()

    async def WatchNodes(
        self, request: ipam_pb2.WatchNodesRequest, context: Any
    ) -> AsyncIterator[ipam_pb2.NodeEvent]:
        since = request.since_revision
        async for msg in serve_watch(
            self.table.subscribe(since), NodeMessages(), since=since, heartbeat=0.2
        ):
            yield msg


@contextlib.asynccontextmanager
async def client_of(
    port: int,
) -> AsyncIterator[tuple[Table[str, ipam_pb2.Node], StreamSource[str, ipam_pb2.Node]]]:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stub = ipam_pb2_grpc.IpamServiceStub(channel)
    table: Table[str, ipam_pb2.Node] = Table("client")
    source: StreamSource[str, ipam_pb2.Node] = StreamSource(
        "nodes",
        lambda since: stub.WatchNodes(ipam_pb2.WatchNodesRequest(since_revision=since)),
        table,
        StreamCodec(),
    )
    async with TaskGroup() as tasks:
        tasks.spawn("follow", source.run())
        await table.wait_initialized(10)
        yield table, source
    await channel.close()


async def put_node(etcd: Etcd, name: str, address: str) -> int:
    node = ipam_pb2.Node(name=name, datapath_address=address)
    return await etcd.put(PREFIX + name, node.SerializeToString())


async def until_synced(source: StreamSource[str, ipam_pb2.Node], revision: int) -> None:
    """Until a SYNCED at revision or later (the table's own revision moves
    with each delta, and a batch's deltas can share one revision)."""
    for _ in range(500):
        if source.revision >= revision:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not synced at {revision}: {source.revision}")


def names(table: Table[str, ipam_pb2.Node]) -> dict[str, str]:
    return {k: v.datapath_address for k, v in table.items()}


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[Etcd]:
    c = etcd.client(timeout=2.0)
    await asyncio.wait_for(c.wait_connected(), 30)
    yield c
    await c.close()


async def test_client_resumes_after_the_server_restarts_without_a_full_resync(
    client: Etcd,
) -> None:
    port = free_port()
    await put_node(client, "n1", "a")
    server = await NodesServer(client, port).start()
    async with client_of(port) as (table, source):
        assert names(table) == {"n1": "a"}
        rev = await put_node(client, "n2", "a")
        await table.wait_for(rev, 5)
        await server.stop()
        # While the server is away: changes it will have to tell.
        await put_node(client, "n1", "b")
        await client.delete(PREFIX + "n2")
        for i in range(100):  # more than the new replica's change log holds
            await put_node(client, f"m{i}", "c")
        head = await put_node(client, "n3", "c")
        server = await NodesServer(client, port).start()
        await until_synced(source, head)
        assert names(table) == {"n1": "b", "n3": "c"} | {f"m{i}": "c" for i in range(100)}
        assert source.snapshots == 1  # resumed from etcd's history, no RESET
        # And it goes on following.
        rev = await put_node(client, "n4", "d")
        await table.wait_for(rev, 5)
        assert table.get("n4") is not None
    await server.stop()


async def test_client_resyncs_when_its_revision_was_compacted(client: Etcd) -> None:
    port = free_port()
    await put_node(client, "n1", "a")
    server = await NodesServer(client, port).start()
    async with client_of(port) as (table, source):
        await server.stop()
        await client.delete(PREFIX + "n1")
        head = await put_node(client, "n2", "b")
        await client.client.compact(head)
        server = await NodesServer(client, port).start()
        await until_synced(source, head)
        assert names(table) == {"n2": "b"}
        assert source.snapshots == 2
    await server.stop()


async def test_client_equals_etcd_after_writes_and_server_restarts_at_random_points(
    client: Etcd,
) -> None:
    rng = random.Random(7)
    port = free_port()
    server = await NodesServer(client, port).start()
    async with client_of(port) as (table, source):
        for _ in range(6):
            for _ in range(rng.randrange(5, 40)):
                name = f"r{rng.randrange(12)}"
                if rng.random() < 0.3:
                    await client.delete(PREFIX + name)
                else:
                    await put_node(client, name, str(rng.randrange(100)))
            if rng.random() < 0.6:
                await server.stop()
                await put_node(client, f"r{rng.randrange(12)}", "away")
                server = await NodesServer(client, port).start()
        head = await put_node(client, "last", "x")
        await until_synced(source, head)
        kvs, _ = await client.get_prefix(PREFIX)
        expected = {
            kv.key[len(PREFIX) :]: ipam_pb2.Node.FromString(kv.value).datapath_address for kv in kvs
        }
        assert names(table) == expected
    await server.stop()
