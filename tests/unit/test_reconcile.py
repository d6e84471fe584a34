"""The reconciler primitive against a fake target (pure logic)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

import pytest

from flagella.common.reconcile import Reconciler


class FakeTarget:
    """A dict standing in for a BPF map, failing the keys it is told to."""

    def __init__(self) -> None:
        self.data: dict[str, int] = {}
        self.fail: dict[str, int] = {}  # key -> failures left
        self.calls: list[tuple[str, str]] = []

    def _maybe_fail(self, key: str) -> None:
        left = self.fail.get(key, 0)
        if left:
            self.fail[key] = left - 1
            raise OSError(f"cannot write {key}")

    async def update(self, key: str, value: int) -> None:
        self.calls.append(("update", key))
        self._maybe_fail(key)
        self.data[key] = value

    async def delete(self, key: str) -> None:
        self.calls.append(("delete", key))
        self._maybe_fail(key)
        self.data.pop(key, None)

    async def list_actual(self) -> Iterable[str]:
        return list(self.data)


@pytest.fixture
async def rec() -> tuple[Reconciler[str, int], FakeTarget]:
    target = FakeTarget()
    return Reconciler("test", target, min_backoff=0.01, max_backoff=0.05), target


async def test_applies_updates_and_deletes_and_waits(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    r.start()
    try:
        r.upsert("a", 1)
        rev = r.upsert("b", 2)
        assert await r.wait_until_reconciled(rev, timeout=5) >= rev
        assert target.data == {"a": 1, "b": 2}
        rev = r.delete("a")
        await r.wait_until_reconciled(rev, timeout=5)
        assert target.data == {"b": 2}
        assert r.status().desired == 1
        assert r.status().pending == 0
    finally:
        await r.stop()


async def test_failures_are_retried_with_backoff(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    target.fail["x"] = 3
    r.start()
    try:
        rev = r.upsert("x", 7)
        await asyncio.sleep(0)
        await r.wait_until_reconciled(rev, timeout=5)
        assert target.data == {"x": 7}
        assert target.calls.count(("update", "x")) == 4
        assert "cannot write x" in r.status().last_error
        assert r.status().errors == 0
    finally:
        await r.stop()


async def test_wait_times_out_while_a_key_keeps_failing(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    target.fail["bad"] = 10_000
    r.start()
    try:
        r.upsert("good", 1)
        rev = r.upsert("bad", 2)
        with pytest.raises(TimeoutError):
            await r.wait_until_reconciled(rev, timeout=0.3)
        assert target.data == {"good": 1}
        assert r.status().errors == 1
        assert r.realized_revision < rev
    finally:
        await r.stop()


async def test_newer_change_during_apply_is_not_lost(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    r.upsert("k", 1)
    r.upsert("k", 2)
    await r.reconcile_once()
    assert target.data == {"k": 2}
    r.delete("k")
    r.upsert("k", 3)
    await r.reconcile_once()
    assert target.data == {"k": 3}


async def test_full_sync_prunes_stale_target_entries(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    target.data = {"stale1": 9, "keep": 0, "stale2": 9}
    r.replace_all({"keep": 1, "new": 2})
    while await r.reconcile_once() is not None:
        pass
    assert target.data == {"keep": 1, "new": 2}
    assert r.status().pruned == 2


async def test_prune_waits_for_pending_updates(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    target.fail["new"] = 1
    target.data = {"old": 1}
    r.replace_all({"new": 2})
    await r.reconcile_once()  # "new" fails: no prune yet
    assert "old" in target.data
    await asyncio.sleep(0.02)
    await r.reconcile_once()
    await r.reconcile_once()
    assert target.data == {"new": 2}


async def test_unchanged_realized_value_is_not_rewritten(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    r, target = rec
    rev = r.upsert("a", 1)
    await r.reconcile_once()
    assert r.upsert("a", 1) == rev
    await r.reconcile_once()
    assert target.calls == [("update", "a")]


class BatchTarget(FakeTarget):
    """A target that also writes many keys per call (as the datapath's
    services do on its map thread), one outcome per key."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []
        self.broken = False  # the whole call fails

    async def apply_batch(
        self, changes: Sequence[tuple[str, int | None]]
    ) -> list[BaseException | None]:
        self.batches.append([k for k, _ in changes])
        if self.broken:
            raise OSError("map thread gone")
        out: list[BaseException | None] = []
        for key, value in changes:
            try:
                self._maybe_fail(key)
            except OSError as exc:
                out.append(exc)
                continue
            if value is None:
                self.data.pop(key, None)
            else:
                self.data[key] = value
            out.append(None)
        return out


async def test_batch_target_gets_a_pass_in_few_calls() -> None:
    target = BatchTarget()
    r: Reconciler[str, int] = Reconciler("test", target, batch_size=40)
    for i in range(100):
        r.upsert(f"k{i}", i)
    r.delete("k3")  # the key's latest change is what is applied
    assert await r.reconcile_once() is None
    assert [len(b) for b in target.batches] == [40, 40, 20]
    assert target.calls == []  # never one key at a time
    assert target.data == {f"k{i}": i for i in range(100) if i != 3}
    assert r.realized_revision == r.revision
    assert r.status().pending == 0


async def test_batch_failure_of_one_key_retries_only_that_key() -> None:
    target = BatchTarget()
    r: Reconciler[str, int] = Reconciler("test", target, min_backoff=0.01, max_backoff=0.05)
    target.fail["bad"] = 2
    r.start()
    try:
        r.upsert("a", 1)
        rev = r.upsert("bad", 2)
        r.upsert("c", 3)
        await r.wait_until_reconciled(rev, timeout=5)
        assert target.data == {"a": 1, "bad": 2, "c": 3}
        assert target.batches[0] == ["a", "bad", "c"]
        assert target.batches[1:] == [["bad"], ["bad"]]
        assert "cannot write bad" in r.status().last_error
    finally:
        await r.stop()


async def test_batch_call_failing_whole_leaves_every_key_pending() -> None:
    target = BatchTarget()
    r: Reconciler[str, int] = Reconciler("test", target, min_backoff=0.01, max_backoff=0.05)
    target.broken = True
    r.upsert("a", 1)
    r.upsert("b", 2)
    await r.reconcile_once()
    assert r.status().errors == 2
    assert r.realized_revision == 0
    target.broken = False
    await asyncio.sleep(0.02)
    await r.reconcile_once()
    assert target.data == {"a": 1, "b": 2}
    assert r.status().errors == 0


async def test_batch_newer_change_during_apply_stays_pending() -> None:
    target = BatchTarget()
    r: Reconciler[str, int] = Reconciler("test", target)
    real = target.apply_batch

    async def changing(changes: Sequence[tuple[str, int | None]]) -> list[BaseException | None]:
        if len(target.batches) == 0:
            r.upsert("k", 2)  # arrives while the first batch is written
        return await real(changes)

    target.apply_batch = changing  # type: ignore[method-assign]
    r.upsert("k", 1)
    r.upsert("j", 1)
    await r.reconcile_once()
    assert target.data == {"k": 1, "j": 1}
    assert r.status().pending == 1
    await r.reconcile_once()
    assert target.data == {"k": 2, "j": 1}
    assert r.realized_revision == r.revision


async def test_status_counts_and_realized_revision_follow_every_transition(
    rec: tuple[Reconciler[str, int], FakeTarget],
) -> None:
    """status() and realized_revision are kept as keys change (no walk):
    a key changed again goes behind newer ones, errors leave the pending
    count, a delete of a realized key is still desired until applied."""
    r, target = rec

    def counts() -> tuple[int, int, int]:
        st = r.status()
        return st.desired, st.pending, st.errors

    a1 = r.upsert("a", 1)
    b1 = r.upsert("b", 1)
    assert counts() == (2, 2, 0)
    assert r.realized_revision == a1 - 1
    a2 = r.upsert("a", 2)  # now the newest: b is the oldest pending
    assert counts() == (2, 2, 0)
    assert r.realized_revision == b1 - 1
    target.fail["b"] = 1
    await r.reconcile_once()
    assert counts() == (2, 0, 1)
    assert r.realized_revision == b1 - 1
    assert r.status().last_error.startswith("'b'")
    r.delete("b")  # replaces the failed change: pending again, no error
    assert counts() == (1, 1, 0)
    assert r.realized_revision == a2
    r.delete("missing")
    assert counts() == (1, 2, 0)
    r.start()
    try:
        await r.wait_until_reconciled(timeout=5)
    finally:
        await r.stop()
    assert counts() == (1, 0, 0)
    assert r.realized_revision == r.revision
    assert target.data == {"a": 2}
