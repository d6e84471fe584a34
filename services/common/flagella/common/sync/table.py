"""Typed tables: the control plane's state in memory, each one a mirror of a
source (an etcd prefix, a peer's Watch* stream, a Kubernetes list/watch) at
a revision of that source.

A table holds key -> record and the source revision it reflects. Sources
write to it through the Sink methods, always whole revisions at a time
(replace() for a full snapshot, commit() for the changes of one or more
revisions, advance() when the source reports progress without changes), so
a reader never sees half of a revision. Readers get:

- get()/items()/snapshot() of the current state, and wait_for(revision);
- subscribe(since): a consistent snapshot, then batches of changes, each
  batch consistent at its revision. A subscriber that says what revision it
  already holds gets only what changed after it, from the table's change
  log or, beyond the log, from the source's history (an etcd read at that
  revision); when neither reaches back that far, a snapshot.

Changes are collapsed per key: a subscriber that was away for many
revisions gets each changed key once, with the record now and, from a
table that keeps them (keep_prev), the record it had before (`prev`).

The change log is what a table costs beyond its records, so it keeps only
what a resume needs: per change the key, whether the key existed before,
and three revisions, in flat arrays (33 bytes a change, and the key while
only the log holds it). A table whose consumers need the record before a
change (lb's watch names a deleted service and its removed backends) says
so with keep_prev, and its log also holds those records.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from array import array
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


@dataclass(frozen=True, slots=True)
class Change(Generic[K, R]):
    key: K
    # None: the key is gone.
    record: R | None
    # What the subscriber held for the key before (None: nothing), from a
    # table that keeps it (Table(keep_prev=True)); None from any other.
    prev: R | None
    # The source revision of the key's latest change.
    revision: int

    @property
    def deleted(self) -> bool:
        return self.record is None


@dataclass(frozen=True, slots=True)
class Batch(Generic[K, R]):
    """What a subscriber receives: the table is consistent at revision once
    the changes are applied. A snapshot batch is the whole table: the
    subscriber drops whatever it held first."""

    revision: int
    changes: tuple[Change[K, R], ...]
    snapshot: bool = False


# One change as a source gives it: key, record (None: deleted), revision.
Update = tuple[K, R | None, int]


class Sink(Protocol[K_contra, R]):
    """What a source feeds (a Table, or an adapter onto other state)."""

    def get(self, key: K_contra) -> R | None:
        """The record held for key now."""

    def replace(self, records: Iterable[tuple[K_contra, R, int]], revision: int) -> None:
        """The whole state at revision (key, record, the key's revision)."""

    def commit(self, updates: Iterable[tuple[K_contra, R | None, int]], revision: int) -> None:
        """The changes of whole revisions, up to revision."""

    def advance(self, revision: int) -> None:
        """Nothing changed up to revision."""

    def set_live(self, live: bool, reason: str = "") -> None:
        """The source is (not) connected and synced."""


# Reads the state of the source at an older revision, or None when the
# source no longer has it (compacted).
History = Callable[[int], Awaitable[Mapping[K, tuple[R, int]] | None]]


# How many changes a table keeps: one served to watches in other processes
# (a watch that reconnects resumes from its revision while its log reaches
# back; services take it as --watch-history), and one read only by this
# process's own consumers, which keep up (one that falls behind gets a
# snapshot): a long log there only grows memory for hours until it is full.
WATCH_LOG_SIZE = 16_384
LOCAL_LOG_SIZE = 1_024


class Table(Generic[K, R]):
    def __init__(
        self, name: str, *, log_size: int = WATCH_LOG_SIZE, keep_prev: bool = False
    ) -> None:
        self.name = name
        self.log_size = log_size
        self.keep_prev = keep_prev
        self._records: dict[K, R] = {}
        self._key_revisions: dict[K, int] = {}
        self._revision = 0
        # The change log, one slot per change in each: the table revision it
        # became visible at (non-decreasing, for bisect), the key, whether
        # the key existed before, the change's own source revision, and
        # (keep_prev only) the record before. Flat arrays of machine
        # integers: a list of ints costs a 32-byte object per revision.
        self._log_revisions = array("q")
        self._log_keys: list[K] = []
        self._log_existed = bytearray()
        self._log_key_revisions = array("q")
        self._log_prevs: list[R | None] = []
        # Every publication (of changes or progress) counts one: subscribers
        # follow this sequence, since a late change can be published at a
        # revision already announced.
        self._seq = 0
        self._log_seqs = array("q")
        # Every change after this revision (this sequence number) is in the log.
        self._floor = 0
        self._floor_seq = 0
        self._changed = asyncio.Event()
        self.initialized = asyncio.Event()
        self._live = False
        self.reason = "not synced yet"
        # Set whenever liveness or its reason changes (watch_liveness).
        self._liveness_watchers: set[asyncio.Event] = set()
        # Set by the source that feeds the table: its state at an older
        # revision, and a check that nothing of the table changed up to a
        # revision (so that a reader can wait for a revision that touched
        # other keys of the source).
        self.history: History[K, R] | None = None
        self.confirm: Callable[[int], Awaitable[None]] | None = None

    # --- reading ---

    @property
    def revision(self) -> int:
        return self._revision

    @property
    def live(self) -> bool:
        """The source is connected and the table is synced with it."""
        return self._live

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: K) -> bool:
        return key in self._records

    def get(self, key: K) -> R | None:
        return self._records.get(key)

    def revision_of(self, key: K) -> int:
        """The source revision of the key's latest change (0: no such key)."""
        return self._key_revisions.get(key, 0)

    def keys(self) -> Iterator[K]:
        return iter(self._records)

    def items(self) -> Iterator[tuple[K, R]]:
        return iter(self._records.items())

    def values(self) -> Iterator[R]:
        return iter(self._records.values())

    def snapshot(self) -> tuple[dict[K, R], int]:
        return dict(self._records), self._revision

    async def wait_for(self, revision: int, timeout: float | None = None) -> int:
        """Returns the table's revision once it is at least revision.
        Raises TimeoutError."""

        async def wait() -> int:
            while self._revision < revision:
                changed = self._changed
                if self.confirm is not None:
                    await self.confirm(revision)
                    if self._revision >= revision:
                        break
                await changed.wait()
            return self._revision

        if self._revision >= revision:
            return self._revision
        return await asyncio.wait_for(wait(), timeout)

    async def wait_initialized(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self.initialized.wait(), timeout)

    def subscribe(self, since: int = 0) -> Subscription[K, R]:
        return Subscription(self, since)

    # --- the sink a source writes to ---

    def replace(self, records: Iterable[tuple[K, R, int]], revision: int) -> None:
        revision = max(revision, self._revision)
        fresh: dict[K, R] = {}
        fresh_revisions: dict[K, int] = {}
        for key, record, key_revision in records:
            fresh[key] = record
            fresh_revisions[key] = key_revision
        for key in [k for k in self._records if k not in fresh]:
            self._log_change(key, self._records.pop(key), revision, revision)
            del self._key_revisions[key]
        for key, record in fresh.items():
            prev = self._records.get(key)
            self._key_revisions[key] = fresh_revisions[key]
            if prev is not None and prev == record:
                continue
            self._records[key] = record
            self._log_change(key, prev, revision, fresh_revisions[key])
        if not self.initialized.is_set():
            # Nothing before the first snapshot is known to this table.
            self._floor = revision
            self._floor_seq = self._seq + 1
        self._publish(revision)
        self.initialized.set()

    def commit(self, updates: Iterable[tuple[K, R | None, int]], revision: int) -> None:
        # A change that arrives after a progress report covering it (etcd
        # can report progress before delivering a revision's events) is
        # still applied and logged, at the table's current revision.
        at = max(revision, self._revision)
        for key, record, key_revision in updates:
            prev = self._records.get(key)
            if record is None:
                if prev is None:
                    continue
                del self._records[key]
                del self._key_revisions[key]
            else:
                self._key_revisions[key] = key_revision
                if prev is not None and prev == record:
                    continue
                self._records[key] = record
            self._log_change(key, prev, at, key_revision)
        self._publish(at)

    def advance(self, revision: int) -> None:
        if revision > self._revision:
            self._publish(revision)

    def set_live(self, live: bool, reason: str = "") -> None:
        if live != self._live:
            log.info(
                "table source " + ("live" if live else "lost"),
                extra={"table": self.name, "reason": reason, "revision": self._revision},
            )
        changed = (live, reason) != (self._live, self.reason)
        self._live = live
        self.reason = reason
        if changed:
            for event in self._liveness_watchers:
                event.set()

    def watch_liveness(self, event: asyncio.Event) -> None:
        """event is set whenever the table's liveness (or its reason)
        changes, until unwatch_liveness(event)."""
        self._liveness_watchers.add(event)

    def unwatch_liveness(self, event: asyncio.Event) -> None:
        self._liveness_watchers.discard(event)

    def _log_change(self, key: K, prev: R | None, visible_at: int, revision: int) -> None:
        self._log_revisions.append(visible_at)
        self._log_seqs.append(self._seq + 1)
        self._log_keys.append(key)
        self._log_existed.append(prev is not None)
        self._log_key_revisions.append(revision)
        if self.keep_prev:
            self._log_prevs.append(prev)

    @property
    def log_length(self) -> int:
        """How many changes the log holds."""
        return len(self._log_keys)

    def _publish(self, revision: int) -> None:
        self._seq += 1
        self._revision = max(self._revision, revision)
        if len(self._log_keys) > self.log_size:
            self._trim()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _trim(self) -> None:
        """Drop the older half of the log (whole revisions only)."""
        cut = len(self._log_keys) // 2
        floor = self._log_revisions[cut - 1]
        cut = bisect.bisect_right(self._log_revisions, floor)
        self._floor_seq = self._log_seqs[cut - 1]
        del self._log_revisions[:cut]
        del self._log_seqs[:cut]
        del self._log_keys[:cut]
        del self._log_existed[:cut]
        del self._log_key_revisions[:cut]
        del self._log_prevs[:cut]
        self._floor = floor

    # --- what subscribers get ---

    def _snapshot_batch(self) -> Batch[K, R]:
        revs = self._key_revisions
        return Batch(
            self._revision,
            tuple(Change(k, r, None, revs[k]) for k, r in self._records.items()),
            snapshot=True,
        )

    def _changes_since(self, revision: int) -> Batch[K, R] | None:
        """The changes after a source revision, from the log; None when the
        log does not reach back to it."""
        if revision < self._floor:
            return None
        return self._changes_from(bisect.bisect_right(self._log_revisions, revision))

    def _changes_after_seq(self, seq: int) -> Batch[K, R] | None:
        """The changes published after sequence number seq."""
        if seq < self._floor_seq:
            return None
        return self._changes_from(bisect.bisect_right(self._log_seqs, seq))

    def _changes_from(self, start: int) -> Batch[K, R]:
        # Per key, whether it existed (and what it was, keep_prev) at the
        # first change after start, and the revision of its last change.
        first: dict[K, int] = {}
        last_at: dict[K, int] = {}
        keys, key_revisions = self._log_keys, self._log_key_revisions
        for i in range(start, len(keys)):
            key = keys[i]
            if key not in first:
                first[key] = i
            last_at[key] = key_revisions[i]
        held: dict[K, R | None] = {}
        existed: dict[K, bool] = {}
        for key, i in first.items():
            existed[key] = bool(self._log_existed[i])
            held[key] = self._log_prevs[i] if self.keep_prev else None
        return self._batch_from(held, last_at, existed)

    def _batch_from(
        self,
        held: Mapping[K, R | None],
        deleted_at: Mapping[K, int],
        existed: Mapping[K, bool] | None = None,
    ) -> Batch[K, R]:
        """The changes of held's keys: held maps each to the record the
        subscriber had (None: none, or not kept: then existed says whether
        it had one)."""
        changes = []
        for key, before in held.items():
            had = before is not None if existed is None else existed[key]
            prev = before if self.keep_prev else None
            record = self._records.get(key)
            if record is None:
                if had:
                    changes.append(Change(key, None, prev, deleted_at.get(key, self._revision)))
            elif prev is None or prev != record:
                # Without prev a record changed and changed back is sent
                # again: a repeated upsert, which every consumer absorbs.
                changes.append(Change(key, record, prev, self._key_revisions[key]))
        # In revision order: a client that loses the stream mid-batch knows
        # every revision below the last one it got is complete.
        changes.sort(key=lambda c: c.revision)
        return Batch(self._revision, tuple(changes))

    async def _changes_from_history(self, since: int) -> Batch[K, R] | None:
        """The difference between the source's state at since and now."""
        if self.history is None:
            return None
        try:
            old = await self.history(since)
        except Exception as exc:
            log.info(
                "cannot read the history of a table",
                extra={"table": self.name, "since": since, "reason": repr(exc)},
            )
            return None
        if old is None:
            return None
        # Keys whose record differs from the one at since. A deletion's own
        # revision is not known: somewhere after since.
        held: dict[K, R | None] = {}
        for key, (record, _) in old.items():
            now = self._records.get(key)
            if now is None or now != record:
                held[key] = record
        for key in self._records:
            if key not in old:
                held[key] = None
        return self._batch_from(held, dict.fromkeys(held, since + 1))


class Subscription(Generic[K, R]):
    """A consistent snapshot (or the changes after `since`), then batches of
    changes. Each batch covers everything up to its revision."""

    def __init__(self, table: Table[K, R], since: int = 0, *, catch_up: float = 1.0) -> None:
        self.table = table
        self.since = since
        self.catch_up = catch_up
        self.seq = -1  # nothing delivered yet
        self.resumed = False

    async def _first(self) -> Batch[K, R]:
        table = self.table
        await table.initialized.wait()
        since = self.since
        if since > table.revision:
            # The subscriber saw a newer revision elsewhere (another
            # replica): give this table a moment to catch up.
            try:
                await table.wait_for(since, self.catch_up)
            except TimeoutError:
                since = 0
        batch: Batch[K, R] | None = None
        if since > 0:
            batch = table._changes_since(since)
            if batch is None:
                # Built after the read, from the table as it is then: what
                # changes later is published after this sequence number.
                batch = await table._changes_from_history(since)
        self.resumed = batch is not None
        if batch is None:
            batch = table._snapshot_batch()
        self.seq = table._seq
        return batch

    async def next(self, timeout: float | None = None) -> Batch[K, R] | None:
        """The next batch, or None when nothing happened for timeout
        seconds."""
        if self.seq < 0:
            return await self._first()
        table = self.table
        if table._seq <= self.seq:
            changed = table._changed
            try:
                # (asyncio.timeout, not wait_for: no task per wait, which
                # every stream of a table makes after each batch)
                async with asyncio.timeout(timeout):
                    await changed.wait()
            except TimeoutError:
                return None
        batch = table._changes_after_seq(self.seq)
        if batch is None:
            log.info(
                "subscriber fell behind the change log: snapshot",
                extra={"table": table.name, "seq": self.seq},
            )
            batch = table._snapshot_batch()
        self.seq = table._seq
        return batch

    def __aiter__(self) -> Subscription[K, R]:
        return self

    async def __anext__(self) -> Batch[K, R]:
        batch = await self.next()
        assert batch is not None
        return batch
