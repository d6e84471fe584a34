"""The server side of every Watch* RPC: one contract, one loop.

    since 0: RESET, UPSERT of every record, SYNCED at the snapshot's
    revision; since > 0: SYNCED at since (unless the stream's contract
    leaves it out), then either the changes after it or (when they cannot
    be told) RESET and a snapshot, then SYNCED; then
    UPSERTs and DELETEs as they happen, in revision order, each batch
    closed by SYNCED at its revision when the stream asks for it
    (sync_batches), and SYNCED every `heartbeat` seconds when idle.

A client that resumes from the last revision it knows complete (a SYNCED,
or the revision of an event followed by one of a higher revision) misses
nothing (stream.py is that client).

A stream whose client asks for it sends a batch's UPSERTs and DELETEs
several to a message (`Batching`: a BATCH message holding them in order,
as they would have come one by one; a lone event goes as itself): a gRPC
message costs both ends tens of microseconds whatever it holds, which at
10,000 services was a third of the lb's and the datapath's CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from google.protobuf.message import Message

from flagella.common.sync.table import Batch, Change

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
M = TypeVar("M")
M_co = TypeVar("M_co", covariant=True)
KM = TypeVar("KM", bound=Hashable)
PM = TypeVar("PM", bound=Message)


class Feed(Protocol[K, R]):
    """Batches to stream: a Table's Subscription, or a service's own view
    over its tables (filtered for one node, say)."""

    async def next(self, timeout: float | None = None) -> Batch[K, R] | None:
        """The next batch (the first one a snapshot or the changes after the
        client's revision); None after timeout seconds without any."""


class WatchMessages(Protocol[K, R, M_co]):
    """The RPC's event messages."""

    def reset(self, revision: int) -> M_co: ...

    async def upsert(self, change: Change[K, R]) -> M_co: ...

    async def delete(self, change: Change[K, R]) -> M_co: ...

    def synced(self, revision: int) -> M_co: ...


class MessageCache(Generic[KM, PM]):
    """Watch messages by what makes them, built once however many watchers
    stream them (a change sent to 1,000 nodes was built 1,000 times; every
    node joining got every other node's message built anew). At most
    max_bytes of messages (their encoded size): the oldest go first. With
    slot (what a key is the message of: a service, a node), only the newest
    message of each slot is kept: once a record changed, its older messages
    are never asked for again, and keeping them until max_bytes (whose
    decoded objects take several times their encoded size) grew a process
    by every change for hours. Entries are shared: never changed after they
    are put."""

    def __init__(
        self, max_bytes: int = 16 << 20, *, slot: Callable[[KM], Hashable] | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._messages: dict[KM, tuple[PM, int]] = {}
        self._slot = slot
        self._by_slot: dict[Hashable, KM] = {}

    def get(self, key: KM) -> PM | None:
        got = self._messages.get(key)
        return None if got is None else got[0]

    def put(self, key: KM, message: PM) -> None:
        messages = self._messages
        if self._slot is not None:
            slot = self._slot(key)
            older = self._by_slot.get(slot)
            if older is not None and older != key:
                self._drop(older)
            self._by_slot[slot] = key
        size = message.ByteSize()
        self._drop(key)
        messages[key] = (message, size)
        self.bytes += size
        while self.bytes > self.max_bytes and messages:
            self._drop(next(iter(messages)))

    def _drop(self, key: KM) -> None:
        gone = self._messages.pop(key, None)
        if gone is None:
            return
        self.bytes -= gone[1]
        if self._slot is not None:
            slot = self._slot(key)
            if self._by_slot.get(slot) == key:
                del self._by_slot[slot]

    def __len__(self) -> int:
        return len(self._messages)


@dataclass(frozen=True)
class Batching(Generic[M]):
    """How a stream packs events into one message: wrap makes a BATCH of
    events; size is an event's encoded size. A message holds at most
    max_events events, and is closed once it reaches max_bytes (gRPC's
    default limit for a message received is 4 MiB)."""

    wrap: Callable[[list[M]], M]
    size: Callable[[M], int]
    max_events: int = 256
    max_bytes: int = 1 << 20
    # Seconds to let changes gather after sending some, so that a stream
    # that keeps up still gets a burst of them (a registration storm) as a
    # few messages, not one per change: 0 sends each as soon as it comes.
    linger: float = 0.0


async def serve_watch(
    feed: Feed[K, R],
    messages: WatchMessages[K, R, M],
    *,
    since: int = 0,
    heartbeat: float | None,
    sync_batches: bool = False,
    acknowledge_resume: bool = True,
    batching: Batching[M] | None = None,
) -> AsyncIterator[M]:
    if since > 0 and acknowledge_resume:
        yield messages.synced(since)
    batch = await feed.next(None)
    assert batch is not None
    first = True
    revision = batch.revision
    while True:
        if batch is not None:
            if batch.snapshot:
                yield messages.reset(batch.revision)
            if batching is None:
                for change in batch.changes:
                    if change.record is None:
                        yield await messages.delete(change)
                    else:
                        yield await messages.upsert(change)
            else:
                pending: list[M] = []
                size = 0
                for change in batch.changes:
                    if change.record is None:
                        event = await messages.delete(change)
                    else:
                        event = await messages.upsert(change)
                    pending.append(event)
                    size += batching.size(event)
                    if len(pending) >= batching.max_events or size >= batching.max_bytes:
                        yield pending[0] if len(pending) == 1 else batching.wrap(pending)
                        pending, size = [], 0
                if pending:
                    yield pending[0] if len(pending) == 1 else batching.wrap(pending)
            if first or sync_batches or batch.snapshot or not batch.changes:
                yield messages.synced(batch.revision)
            revision = batch.revision
            first = False
            if batching is not None and batching.linger and batch.changes:
                await asyncio.sleep(batching.linger)
        else:
            yield messages.synced(revision)
        batch = await feed.next(heartbeat)
