"""Keeps a replica's PolicyState in step with etcd: the mirror is the sink
of the store's EtcdSource (flagella.common.sync), which reads the mirrored
keys at one revision and then watches them; each etcd response is applied
and committed whole. It fans changes out to the watch streams and lets
writers wait until their write is visible locally."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from flagella.common.backoff import retry
from flagella.common.errors import Unavailable
from flagella.common.etcd import Compacted, FutureRevision, KeyValue
from flagella.common.sync import WATCH_LOG_SIZE, Table
from flagella.common.tasks import TaskGroup
from flagella.policy.state import Change, IPEntry, PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)

# Commit times remembered: far more revisions than a stream lags behind.
COMMIT_TIMES = 1024
# Waiters kept before those that timed out are dropped from the heap.
WAITERS_PRUNED_AT = 1024


class Subscription:
    """Changes committed since one watch stream last took them. Pushing is
    O(1) (the change objects are shared by every subscriber); they are
    merged when taken. The mirror pushes a stream only the changes it
    follows (Mirror.subscribe, subscribe_node, subscribe_host): a change
    that touches nothing of a node wakes none of that node's streams.
    wake_on_revision asks for one wake at the next commit of any kind,
    with nothing pushed (how a stream learns of revisions that touch
    nothing of it, when it wants to)."""

    MAX_PENDING = 256

    def __init__(self, mirror: Mirror, node: str | None = None, *, host: bool = False) -> None:
        self._mirror = mirror
        self.node = node
        self.host = host
        self._pending: list[Change] = []
        self._event = asyncio.Event()

    @property
    def pending(self) -> bool:
        """Whether changes wait to be taken."""
        return bool(self._pending)

    def push(self, change: Change) -> None:
        self._pending.append(change)
        if len(self._pending) > self.MAX_PENDING:
            self._pending = [self._merged()]
        self._event.set()

    def wake(self) -> None:
        self._event.set()

    def wake_on_revision(self) -> None:
        self._mirror._revision_waiters.add(self)

    def _merged(self) -> Change:
        merged = Change()
        for change in self._pending:
            merged.merge(change)
        return merged

    async def next(self, timeout: float | None) -> Change | None:
        """What changed since the last call (empty, bool False, when only
        woken by a revision), or None after timeout seconds of nothing."""
        if not self._event.is_set():
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                return None
        self._event.clear()
        change = self._merged()
        self._pending = []
        return change

    def close(self) -> None:
        self._mirror._unsubscribe(self)


StateFactory = Callable[[], PolicyState]


class Mirror:
    def __init__(
        self,
        store: PolicyStore,
        make_state: StateFactory,
        *,
        tasks: TaskGroup,
        wait_timeout: float = 10.0,
        watch_history: int = WATCH_LOG_SIZE,
    ) -> None:
        self.make_state = make_state
        self.wait_timeout = wait_timeout
        # The owner's (the service's) task group: it stops the source.
        self.tasks = tasks
        self.state = make_state()
        self.source = store.mirror_source(self)
        # Streams following every change, a node's changes, host changes,
        # and those to wake once at the next commit.
        self._subscribers: set[Subscription] = set()
        self._node_subscribers: dict[str, set[Subscription]] = {}
        self._host_subscribers: set[Subscription] = set()
        self._revision_waiters: set[Subscription] = set()
        self._node_stream_count = 0
        # Counts the changes that may touch a node's host policy.
        self.host_epoch = 0
        # The ipcache as the datapaths load it (PolicyState.ipcache), kept
        # in step with the state at every commit: one versioned table every
        # WatchIPCache stream follows (instead of each diffing its own copy).
        # Its revision moves only with ipcache changes (and for a stream
        # resuming from a later revision: confirm).
        self.ipcache: Table[str, IPEntry] = Table("policy-ipcache", log_size=watch_history)
        self.ipcache.history = self._ipcache_at
        self.ipcache.confirm = self._ipcache_confirm
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
        # (unchanged entries are not logged: the table diffs)
        self.ipcache.replace(((p, e, revision) for p, e in state.ipcache().items()), revision)
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

    def _commit_ipcache(self, change: Change) -> None:
        """The ipcache table follows the state's committed change (at the
        commit's revision: what a stream's events carry)."""
        if not change.ipcache:
            return
        state = self.state
        self.ipcache.commit(
            [(p, state.ipcache_entry(p), change.revision) for p in sorted(change.ipcache)],
            change.revision,
        )

    async def _ipcache_at(self, revision: int) -> dict[str, tuple[IPEntry, int]] | None:
        """The ipcache at an older revision (a stream resuming from before
        the table's log), from etcd's history."""
        try:
            state = await self.historic(revision)
        except (Compacted, FutureRevision):
            return None
        return {p: (e, revision) for p, e in state.ipcache().items()}

    async def _ipcache_confirm(self, revision: int) -> None:
        """A stream resumes from a revision past the table's (which moves
        only with ipcache changes): once the state has it, so has the table."""
        with contextlib.suppress(Unavailable):
            await self.wait_for(revision, timeout=1.0)
        if self.state.revision > self.ipcache.revision:
            self.ipcache.advance(self.state.revision)

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
        self._commit_ipcache(change)
        for sub in self._subscribers:
            sub.push(change)
        if change.full:
            for subs in self._node_subscribers.values():
                for sub in subs:
                    sub.push(change)
        elif self._node_subscribers:
            for node in self._touched_nodes(change):
                for sub in self._node_subscribers.get(node, ()):
                    sub.push(change)
        if change.full or change.host:
            self.host_epoch += 1
            for sub in self._host_subscribers:
                sub.push(change)
        waiters, self._revision_waiters = self._revision_waiters, set()
        for sub in waiters:
            sub.wake()

    def _touched_nodes(self, change: Change) -> set[str]:
        """The nodes whose resolved policies the change may touch: those
        whose references changed, and those referencing an identity whose
        policy may have changed. (A node that stopped referencing one is in
        the first: its reference changed in this change or an earlier one.)"""
        subscribed = self._node_subscribers
        nodes = {n for n in change.nodes if n in subscribed}
        refs_by_id = self.state.refs_by_id
        for ident in change.dirty:
            by_node = refs_by_id.get(ident)
            if by_node:
                nodes.update(n for n in by_node if n in subscribed)
        return nodes

    def _wake(self) -> None:
        revision, waiters = self.state.revision, self._waiters
        while waiters and waiters[0][0] <= revision:
            fut = heapq.heappop(waiters)[2]
            if not fut.done():
                fut.set_result(None)

    def subscribe(self) -> Subscription:
        """Every change."""
        sub = Subscription(self)
        self._subscribers.add(sub)
        return sub

    def subscribe_node(self, node: str) -> Subscription:
        """The changes that may touch the node's resolved policies."""
        sub = Subscription(self, node)
        self._node_subscribers.setdefault(node, set()).add(sub)
        self._node_stream_count += 1
        return sub

    def subscribe_host(self) -> Subscription:
        """The changes that may touch a node's host policy."""
        sub = Subscription(self, host=True)
        self._host_subscribers.add(sub)
        return sub

    def _unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        self._host_subscribers.discard(sub)
        self._revision_waiters.discard(sub)
        if sub.node is not None:
            subs = self._node_subscribers.get(sub.node)
            if subs is not None and sub in subs:
                subs.discard(sub)
                self._node_stream_count -= 1
                if not subs:
                    del self._node_subscribers[sub.node]

    @property
    def node_stream_count(self) -> int:
        """The node subscriptions open (WatchPolicy streams)."""
        return self._node_stream_count

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
