"""Desired state pushed to a target by a reconciler, as Cilium's statedb
reconcilers do for BPF maps.

A Reconciler holds a desired table (key -> value) with a revision per change.
A background task applies pending changes through Operations: updates and
deletes are idempotent (deleting a missing key counts as success), failures
are retried per key with exponential backoff, and after a full sync from the
source of truth a prune deletes whatever the target holds that is not
desired. Callers wait for their change with wait_until_reconciled(revision).

Operations that can write many keys at once (BatchOperations: one trip to
a map-writing thread, batched syscalls) get every due change of a pass in
one apply_batch call, up to batch_size at a time; the outcome is still per
key (a failed key is retried alone, the others are done).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from flagella.common.backoff import Backoff
from flagella.common.tasks import TaskGroup

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)
V_contra = TypeVar("V_contra", contravariant=True)


class Operations(Protocol[K_contra, V_contra]):
    """How to write one key to the target (a BPF map, a route table ...)."""

    async def update(self, key: K_contra, value: V_contra) -> None:
        """Create or replace; must be idempotent."""

    async def delete(self, key: K_contra) -> None:
        """Remove; a missing key is success."""

    async def list_actual(self) -> Iterable[Any]:
        """Every key the target holds now, for pruning."""


class BatchOperations(Operations[K_contra, V_contra], Protocol):
    """Operations that also apply many changes in one call."""

    async def apply_batch(
        self, changes: Sequence[tuple[K_contra, V_contra | None]]
    ) -> Sequence[BaseException | None]:
        """Apply each (key, value) change, a None value being a delete, in
        order; one outcome per change: None when applied, else its error
        (the others are still applied)."""


class Status(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


@dataclass
class _Entry(Generic[V]):
    value: V | None  # None: to be deleted
    revision: int
    status: Status = Status.PENDING
    attempts: int = 0
    retry_at: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class ReconcilerStatus:
    name: str
    desired_revision: int
    realized_revision: int
    desired: int
    pending: int
    errors: int
    last_error: str
    pruned: int


class Reconciler(Generic[K, V]):
    def __init__(
        self,
        name: str,
        ops: Operations[K, V],
        *,
        min_backoff: float = 0.05,
        max_backoff: float = 5.0,
        batch_size: int = 1000,
    ) -> None:
        self.name = name
        self.ops = ops
        self.batch_size = batch_size
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        # Each key counts its own attempts; the delays are the common policy's.
        self.backoff = Backoff(min_backoff, max_backoff)
        self._entries: dict[K, _Entry[V]] = {}
        # Keys not yet realized, in the order of their last change (so in
        # revision order): a pass visits only these, so a burst of n changes
        # costs O(n), not O(n * table size), and the realized revision is the
        # first one's.
        self._pending: dict[K, None] = {}
        # Counted as they change: status() is polled (ListMaps) while
        # thousands of keys are pending, and must not walk them.
        self._desired = 0
        self._errors: set[K] = set()
        self._revision = 0
        self._wake = asyncio.Event()
        self._progress = asyncio.Condition()
        self._prune_requested = False
        self._prune_retry_at = 0.0
        self._prune_attempts = 0
        self._pruned = 0
        self._last_error = ""
        self._tasks: TaskGroup | None = None
        self._own_tasks = False

    # --- desired state ---

    @property
    def revision(self) -> int:
        return self._revision

    def upsert(self, key: K, value: V) -> int:
        """Desire key=value. Returns the change's revision. An unchanged value
        that is already realized is not applied again."""
        entry = self._entries.get(key)
        if entry is not None and entry.value == value and entry.status is Status.DONE:
            return entry.revision
        if entry is None or entry.value is None:
            self._desired += 1
        return self._change(key, value)

    def delete(self, key: K) -> int:
        """Desire the key gone. Returns the change's revision."""
        entry = self._entries.get(key)
        if entry is not None and entry.value is None:
            return entry.revision
        if entry is not None:
            self._desired -= 1
        return self._change(key, None)

    def _change(self, key: K, value: V | None) -> int:
        self._revision += 1
        self._entries[key] = _Entry(value, self._revision)
        self._errors.discard(key)
        # To the end: _pending stays in revision order.
        self._pending.pop(key, None)
        self._pending[key] = None
        self._wake.set()
        return self._revision

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.value

    def desired(self) -> dict[K, V]:
        return {k: e.value for k, e in self._entries.items() if e.value is not None}

    def keys(self) -> list[K]:
        return [k for k, e in self._entries.items() if e.value is not None]

    def replace_all(self, items: dict[K, V]) -> int:
        """A full sync: desire exactly items, then prune the target."""
        for key in [k for k, e in self._entries.items() if e.value is not None and k not in items]:
            self.delete(key)
        for key, value in items.items():
            self.upsert(key, value)
        self.request_prune()
        return self._revision

    def request_prune(self) -> None:
        """After a full sync: delete from the target what is not desired."""
        self._prune_requested = True
        self._wake.set()

    # --- realization ---

    @property
    def realized_revision(self) -> int:
        """Every change up to this revision has been applied."""
        if not self._pending:
            return self._revision
        return self._entries[next(iter(self._pending))].revision - 1

    async def wait_until_reconciled(
        self, revision: int | None = None, timeout: float | None = None
    ) -> int:
        """Wait until every change up to revision (default: now) is applied.
        Raises TimeoutError. Returns the realized revision."""
        target = self._revision if revision is None else revision

        async def wait() -> int:
            async with self._progress:
                await self._progress.wait_for(lambda: self.realized_revision >= target)
                return self.realized_revision

        return await asyncio.wait_for(wait(), timeout)

    def status(self) -> ReconcilerStatus:
        return ReconcilerStatus(
            name=self.name,
            desired_revision=self._revision,
            realized_revision=self.realized_revision,
            desired=self._desired,
            pending=len(self._pending) - len(self._errors),
            errors=len(self._errors),
            last_error=self._last_error,
            pruned=self._pruned,
        )

    async def reconcile_once(self) -> float | None:
        """Apply what is due. Returns seconds until the next retry, or None
        when nothing is left to do."""
        now = time.monotonic()
        due = [(k, e) for k in self._pending if (e := self._entries[k]).retry_at <= now]
        apply_batch = getattr(self.ops, "apply_batch", None)
        if apply_batch is not None:
            for start in range(0, len(due), self.batch_size):
                part = due[start : start + self.batch_size]
                changes = [(k, e.value) for k, e in part]
                try:
                    outcomes: Sequence[BaseException | None] = await apply_batch(changes)
                except Exception as exc:
                    outcomes = [exc] * len(part)
                if len(outcomes) != len(part):
                    lost = RuntimeError(f"{len(outcomes)} outcomes for {len(part)} changes")
                    outcomes = [lost] * len(part)
                for (key, entry), outcome in zip(part, outcomes, strict=True):
                    self._settle(key, entry.revision, outcome)
                if start + self.batch_size < len(due):
                    async with self._progress:
                        self._progress.notify_all()
        else:
            for key, entry in due:
                error: BaseException | None = None
                try:
                    if entry.value is None:
                        await self.ops.delete(key)
                    else:
                        await self.ops.update(key, entry.value)
                except Exception as exc:
                    error = exc
                self._settle(key, entry.revision, error)
        waiting = [self._entries[k].retry_at for k in self._pending]
        if self._prune_requested and not waiting and self._prune_retry_at <= time.monotonic():
            await self._prune()
        async with self._progress:
            self._progress.notify_all()
        if self._prune_requested and not waiting:
            waiting = [self._prune_retry_at]
        return max(min(waiting) - time.monotonic(), 0.0) if waiting else None

    def _settle(self, key: K, revision: int, outcome: BaseException | None) -> None:
        """Record the outcome of applying the key's change at revision."""
        current = self._entries.get(key)
        # A newer change to the key arrived meanwhile: leave it pending.
        if current is None or current.revision != revision:
            return
        if outcome is not None:
            current.status = Status.ERROR
            self._errors.add(key)
            current.attempts += 1
            current.retry_at = time.monotonic() + self.backoff.delay(current.attempts - 1)
            current.error = repr(outcome)
            self._last_error = f"{key!r}: {outcome!r}"
            log.warning(
                "reconcile failed",
                extra={
                    "reconciler": self.name,
                    "key": repr(key),
                    "error": repr(outcome),
                    "attempt": current.attempts,
                },
            )
            return
        del self._pending[key]
        self._errors.discard(key)
        if current.value is None:
            del self._entries[key]
        else:
            current.status = Status.DONE
            current.attempts = 0
            current.error = ""

    async def _prune(self) -> None:
        """Delete every target key that is not desired. Runs only once all
        desired changes are applied, so nothing just written is removed."""
        self._prune_requested = False
        failed = False
        try:
            actual = list(await self.ops.list_actual())
        except Exception as exc:
            self._last_error = f"prune: {exc!r}"
            actual, failed = [], True
        for key in actual:
            if key in self._entries:
                continue
            try:
                await self.ops.delete(key)
                self._pruned += 1
            except Exception as exc:
                self._last_error = f"prune {key!r}: {exc!r}"
                failed = True
        if failed:
            self._prune_attempts += 1
            self._prune_requested = True
            self._prune_retry_at = time.monotonic() + self.backoff.delay(self._prune_attempts - 1)
        else:
            self._prune_attempts = 0

    async def run(self) -> None:
        while True:
            self._wake.clear()
            delay = await self.reconcile_once()
            if delay == 0.0:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    def start(self, tasks: TaskGroup | None = None) -> None:
        """Run in tasks (the service's runtime, which stops it), or in a
        group of its own that stop() stops."""
        if self._tasks is not None:
            return
        self._own_tasks = tasks is None
        self._tasks = TaskGroup(f"reconciler-{self.name}") if tasks is None else tasks
        self._tasks.spawn(f"reconciler-{self.name}", self.run())

    async def stop(self) -> None:
        if self._tasks is not None and self._own_tasks:
            await self._tasks.stop()
        self._tasks = None
