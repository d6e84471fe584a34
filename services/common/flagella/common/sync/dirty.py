"""The keys a level-triggered sync loop still has to look at."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable

from flagella.common.backoff import Backoff


class DirtyKeys:
    """Keys to sync (a watcher's objects whose state changed): a set, so
    that a key marked many times while a sync runs is synced once, from
    the latest state."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._marked = asyncio.Event()

    def mark(self, keys: Iterable[str]) -> None:
        self._keys.update(keys)
        if self._keys:
            self._marked.set()

    def clear(self) -> None:
        self._keys.clear()
        self._marked.clear()

    async def take(self, timeout: float | None = None) -> set[str]:
        """The keys marked so far, once there are any or after timeout
        seconds (then maybe none)."""
        if not self._keys:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._marked.wait(), timeout)
        keys, self._keys = self._keys, set()
        self._marked.clear()
        return keys

    async def sync_forever(
        self,
        sync: Callable[[str], Awaitable[bool]],
        failed: set[str],
        backoff: Backoff,
        idle: Callable[[], None] | None = None,
        *,
        concurrency: int = 1,
    ) -> None:
        """Sync each key as it is marked, forever: in order, one at a time,
        or up to `concurrency` keys at once (never one key twice at once:
        a pass ends before the next takes what was marked meanwhile).
        A key whose sync answers False joins failed and is synced again
        after a backoff (reset once none fail); idle() is called after each
        pass that left nothing failed."""
        loop = asyncio.get_running_loop()
        retry_at: float | None = None
        while True:
            timeout = None if retry_at is None else max(0.0, retry_at - loop.time())
            keys = await self.take(timeout)
            if retry_at is not None and loop.time() >= retry_at:
                keys |= failed
                retry_at = None
            failed -= keys
            failed |= await _sync_all(sync, sorted(keys), concurrency)
            if not failed:
                backoff.reset()
                if idle is not None:
                    idle()
            elif retry_at is None:
                retry_at = loop.time() + backoff.next()


async def _sync_all(
    sync: Callable[[str], Awaitable[bool]], keys: list[str], concurrency: int
) -> set[str]:
    """The keys whose sync answered False."""
    if concurrency <= 1:
        return {key for key in keys if not await sync(key)}
    slots = asyncio.Semaphore(concurrency)

    async def one(key: str) -> bool:
        async with slots:
            return await sync(key)

    # A sync that raises stops the others (as it would stop a sequence).
    async with asyncio.TaskGroup() as group:
        tasks = [group.create_task(one(key)) for key in keys]
    return {key for key, task in zip(keys, tasks, strict=True) if not task.result()}
