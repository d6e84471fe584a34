"""DirtyKeys, the keys a level-triggered sync loop still has to look at: a
key marked many times while a sync runs is synced once more, a failed key
is retried after a backoff, idle() follows a pass that left nothing failed,
and keys are synced up to `concurrency` at once but never one key twice at
once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from harness.aio import until

from flagella.common.backoff import Backoff
from flagella.common.sync.dirty import DirtyKeys


class Syncs:
    """A sync function that records its calls, fails keys while told, and
    holds each call until released (when `hold` is set)."""

    def __init__(self, hold: bool = False) -> None:
        self.calls: list[str] = []
        self.failing: set[str] = set()
        self.running: dict[str, int] = {}
        self.most = 0
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def __call__(self, key: str) -> bool:
        self.calls.append(key)
        self.running[key] = self.running.get(key, 0) + 1
        assert self.running[key] == 1, f"{key} synced twice at once"
        self.most = max(self.most, sum(self.running.values()))
        try:
            await self.release.wait()
            return key not in self.failing
        finally:
            self.running[key] -= 1
            if not self.running[key]:
                del self.running[key]


@contextlib.asynccontextmanager
async def looping(
    dirty: DirtyKeys,
    sync: Callable[[str], Awaitable[bool]],
    idle: Callable[[], None] | None = None,
    concurrency: int = 1,
) -> AsyncIterator[set[str]]:
    failed: set[str] = set()
    task = asyncio.create_task(
        dirty.sync_forever(
            sync, failed, Backoff(0.05, 0.05, jitter=0), idle, concurrency=concurrency
        )
    )
    try:
        yield failed
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_each_marked_key_is_synced_and_marks_during_a_sync_collapse() -> None:
    dirty, syncs = DirtyKeys(), Syncs(hold=True)
    passes: list[int] = []
    async with looping(dirty, syncs, idle=lambda: passes.append(len(syncs.calls))):
        dirty.mark(["b", "a"])
        await until(lambda: syncs.calls == ["a"])
        dirty.mark(["a", "a", "c"])  # while "a" is being synced
        syncs.release.set()
        await until(lambda: len(passes) == 2)
    assert syncs.calls == ["a", "b", "a", "c"]


async def test_a_failed_key_is_retried_after_the_backoff_until_it_succeeds() -> None:
    dirty, syncs = DirtyKeys(), Syncs()
    syncs.failing.add("x")
    idle: list[bool] = []
    async with looping(dirty, syncs, idle=lambda: idle.append(True)) as failed:
        dirty.mark(["x", "y"])
        await until(lambda: syncs.calls.count("x") >= 3)
        assert failed == {"x"}
        assert syncs.calls.count("y") == 1
        assert not idle
        syncs.failing.clear()
        await until(lambda: bool(idle))
        assert not failed


async def test_keys_are_synced_up_to_the_concurrency_at_once() -> None:
    dirty, syncs = DirtyKeys(), Syncs(hold=True)
    async with looping(dirty, syncs, concurrency=3):
        dirty.mark([f"k{i}" for i in range(7)])
        await until(lambda: len(syncs.running) == 3)
        await asyncio.sleep(0.05)
        assert len(syncs.running) == 3
        dirty.mark(["k0"])  # synced again only after this pass
        syncs.release.set()
        await until(lambda: len(syncs.calls) == 8)
    assert syncs.most == 3
    assert syncs.calls[-1] == "k0"
