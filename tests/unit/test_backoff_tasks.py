"""The retry policy (bounds and jitter) and the runtime's task group."""

from __future__ import annotations

import asyncio
import random
import statistics

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flagella.common.backoff import Backoff, retry
from flagella.common.errors import Unavailable
from flagella.common.tasks import TaskGroup


@given(
    initial=st.floats(0.001, 1.0),
    factor=st.floats(1.0, 100.0),
    multiplier=st.floats(1.0, 4.0),
    jitter=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**32),
    attempts=st.integers(1, 200),
)
def test_every_delay_stays_within_its_bounds(
    initial: float, factor: float, multiplier: float, jitter: float, seed: int, attempts: int
) -> None:
    maximum = initial * factor
    b = Backoff(initial, maximum, multiplier=multiplier, jitter=jitter, rng=random.Random(seed))
    for n in range(attempts):
        nominal = min(initial * multiplier**n, maximum)
        delay = b.next()
        assert (1 - jitter) * nominal - 1e-12 <= delay <= nominal + 1e-12
        assert delay <= maximum + 1e-12


def test_delays_grow_then_cap_and_reset_starts_over() -> None:
    b = Backoff(0.1, 1.0, jitter=0.0)
    assert [round(b.next(), 6) for _ in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    b.reset()
    assert b.next() == pytest.approx(0.1)


def test_jitter_spreads_replicas_that_failed_together() -> None:
    # 100 replicas losing etcd at once, each with its own generator: their
    # fifth retry must not land at one instant.
    fifth = []
    for seed in range(100):
        b = Backoff(0.1, 5.0, rng=random.Random(seed))
        for _ in range(4):
            b.next()
        fifth.append(b.next())
    assert min(fifth) >= 0.8 - 1e-9  # half of the nominal 1.6 s
    assert max(fifth) <= 1.6 + 1e-9
    assert len({round(d, 4) for d in fifth}) > 90
    assert statistics.pstdev(fifth) > 0.15  # uniform over 0.8 s: ~0.23


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="initial"):
        Backoff(0, 1)
    with pytest.raises(ValueError, match="initial"):
        Backoff(2, 1)
    with pytest.raises(ValueError, match="jitter"):
        Backoff(0.1, 1, jitter=1.5)
    with pytest.raises(ValueError, match="multiplier"):
        Backoff(0.1, 1, multiplier=0.5)


async def test_retry_waits_through_failures_of_the_named_kind_only() -> None:
    calls = 0

    async def flaky() -> str:
        nonlocal calls
        calls += 1
        if calls < 4:
            raise Unavailable("etcd away")
        return "ok"

    assert (
        await retry(flaky, what="x", retry_on=(Unavailable,), backoff=Backoff(0.001, 0.002)) == "ok"
    )
    assert calls == 4

    async def broken() -> str:
        raise KeyError("not retried")

    with pytest.raises(KeyError):
        await retry(broken, what="x", retry_on=(Unavailable,))


async def test_task_group_stop_cancels_and_awaits_every_task() -> None:
    group = TaskGroup("t")
    cancelled: list[str] = []

    async def forever(name: str) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.append(name)

    group.spawn("a", forever("a"))
    group.spawn("b", forever("b"))
    await asyncio.sleep(0)
    assert group.names() == ["a", "b"]
    await group.stop()
    assert sorted(cancelled) == ["a", "b"]
    assert len(group) == 0


async def test_a_finished_or_failed_task_leaves_the_group(caplog: pytest.LogCaptureFixture) -> None:
    group = TaskGroup()

    async def fail() -> None:
        raise RuntimeError("boom")

    async def done() -> None:
        return None

    group.spawn("fail", fail())
    group.spawn("done", done())
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(group) == 0
    assert any("background task failed" in r.message for r in caplog.records)
    await group.stop()


async def test_supervised_task_is_restarted_after_a_backoff_until_stopped() -> None:
    group = TaskGroup()
    runs = 0
    third = asyncio.Event()

    async def run() -> None:
        nonlocal runs
        runs += 1
        if runs == 3:
            third.set()
        raise RuntimeError("crash")

    group.supervise("loop", run, backoff=Backoff(0.001, 0.002))
    await asyncio.wait_for(third.wait(), 5)
    await group.stop()
    seen = runs
    await asyncio.sleep(0.01)
    assert runs == seen  # nothing runs after stop


async def test_context_manager_stops_the_group() -> None:
    async with TaskGroup() as group:
        task = group.spawn("sleep", asyncio.sleep(60))
    assert task.cancelled()
