"""The watch streams (WatchIPCache, WatchPolicy), served by the sync layer's
serve_watch; the servicer gives the messages (built once for every stream:
flagella.common.sync.MessageCache).

WatchIPCache: every stream has the same view, so every stream follows one
versioned table of it (Mirror.ipcache, the sync layer's Table): a change is
diffed once, in the mirror, whatever the number of streams, and no stream
keeps a copy of the ipcache.

WatchPolicy: the resolved policies of the identities one node references.
The mirror wakes a node's stream only for a change that may touch them
(Mirror.subscribe_node); the stream diffs what it sent (one content object
per identity, shared) against the state. A revision that touches nothing of
the node is still announced (SYNCED: a datapath waiting for it learns that
it has all of it), at once when the stream was quiet, and otherwise once
for all the revisions of the stream's quiet interval, which grows with the
number of streams (so that the replica sends at most --watch-quiet-sync-rate
such SYNCEDs a second): at 1,000 nodes, a SYNCED per revision per stream was
most of what policy did."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from flagella.common.errors import Unavailable
from flagella.common.etcd import Compacted, FutureRevision
from flagella.common.sync import (
    Batch,
    Batching,
    Change,
    Feed,
    Subscription,
    WatchMessages,
    serve_watch,
)
from flagella.common.tasks import TaskGroup
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.resolve import PolicyContent
from flagella.policy.settings import Settings
from flagella.policy.state import CIDR_POLICY_SOURCE, IPEntry, PolicyState
from flagella.policy.state import Change as StateChange

K = TypeVar("K", str, int)
R = TypeVar("R")
M = TypeVar("M")


class EventKind:
    RESET = "reset"
    UPSERT = "upsert"
    DELETE = "delete"
    SYNCED = "synced"


class WatchCounters:
    """How many watch messages of each stream were built (once each, for
    every stream that sends them): a test and an operator can tell that a
    change is encoded once, not once per stream."""

    def __init__(self) -> None:
        self.built: dict[str, int] = {"ipcache": 0, "policy": 0}


# The least time between two SYNCEDs of a WatchPolicy stream for revisions
# that touched nothing of its node (a revision that touches it is sent at
# once): the rate across streams (--watch-quiet-sync-rate) lengthens it.
MIN_QUIET_INTERVAL = 0.02


def _differs(before: R | None, after: R, *, resumed: bool = False) -> bool:
    if (
        resumed
        and isinstance(after, PolicyContent)
        and (after.ipblock_rules or after.service_rules)
    ):
        # The baseline is rebuilt with this replica's --k8s-ipblock-mode
        # (which decides these policies); the client may hold what a replica
        # of the other mode sent. Likewise toServices backends: the baseline
        # has today's, not the ones the client got.
        return True
    # Resolved contents are shared objects: identity first, then equality.
    return before is None or (before is not after and before != after)


class IPCacheFeed:
    """WatchIPCache's Feed (flagella.common.sync.serve): the mirror's
    ipcache table, shared by every stream."""

    def __init__(self, mirror: Mirror, since: int) -> None:
        self.mirror = mirror
        self.sub: Subscription[str, IPEntry] = mirror.ipcache.subscribe(since)
        self.revision = -1  # nothing sent yet

    def close(self) -> None:
        """(A table subscription holds nothing in the table.)"""

    def _with_cidr_entries(self, batch: Batch[str, IPEntry]) -> Batch[str, IPEntry]:
        """A resume's changes and every CIDR-policy entry: this replica's
        --k8s-ipblock-mode decides which prefixes are CIDR identities, and the
        client may hold what a replica of the other mode sent. (CIDR entries
        it holds that this mode lacks stay until it restarts: they name
        identities no policy selects, fail-closed.)"""
        table = self.mirror.ipcache
        named = {c.key for c in batch.changes}
        extra = []
        for prefix in self.mirror.state.cidr_prefixes():
            entry = table.get(prefix)
            if prefix not in named and entry is not None and entry.source == CIDR_POLICY_SOURCE:
                extra.append(Change(prefix, entry, None, table.revision_of(prefix)))
        if not extra:
            return batch
        changes = sorted((*batch.changes, *extra), key=lambda c: c.revision)
        return Batch(batch.revision, tuple(changes))

    async def next(self, timeout: float | None = None) -> Batch[str, IPEntry] | None:
        if self.revision < 0:
            batch = await self.sub.next(None)
            assert batch is not None
            if self.sub.resumed:
                batch = self._with_cidr_entries(batch)
            self.revision = batch.revision
            return batch
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            batch = await self.sub.next(left)
            if batch is None:
                # Idle: a SYNCED heartbeat, at the newest revision (the table
                # is in step with the state; its own revision moves only
                # with the ipcache).
                revision = self.mirror.state.revision
                if revision > self.revision:
                    self.revision = revision
                    return Batch(revision, ())
                return None
            if batch.changes or batch.snapshot:
                self.revision = max(self.revision, batch.revision)
                return batch
            # The table only advanced (for a stream resuming): nothing to say.


class NodePolicyFeed:
    """WatchPolicy's Feed: the resolved policies of the identities the node
    references; what the client holds (sent), and the changes since."""

    def __init__(self, mirror: Mirror, node: str, since: int, *, quiet_sync_rate: float) -> None:
        self.mirror = mirror
        self.node = node
        self.since = since
        self.quiet_sync_rate = quiet_sync_rate
        self.sub = mirror.subscribe_node(node)
        self.sent: dict[int, PolicyContent] | None = None
        self.revision = 0
        # Loop time before which a revision touching nothing of the node is
        # not announced (it waits for the next SYNCED).
        self._quiet_until = 0.0

    def close(self) -> None:
        self.sub.close()

    def _all(self, state: PolicyState) -> dict[int, PolicyContent]:
        return state.node_policies(self.node)

    def _value(self, state: PolicyState, key: int) -> PolicyContent | None:
        if key not in state.node_refs.get(self.node, {}):
            return None
        return state.resolver.content(key)

    def _candidates(
        self, state: PolicyState, change: StateChange, sent: dict[int, PolicyContent]
    ) -> set[int]:
        """The identities whose policy, as this node holds it, may differ."""
        on_node = state.node_refs.get(self.node, {})
        if change.full:
            return set(sent) | set(on_node)
        candidates = set(change.nodes.get(self.node, ()))
        dirty = change.dirty
        if len(dirty) <= len(sent) + len(on_node):
            candidates |= {i for i in dirty if i in sent or i in on_node}
        else:
            candidates |= {i for i in (*sent, *on_node) if i in dirty}
        return candidates

    def _quiet_interval(self) -> float:
        """Seconds until this stream announces untouched revisions again."""
        streams = self.mirror.node_stream_count
        return max(MIN_QUIET_INTERVAL, streams / self.quiet_sync_rate)

    async def _baseline(self) -> PolicyState | None:
        """The state a client resuming from since holds, or None when it
        must start over."""
        since = self.since
        if since <= 0:
            return None
        if since > self.mirror.state.revision:
            # The client saw a newer revision elsewhere: give this replica a
            # moment to catch up. (If nothing of ours changed up to since,
            # it never will, and need not: the diff below is exact anyway.)
            with contextlib.suppress(Unavailable):
                await self.mirror.wait_for(since, timeout=1.0)
        try:
            return await self.mirror.historic(since)
        except (Compacted, FutureRevision):
            return None

    def _diff(
        self,
        before: dict[int, PolicyContent],
        keys: set[int],
        state: PolicyState,
        revision: int,
        *,
        resumed: bool = False,
    ) -> list[Change[int, PolicyContent]]:
        changes = []
        for key in sorted(keys):
            old, new = before.get(key), self._value(state, key)
            if new is None:
                if old is not None:
                    changes.append(Change(key, None, old, revision))
            elif _differs(old, new, resumed=resumed):
                changes.append(Change(key, new, old, revision))
        return changes

    async def _first(self) -> Batch[int, PolicyContent]:
        baseline = await self._baseline()
        state = self.mirror.state
        current = self._all(state)
        self.sent, self.revision = dict(current), state.revision
        if baseline is None:
            return Batch(
                state.revision,
                tuple(Change(k, current[k], None, state.revision) for k in sorted(current)),
                snapshot=True,
            )
        old = self._all(baseline)
        keys = old.keys() | current.keys()
        return Batch(
            state.revision, tuple(self._diff(old, keys, state, state.revision, resumed=True))
        )

    async def next(self, timeout: float | None = None) -> Batch[int, PolicyContent] | None:
        if self.sent is None:
            return await self._first()
        sent = self.sent
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            now = loop.time()
            state = self.mirror.state
            if state.revision > self.revision and now >= self._quiet_until and not self.sub.pending:
                # Revisions that touched nothing of the node: one SYNCED
                # for all of them.
                self.revision = state.revision
                self._quiet_until = now + self._quiet_interval()
                return Batch(state.revision, ())
            wait = None if deadline is None else max(deadline - now, 0.0)
            if now < self._quiet_until:
                hold = self._quiet_until - now
                wait = hold if wait is None else min(wait, hold)
            else:
                self.sub.wake_on_revision()
            change = await self.sub.next(wait)
            if change is None:
                if deadline is not None and loop.time() >= deadline:
                    return None  # idle for a heartbeat: serve_watch says SYNCED
                continue  # the quiet time ended: look at the revision again
            if not change:
                continue  # a revision, nothing of the node's
            state = self.mirror.state
            # The change's own revision for the policies it sends: every
            # node it touched sends the same message (built once).
            changes = self._diff(
                sent, self._candidates(state, change, sent), state, change.revision
            )
            for c in changes:
                if c.record is None:
                    sent.pop(c.key, None)
                else:
                    sent[c.key] = c.record
            # Even with nothing to send (a second reference): a datapath
            # waiting for this revision (WaitForPolicy) learns at once that
            # it has all of it.
            self.revision = state.revision
            return Batch(state.revision, tuple(changes))


class Streams:
    """The watch streams: the ipcache, and the resolved policies of a
    node's identities. Both end each batch with SYNCED and answer a resume
    with the changes alone (no SYNCED at since first)."""

    def __init__(self, mirror: Mirror, leases: NodeLeases, settings: Settings) -> None:
        self.mirror = mirror
        self.leases = leases
        self.settings = settings

    def watch_ipcache(
        self,
        since: int,
        messages: WatchMessages[str, IPEntry, M],
        batching: Batching[M] | None = None,
    ) -> AsyncIterator[M]:
        return self._serve(IPCacheFeed(self.mirror, since), messages, since, batching)

    async def watch_policy(
        self, node: str, since: int, messages: WatchMessages[int, PolicyContent, M]
    ) -> AsyncIterator[M]:
        feed = NodePolicyFeed(
            self.mirror, node, since, quiet_sync_rate=self.settings.watch_quiet_sync_rate
        )
        try:
            # While the stream is open the node's leases stay alive.
            async with TaskGroup(f"watch-policy {node}") as tasks:
                tasks.spawn(f"keepalive-{node}", self.leases.keep_alive(node))
                async for event in self._serve(feed, messages, since):
                    yield event
        finally:
            feed.close()

    def _serve(
        self,
        feed: Feed[K, R],
        messages: WatchMessages[K, R, M],
        since: int,
        batching: Batching[M] | None = None,
    ) -> AsyncIterator[M]:
        return serve_watch(
            feed,
            messages,
            since=since,
            heartbeat=self.settings.watch_heartbeat,
            sync_batches=True,
            acknowledge_resume=False,
            batching=batching,
        )
