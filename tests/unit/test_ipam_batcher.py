"""Group commit of the ipam store (TxnBatcher) against a small in-memory
fake of etcd's transactions: every caller gets the outcome it would have
had alone, and concurrent callers share transactions."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from flagella.common.errors import Unavailable
from flagella.common.etcd import KeyValue, TxnResult, absent, get_op, put_op
from flagella.ipam.store import TxnBatcher


class FakeEtcd:
    """Just enough of etcd: compares on create/mod revision of one key,
    put and range operations, a revision per successful write txn; rejects a
    key written twice in one transaction as etcd does."""

    def __init__(self) -> None:
        self.kv: dict[bytes, KeyValue] = {}
        self.revision = 1
        self.calls: list[int] = []  # operations per txn
        self.fail_next = False

    def _holds(self, c: Any) -> bool:
        kv = self.kv.get(c.key)
        target = c.WhichOneof("target_union")
        got = (
            0
            if kv is None
            else (kv.create_revision if target == "create_revision" else kv.mod_revision)
        )
        want = getattr(c, target)
        return bool(got == want)

    async def txn(
        self, compare: Sequence[Any], success: Sequence[Any], failure: Sequence[Any] = ()
    ) -> TxnResult:
        await asyncio.sleep(0.001)
        if self.fail_next:
            self.fail_next = False
            raise Unavailable("etcd down")
        self.calls.append(len(success))
        ok = all(self._holds(c) for c in compare)
        ops = success if ok else failure
        puts = [op.request_put.key for op in ops if op.WhichOneof("request") == "request_put"]
        if len(puts) != len(set(puts)):
            raise Unavailable("etcd error: INVALID_ARGUMENT duplicate key given in txn request")
        if puts:
            self.revision += 1
        ranges = []
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_put":
                p = op.request_put
                old = self.kv.get(p.key)
                created = old.create_revision if old else self.revision
                self.kv[p.key] = KeyValue(p.key.decode(), p.value, created, self.revision, 1, 0)
            elif kind == "request_range":
                kv = self.kv.get(op.request_range.key)
                ranges.append([kv] if kv else [])
        return TxnResult(ok, self.revision, ranges)


def create(batcher: TxnBatcher, key: str) -> Any:
    return batcher.txn([absent(key)], [put_op(key, b"v")], [get_op(key)], [key])


async def test_concurrent_writes_share_one_transaction() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd)  # type: ignore[arg-type]
    results = await asyncio.gather(*(create(batcher, f"k{i}") for i in range(10)))
    assert all(r.succeeded for r in results)
    assert len({r.revision for r in results}) == 1
    assert etcd.calls == [10]
    assert len(etcd.kv) == 10


async def test_a_failed_compare_gives_each_caller_its_own_outcome() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd)  # type: ignore[arg-type]
    await create(batcher, "taken")
    results = await asyncio.gather(
        create(batcher, "a"), create(batcher, "taken"), create(batcher, "b")
    )
    assert [r.succeeded for r in results] == [True, False, True]
    # The loser sees what etcd holds (its failure operations ran).
    assert results[1].ranges[0][0].key == "taken"
    assert sorted(etcd.kv) == [b"a", b"b", b"taken"]
    # One combined try, then each alone.
    assert etcd.calls == [1, 3, 1, 1, 1]


async def test_writes_to_the_same_key_never_share_a_transaction() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd)  # type: ignore[arg-type]
    results = await asyncio.gather(
        create(batcher, "same"), create(batcher, "same"), create(batcher, "other")
    )
    assert sorted(r.succeeded for r in results) == [False, True, True]
    assert len(etcd.kv) == 2


async def test_batches_respect_the_operation_limit() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd, max_ops=4)  # type: ignore[arg-type]
    results = await asyncio.gather(*(create(batcher, f"k{i}") for i in range(10)))
    assert all(r.succeeded for r in results)
    assert max(etcd.calls) <= 4
    assert sum(etcd.calls) == 10


async def test_an_etcd_failure_reaches_every_caller_of_the_batch() -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd)  # type: ignore[arg-type]
    etcd.fail_next = True
    results = await asyncio.gather(
        *(create(batcher, f"k{i}") for i in range(3)), return_exceptions=True
    )
    assert all(isinstance(r, Unavailable) for r in results)
    assert etcd.kv == {}
    # The batcher carries on afterwards.
    assert (await create(batcher, "k0")).succeeded


@pytest.mark.parametrize("n", [1, 2])
async def test_a_lone_write_goes_straight_through(n: int) -> None:
    etcd = FakeEtcd()
    batcher = TxnBatcher(etcd)  # type: ignore[arg-type]
    for i in range(n):
        assert (await create(batcher, f"k{i}")).succeeded
    assert etcd.calls == [1] * n
