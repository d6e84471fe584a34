"""The datapath's control-plane streams as pure logic: events through their
codec into a typed table, the table onto desired state (routes per node),
and the backends a batch of service changes removed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

from harness.aio import until
from harness.reconcile import NoOps

from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common.reconcile import Reconciler
from flagella.common.sync import Change, StreamSource, Table
from flagella.common.sync.reconcile import apply, reconcile_table
from flagella.common.tasks import TaskGroup
from flagella.datapath.bpf import Backend, Service
from flagella.datapath.handlers import IPCacheCodec, PolicyCodec, PolicySynced, removed_backends
from flagella.datapath.routes import NodeRoutes, NodeRoutesCodec
from flagella.datapath.service import IdentityPolicy


def ip_event(
    kind: policy_pb2.EventKind.ValueType, revision: int, prefix: str = "", identity: int = 0
) -> policy_pb2.IPCacheEvent:
    return policy_pb2.IPCacheEvent(
        kind=kind,
        revision=revision,
        entry=policy_pb2.IPCacheEntry(prefix=prefix, identity=identity),
    )


async def test_ipcache_events_become_prefixes_and_a_bad_prefix_is_dropped() -> None:
    events = [
        ip_event(policy_pb2.EVENT_KIND_RESET, 4),
        ip_event(policy_pb2.EVENT_KIND_UPSERT, 3, "10.0.0.1", 300),
        ip_event(policy_pb2.EVENT_KIND_UPSERT, 4, "not an address", 301),
        ip_event(policy_pb2.EVENT_KIND_UPSERT, 4, "fd00::/64", 302),
        ip_event(policy_pb2.EVENT_KIND_SYNCED, 4),
        ip_event(policy_pb2.EVENT_KIND_DELETE, 5, "10.0.0.1"),
        ip_event(policy_pb2.EVENT_KIND_SYNCED, 5),
    ]

    async def open_stream(since: int) -> AsyncIterator[policy_pb2.IPCacheEvent]:
        for ev in events:
            yield ev
        await asyncio.Event().wait()

    table: Table[str, int] = Table("ipcache")
    async with TaskGroup() as tasks:
        tasks.spawn("source", StreamSource("ipcache", open_stream, table, IPCacheCodec()).run())
        await table.wait_for(5, 5)
    assert dict(table.items()) == {"fd00::/64": 302}


def node(name: str, ip: str, *cidrs: str) -> ipam_pb2.Node:
    return ipam_pb2.Node(
        name=name,
        addresses=[ipam_pb2.NodeAddress(type=ipam_pb2.NodeAddress.TYPE_INTERNAL_IP, ip=ip)],
        pod_cidrs=cidrs,
    )


async def test_nodes_become_routes_to_every_other_node() -> None:
    codec = NodeRoutesCodec()
    table: Table[str, Mapping[str, str]] = Table("nodes")

    def record(n: ipam_pb2.Node) -> Mapping[str, str]:
        return codec.decode(ipam_pb2.NodeEvent(node=n))

    routes: Reconciler[str, str] = Reconciler("routes", NoOps())
    target = NodeRoutes("me", routes)
    table.replace(
        [
            ("me", record(node("me", "192.168.0.1", "10.1.0.0/24")), 1),
            ("a", record(node("a", "192.168.0.2", "10.2.0.0/24")), 1),
        ],
        1,
    )
    sub = table.subscribe()
    batch = await sub.next(1)
    assert batch is not None
    apply(target, batch)
    assert routes.desired() == {"10.2.0.0/24": "192.168.0.2"}

    # a moves to another CIDR, b arrives, then a goes.
    table.commit(
        [
            ("a", record(node("a", "192.168.0.2", "10.2.1.0/24")), 2),
            ("b", record(node("b", "192.168.0.3", "10.3.0.0/24", "fd00:3::/64")), 2),
        ],
        2,
    )
    batch = await sub.next(1)
    assert batch is not None
    apply(target, batch)
    assert routes.desired() == {"10.2.1.0/24": "192.168.0.2", "10.3.0.0/24": "192.168.0.3"}
    table.commit([("a", None, 3)], 3)
    batch = await sub.next(1)
    assert batch is not None
    apply(target, batch)
    assert routes.desired() == {"10.3.0.0/24": "192.168.0.3"}


def svc(service_id: int, *backend_ids: int) -> Service:
    return Service(
        service_id=service_id,
        frontends=(),
        backends=tuple(Backend(b, f"10.200.0.{b}", 80, 6, 1) for b in backend_ids),
    )


def test_removed_backends_of_a_batch() -> None:
    changes = [
        Change(1, svc(1, 10), svc(1, 10, 11, 12), 5),  # 11 and 12 left
        Change(2, None, svc(2, 20, 21), 5),  # deleted: all of its backends
        Change(3, svc(3, 30), None, 5),  # new: nothing removed
        # An id freed by one service and taken by another in the same batch.
        Change(4, svc(4), svc(4, 40), 6),
        Change(5, svc(5, 40), None, 6),
    ]
    assert removed_backends(changes) == [11, 12, 20, 21]


def policy_event(
    kind: policy_pb2.EventKind.ValueType, revision: int, identity: int = 0
) -> policy_pb2.PolicyEvent:
    return policy_pb2.PolicyEvent(
        kind=kind,
        revision=revision,
        identity=identity,
        policy=policy_pb2.ResolvedPolicy(identity=identity, revision=revision),
    )


async def test_policy_realized_at_every_synced_even_at_the_revision_of_its_deltas() -> None:
    """The policy service sends a batch's deltas and its SYNCED at one
    revision: the endpoints are realized there once the batch is applied,
    and never at a revision whose deltas are still arriving."""
    events: asyncio.Queue[policy_pb2.PolicyEvent] = asyncio.Queue()

    async def open_stream(since: int) -> AsyncIterator[policy_pb2.PolicyEvent]:
        while True:
            yield await events.get()

    table: Table[int, IdentityPolicy] = Table("policy")
    source = StreamSource("policy", open_stream, table, PolicyCodec())
    desired: Reconciler[int, IdentityPolicy] = Reconciler("policy", NoOps())
    synced: list[tuple[int, list[int]]] = []

    async def policy_synced(revision: int) -> None:
        synced.append((revision, sorted(desired.desired())))

    async with TaskGroup() as tasks:
        tasks.spawn("source", source.run())
        tasks.spawn(
            "drive",
            reconcile_table(table, desired, after=PolicySynced(policy_synced, source)),
        )
        for ev in [
            policy_event(policy_pb2.EVENT_KIND_RESET, 5),
            policy_event(policy_pb2.EVENT_KIND_UPSERT, 5, 300),
            policy_event(policy_pb2.EVENT_KIND_SYNCED, 5),
        ]:
            events.put_nowait(ev)
        await until(lambda: len(synced) == 1)
        # Each delta applied on its own before the SYNCED arrives.
        events.put_nowait(policy_event(policy_pb2.EVENT_KIND_UPSERT, 6, 301))
        await until(lambda: 301 in desired.desired())
        events.put_nowait(policy_event(policy_pb2.EVENT_KIND_UPSERT, 6, 302))
        await until(lambda: 302 in desired.desired())
        await asyncio.sleep(0.05)
        assert len(synced) == 1  # 6 is not complete yet
        events.put_nowait(policy_event(policy_pb2.EVENT_KIND_SYNCED, 6))
        await until(lambda: len(synced) == 2)
    assert synced == [(5, [300]), (6, [300, 301, 302])]
