"""A typed table driving a Reconciler (flagella.common.sync.reconcile): the
snapshot replaces the desired state whole (and prunes the target), changes
upsert and delete, the hook sees each batch with the revision to wait for,
and a restarted consumer starts over from a snapshot."""

from __future__ import annotations

from collections.abc import Iterable

from harness.aio import until

from flagella.common.reconcile import Reconciler
from flagella.common.sync import Batch, Table
from flagella.common.sync.reconcile import reconcile_table
from flagella.common.tasks import TaskGroup


class Target:
    """A dict standing in for a BPF map."""

    def __init__(self, data: dict[str, int] | None = None) -> None:
        self.data = dict(data or {})

    async def update(self, key: str, value: int) -> None:
        self.data[key] = value

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def list_actual(self) -> Iterable[str]:
        return list(self.data)


async def test_snapshot_then_changes_reach_the_target() -> None:
    table: Table[str, int] = Table("t", keep_prev=True)
    table.replace([("a", 1, 3), ("b", 2, 5)], 5)
    # What a previous process left behind: pruned after the snapshot.
    target = Target({"stale": 9, "a": 0})
    rec: Reconciler[str, int] = Reconciler("t", target)
    seen: list[tuple[Batch[str, int], int]] = []

    async def after(batch: Batch[str, int], revision: int) -> None:
        seen.append((batch, revision))

    async with TaskGroup() as tasks:
        rec.start(tasks)  # stopped with the group
        tasks.spawn("drive", reconcile_table(table, rec, after=after))
        await until(lambda: bool(seen))
        await rec.wait_until_reconciled(seen[-1][1], timeout=5)
        assert target.data == {"a": 1, "b": 2}
        assert seen[0][0].snapshot
        assert seen[0][0].revision == 5

        table.commit([("a", None, 6), ("c", 3, 6)], 6)
        await until(lambda: seen[-1][0].revision == 6)
        batch, revision = seen[-1]
        assert not batch.snapshot
        assert {(c.key, c.record, c.prev) for c in batch.changes} == {
            ("a", None, 1),
            ("c", 3, None),
        }
        await rec.wait_until_reconciled(revision, timeout=5)
        assert target.data == {"b": 2, "c": 3}


async def test_a_restarted_consumer_replaces_the_desired_state_whole() -> None:
    table: Table[str, int] = Table("t")
    table.replace([("a", 1, 1)], 1)
    target = Target()
    rec: Reconciler[str, int] = Reconciler("t", target)
    rec.start()
    try:
        async with TaskGroup() as tasks:
            tasks.spawn("drive", reconcile_table(table, rec))
            await until(lambda: rec.desired() == {"a": 1})
        # While no one consumed the table: a change. A key desired by hand
        # and absent from the table is gone after the next snapshot.
        table.commit([("b", 2, 2)], 2)
        rec.upsert("stray", 7)
        async with TaskGroup() as tasks:
            tasks.spawn("drive", reconcile_table(table, rec))
            await until(lambda: rec.desired() == {"a": 1, "b": 2})
            await rec.wait_until_reconciled(timeout=5)
        assert target.data == {"a": 1, "b": 2}
    finally:
        await rec.stop()
