"""WatchServices: snapshot then deltas, removed backend ids, Maglev tables on
the stream, and a resumed stream that ends where a fresh snapshot starts."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from harness.etcd import EtcdServer
from harness.lb import LbClient, WatchState, service
from harness.procs import ServiceProcess

from flagella.api.lb.v1 import lb_pb2 as pb
from flagella.lb.model import Algorithm, Frontend, Protocol, ServiceRecord, ServiceType, Source
from flagella.lb.store import LbStore, service_key

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

K = pb.ServiceEvent


def test_snapshot_then_deltas_with_removed_backends(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    c = LbClient(spawn("lb", "--etcd-endpoints", etcd.endpoint).address)
    a = c.upsert(service("w/a", "10.100.0.1", 80, [("10.9.0.1", 80), ("10.9.0.2", 80)])).service
    c.upsert(service("w/b", "10.100.0.2", 80))
    stream = c.watch()
    snap = WatchState().follow(stream)
    kinds = [e.kind for e in snap.events]
    assert kinds == [K.KIND_RESET, K.KIND_UPSERT, K.KIND_UPSERT, K.KIND_SYNCED]
    assert set(snap.services) == {"w/a", "w/b"}
    assert snap.services["w/a"] == a
    assert all(not e.removed_backend_ids for e in snap.events)

    # Drop one backend, make the other terminating (kept: no purge), add one.
    changed = service("w/a", "10.100.0.1", 80, [("10.9.0.2", 80), ("10.9.0.3", 80)])
    changed.backends[0].state = pb.BACKEND_STATE_TERMINATING
    updated = c.upsert(changed).service
    ev = next(stream)
    assert ev.kind == K.KIND_UPSERT
    assert ev.service == updated
    assert list(ev.removed_backend_ids) == [a.backends[0].id]
    assert ev.revision == updated.revision

    assert c.delete("w/a")
    ev = next(stream)
    assert ev.kind == K.KIND_DELETE
    assert (ev.service.name, ev.service.id, ev.service.rev_nat_id) == (
        "w/a",
        a.id,
        a.rev_nat_id,
    )
    assert not ev.service.backends
    assert sorted(ev.removed_backend_ids) == sorted(b.id for b in updated.backends)
    stream.cancel()
    c.close()


def test_maglev_tables_on_the_stream(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    c = LbClient(spawn("lb", "--etcd-endpoints", etcd.endpoint).address)
    c.upsert(
        service(
            "t/m",
            "10.100.1.1",
            80,
            [("10.9.1.1", 80), ("10.9.1.2", 80, 4)],
            algorithm=pb.ALGORITHM_MAGLEV,
        )
    )
    c.upsert(service("t/r", "10.100.1.2", 80, [("10.9.1.3", 80)]))
    stream = c.watch(tables=True)
    snap = WatchState().follow(stream)
    assert set(snap.tables) == {"t/m"}  # random services have none
    assert snap.tables["t/m"] == c.table("t/m")
    assert len(snap.tables["t/m"].backend_ids) == 16381
    c.upsert(service("t/m", "10.100.1.1", 80, [("10.9.1.2", 80, 4)], algorithm=pb.ALGORITHM_MAGLEV))
    ev = next(stream)
    assert ev.maglev_table == c.table("t/m")
    assert set(ev.maglev_table.backend_ids) == {ev.service.backends[0].id}
    stream.cancel()
    c.close()


def test_resumed_stream_equals_a_fresh_snapshot(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c = LbClient(lb.address)
    for i in range(8):
        c.upsert(service(f"r/s{i}", f"10.100.2.{i + 1}", 80, [(f"10.9.2.{i + 1}", 80)]))
    stream = c.watch(tables=True)
    state = WatchState().follow(stream)
    stream.cancel()
    seen_at = state.revision

    # Changes while the watcher is away, through another replica.
    other = LbClient(spawn("lb", "--etcd-endpoints", etcd.endpoint).address)
    other.delete("r/s1")
    other.upsert(service("r/s2", "10.100.2.3", 80, [("10.9.2.3", 80), ("10.9.9.9", 80)]))
    other.upsert(
        service("r/s3", "10.100.2.4", 80, [("10.9.9.8", 80)], algorithm=pb.ALGORITHM_MAGLEV)
    )
    for i in range(8, 11):
        other.upsert(service(f"r/s{i}", f"10.100.2.{i + 1}", 80, [(f"10.9.2.{i + 1}", 80)]))
    other.delete("r/s9")
    head = other.list().revision

    # Resume where it stopped: SYNCED at the old revision, then the deltas.
    resumed = c.watch(since=seen_at, tables=True)
    first = next(resumed)
    assert (first.kind, first.revision) == (K.KIND_SYNCED, seen_at)
    state.apply(first)
    state.follow(resumed, until_revision=head)
    resumed.cancel()
    assert not any(e.kind == K.KIND_RESET for e in state.events[-8:])

    fresh = WatchState().follow(c.watch(tables=True))
    assert fresh.services == state.services
    assert fresh.tables == state.tables
    assert set(fresh.services) == {f"r/s{i}" for i in (0, 2, 3, 4, 5, 6, 7, 8, 10)}
    c.close()
    other.close()


def test_batched_stream_says_what_the_unbatched_one_says(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    """batch_events: the snapshot and the deltas of a batch come several to
    a KIND_BATCH message (256 at most, fewer when Maglev tables make them
    large), and a watcher ends with exactly what one-by-one events give,
    removed backends and tables included, also after a resume."""
    lb = spawn("lb", "--etcd-endpoints", etcd.endpoint)
    c = LbClient(lb.address)

    def svc(i: int, backend: int) -> pb.Service:
        algorithm = pb.ALGORITHM_MAGLEV if i % 10 == 0 else pb.ALGORITHM_RANDOM
        return service(
            f"b/s{i}",
            f"10.101.{i // 250}.{i % 250 + 1}",
            80,
            [(f"10.9.{backend}.{i % 250 + 1}", 80), ("10.9.200.1", 80)],
            algorithm=algorithm,
        )

    def upsert_all(services: list[pb.Service]) -> None:
        for i in range(0, len(services), 500):
            c.stub.UpsertServices(pb.UpsertServicesRequest(services=services[i : i + 500]))

    upsert_all([svc(i, 1) for i in range(600)])
    batched, plain = c.watch(tables=True, batch=True), c.watch(tables=True)
    got, want = WatchState().follow(batched), WatchState().follow(plain)
    assert [e.kind for e in got.events] == [e.kind for e in want.events]
    assert got.services == want.services
    assert got.tables == want.tables
    assert len(got.services) == 600
    assert len(got.tables) == 60
    # 256 a message: the 60 Maglev tables (16,381 slots each) cut them short.
    assert 3 <= got.batches < 20
    assert want.batches == 0

    # One UpsertServices is one etcd batch to the watchers: 400 changed
    # services (their first backend replaced) and then 100 deleted.
    upsert_all([svc(i, 2) for i in range(400)])
    for i in range(500, 600):
        c.delete(f"b/s{i}")
    head = c.list().revision
    got.follow(batched, until_revision=head)
    want.follow(plain, until_revision=head)
    assert got.services == want.services
    assert got.tables == want.tables
    assert sorted(got.removed_backend_ids) == sorted(want.removed_backend_ids)
    assert len(got.removed_backend_ids) == 400 + 2 * 100
    batched.cancel()
    plain.cancel()

    # A resumed batched stream ends where a fresh snapshot starts.
    seen_at = got.revision
    upsert_all([svc(i, 3) for i in range(100, 300)])
    c.delete("b/s0")
    head = c.list().revision
    resumed = c.watch(since=seen_at, tables=True, batch=True)
    got.follow(resumed, until_revision=head)
    resumed.cancel()
    fresh = WatchState().follow(c.watch(tables=True))
    assert got.services == fresh.services
    assert got.tables == fresh.tables
    assert len(fresh.services) == 499
    c.close()


async def test_snapshot_pages_are_one_consistent_revision(etcd: EtcdServer) -> None:
    """The snapshot is read in pages (a single range of 10,000 services would
    not fit in a gRPC message), all at the first page's revision, so writes
    between pages do not show up in it."""
    client = etcd.client()
    store = LbStore(client)

    def record(i: int) -> ServiceRecord:
        return ServiceRecord(
            name=f"p/s{i}",
            namespace="p",
            id=i,
            rev_nat_id=i,
            frontend=Frontend(f"10.100.3.{i}", 80, Protocol.TCP),
            type=ServiceType.CLUSTER_IP,
            node_port=0,
            backends=(),
            algorithm=Algorithm.RANDOM,
            maglev_table_size=16381,
            affinity=None,
            source_ranges=(),
            source=Source.API,
        )

    try:
        for i in range(1, 11):
            await client.put(service_key(i), record(i).to_json())
        seen: list[str] = []
        revisions = set()
        async for kvs, revision in store.pages("flagella/lb/v1/services/", page_size=3):
            revisions.add(revision)
            seen += [kv.key for kv in kvs]
            # Written after the snapshot's revision: not in it.
            await client.put(service_key(50 + len(seen)), record(50 + len(seen)).to_json())
            await client.delete(service_key(len(seen)))
        assert len(revisions) == 1
        assert seen == [service_key(i) for i in range(1, 11)]
    finally:
        await client.close()
