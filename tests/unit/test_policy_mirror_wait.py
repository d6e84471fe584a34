"""Mirror.wait_for: a commit wakes the callers whose revision it reaches,
in order, and no others; a caller that gives up is refused with Unavailable
and dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from flagella.common.errors import Unavailable
from flagella.common.tasks import TaskGroup
from flagella.policy.mirror import Mirror
from flagella.policy.state import PolicyState


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


class NoStore:
    def mirror_source(self, sink: Any) -> None:
        return None


async def test_waiters_wake_at_their_revision_only() -> None:
    mirror = Mirror(NoStore(), PolicyState, tasks=TaskGroup("t"))  # type: ignore[arg-type]
    woke: list[int] = []

    async def wait(revision: int) -> None:
        await mirror.wait_for(revision, timeout=5)
        woke.append(revision)

    tasks = [asyncio.create_task(wait(r)) for r in (7, 3, 5, 5, 9)]
    await settle()
    assert len(mirror._waiters) == 5
    mirror.advance(5)
    await settle()
    assert sorted(woke) == [3, 5, 5]
    assert [w[0] for w in mirror._waiters] == [7, 9]
    mirror.advance(6)  # reaches nobody
    await settle()
    assert len(woke) == 3
    mirror.advance(9)
    await asyncio.gather(*tasks)
    assert sorted(woke) == [3, 5, 5, 7, 9]
    assert not mirror._waiters
    await mirror.wait_for(2)  # reached already: no waiting


async def test_a_waiter_that_gives_up_is_refused_and_dropped() -> None:
    mirror = Mirror(NoStore(), PolicyState, tasks=TaskGroup("t"))  # type: ignore[arg-type]
    with pytest.raises(Unavailable, match="not seen etcd revision 4"):
        await mirror.wait_for(4, timeout=0.01)
    assert mirror._waiters[0][2].done()
    mirror.advance(4)  # the given-up one is popped, nothing raised
    assert not mirror._waiters
