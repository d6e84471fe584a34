"""Background tasks owned by one runtime.

A service starts its loops (watches, sweeps, keep-alives) in its runtime's
TaskGroup instead of calling asyncio.create_task and keeping handles: the
group names them, logs one that fails, restarts a supervised one after a
backoff, and on stop cancels and awaits them all. Nothing else cancels.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from flagella.common.backoff import Backoff

log = logging.getLogger(__name__)

T = TypeVar("T")


class TaskGroup:
    def __init__(self, name: str = "") -> None:
        self.name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False

    def __len__(self) -> int:
        return len(self._tasks)

    def names(self) -> list[str]:
        return sorted(t.get_name() for t in self._tasks)

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run coro in the background until it returns or the group stops.
        An exception it raises is logged (the task ends)."""
        if self._stopping:
            coro.close()
            raise RuntimeError(f"task group {self.name!r} is stopping: cannot start {name!r}")
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def supervise(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        *,
        backoff: Backoff | None = None,
    ) -> asyncio.Task[None]:
        """Run run() for as long as the group lives: when it returns or
        raises, log it and start it again after a backoff."""
        return self.spawn(name, self._supervised(name, run, backoff or Backoff(0.2, 10.0)))

    async def _supervised(
        self, name: str, run: Callable[[], Awaitable[None]], backoff: Backoff
    ) -> None:
        while True:
            try:
                await run()
                reason = "returned"
            except Exception as exc:
                reason = repr(exc)
                log.error("background task failed", exc_info=exc, extra={"task": name})
            delay = backoff.next()
            log.warning(
                "background task restarting",
                extra={"task": name, "reason": reason, "retry_in_s": delay},
            )
            await asyncio.sleep(delay)

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task failed", exc_info=exc, extra={"task": task.get_name()})

    async def stop(self) -> None:
        """Cancel every task and wait for them to end."""
        self._stopping = True
        try:
            while self._tasks:
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._stopping = False

    async def __aenter__(self) -> TaskGroup:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
