"""The sync layer against a real etcd: a table fed by a key range matches
etcd at every revision a subscriber is given, under concurrent writes
(hypothesis picks the writes and their interleaving); reads its snapshot in
pages at one revision; resyncs after a compaction; resumes after an etcd
restart without reading everything again; confirms a revision that changed
nothing in its range."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from harness.etcd import EtcdServer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flagella.common.etcd import Etcd, KeyValue, delete_op, put_op
from flagella.common.sync import Batch, EtcdSource, Table
from flagella.common.tasks import TaskGroup

pytestmark = pytest.mark.integration

PREFIX = "sync/t/"


class TextCodec:
    """Keys under PREFIX -> their suffix; values as text ("skip" is not a
    record of the table)."""

    def key(self, key: str) -> str | None:
        return key[len(PREFIX) :] if key.startswith(PREFIX) else None

    def decode(self, key: str, kv: KeyValue) -> str | None:
        text = kv.value.decode()
        return None if text == "skip" else text


async def etcd_view(client: Etcd, revision: int = 0) -> dict[str, str]:
    kvs, _ = await client.get_prefixes([PREFIX], revision=revision)
    return {kv.key[len(PREFIX) :]: kv.value.decode() for kv in kvs[0] if kv.value != b"skip"}


def apply(view: dict[str, str], batch: Batch[str, str]) -> None:
    if batch.snapshot:
        view.clear()
    for c in batch.changes:
        if c.record is None:
            view.pop(c.key, None)
        else:
            view[c.key] = c.record


@contextlib.asynccontextmanager
async def following(
    client: Etcd, **kwargs: object
) -> AsyncIterator[tuple[Table[str, str], EtcdSource[str, str]]]:
    table: Table[str, str] = Table("t")
    source = EtcdSource(client, table, TextCodec(), prefix=PREFIX, **kwargs)  # type: ignore[arg-type]
    async with TaskGroup() as tasks:
        tasks.spawn("source", source.run())
        await table.wait_initialized(10)
        yield table, source


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[Etcd]:
    c = etcd.client(timeout=2.0)
    await asyncio.wait_for(c.wait_connected(), 30)
    yield c
    await c.close()


writes = st.lists(
    st.lists(
        st.tuples(
            st.sampled_from([f"k{i}" for i in range(6)]), st.sampled_from(["a", "b", "skip", None])
        ),
        min_size=1,
        max_size=4,
        unique_by=lambda t: t[0],
    ),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)
@given(batches=writes, writers=st.integers(1, 3), page_size=st.integers(1, 4))
def test_subscribers_see_etcd_as_it_was_at_every_batch_revision(
    etcd: EtcdServer, batches: list[list[tuple[str, str | None]]], writers: int, page_size: int
) -> None:
    async def run() -> None:
        client = etcd.client(timeout=2.0)
        await client.delete_prefix(PREFIX)
        await client.put(PREFIX + "k0", b"seed")
        seen: list[tuple[int, dict[str, str]]] = []
        async with following(client, page_size=page_size) as (table, _):
            sub = table.subscribe()
            view: dict[str, str] = {}

            async def reader() -> None:
                while True:
                    batch = await sub.next()
                    assert batch is not None
                    apply(view, batch)
                    seen.append((batch.revision, dict(view)))

            async def writer(part: list[list[tuple[str, str | None]]]) -> int:
                rev = 0
                for ops in part:
                    txn = await client.txn(
                        [],
                        [
                            delete_op(PREFIX + k) if v is None else put_op(PREFIX + k, v.encode())
                            for k, v in ops
                        ],
                    )
                    rev = max(rev, txn.revision)
                return rev

            reading = asyncio.create_task(reader())
            revs = await asyncio.gather(*(writer(batches[i::writers]) for i in range(writers)))
            await table.wait_for(max(revs), timeout=10)
            await asyncio.sleep(0.05)
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            assert dict(table.items()) == await etcd_view(client)
        for revision, snapshot in seen:
            assert snapshot == await etcd_view(client, revision), revision
        await client.close()

    asyncio.run(run())


async def test_snapshot_read_in_pages_at_one_revision(client: Etcd) -> None:
    for i in range(10):
        await client.put(f"{PREFIX}p{i:02d}", f"v{i}".encode())
    await client.put(PREFIX + "p99", b"skip")
    async with following(client, page_size=3) as (table, source):
        assert dict(table.items()) == {f"p{i:02d}": f"v{i}" for i in range(10)}
        assert source.snapshots == 1
        records, revision = await source.read()
        assert revision == table.revision
        assert sorted(k for k, _, _ in records) == sorted(table.keys())


async def test_resyncs_with_a_diff_after_the_revision_was_compacted(client: Etcd) -> None:
    await client.put(PREFIX + "a", b"1")
    await client.put(PREFIX + "b", b"1")
    table: Table[str, str] = Table("t")
    source = EtcdSource(client, table, TextCodec(), prefix=PREFIX)
    await source.snapshot()  # at R; nothing follows it yet
    sub = table.subscribe()
    first = await sub.next()
    assert first is not None
    assert first.snapshot
    await client.delete(PREFIX + "a")
    await client.put(PREFIX + "c", b"2")
    head = await client.put("sync/other", b"x")
    await client.client.compact(head)
    async with TaskGroup() as tasks:
        tasks.spawn("source", source.run())
        await table.wait_for(head, timeout=10)
        assert source.snapshots == 2
        assert dict(table.items()) == {"b": "1", "c": "2"}
        batch = await sub.next(1)
        # The subscriber gets what changed, not a second snapshot.
        assert batch is not None
        assert not batch.snapshot
        assert {(c.key, c.record) for c in batch.changes} == {("a", None), ("c", "2")}


async def test_rides_out_an_etcd_restart_without_a_new_snapshot(
    etcd: EtcdServer, client: Etcd
) -> None:
    await client.put(PREFIX + "a", b"1")
    async with following(client) as (table, source):
        etcd.stop()
        await asyncio.sleep(0.3)
        # Live only once etcd confirms a watch: the retries while it is down
        # open streams that etcd never answers, and must not flap it back.
        for _ in range(100):
            assert not table.live
            await asyncio.sleep(0.01)
        etcd.start()
        rev = 0
        for _ in range(100):
            with contextlib.suppress(Exception):
                rev = await client.put(PREFIX + "b", b"2")
                break
            await asyncio.sleep(0.1)
        await table.wait_for(rev, timeout=15)
        assert dict(table.items()) == {"a": "1", "b": "2"}
        assert table.live
        assert source.snapshots == 1


async def test_wait_for_a_revision_outside_the_range_is_confirmed_by_etcd(
    client: Etcd,
) -> None:
    await client.put(PREFIX + "a", b"1")
    async with following(client) as (table, _):
        elsewhere = await client.put("sync/elsewhere", b"x")
        assert table.revision < elsewhere
        # No event of the range will come: etcd confirms that nothing in
        # the range changed up to that revision.
        assert await table.wait_for(elsewhere, timeout=2) >= elsewhere
        # A revision that did change the range is not confirmed early.
        await client.put(PREFIX + "b", b"2")
        await client.put(PREFIX + "b", b"3")
        later = await client.put("sync/elsewhere", b"y")
        assert await table.wait_for(later, timeout=2) >= later
        assert table.get("b") == "3"
