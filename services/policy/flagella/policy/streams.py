"""The watch streams (WatchIPCache, WatchPolicy), served by the sync layer's
serve_watch: each stream follows a view derived from the mirror (the
ipcache, or the resolved policies of one node's identities) through a
ViewFeed, which remembers what it sent and turns each committed change of
the mirror into the changes of the view."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from flagella.common.errors import Unavailable
from flagella.common.etcd import Compacted, FutureRevision
from flagella.common.sync import Batch, Change, WatchMessages, serve_watch
from flagella.common.tasks import TaskGroup
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.resolve import PolicyContent, ResolvedPolicy
from flagella.policy.settings import Settings
from flagella.policy.state import CIDR_POLICY_SOURCE, IPEntry, PolicyState
from flagella.policy.state import Change as StateChange

log = logging.getLogger(__name__)

# Prefixes or identities: sortable, for a stable order of events.
K = TypeVar("K", str, int)
V = TypeVar("V")
M = TypeVar("M")


class EventKind:
    RESET = "reset"
    UPSERT = "upsert"
    DELETE = "delete"
    SYNCED = "synced"


@dataclass(frozen=True, slots=True)
class IPCacheEvent:
    kind: str
    revision: int
    prefix: str = ""
    entry: IPEntry | None = None


@dataclass(frozen=True, slots=True)
class PolicyEvent:
    kind: str
    revision: int
    identity: int = 0
    policy: ResolvedPolicy | None = None
    # Unix time the mirror committed the revision (0: unknown).
    revision_time: float = 0.0


class View(Protocol[K, V]):
    """A view of the policy state one stream follows."""

    def all(self, state: PolicyState) -> dict[K, V]: ...

    def candidates(self, state: PolicyState, change: StateChange, sent: dict[K, V]) -> set[K]:
        """The keys whose value may differ after change."""

    def value(self, state: PolicyState, key: K) -> V | None: ...

    def must_sync(self, change: StateChange) -> bool:
        """Whether a change with nothing to send still ends in SYNCED (so
        that a client waiting for its revision sees it)."""


class IPCacheView:
    def all(self, state: PolicyState) -> dict[str, IPEntry]:
        return state.ipcache()

    def candidates(
        self, state: PolicyState, change: StateChange, sent: dict[str, IPEntry]
    ) -> set[str]:
        if change.full:
            return set(change.ipcache) | sent.keys() | state.ipcache().keys()
        return set(change.ipcache)

    def value(self, state: PolicyState, key: str) -> IPEntry | None:
        return state.ipcache_entry(key)

    def must_sync(self, change: StateChange) -> bool:
        return False


class NodePolicyView:
    """The resolved policies of the identities the node references."""

    def __init__(self, node: str) -> None:
        self.node = node

    def all(self, state: PolicyState) -> dict[int, PolicyContent]:
        return state.node_policies(self.node)

    def candidates(
        self, state: PolicyState, change: StateChange, sent: dict[int, PolicyContent]
    ) -> set[int]:
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

    def value(self, state: PolicyState, key: int) -> PolicyContent | None:
        if key not in state.node_refs.get(self.node, {}):
            return None
        return state.resolver.content(key)

    def must_sync(self, change: StateChange) -> bool:
        # Every revision ends in SYNCED, even one that changes nothing on
        # this node (another node's references, an ipcache write, a rule
        # selecting no local identity): a datapath waiting for a revision
        # (WaitForPolicy: the endpoint service's, a CLI's, a test's) learns
        # at once that it has all of it, not at the next heartbeat. One
        # small message per batch (changes that come faster than the stream
        # sends are merged).
        return True


def _differs(before: V | None, after: V, *, resumed: bool = False) -> bool:
    if resumed and (
        (isinstance(after, PolicyContent) and (after.ipblock_rules or after.service_rules))
        or (isinstance(after, IPEntry) and after.source == CIDR_POLICY_SOURCE)
    ):
        # The baseline is rebuilt with this replica's --k8s-ipblock-mode
        # (which decides these policies and which prefixes are CIDR
        # identities); the client may hold what a replica of the other mode
        # sent. (CIDR entries it holds that this mode lacks stay until it
        # restarts: they name identities no policy selects, fail-closed.)
        # Likewise toServices backends: the baseline has today's, not the
        # ones the client got.
        return True
    # Resolved contents are shared objects: identity first, then equality.
    return before is None or (before is not after and before != after)


class ViewFeed(Generic[K, V]):
    """A Feed (flagella.common.sync.serve) of one stream's view: what the
    client holds (sent), and the changes of the view since."""

    def __init__(self, mirror: Mirror, view: View[K, V], since: int) -> None:
        self.mirror = mirror
        self.view: View[K, V] = view
        self.since = since
        self.sub = mirror.subscribe()
        self.sent: dict[K, V] | None = None
        self.revision = 0

    def close(self) -> None:
        self.sub.close()

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
        self, before: dict[K, V], keys: set[K], state: PolicyState, *, resumed: bool = False
    ) -> list[Change[K, V]]:
        changes = []
        for key in sorted(keys):
            old, new = before.get(key), self.view.value(state, key)
            if new is None:
                if old is not None:
                    changes.append(Change(key, None, old, state.revision))
            elif _differs(old, new, resumed=resumed):
                changes.append(Change(key, new, old, state.revision))
        return changes

    async def _first(self) -> Batch[K, V]:
        baseline = await self._baseline()
        state = self.mirror.state
        current = self.view.all(state)
        self.sent, self.revision = dict(current), state.revision
        if baseline is None:
            return Batch(
                state.revision,
                tuple(Change(k, current[k], None, state.revision) for k in sorted(current)),
                snapshot=True,
            )
        old = self.view.all(baseline)
        keys = old.keys() | current.keys()
        return Batch(state.revision, tuple(self._diff(old, keys, state, resumed=True)))

    async def next(self, timeout: float | None = None) -> Batch[K, V] | None:
        if self.sent is None:
            return await self._first()
        sent = self.sent
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            left = None if deadline is None else max(deadline - loop.time(), 0.0)
            change = await self.sub.next(left)
            state = self.mirror.state
            if change is None:
                # Idle: a SYNCED heartbeat, at the newest revision.
                if state.revision > self.revision:
                    self.revision = state.revision
                    return Batch(state.revision, ())
                return None
            changes = self._diff(sent, self.view.candidates(state, change, sent), state)
            for c in changes:
                if c.record is None:
                    sent.pop(c.key, None)
                else:
                    sent[c.key] = c.record
            if changes or self.view.must_sync(change):
                self.revision = state.revision
                return Batch(state.revision, tuple(changes))


class IPCacheMessages:
    def reset(self, revision: int) -> IPCacheEvent:
        return IPCacheEvent(EventKind.RESET, revision)

    async def upsert(self, change: Change[str, IPEntry]) -> IPCacheEvent:
        return IPCacheEvent(EventKind.UPSERT, change.revision, change.key, change.record)

    async def delete(self, change: Change[str, IPEntry]) -> IPCacheEvent:
        return IPCacheEvent(EventKind.DELETE, change.revision, change.key)

    def synced(self, revision: int) -> IPCacheEvent:
        return IPCacheEvent(EventKind.SYNCED, revision)


class PolicyMessages:
    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def reset(self, revision: int) -> PolicyEvent:
        return PolicyEvent(EventKind.RESET, revision)

    async def upsert(self, change: Change[int, PolicyContent]) -> PolicyEvent:
        assert change.record is not None
        policy = ResolvedPolicy(change.key, change.revision, change.record)
        return PolicyEvent(
            EventKind.UPSERT,
            change.revision,
            change.key,
            policy,
            self.mirror.commit_time(change.revision),
        )

    async def delete(self, change: Change[int, PolicyContent]) -> PolicyEvent:
        return PolicyEvent(EventKind.DELETE, change.revision, change.key)

    def synced(self, revision: int) -> PolicyEvent:
        return PolicyEvent(EventKind.SYNCED, revision)


class Streams:
    """The watch streams: the ipcache, and the resolved policies of a
    node's identities. Both end each batch with SYNCED and answer a resume
    with the changes alone (no SYNCED at since first)."""

    def __init__(self, mirror: Mirror, leases: NodeLeases, settings: Settings) -> None:
        self.mirror = mirror
        self.leases = leases
        self.settings = settings

    def watch_ipcache(self, since: int) -> AsyncIterator[IPCacheEvent]:
        return self._serve(ViewFeed(self.mirror, IPCacheView(), since), IPCacheMessages(), since)

    async def watch_policy(self, node: str, since: int) -> AsyncIterator[PolicyEvent]:
        feed = ViewFeed(self.mirror, NodePolicyView(node), since)
        # While the stream is open the node's leases stay alive.
        async with TaskGroup(f"watch-policy {node}") as tasks:
            tasks.spawn(f"keepalive-{node}", self.leases.keep_alive(node))
            async for event in self._serve(feed, PolicyMessages(self.mirror), since):
                yield event

    async def _serve(
        self, feed: ViewFeed[K, V], messages: WatchMessages[K, V, M], since: int
    ) -> AsyncIterator[M]:
        try:
            async for event in serve_watch(
                feed,
                messages,
                since=since,
                heartbeat=self.settings.watch_heartbeat,
                sync_batches=True,
                acknowledge_resume=False,
            ):
                yield event
        finally:
            feed.close()
