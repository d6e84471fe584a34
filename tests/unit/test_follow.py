"""StreamFollower: snapshot, deltas, and resume from the last revision."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from flagella.datapath.follow import DELETE, RESET, SYNCED, UPSERT, StreamFollower


@dataclass
class Ev:
    kind: int
    revision: int
    key: str = ""
    value: str = ""


class Table:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}
        self.synced_at: list[int] = []

    async def reset(self) -> None:
        self.data.clear()

    async def upsert(self, event: Any) -> None:
        self.data[event.key] = event.value

    async def delete(self, event: Any) -> None:
        self.data.pop(event.key, None)

    async def synced(self, revision: int) -> None:
        self.synced_at.append(revision)


def broken() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "server went away"
    )


async def run_until(follower: StreamFollower, done: asyncio.Event) -> None:
    task = asyncio.create_task(follower.run())
    try:
        await asyncio.wait_for(done.wait(), 5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_resumes_from_last_revision_after_a_break() -> None:
    calls: list[int] = []
    done = asyncio.Event()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        calls.append(since)
        if len(calls) == 1:
            for ev in [
                Ev(RESET, 10),
                Ev(UPSERT, 3, "a", "1"),
                Ev(UPSERT, 7, "b", "2"),
                Ev(SYNCED, 10),
                Ev(UPSERT, 11, "c", "3"),
            ]:
                yield ev
            raise broken()
        for ev in [Ev(SYNCED, since), Ev(DELETE, 12, "a"), Ev(UPSERT, 13, "b", "22")]:
            yield ev
        done.set()
        await asyncio.Event().wait()

    table = Table()
    follower = StreamFollower("t", open_stream, table, max_backoff=0.01)
    await run_until(follower, done)
    assert calls == [0, 11]
    assert table.data == {"b": "22", "c": "3"}
    assert follower.revision == 13
    assert table.synced_at == [10, 11]


async def test_break_mid_snapshot_restarts_the_snapshot() -> None:
    calls: list[int] = []
    done = asyncio.Event()

    async def open_stream(since: int) -> AsyncIterator[Ev]:
        calls.append(since)
        if len(calls) == 1:
            yield Ev(RESET, 20)
            yield Ev(UPSERT, 19, "x", "1")  # snapshot cut short
            raise broken()
        for ev in [
            Ev(RESET, 21),
            Ev(UPSERT, 19, "x", "1"),
            Ev(UPSERT, 21, "y", "2"),
            Ev(SYNCED, 21),
        ]:
            yield ev
        done.set()
        await asyncio.Event().wait()

    table = Table()
    follower = StreamFollower("t", open_stream, table, max_backoff=0.01)
    await run_until(follower, done)
    assert calls == [0, 0]
    assert table.data == {"x": "1", "y": "2"}
    assert follower.synced.is_set()


@pytest.mark.parametrize("kinds", [(1, 2, 3, 4)])
def test_kinds_match_every_watch_enum(kinds: tuple[int, int, int, int]) -> None:
    from flagella.api.ipam.v1 import ipam_pb2
    from flagella.api.lb.v1 import lb_pb2
    from flagella.api.policy.v1 import policy_pb2

    assert kinds == (RESET, UPSERT, DELETE, SYNCED)
    assert kinds == (
        ipam_pb2.NodeEvent.KIND_RESET,
        ipam_pb2.NodeEvent.KIND_UPSERT,
        ipam_pb2.NodeEvent.KIND_DELETE,
        ipam_pb2.NodeEvent.KIND_SYNCED,
    )
    assert kinds == (
        lb_pb2.ServiceEvent.KIND_RESET,
        lb_pb2.ServiceEvent.KIND_UPSERT,
        lb_pb2.ServiceEvent.KIND_DELETE,
        lb_pb2.ServiceEvent.KIND_SYNCED,
    )
    assert kinds == (
        policy_pb2.EVENT_KIND_RESET,
        policy_pb2.EVENT_KIND_UPSERT,
        policy_pb2.EVENT_KIND_DELETE,
        policy_pb2.EVENT_KIND_SYNCED,
    )
