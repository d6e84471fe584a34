"""A typed table driving desired state: the one consumer that turns a
table's subscription into a Reconciler's desired state (the datapath's
maps and routes from the control plane's streams).

The subscription's first batch is a snapshot: it becomes the target's
whole desired state (replace_all, after which the reconciler prunes what
the target holds beyond it); every later change is an upsert or a delete.
A consumer that starts again subscribes again from scratch, so its target
is replaced whole: a restart loses nothing.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable
from typing import Protocol, TypeVar

from flagella.common.sync.table import Batch, Table

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Target(Protocol[K, V]):
    """Desired state keyed as the table is: a Reconciler, or an adapter
    that maps each record onto one (under another key, or several keys per
    record). Each method returns the target's revision after the change."""

    @property
    def revision(self) -> int: ...

    def replace_all(self, items: dict[K, V]) -> int: ...

    def upsert(self, key: K, value: V) -> int: ...

    def delete(self, key: K) -> int: ...


# Called after each batch was handed to the target, with the target's
# revision after it (what to wait_until_reconciled for). Nothing is awaited
# between the table handing out the batch and this call: what the table's
# source says at its start (its last SYNCED, say) holds for the batch.
AfterBatch = Callable[[Batch[K, V], int], Awaitable[None]]


def apply(target: Target[K, V], batch: Batch[K, V]) -> int:
    """Hand one batch to the target; returns the target's revision after it."""
    if batch.snapshot:
        return target.replace_all({c.key: c.record for c in batch.changes if c.record is not None})
    for change in batch.changes:
        if change.record is None:
            target.delete(change.key)
        else:
            target.upsert(change.key, change.record)
    return target.revision


async def reconcile_table(
    table: Table[K, V], target: Target[K, V], *, after: AfterBatch[K, V] | None = None
) -> None:
    """Forever: the table into the target, batch by batch (run it in a
    TaskGroup, supervised: a failed `after` starts it over from a snapshot)."""
    async for batch in table.subscribe():
        revision = apply(target, batch)
        if after is not None:
            await after(batch, revision)
