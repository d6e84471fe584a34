"""Keeps a replica's PolicyState in step with etcd: the mirror is the sink
of the store's EtcdSource (flagella.common.sync), which reads the mirrored
keys at one revision and then watches them; each etcd response is applied
and committed whole. It fans changes out to the watch streams and lets
writers wait until their write is visible locally."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from flagella.common.backoff import retry
from flagella.common.errors import Unavailable
from flagella.common.etcd import KeyValue
from flagella.common.tasks import TaskGroup
from flagella.policy.state import Change, PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)

# Commit times remembered: far more revisions than a stream lags behind.
COMMIT_TIMES = 1024
# Waiters kept before those that timed out are dropped from the heap.
WAITERS_PRUNED_AT = 1024


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

    async def next(self, timeout: float | None) -> Change | None:
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
        self,
        store: PolicyStore,
        make_state: StateFactory,
        *,
        tasks: TaskGroup,
        wait_timeout: float = 10.0,
    ) -> None:
        self.make_state = make_state
        self.wait_timeout = wait_timeout
        # The owner's (the service's) task group: it stops the source.
        self.tasks = tasks
        self.state = make_state()
        self.source = store.mirror_source(self)
        self._subscribers: set[Subscription] = set()
        # Callers of wait_for, by the revision each waits for (a heap): a
        # commit wakes only those it satisfies, not every waiter (32 calls
        # in flight woke 32 tasks per commit under churn).
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_seq = itertools.count()
        self.synced = asyncio.Event()
        # When the newest revisions were committed (the start of their
        # policy implementation delay on the datapaths).
        self._commit_times: OrderedDict[int, float] = OrderedDict()

    # --- life cycle ---

    async def start(self) -> None:
        """Loads the snapshot (waiting for etcd) and starts following."""
        await retry(self.source.snapshot, what="reading the policy state", retry_on=(Unavailable,))
        self.tasks.spawn("policy-mirror", self.source.run())

    # --- the sink the store's source writes to ---

    def get(self, key: str) -> KeyValue | None:
        """The mirror keeps decoded state, not key-values."""
        return None

    def replace(self, records: Iterable[tuple[str, KeyValue, int]], revision: int) -> None:
        state = self.make_state()
        for _, kv, _ in records:
            state.put(kv)
        state.commit(revision)
        first = not self.synced.is_set()
        self.state = state
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
        self._wake()

    def commit(self, updates: Iterable[tuple[str, KeyValue | None, int]], revision: int) -> None:
        state = self.state
        for key, kv, rev in updates:
            if kv is None:
                state.delete(key, rev)
            else:
                state.put(kv)
        self._committed(revision)
        self._notify(state.commit(revision))
        self._wake()

    def advance(self, revision: int) -> None:
        if revision > self.state.revision:
            self._committed(revision)
            self._notify(self.state.commit(revision))
            self._wake()

    def _committed(self, revision: int) -> None:
        self._commit_times[revision] = time.time()
        while len(self._commit_times) > COMMIT_TIMES:
            self._commit_times.popitem(last=False)

    def commit_time(self, revision: int) -> float:
        """Unix time this mirror committed revision; 0 when it loaded it
        whole or it is too old to remember."""
        return self._commit_times.get(revision, 0.0)

    def set_live(self, live: bool, reason: str = "") -> None:
        """(Readiness follows etcd through the service's probe.)"""

    def services_changed(self) -> None:
        """The lb services changed: toServices rules follow their backends."""
        change = self.state.services_changed()
        if change:
            self._notify(change)
            self._wake()

    # --- fan-out and waiting ---

    def _notify(self, change: Change) -> None:
        for sub in list(self._subscribers):
            sub.push(change)

    def _wake(self) -> None:
        revision, waiters = self.state.revision, self._waiters
        while waiters and waiters[0][0] <= revision:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

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
        waiters = self._waiters
        if len(waiters) > WAITERS_PRUNED_AT:  # those that gave up, dropped
            self._waiters = waiters = [w for w in waiters if not w[2].done()]
            heapq.heapify(waiters)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(waiters, (revision, next(self._waiter_seq), fut))
        try:
            await asyncio.wait_for(fut, self.wait_timeout if timeout is None else timeout)
        except TimeoutError:
            raise Unavailable(
                f"this replica has not seen etcd revision {revision} yet (at "
                f"{self.state.revision}); retry"
            ) from None

    async def historic(self, revision: int) -> PolicyState:
        """The state as it was at an older revision, rebuilt from etcd's
        history. Raises Compacted or FutureRevision."""
        records, _ = await self.source.read(revision)
        state = self.make_state()
        for _, kv, _ in records:
            state.put(kv)
        state.commit(revision)
        return state
