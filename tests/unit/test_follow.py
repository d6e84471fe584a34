"""Following a Watch* stream (StreamSource, which replaced the datapath's
StreamFollower): snapshot, deltas, and resume from the last SYNCED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import grpc
import pytest

from flagella.common.backoff import Backoff
from flagella.common.sync import Batching, Change, StreamSource, serve_watch
from flagella.common.sync import Table as SyncTable
from flagella.common.sync.stream import BATCH, DELETE, RESET, SYNCED, UPSERT
from flagella.common.sync.table import Batch
from flagella.common.tasks import TaskGroup


@dataclass
class Ev:
    kind: int
    revision: int
    key: str = ""
    value: str = ""
    events: tuple[Ev, ...] = field(default=())


class Codec:
    def key(self, event: Ev) -> str:
        return event.key

    def decode(self, event: Ev) -> str:
        return event.value


class Table:
    """A sink that records the SYNCED revisions it was told of."""

    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.synced_at: list[int] = []
        self.commits = 0

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def replace(self, records: Iterable[tuple[str, str, int]], revision: int) -> None:
        self.data = {k: r for k, r, _ in records}
        self.synced_at.append(revision)

    def commit(self, updates: Iterable[tuple[str, str | None, int]], revision: int) -> None:
        self.commits += 1
        for key, record, _ in updates:
            if record is None:
                self.data.pop(key, None)
            else:
                self.data[key] = record

    def advance(self, revision: int) -> None:
        self.synced_at.append(revision)

    def set_live(self, live: bool, reason: str = "") -> None:
        pass


def broken() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "server went away"
    )


def source_of(
    open_stream: Callable[[int], AsyncIterator[Ev]], table: Table
) -> StreamSource[str, str]:
    return StreamSource("t", open_stream, table, Codec(), backoff=Backoff(0.001, 0.01))


async def run_until(source: StreamSource[str, str], done: asyncio.Event) -> None:
    async with TaskGroup() as tasks:
        tasks.spawn("source", source.run())
        await asyncio.wait_for(done.wait(), 5)


async def test_resumes_from_last_revision_after_a_break() -> None:
    calls: list[int] = []
    done = asyncio.Event()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        calls.append(since)
        if len(calls) == 1:
            for ev in [
                Ev(RESET, 10),
                Ev(UPSERT, 3, "a", "1"),
                Ev(UPSERT, 7, "b", "2"),
                Ev(SYNCED, 10),
                Ev(UPSERT, 11, "c", "3"),
            ]:
                yield ev
            raise broken()
        for ev in [Ev(SYNCED, since), Ev(DELETE, 12, "a"), Ev(UPSERT, 13, "b", "22")]:
            yield ev
        done.set()
        await asyncio.Event().wait()

    table = Table()
    source = source_of(open_stream, table)
    await run_until(source, done)
    # The StreamFollower resumed from the revision of its last delta (11):
    # unsafe when a break splits the events of one revision. StreamSource
    # resumes from its last SYNCED (10), restoring what it applied since if
    # the server does not name it again; so the server's acknowledgement
    # of the resume (SYNCED at since) is now at 10 and tells the sink
    # nothing (the follower handed the SYNCED at 11 on), and the source is
    # still at 10: no SYNCED closed the deltas 12 and 13.
    assert calls == [0, 10]
    assert table.data == {"b": "22", "c": "3"}
    assert source.revision == 10
    assert table.synced_at == [10]


async def test_break_mid_snapshot_restarts_the_snapshot() -> None:
    calls: list[int] = []
    done = asyncio.Event()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        calls.append(since)
        if len(calls) == 1:
            yield Ev(RESET, 20)
            yield Ev(UPSERT, 19, "x", "1")  # snapshot cut short
            raise broken()
        for ev in [
            Ev(RESET, 21),
            Ev(UPSERT, 19, "x", "1"),
            Ev(UPSERT, 21, "y", "2"),
            Ev(SYNCED, 21),
        ]:
            yield ev
        done.set()
        await asyncio.Event().wait()

    table = Table()
    source = source_of(open_stream, table)
    await run_until(source, done)
    assert calls == [0, 0]
    assert table.data == {"x": "1", "y": "2"}
    assert source.synced.is_set()


async def test_a_synced_closing_deltas_reaches_subscribers() -> None:
    """A SYNCED at the revision of the deltas it closes still wakes the
    table's subscribers: they learn the table is complete there (the
    datapath tells the endpoints' policy realized at each)."""
    events: asyncio.Queue[Ev] = asyncio.Queue()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        while True:
            yield await events.get()

    table: SyncTable[str, str] = SyncTable("t")
    source = StreamSource("t", open_stream, table, Codec())
    sub = table.subscribe()
    async with TaskGroup() as tasks:
        tasks.spawn("source", source.run())
        for ev in [Ev(RESET, 5), Ev(UPSERT, 5, "a", "1"), Ev(SYNCED, 5)]:
            events.put_nowait(ev)
        first = await sub.next(5)
        assert first is not None
        assert first.snapshot
        events.put_nowait(Ev(UPSERT, 6, "b", "2"))
        batch = await sub.next(5)
        assert batch is not None
        assert [c.key for c in batch.changes] == ["b"]
        assert source.revision == 5  # not complete at 6 yet
        events.put_nowait(Ev(SYNCED, 6))
        batch = await sub.next(5)
        assert batch is not None
        assert (batch.revision, batch.changes, source.revision) == (6, (), 6)
        # A heartbeat at the same revision publishes nothing.
        events.put_nowait(Ev(SYNCED, 6))
        assert await sub.next(0.2) is None


@pytest.mark.parametrize("kinds", [(1, 2, 3, 4)])
def test_kinds_match_every_watch_enum(kinds: tuple[int, int, int, int]) -> None:
    from flagella.api.ipam.v1 import ipam_pb2
    from flagella.api.lb.v1 import lb_pb2
    from flagella.api.policy.v1 import policy_pb2

    assert kinds == (RESET, UPSERT, DELETE, SYNCED)
    assert kinds == (
        ipam_pb2.NodeEvent.KIND_RESET,
        ipam_pb2.NodeEvent.KIND_UPSERT,
        ipam_pb2.NodeEvent.KIND_DELETE,
        ipam_pb2.NodeEvent.KIND_SYNCED,
    )
    assert kinds == (
        lb_pb2.ServiceEvent.KIND_RESET,
        lb_pb2.ServiceEvent.KIND_UPSERT,
        lb_pb2.ServiceEvent.KIND_DELETE,
        lb_pb2.ServiceEvent.KIND_SYNCED,
    )
    assert kinds == (
        policy_pb2.EVENT_KIND_RESET,
        policy_pb2.EVENT_KIND_UPSERT,
        policy_pb2.EVENT_KIND_DELETE,
        policy_pb2.EVENT_KIND_SYNCED,
    )

    assert BATCH == lb_pb2.ServiceEvent.KIND_BATCH == ipam_pb2.NodeEvent.KIND_BATCH


def batched(*events: Ev) -> Ev:
    return Ev(BATCH, events[-1].revision, events=events)


async def test_batches_are_their_events_in_order_and_resume_the_same() -> None:
    """A BATCH is its events one after the other, in a snapshot and as
    deltas; its deltas reach the sink in one commit; a break after a
    batch resumes from the last SYNCED, restoring what the server does
    not name again."""
    calls: list[int] = []
    done = asyncio.Event()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        calls.append(since)
        if len(calls) == 1:
            for ev in [
                Ev(RESET, 10),
                batched(Ev(UPSERT, 3, "a", "1"), Ev(UPSERT, 7, "b", "2"), Ev(UPSERT, 8, "z", "0")),
                Ev(UPSERT, 9, "y", "9"),
                batched(Ev(DELETE, 10, "z")),
                Ev(SYNCED, 10),
                batched(Ev(UPSERT, 11, "c", "3"), Ev(DELETE, 11, "a"), Ev(UPSERT, 12, "b", "5")),
            ]:
                yield ev
            assert table.commits == 1  # the three deltas together
            raise broken()
        for ev in [Ev(SYNCED, since), batched(Ev(UPSERT, 13, "b", "22"), Ev(DELETE, 13, "y"))]:
            yield ev
        yield Ev(SYNCED, 13)
        done.set()
        await asyncio.Event().wait()

    table = Table()
    source = source_of(open_stream, table)
    await run_until(source, done)
    assert calls == [0, 10]
    # "a" came back (the server did not name it again after 10), "c" went
    # (it was not there at 10), "b" and "y" as the resumed deltas say.
    assert table.data == {"a": "1", "b": "22"}
    assert table.synced_at == [10]
    assert source.revision == 13


class EvMessages:
    def reset(self, revision: int) -> Ev:
        return Ev(RESET, revision)

    async def upsert(self, change: Change[str, str]) -> Ev:
        return Ev(UPSERT, change.revision, change.key, change.record or "")

    async def delete(self, change: Change[str, str]) -> Ev:
        return Ev(DELETE, change.revision, change.key)

    def synced(self, revision: int) -> Ev:
        return Ev(SYNCED, revision)


class ListFeed:
    def __init__(self, batches: list[Batch[str, str]]) -> None:
        self.batches = batches

    async def next(self, timeout: float | None = None) -> Batch[str, str] | None:
        return self.batches.pop(0) if self.batches else None


async def test_serve_watch_packs_a_batch_by_count_and_by_size() -> None:
    """Up to max_events a message, closed early at max_bytes; a lone event
    goes as itself; RESET and SYNCED stay apart."""
    snapshot = Batch(
        revision=20,
        changes=tuple(Change(f"k{i}", f"v{i}", None, i + 1) for i in range(7)),
        snapshot=True,
    )
    deltas = Batch(
        revision=23,
        changes=(
            Change("big", "x" * 50, None, 21),
            Change("k0", None, "v0", 22),
            Change("k1", "w", "v1", 23),
        ),
    )
    lone = Batch(revision=24, changes=(Change("k2", None, "v2", 24),))
    batching = Batching(
        wrap=lambda evs: Ev(BATCH, evs[-1].revision, events=tuple(evs)),
        size=lambda ev: len(ev.value) + 1,
        max_events=3,
        max_bytes=40,
    )
    stream = serve_watch(
        ListFeed([snapshot, deltas, lone]), EvMessages(), heartbeat=0.01, batching=batching
    )
    got = [await anext(stream) for _ in range(9)]
    shape = [(e.kind, e.revision, [x.key for x in e.events] or e.key) for e in got]
    assert shape == [
        (RESET, 20, ""),
        (BATCH, 3, ["k0", "k1", "k2"]),
        (BATCH, 6, ["k3", "k4", "k5"]),
        (UPSERT, 7, "k6"),  # the last of the snapshot, alone
        (SYNCED, 20, ""),
        (UPSERT, 21, "big"),  # over max_bytes at once: alone
        (BATCH, 23, ["k0", "k1"]),
        (DELETE, 24, "k2"),
        (SYNCED, 24, ""),  # heartbeat
    ]
    assert [e.kind for e in got[6].events] == [DELETE, UPSERT]


async def test_serve_watch_lingers_so_a_burst_goes_as_one_message() -> None:
    """With Batching.linger, the first change after a quiet spell goes at
    once; the ones that follow within the linger gather into one BATCH."""
    table: SyncTable[str, str] = SyncTable("t")
    table.replace([("a", "1", 1)], 1)
    batching = Batching(
        wrap=lambda evs: Ev(BATCH, evs[-1].revision, events=tuple(evs)),
        size=lambda ev: 1,
        linger=0.2,
    )
    stream = serve_watch(table.subscribe(), EvMessages(), heartbeat=None, batching=batching)
    assert [(await anext(stream)).kind for _ in range(3)] == [RESET, UPSERT, SYNCED]
    table.commit([("b", "2", 2)], 2)
    first = await asyncio.wait_for(anext(stream), 1)
    assert (first.kind, first.key) == (UPSERT, "b")  # at once
    for i, key in enumerate("cde"):
        table.commit([(key, "3", 3 + i)], 3 + i)
        await asyncio.sleep(0.01)
    burst = await asyncio.wait_for(anext(stream), 1)
    assert burst.kind == BATCH
    assert [e.key for e in burst.events] == ["c", "d", "e"]
