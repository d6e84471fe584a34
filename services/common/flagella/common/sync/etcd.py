"""A table fed by an etcd key range: a paged snapshot at one revision, a
watch from the next revision on, a resume from the last revision seen when
the watch breaks, and a fresh snapshot (swapped in as a diff) when etcd has
compacted the revision away.

The decoding of keys and values into typed records is the store's (a
Codec); the source only moves whole revisions into the table.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Hashable, Mapping
from typing import Generic, Protocol, TypeVar

from flagella.common.backoff import Backoff
from flagella.common.errors import Unavailable
from flagella.common.etcd import (
    Compacted,
    Etcd,
    EventType,
    FutureRevision,
    KeyValue,
    StreamEvent,
    StreamKind,
    WatchEvent,
    prefix_end,
)
from flagella.common.sync.serve import serve_watch
from flagella.common.sync.table import Change, Sink, Table
from flagella.common.tasks import TaskGroup

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)


class Codec(Protocol[K, R_co]):
    """How a store's keys and values become a table's keys and records."""

    def key(self, key: str) -> K | None:
        """The table key of an etcd key; None: not a key of this table."""

    def decode(self, key: K, kv: KeyValue) -> R_co | None:
        """The record of a key-value; None: skip it (logged by the codec)."""


class EtcdSource(Generic[K, R]):
    """Keeps sink (usually a Table) in step with the keys in
    [start, range_end) of etcd. run() until cancelled."""

    def __init__(
        self,
        etcd: Etcd,
        sink: Sink[K, R],
        codec: Codec[K, R],
        *,
        prefix: str = "",
        start: str = "",
        range_end: bytes = b"",
        page_size: int = 1000,
        backoff: Backoff | None = None,
        name: str = "",
    ) -> None:
        if prefix:
            start, range_end = prefix, prefix_end(prefix)
        if not start or not range_end:
            raise ValueError("give a prefix, or start and range_end")
        self.etcd = etcd
        self.sink = sink
        self.codec = codec
        self.start = start
        self.range_end = range_end
        self.page_size = page_size
        self.backoff = backoff or Backoff(0.1, 5.0)
        self.name = name or start
        self.revision = 0
        self.snapshots = 0  # full reads, for tests and status
        if isinstance(sink, Table):
            sink.history = self.read_at
            sink.confirm = self.confirm

    async def read(self, revision: int = 0) -> tuple[list[tuple[K, R, int]], int]:
        """Every record of the range at revision (0: now), and that
        revision. Raises Unavailable, Compacted, FutureRevision."""
        records: list[tuple[K, R, int]] = []
        read_at = revision
        async for kvs, page_revision in self.etcd.range_pages(
            self.start, self.range_end, revision=revision, page_size=self.page_size
        ):
            read_at = page_revision
            for kv in kvs:
                key = self.codec.key(kv.key)
                if key is None:
                    continue
                record = self.codec.decode(key, kv)
                if record is not None:
                    records.append((key, record, kv.mod_revision))
        return records, read_at

    async def read_at(self, revision: int) -> Mapping[K, tuple[R, int]] | None:
        """The range as it was at revision, or None when etcd no longer has
        it (the table's history, for subscribers resuming from long ago)."""
        try:
            records, _ = await self.read(revision)
        except (Compacted, FutureRevision):
            return None
        return {key: (record, rev) for key, record, rev in records}

    async def confirm(self, revision: int) -> None:
        """Advance the sink to revision if nothing of the range changed up to
        it (a reader waits for a revision that wrote other keys); if
        something did, its events are on their way and advance it."""
        since = self.revision
        if not since or revision <= since:
            return
        try:
            unchanged = await self.etcd.range_unchanged(self.start, self.range_end, since, revision)
        except Unavailable:
            return
        if unchanged:
            # Events that arrived meanwhile are of later revisions.
            self.sink.advance(revision)
            self.revision = max(self.revision, revision)

    async def snapshot(self) -> None:
        records, revision = await self.read()
        self.sink.replace(records, revision)
        self.revision = revision
        self.snapshots += 1

    async def run(self) -> None:
        while True:
            try:
                if self.revision == 0:
                    await self.snapshot()
                await self._watch()
            except Compacted as exc:
                log.info(
                    f"{self.name} watch revision compacted: reading a fresh snapshot",
                    extra={"range": self.start, "revision": self.revision, "compacted": str(exc)},
                )
                self.sink.set_live(False, "compacted")
                self.revision = 0
            except Unavailable as exc:
                self.sink.set_live(False, exc.message)
                delay = self.backoff.next()
                log.warning(
                    f"{self.name} watch interrupted",
                    extra={"range": self.start, "reason": exc.message, "retry_in_s": delay},
                )
                # The backoff's delay, or less when etcd answers again (then
                # a jitter of up to the initial delay, so the watches of a
                # service, and of every service, do not all resume at once):
                # after an outage the first write must not wait for its
                # table's watch to come back (issue 18: a 2.4 s ADD).
                if await self.etcd.backoff_sleep(delay):
                    await asyncio.sleep(self.backoff.initial * self.backoff.rng.random())

    async def _watch(self) -> None:
        async with self.etcd.watch_keys(
            self.start,
            self.range_end,
            self.revision + 1,
            on_created=lambda: self.sink.set_live(True),
        ) as watch:
            async for batch in watch:
                self.backoff.reset()
                self.sink.commit(self._updates(batch.events), batch.revision)
                self.revision = max(self.revision, batch.revision)

    def _updates(self, events: list[WatchEvent]) -> list[tuple[K, R | None, int]]:
        updates: list[tuple[K, R | None, int]] = []
        for ev in events:
            key = self.codec.key(ev.kv.key)
            if key is None:
                continue
            # A value that does not decode counts as no record: the table
            # must not keep a stale one.
            record = None if ev.type is EventType.DELETE else self.codec.decode(key, ev.kv)
            updates.append((key, record, ev.revision))
        return updates


class RawCodec:
    """Every key of a prefix, as its etcd key-value."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def key(self, key: str) -> str | None:
        return key if key.startswith(self.prefix) else None

    def decode(self, key: str, kv: KeyValue) -> KeyValue:
        return kv


class _RawMessages:
    def reset(self, revision: int) -> StreamEvent:
        return StreamEvent(StreamKind.RESET, revision)

    async def upsert(self, change: Change[str, KeyValue]) -> StreamEvent:
        return StreamEvent(StreamKind.UPSERT, change.revision, change.record, change.prev)

    async def delete(self, change: Change[str, KeyValue]) -> StreamEvent:
        gone = KeyValue(change.key, b"", 0, change.revision, 0, 0)
        return StreamEvent(StreamKind.DELETE, change.revision, gone, change.prev)

    def synced(self, revision: int) -> StreamEvent:
        return StreamEvent(StreamKind.SYNCED, revision)


async def prefix_stream(
    etcd: Etcd, prefix: str, since: int = 0, *, max_delay: float = 5.0, prev_kv: bool = False
) -> AsyncIterator[StreamEvent]:
    """The key-values of one prefix as a Watch* stream (see serve.py), for a
    consumer that follows a prefix with no table of its own (with prev_kv,
    each delta names the key-value it replaces)."""
    table: Table[str, KeyValue] = Table(prefix, keep_prev=prev_kv)
    source = EtcdSource(
        etcd, table, RawCodec(prefix), prefix=prefix, backoff=Backoff(0.1, max_delay)
    )
    async with TaskGroup(f"stream {prefix}") as tasks:
        tasks.spawn(f"source {prefix}", source.run())
        async for event in serve_watch(
            table.subscribe(since), _RawMessages(), since=since, heartbeat=None
        ):
            yield event
