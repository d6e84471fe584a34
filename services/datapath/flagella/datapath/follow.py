"""Following a control-plane watch stream (the xDS pattern).

Every flagella Watch* RPC speaks the same contract: RESET (drop what you
have; a snapshot follows), UPSERT..., SYNCED at a revision, then UPSERT and
DELETE deltas. A StreamFollower keeps one such stream open, hands events to
a handler, and on a broken stream reconnects with since_revision = the last
revision seen, so it resumes instead of starting over (the server answers a
RESET and a snapshot when it cannot resume).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import grpc

log = logging.getLogger(__name__)

# The kinds every watch event enum shares (NodeEvent.Kind, EventKind,
# ServiceEvent.Kind).
RESET, UPSERT, DELETE, SYNCED = 1, 2, 3, 4


class StreamHandler(Protocol):
    async def reset(self) -> None:
        """Forget everything: a full snapshot follows."""

    async def upsert(self, event: Any) -> None: ...

    async def delete(self, event: Any) -> None: ...

    async def synced(self, revision: int) -> None:
        """The snapshot (or the resumed stream) is complete."""


OpenStream = Callable[[int], AsyncIterator[Any]]


class StreamFollower:
    def __init__(
        self,
        name: str,
        open_stream: OpenStream,
        handler: StreamHandler,
        *,
        max_backoff: float = 5.0,
        on_state: Callable[[str, bool, str], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        self.open_stream = open_stream
        self.handler = handler
        self.max_backoff = max_backoff
        self.on_state = on_state
        self.revision = 0
        self.synced = asyncio.Event()
        self.connected = False
        self.last_error = ""

    async def _state(self, connected: bool, reason: str = "") -> None:
        if connected != self.connected:
            self.connected = connected
            if self.on_state is not None:
                await self.on_state(self.name, connected, reason)

    async def run(self) -> None:
        delay = 0.1
        while True:
            try:
                async for event in self.open_stream(self.revision):
                    await self._state(True)
                    delay = 0.1
                    await self._apply(event)
                reason = "stream ended"
            except grpc.aio.AioRpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            self.last_error = reason
            await self._state(False, reason)
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
            delay = min(delay * 2, self.max_backoff)

    async def _apply(self, event: Any) -> None:
        kind = int(event.kind)
        if kind == RESET:
            # Until SYNCED the snapshot is partial: a break now must not
            # resume from it, so forget the revision.
            self.revision = 0
            await self.handler.reset()
        elif kind == UPSERT:
            await self.handler.upsert(event)
        elif kind == DELETE:
            await self.handler.delete(event)
        elif kind == SYNCED:
            await self.handler.synced(int(event.revision))
            self.revision = int(event.revision)
            self.synced.set()
            return
        if self.synced.is_set() and self.revision and int(event.revision) > self.revision:
            self.revision = int(event.revision)
