"""The sync layer's typed table as pure logic: what subscribers receive
(a snapshot, then collapsed deltas) always rebuilds the table as it is at
the batch's revision, whatever the interleaving of writes, reads, log trims
and late subscribers; resume from a revision; wait_for; the serve loop's
framing of a Watch* stream."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tracemalloc
from collections.abc import Mapping
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flagella.common.sync import Batch, Change, Table, serve_watch


def apply(view: dict[str, int], batch: Batch[str, int]) -> None:
    if batch.snapshot:
        view.clear()
    for change in batch.changes:
        if change.record is None:
            view.pop(change.key, None)
        else:
            view[change.key] = change.record


# One step: a commit of several updates at the next revision, a full
# replace, a progress report, or a subscriber taking what is there.
keys = st.sampled_from([f"k{i}" for i in range(8)])
updates = st.lists(st.tuples(keys, st.one_of(st.none(), st.integers(0, 3))), max_size=5)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("commit"), updates),
        st.tuples(st.just("replace"), st.dictionaries(keys, st.integers(0, 3), max_size=8)),
        st.tuples(st.just("advance"), st.none()),
        st.tuples(st.just("read"), st.integers(0, 2)),
        st.tuples(st.just("subscribe"), st.integers(0, 2)),
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(steps=steps, log_size=st.integers(2, 40), keep_prev=st.booleans())
def test_subscribers_rebuild_the_table_at_every_batch(
    steps: list,  # type: ignore[type-arg]
    log_size: int,
    keep_prev: bool,
) -> None:
    async def run() -> None:
        table: Table[str, int] = Table("t", log_size=log_size, keep_prev=keep_prev)
        revision = 1
        table.replace([], revision)
        subs = [table.subscribe(), table.subscribe()]
        views: list[dict[str, int]] = [{}, {}]
        # What the table was at each revision, to check resumes.
        history: dict[int, dict[str, int]] = {revision: {}}
        for op, arg in steps:
            if op == "commit":
                revision += 1
                table.commit([(k, v, revision) for k, v in arg], revision)
            elif op == "replace":
                revision += 1
                table.replace([(k, v, revision) for k, v in arg.items()], revision)
            elif op == "advance":
                revision += 1
                table.advance(revision)
            elif op == "subscribe":
                # A subscriber that says it holds an older revision.
                since = max(1, revision - arg)
                sub = table.subscribe(since)
                subs.append(sub)
                views.append(dict(history[since]))
            history[revision] = dict(table.items())
            if op == "read":
                i = arg % len(subs)
                batch = await subs[i].next(0)
                if batch is not None:
                    apply(views[i], batch)
                    assert views[i] == history[batch.revision]
                    assert batch.revision == table.revision
        for sub, view in zip(subs, views, strict=True):
            batch = await sub.next(0)
            if batch is not None:
                apply(view, batch)
            assert view == dict(table.items())

    asyncio.run(run())


async def test_deltas_collapse_per_key_with_the_record_the_subscriber_held() -> None:
    table: Table[str, str] = Table("t", keep_prev=True)
    table.replace([("a", "a1", 1), ("b", "b1", 1)], 1)
    sub = table.subscribe()
    first = await sub.next()
    assert first is not None
    assert first.snapshot
    assert {c.key: c.record for c in first.changes} == {"a": "a1", "b": "b1"}
    table.commit([("a", "a2", 2)], 2)
    table.commit([("a", "a3", 3), ("c", "c1", 3)], 3)
    table.commit([("b", None, 4), ("c", None, 4)], 4)  # c came and went
    batch = await sub.next()
    assert batch is not None
    assert not batch.snapshot
    assert batch.revision == 4
    assert batch.changes == (
        Change("a", "a3", "a1", 3),
        Change("b", None, "b1", 4),
    )
    assert await sub.next(0.01) is None


async def test_an_unchanged_record_is_not_a_change() -> None:
    table: Table[str, int] = Table("t", keep_prev=True)
    table.replace([("a", 1, 1)], 1)
    sub = table.subscribe()
    await sub.next()
    table.replace([("a", 1, 1)], 5)  # a resync that finds nothing new
    table.commit([("a", 2, 6)], 6)
    table.commit([("a", 1, 7)], 7)  # and back
    batch = await sub.next()
    assert batch is not None
    assert (batch.revision, batch.changes) == (7, ())


async def test_resume_from_a_revision_in_the_log_or_snapshot_beyond_it() -> None:
    table: Table[str, int] = Table("t", log_size=4)
    table.replace([("a", 1, 10)], 10)
    for rev in range(11, 14):
        table.commit([(f"k{rev}", rev, rev)], rev)
    resumed = table.subscribe(since=11)
    batch = await resumed.next()
    assert batch is not None
    assert not batch.snapshot
    assert resumed.resumed
    assert [c.key for c in batch.changes] == ["k12", "k13"]
    for rev in range(14, 24):  # trims the log past 11
        table.commit([(f"k{rev}", rev, rev)], rev)
    late = table.subscribe(since=11)
    batch = await late.next()
    assert batch is not None
    assert batch.snapshot
    assert not late.resumed
    assert len(batch.changes) == len(table)


async def test_resume_beyond_the_log_reads_the_source_history() -> None:
    table: Table[str, int] = Table("t", log_size=2, keep_prev=True)
    past = {5: {"a": (1, 3), "b": (2, 4)}}

    async def history(revision: int) -> Mapping[str, tuple[int, int]] | None:
        return past.get(revision)

    table.history = history
    table.replace([("a", 1, 3), ("b", 2, 4)], 5)
    for rev in range(6, 12):
        table.commit([("c", rev, rev)], rev)
    table.commit([("b", None, 12)], 12)
    batch = await table.subscribe(since=5).next()
    assert batch is not None
    assert not batch.snapshot
    assert {(c.key, c.record, c.prev) for c in batch.changes} == {("c", 11, None), ("b", None, 2)}
    # Compacted history: a snapshot.
    batch = await table.subscribe(since=4).next()
    assert batch is not None
    assert batch.snapshot


def test_the_change_log_costs_a_few_bytes_a_change_not_the_records_it_replaced() -> None:
    """Churn of large records: the log grows by the change, not by the
    record each change replaced (which it held until issue 18: a soak's
    memory grew for as long as the log had room), unless the table keeps
    them (keep_prev, measured the same way)."""
    size, keys, changes = 4096, 50, 2000

    def churn(keep_prev: bool) -> tuple[int, int, Table[str, bytes]]:
        table: Table[str, bytes] = Table("t", keep_prev=keep_prev)
        present = {f"k{i}" for i in range(keys)}
        logged = keys
        table.replace([(f"k{i}", os.urandom(size), 1) for i in range(keys)], 1)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for n in range(changes):
                rev = n + 2
                key = f"k{n % keys}"
                # A fresh record each time; every tenth change a deletion.
                record = None if n % 10 == 9 else os.urandom(size)
                logged += key in present or record is not None
                (present.discard if record is None else present.add)(key)
                table.commit([(key, record, rev)], rev)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        return grown, logged, table

    grown, logged, table = churn(keep_prev=False)
    assert table.log_length == logged  # every change is there to resume from
    # Whichever records are current (at most keys of them) plus ~40 bytes
    # a change; the replaced records alone would be changes * size (8 MB).
    assert grown < keys * size + changes * 100, grown
    kept, _, _ = churn(keep_prev=True)
    assert kept > changes // 2 * size, kept  # the measure sees what a log holds


async def test_a_subscriber_ahead_of_the_table_waits_for_it_to_catch_up() -> None:
    table: Table[str, int] = Table("t")
    table.replace([("a", 1, 1)], 1)
    sub = table.subscribe(since=3)
    task = asyncio.create_task(sub.next())
    await asyncio.sleep(0.01)
    assert not task.done()
    table.commit([("b", 2, 3)], 3)
    batch = await asyncio.wait_for(task, 1)
    assert batch is not None
    assert (batch.snapshot, batch.revision, batch.changes) == (False, 3, ())


async def test_wait_for_returns_at_the_revision_and_asks_the_source_to_confirm_it() -> None:
    table: Table[str, int] = Table("t")
    table.replace([], 1)
    asked: list[int] = []

    async def confirm(revision: int) -> None:
        asked.append(revision)

    table.confirm = confirm
    waiter = asyncio.create_task(table.wait_for(4, timeout=1))
    await asyncio.sleep(0.01)
    assert asked == [4]
    table.advance(4)  # progress without a change of this table
    assert await waiter == 4
    with pytest.raises(TimeoutError):
        await table.wait_for(9, timeout=0.01)


async def test_late_changes_after_a_progress_report_are_still_delivered() -> None:
    table: Table[str, int] = Table("t")
    table.replace([], 1)
    sub = table.subscribe()
    await sub.next()
    table.advance(5)
    assert (await sub.next()) == Batch(5, ())
    table.commit([("a", 1, 5)], 5)  # an event of revision 5 after the report
    batch = await sub.next(0.1)
    assert batch is not None
    assert batch.changes == (Change("a", 1, None, 5),)
    assert table.revision == 5


@dataclass(frozen=True)
class Msg:
    kind: str
    revision: int
    key: str = ""


class Messages:
    def reset(self, revision: int) -> Msg:
        return Msg("RESET", revision)

    async def upsert(self, change: Change[str, int]) -> Msg:
        return Msg("UPSERT", change.revision, change.key)

    async def delete(self, change: Change[str, int]) -> Msg:
        return Msg("DELETE", change.revision, change.key)

    def synced(self, revision: int) -> Msg:
        return Msg("SYNCED", revision)


async def test_serve_frames_snapshot_deltas_in_revision_order_and_heartbeats() -> None:
    table: Table[str, int] = Table("t")
    table.replace([("a", 1, 2)], 3)
    stream = serve_watch(table.subscribe(), Messages(), heartbeat=0.05)
    got = [await anext(stream) for _ in range(3)]
    assert got == [Msg("RESET", 3), Msg("UPSERT", 2, "a"), Msg("SYNCED", 3)]
    table.commit([("b", 1, 4)], 4)
    table.commit([("a", 2, 5)], 5)
    table.commit([("b", 2, 6), ("c", 1, 6)], 6)
    got = [await anext(stream) for _ in range(3)]
    # a (5) before b and c (6): every revision below the last one seen is
    # complete when the stream breaks.
    assert got == [Msg("UPSERT", 5, "a"), Msg("UPSERT", 6, "b"), Msg("UPSERT", 6, "c")]
    assert await anext(stream) == Msg("SYNCED", 6)  # heartbeat
    await stream.aclose()


async def test_serve_resume_acknowledges_the_revision_then_sends_what_changed() -> None:
    table: Table[str, int] = Table("t")
    table.replace([("a", 1, 2)], 3)
    table.commit([("b", 1, 4)], 4)
    stream = serve_watch(table.subscribe(since=3), Messages(), since=3, heartbeat=10)
    got = [await anext(stream) for _ in range(3)]
    assert got == [Msg("SYNCED", 3), Msg("UPSERT", 4, "b"), Msg("SYNCED", 4)]
    await stream.aclose()
    # With sync_batches every batch is closed by SYNCED.
    stream = serve_watch(table.subscribe(), Messages(), heartbeat=10, sync_batches=True)
    assert [(await anext(stream)).kind for _ in range(4)] == ["RESET", "UPSERT", "UPSERT", "SYNCED"]
    table.commit([("c", 1, 5)], 5)
    assert [await anext(stream) for _ in range(2)] == [Msg("UPSERT", 5, "c"), Msg("SYNCED", 5)]
    await stream.aclose()


@dataclass(frozen=True)
class Event:
    kind: int
    revision: int
    key: str = ""
    value: int = 0


class EventMessages:
    def reset(self, revision: int) -> Event:
        return Event(1, revision)

    async def upsert(self, change: Change[str, int]) -> Event:
        assert change.record is not None
        return Event(2, change.revision, change.key, change.record)

    async def delete(self, change: Change[str, int]) -> Event:
        return Event(3, change.revision, change.key)

    def synced(self, revision: int) -> Event:
        return Event(4, revision)


class EventCodec:
    def key(self, event: Event) -> str:
        return event.key

    def decode(self, event: Event) -> int:
        return event.value


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(st.tuples(updates, st.booleans()), max_size=25),
    cuts=st.lists(st.integers(1, 12), max_size=8),
    log_size=st.integers(2, 30),
    sync_batches=st.booleans(),
    keep_prev=st.booleans(),
)
def test_a_follower_cut_off_anywhere_resumes_to_the_servers_table(
    ops: list,
    cuts: list[int],
    log_size: int,
    sync_batches: bool,  # type: ignore[type-arg]
    keep_prev: bool,
) -> None:
    from flagella.common.backoff import Backoff
    from flagella.common.sync import StreamSource

    async def run() -> None:
        server: Table[str, int] = Table("server", log_size=log_size, keep_prev=keep_prev)
        server.replace([("k0", 0, 1)], 1)
        connections = iter(cuts)

        async def open_stream(since: int):  # type: ignore[no-untyped-def]
            # Each connection ends after the next cut's number of messages
            # (in the middle of a batch, often); the last one lives on.
            limit = next(connections, None)
            sent = 0
            stream = serve_watch(
                server.subscribe(since),
                EventMessages(),
                since=since,
                heartbeat=0.005,
                sync_batches=sync_batches,
            )
            async for msg in stream:
                if limit is not None and sent >= limit:
                    await stream.aclose()
                    return
                sent += 1
                yield msg

        client: Table[str, int] = Table("client")
        source: StreamSource[str, int] = StreamSource(
            "s", open_stream, client, EventCodec(), backoff=Backoff(0.001, 0.002)
        )
        task = asyncio.create_task(source.run())
        revision = 1
        for batch, pause in ops:
            revision += 1
            server.commit([(k, v, revision) for k, v in batch], revision)
            if pause:
                await asyncio.sleep(0.001)
        # Settle: the follower is at the server's revision and has heard a
        # heartbeat after it.
        for _ in range(2000):
            await asyncio.sleep(0.002)
            if source.revision >= server.revision and dict(client.items()) == dict(server.items()):
                break
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert dict(client.items()) == dict(server.items())

    asyncio.run(run())
