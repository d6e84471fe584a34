"""Keeps a replica's PolicyState in step with etcd: a consistent snapshot
of the mirrored keys, then one range watch; fans changes out to the watch
streams; lets writers wait until their write is visible locally."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from flagella.common.errors import Unavailable
from flagella.common.etcd import Compacted
from flagella.policy.state import Change, PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)


class Subscription:
    """Changes committed since one watch stream last took them. Pushing is
    O(1) (the change objects are shared by every subscriber); they are
    merged when taken."""

    MAX_PENDING = 256

    def __init__(self, mirror: Mirror) -> None:
        self._mirror = mirror
        self._pending: list[Change] = []
        self._event = asyncio.Event()

    def push(self, change: Change) -> None:
        self._pending.append(change)
        if len(self._pending) > self.MAX_PENDING:
            self._pending = [self._merged()]
        self._event.set()

    def _merged(self) -> Change:
        merged = Change()
        for change in self._pending:
            merged.merge(change)
        return merged

    async def next(self, timeout: float) -> Change | None:
        """What changed since the last call, or None after timeout seconds
        of nothing."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return None
        self._event.clear()
        change = self._merged()
        self._pending = []
        return change

    def close(self) -> None:
        self._mirror._subscribers.discard(self)


StateFactory = Callable[[], PolicyState]


class Mirror:
    def __init__(
        self, store: PolicyStore, make_state: StateFactory, *, wait_timeout: float = 10.0
    ) -> None:
        self.store = store
        self.make_state = make_state
        self.wait_timeout = wait_timeout
        self.state = make_state()
        self._subscribers: set[Subscription] = set()
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._seen = 0
        self._commit_handle: asyncio.Handle | None = None
        self.synced = asyncio.Event()

    # --- life cycle ---

    async def start(self) -> None:
        """Loads the snapshot (waiting for etcd) and starts following."""
        await self._load()
        self._task = asyncio.create_task(self._follow(), name="policy-mirror")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(Unavailable("policy service stopping"))
        self._waiters.clear()

    async def _load(self) -> None:
        delay = 0.1
        while True:
            try:
                kvs, revision = await self.store.snapshot()
                break
            except Unavailable as exc:
                log.warning("cannot read policy state", extra={"reason": exc.message})
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        state = self.make_state()
        for kv in kvs:
            state.put(kv)
        state.commit(revision)
        first = not self.synced.is_set()
        self.state = state
        self._seen = revision
        log.info(
            "policy state loaded",
            extra={
                "revision": revision,
                "identities": len(state.identities),
                "rules": len(state.rules),
                "ipcache": len(state.ip),
            },
        )
        if not first:
            self._notify(Change(revision=revision, full=True))
        self.synced.set()
        self._release_waiters()

    async def _follow(self) -> None:
        delay = 0.1
        start = self.state.revision + 1
        while True:
            try:
                async for event in self.store.watch(start):
                    delay = 0.1
                    if event.deleted:
                        self.state.delete(event.kv.key, event.revision)
                    else:
                        self.state.put(event.kv)
                    self._seen = max(self._seen, event.revision)
                    if self._commit_handle is None:
                        # Runs once this task stops getting events without
                        # waiting: all events of one etcd watch response
                        # (one or more whole revisions) are applied by then.
                        self._commit_handle = asyncio.get_running_loop().call_soon(self._commit)
            except Compacted:
                log.warning("policy watch fell behind a compaction: reloading")
                self._cancel_commit()
                await self._load()
                start = self.state.revision + 1
            except Unavailable as exc:
                log.warning("policy watch interrupted", extra={"reason": exc.message})
                # Watch again from the last revision seen: if it was not
                # committed it may be partial, and replaying it is harmless.
                self._cancel_commit()
                start = max(self.state.revision + 1, self._seen)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _cancel_commit(self) -> None:
        if self._commit_handle is not None:
            self._commit_handle.cancel()
            self._commit_handle = None

    # --- commits and fan-out ---

    def _commit(self) -> None:
        self._commit_handle = None
        if self._seen <= self.state.revision:
            return
        change = self.state.commit(self._seen)
        self._notify(change)
        self._release_waiters()

    def _notify(self, change: Change) -> None:
        for sub in list(self._subscribers):
            sub.push(change)

    def _release_waiters(self) -> None:
        if not self._waiters:
            return
        keep = []
        for revision, fut in self._waiters:
            if revision <= self.state.revision:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((revision, fut))
        self._waiters = keep

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        self._subscribers.add(sub)
        return sub

    async def wait_for(self, revision: int, *, timeout: float | None = None) -> None:
        """Returns once the local state includes revision (a write to the
        mirrored keys this replica or another made). Raises Unavailable
        after timeout (default wait_timeout)."""
        if revision <= self.state.revision:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((revision, fut))
        try:
            await asyncio.wait_for(
                asyncio.shield(fut), self.wait_timeout if timeout is None else timeout
            )
        except TimeoutError:
            self._waiters = [(r, f) for r, f in self._waiters if f is not fut]
            raise Unavailable(
                f"this replica has not seen etcd revision {revision} yet (at "
                f"{self.state.revision}); retry"
            ) from None

    async def historic(self, revision: int) -> PolicyState:
        """The state as it was at an older revision, rebuilt from etcd's
        history. Raises Compacted or FutureRevision."""
        kvs, _ = await self.store.snapshot(revision)
        state = self.make_state()
        for kv in kvs:
            state.put(kv)
        state.commit(revision)
        return state
