"""flagella.common.etcd against a real etcd: transactions, leases that are
kept and replaced, and watch streams that snapshot, resume and ride out an
etcd restart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from harness.etcd import EtcdServer

from flagella.common import etcd as e
from flagella.common.errors import Unavailable

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(etcd: EtcdServer) -> AsyncIterator[e.Etcd]:
    c = etcd.client(timeout=2.0)
    await asyncio.wait_for(c.wait_connected(), 30)
    yield c
    await c.close()


async def test_put_get_prefix_delete(client: e.Etcd) -> None:
    rev1 = await client.put("t/a", b"1")
    rev2 = await client.put("t/b", b"2")
    assert rev2 > rev1
    kv = await client.get("t/a")
    assert kv is not None
    assert kv.value == b"1"
    assert kv.mod_revision == rev1
    kvs, rev = await client.get_prefix("t/")
    assert [(k.key, k.value) for k in kvs] == [("t/a", b"1"), ("t/b", b"2")]
    assert rev == rev2
    assert await client.delete("t/a") == 1
    assert await client.delete("t/a") == 0
    assert await client.get("t/a") is None
    assert await client.delete_prefix("t/") == 1


async def test_create_if_absent_transaction_has_one_winner(client: e.Etcd) -> None:
    async def claim(who: str) -> bool:
        res = await client.txn([e.absent("claim/x")], [e.put_op("claim/x", who.encode())])
        return res.succeeded

    results = await asyncio.gather(*(claim(f"w{i}") for i in range(20)))
    assert results.count(True) == 1
    winner = (await client.get("claim/x")).value  # type: ignore[union-attr]
    assert winner == f"w{results.index(True)}".encode()
    failed = await client.txn([e.absent("claim/x")], [], [e.get_op("claim/x")])
    assert not failed.succeeded
    assert failed.ranges[0][0].value == winner


async def test_mod_revision_compare_guards_against_lost_updates(client: e.Etcd) -> None:
    rev = await client.put("cas", b"v1")
    ok = await client.txn([e.mod_revision_is("cas", rev)], [e.put_op("cas", b"v2")])
    assert ok.succeeded
    stale = await client.txn([e.mod_revision_is("cas", rev)], [e.put_op("cas", b"v3")])
    assert not stale.succeeded
    assert (await client.get("cas")).value == b"v2"  # type: ignore[union-attr]


async def test_lease_keys_vanish_when_lease_is_revoked(client: e.Etcd) -> None:
    keeper = e.LeaseKeeper(client, ttl=2)
    lease = await keeper.start()
    await client.put("leased/k", b"v", lease=lease)
    await asyncio.sleep(3)  # longer than the TTL: the keeper kept it alive
    assert await client.get("leased/k") is not None
    await keeper.stop(revoke=True)
    assert await client.get("leased/k") is None


async def test_lost_lease_is_replaced_and_owner_called(client: e.Etcd) -> None:
    regranted: list[int] = []

    async def on_new_lease(lease_id: int) -> None:
        regranted.append(lease_id)
        await client.put("owner/k", b"again", lease=lease_id)

    keeper = e.LeaseKeeper(client, ttl=2, on_new_lease=on_new_lease)
    first = await keeper.start()
    await client.put("owner/k", b"v", lease=first)
    await client.revoke_lease(first)  # as if it had expired during an outage
    for _ in range(50):
        if regranted:
            break
        await asyncio.sleep(0.1)
    assert regranted
    assert regranted[0] != first
    kv = await client.get("owner/k")
    assert kv is not None
    assert kv.lease == regranted[0]
    await keeper.stop()


async def test_unreachable_etcd_is_unavailable() -> None:
    c = e.Etcd(["127.0.0.1:1"], timeout=0.5)
    with pytest.raises(Unavailable, match="etcd unreachable"):
        await c.connect()
    with pytest.raises(Unavailable):
        await c.put("k", b"v")
    await c.close()


async def collect(
    stream: AsyncIterator[e.StreamEvent], until: e.StreamKind, n: int = 1
) -> list[e.StreamEvent]:
    out: list[e.StreamEvent] = []
    seen = 0
    async for ev in stream:
        out.append(ev)
        if ev.kind is until:
            seen += 1
            if seen == n:
                return out
    return out


def state_after(
    events: list[e.StreamEvent], state: dict[str, bytes] | None = None
) -> dict[str, bytes]:
    state = dict(state or {})
    for ev in events:
        if ev.kind is e.StreamKind.RESET:
            state.clear()
        elif ev.kind is e.StreamKind.UPSERT and ev.kv is not None:
            state[ev.kv.key] = ev.kv.value
        elif ev.kind is e.StreamKind.DELETE and ev.kv is not None:
            state.pop(ev.kv.key, None)
    return state


async def test_snapshot_then_deltas_and_resume_equal_fresh_snapshot(client: e.Etcd) -> None:
    await client.put("w/a", b"1")
    await client.put("w/b", b"2")
    await client.put("other/x", b"no")
    stream = client.snapshot_then_watch("w/")
    first = await collect(stream, e.StreamKind.SYNCED)
    assert first[0].kind is e.StreamKind.RESET
    assert state_after(first) == {"w/a": b"1", "w/b": b"2"}
    await client.put("w/c", b"3")
    await client.delete("w/a")
    deltas = [await anext(stream), await anext(stream)]
    assert [d.kind for d in deltas] == [e.StreamKind.UPSERT, e.StreamKind.DELETE]
    held = state_after(first + deltas)
    last = deltas[-1].revision
    await stream.aclose()

    # Changes while disconnected, then resume from the last revision seen.
    await client.put("w/b", b"22")
    await client.put("w/d", b"4")
    await client.delete("w/c")
    resumed = client.snapshot_then_watch("w/", since_revision=last)
    head = await anext(resumed)
    assert head.kind is e.StreamKind.SYNCED
    catch_up = [await anext(resumed) for _ in range(3)]
    await resumed.aclose()
    fresh_stream = client.snapshot_then_watch("w/")
    fresh = state_after(await collect(fresh_stream, e.StreamKind.SYNCED))
    await fresh_stream.aclose()
    assert state_after(catch_up, held) == fresh == {"w/b": b"22", "w/d": b"4"}


async def test_resume_from_compacted_revision_resyncs(client: e.Etcd) -> None:
    old = await client.put("c/a", b"1")
    await client.put("c/a", b"2")
    rev = await client.put("c/b", b"3")
    await client.client.compact(rev)
    stream = client.snapshot_then_watch("c/", since_revision=old)
    events = await collect(stream, e.StreamKind.SYNCED, n=2)
    await stream.aclose()
    assert events[0].kind is e.StreamKind.SYNCED  # resume attempted
    assert e.StreamKind.RESET in [ev.kind for ev in events]  # then a full resync
    assert state_after(events) == {"c/a": b"2", "c/b": b"3"}


async def test_watch_rides_out_an_etcd_restart(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "restart").start()
    c = server.client(timeout=1.0)
    try:
        await c.connect()
        await c.put("r/a", b"1")
        stream = c.snapshot_then_watch("r/", max_delay=0.5)
        await collect(stream, e.StreamKind.SYNCED)
        server.stop()
        await asyncio.sleep(0.5)
        server.start()
        await c.wait_connected(max_delay=0.5)
        await c.put("r/b", b"2")
        event = await asyncio.wait_for(anext(stream), 20)
        assert event.kind is e.StreamKind.UPSERT
        assert event.kv is not None
        assert event.kv.key == "r/b"
        await stream.aclose()
    finally:
        with contextlib.suppress(Exception):
            await c.close()
        server.cleanup()


async def test_backoff_sleep_ends_when_etcd_returns_not_before(tmp_path: Path) -> None:
    """A retry loop's sleep: the whole delay while etcd answers (an error
    from etcd itself must not turn into a busy loop); cut short when etcd
    was down and comes back."""
    server = EtcdServer(tmp_path / "back").start()
    c = server.client(timeout=1.0)
    loop = asyncio.get_running_loop()
    try:
        await c.connect()
        started = loop.time()
        assert not await c.backoff_sleep(0.5)
        assert loop.time() - started >= 0.5

        server.stop()
        started = loop.time()
        sleeping = asyncio.ensure_future(c.backoff_sleep(30))
        await asyncio.to_thread(server.start)
        assert await asyncio.wait_for(sleeping, 10)
        assert loop.time() - started < 10
        assert await c.put("back/a", b"1")
    finally:
        with contextlib.suppress(Exception):
            await c.close()
        server.cleanup()


async def test_watch_rides_out_its_client_closed_under_it(client: e.Etcd) -> None:
    """A failover closes the client a watch runs on; gRPC then cancels the
    watch's call, which must read as a broken stream (resumed), not as the
    watching task being cancelled (its table would be dead for good)."""
    stream = client.snapshot_then_watch("f/", max_delay=0.2)
    await collect(stream, e.StreamKind.SYNCED)
    await client.put("f/a", b"1")
    assert (await asyncio.wait_for(anext(stream), 10)).kind is e.StreamKind.UPSERT
    following = asyncio.ensure_future(anext(stream))
    for _ in range(5):  # back inside the watch's read
        await asyncio.sleep(0)
    await client.close()  # as _fail_over does
    await client.put("f/b", b"2")
    event = await asyncio.wait_for(following, 10)
    assert event.kind is e.StreamKind.UPSERT
    assert event.kv is not None
    assert event.kv.key == "f/b"
    await stream.aclose()
