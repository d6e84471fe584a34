"""A table fed by a peer's Watch* stream (the xDS pattern).

Every flagella Watch* RPC speaks one contract (served by serve.py): RESET
(a full snapshot follows), UPSERT..., SYNCED at a revision; then UPSERTs
and DELETEs as they happen, SYNCED after a batch (when the stream says so)
and as a heartbeat when idle. The source buffers a snapshot and swaps it in
whole at its SYNCED, and applies each delta as it comes. A BATCH message
(a stream that packs events, serve.Batching) is its events one after the
other; its deltas reach the sink in one commit.

On a broken stream it reconnects with since_revision = the last SYNCED,
where its state was exactly the server's. Deltas applied after that SYNCED
may be part of a batch it did not get whole, so it keeps the record each
such key had at the SYNCED; the server answers a resume with SYNCED at
since, every key whose record differs from the one at since, and SYNCED:
a key it kept that the server does not name is unchanged since, and gets
its kept record back. (The server answers a RESET and a snapshot when it
cannot resume.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, Callable, Hashable, Iterable
from typing import Any, Generic, Protocol, TypeVar

import grpc

from flagella.common.backoff import Backoff
from flagella.common.sync.table import Sink

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")
M_contra = TypeVar("M_contra", contravariant=True)
K_co = TypeVar("K_co", bound=Hashable, covariant=True)
R_co = TypeVar("R_co", covariant=True)

# The kinds every watch event enum shares (NodeEvent.Kind, EventKind,
# ServiceEvent.Kind); BATCH (ServiceEvent.Kind) carries several UPSERTs and
# DELETEs in its `events`.
RESET, UPSERT, DELETE, SYNCED, BATCH = 1, 2, 3, 4, 5


class StreamCodec(Protocol[M_contra, K_co, R_co]):
    """How a stream's event messages become a table's keys and records."""

    def key(self, event: M_contra) -> K_co:
        """The key of an UPSERT or DELETE event."""

    def decode(self, event: M_contra) -> R_co | None:
        """The record of an UPSERT event; None: no record (logged by the
        codec), as if deleted."""


# Opens the stream, resuming after the given revision (0: from scratch): a
# gRPC streaming call will do.
OpenStream = Callable[[int], AsyncIterable[Any]]


class StreamSource(Generic[K, R]):
    def __init__(
        self,
        name: str,
        open_stream: OpenStream,
        sink: Sink[K, R],
        codec: StreamCodec[Any, K, R],
        *,
        backoff: Backoff | None = None,
        acknowledges_resume: bool = True,
    ) -> None:
        self.name = name
        self.open_stream = open_stream
        # Whether the server answers a resume with SYNCED at since before
        # the changes (serve_watch's acknowledge_resume).
        self.acknowledges_resume = acknowledges_resume
        self.sink = sink
        self.codec = codec
        self.backoff = backoff or Backoff(0.1, 5.0)
        # The last revision the sink is complete at: where a new stream resumes.
        self.revision = 0
        self.synced = asyncio.Event()
        self.connected = False
        self.last_error = ""
        self.snapshots = 0  # RESETs received, for tests and status
        # Keys changed since the last SYNCED, with their record at it.
        self._kept: dict[K, R | None] = {}

    async def run(self) -> None:
        while True:
            try:
                await self._follow()
                reason = "stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            self.connected = False
            self.last_error = reason
            self.sink.set_live(False, reason)
            delay = self.backoff.next()
            log.warning(
                "watch stream broke",
                extra={
                    "stream": self.name,
                    "reason": reason,
                    "resume_from": self.revision,
                    "retry_in_s": delay,
                },
            )
            await asyncio.sleep(delay)

    async def _follow(self) -> None:
        snapshot: dict[K, tuple[R, int]] | None = None
        resuming = self.revision > 0 and self.acknowledges_resume
        named: set[K] = set()
        async for event in self.open_stream(self.revision):
            self.connected = True
            kind = int(event.kind)
            revision = int(event.revision)
            if kind in (UPSERT, DELETE, BATCH):
                events = event.events if kind == BATCH else (event,)
                if snapshot is None:
                    self._apply_deltas(events, named)
                else:
                    self._add_to_snapshot(events, snapshot)
            elif kind == RESET:
                snapshot = {}
                self.snapshots += 1
                # A resume the server could not take (or a first open):
                # how a failover to another replica shows a full resync.
                log.info(
                    "watch stream snapshot",
                    extra={"stream": self.name, "resume_from": self.revision},
                )
            elif kind == SYNCED:
                if resuming and revision == self.revision and snapshot is None:
                    resuming = False  # the server takes the resume: deltas follow
                    log.info("watch stream resumed", extra={"stream": self.name, "at": revision})
                    continue
                if snapshot is not None:
                    self.sink.replace(((k, r, rev) for k, (r, rev) in snapshot.items()), revision)
                    snapshot = None
                else:
                    restore = [
                        (k, rec, revision) for k, rec in self._kept.items() if k not in named
                    ]
                    if restore or named:
                        # Published even at the revision of the last delta:
                        # subscribers learn that the table is complete there.
                        self.sink.commit(restore, revision)
                    else:
                        self.sink.advance(revision)
                self._kept.clear()
                named.clear()
                resuming = False
                self.revision = revision
                self.sink.set_live(True)
                self.synced.set()
                self.backoff.reset()

    def _apply_deltas(self, events: Iterable[Any], named: set[K]) -> None:
        """Deltas into the sink, in one commit, each key's record at the last
        SYNCED kept first."""
        updates: list[tuple[K, R | None, int]] = []
        for event in events:
            key = self.codec.key(event)
            record = self.codec.decode(event) if int(event.kind) == UPSERT else None
            if key not in self._kept:
                self._kept[key] = self.sink.get(key)
            named.add(key)
            updates.append((key, record, int(event.revision)))
        if updates:
            self.sink.commit(updates, max(u[2] for u in updates))

    def _add_to_snapshot(self, events: Iterable[Any], snapshot: dict[K, tuple[R, int]]) -> None:
        for event in events:
            key = self.codec.key(event)
            if int(event.kind) == UPSERT:
                record = self.codec.decode(event)
                if record is not None:
                    snapshot[key] = (record, int(event.revision))
                    continue
            snapshot.pop(key, None)
