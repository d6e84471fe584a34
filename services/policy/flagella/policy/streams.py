"""The watch streams (WatchIPCache, WatchPolicy): a snapshot or a resume
from a revision, then deltas and SYNCED marks, fed by the mirror."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from flagella.common.errors import Unavailable
from flagella.common.etcd import Compacted, FutureRevision
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.resolve import PolicyContent, ResolvedPolicy
from flagella.policy.settings import Settings
from flagella.policy.state import IPEntry, PolicyState

log = logging.getLogger(__name__)


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


class Streams:
    """The watch streams: the ipcache, and the resolved policies of a
    node's identities."""

    def __init__(self, mirror: Mirror, leases: NodeLeases, settings: Settings) -> None:
        self.mirror = mirror
        self.leases = leases
        self.settings = settings

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def _baseline(self, since: int) -> PolicyState | None:
        """The state a client resuming from since holds, or None when it
        must start over."""
        if since <= 0:
            return None
        if since > self.state.revision:
            # The client saw a newer revision elsewhere: give this replica a
            # moment to catch up. (If nothing of ours changed up to since,
            # it never will, and need not: the diff below is exact anyway.)
            with contextlib.suppress(Unavailable):
                await self.mirror.wait_for(since, timeout=1.0)
        try:
            return await self.mirror.historic(since)
        except (Compacted, FutureRevision):
            return None

    async def watch_ipcache(self, since: int) -> AsyncIterator[IPCacheEvent]:
        sub = self.mirror.subscribe()
        try:
            baseline = await self._baseline(since)
            state = self.state
            current = state.ipcache()
            revision = state.revision
            if baseline is None:
                yield IPCacheEvent(EventKind.RESET, revision)
                for prefix in sorted(current):
                    yield IPCacheEvent(EventKind.UPSERT, revision, prefix, current[prefix])
            else:
                old = baseline.ipcache()
                for event in _ip_diff(old, current, current.keys() | old.keys(), revision):
                    yield event
            yield IPCacheEvent(EventKind.SYNCED, revision)
            sent = current
            synced = revision
            synced_at = time.monotonic()
            heartbeat = self.settings.watch_heartbeat
            while True:
                change = await sub.next(heartbeat)
                state = self.state
                if change is None:
                    if state.revision > synced:
                        synced, synced_at = state.revision, time.monotonic()
                        yield IPCacheEvent(EventKind.SYNCED, synced)
                    continue
                candidates = set(change.ipcache)
                if change.full:
                    candidates |= sent.keys() | state.ipcache().keys()
                now = {p: state.ipcache_entry(p) for p in candidates}
                events = _ip_diff(
                    sent,
                    {p: e for p, e in now.items() if e is not None},
                    candidates,
                    state.revision,
                )
                for p, e in now.items():
                    if e is None:
                        sent.pop(p, None)
                    else:
                        sent[p] = e
                for event in events:
                    yield event
                if events or time.monotonic() - synced_at >= heartbeat:
                    synced, synced_at = state.revision, time.monotonic()
                    yield IPCacheEvent(EventKind.SYNCED, synced)
        finally:
            sub.close()

    async def watch_policy(self, node: str, since: int) -> AsyncIterator[PolicyEvent]:
        sub = self.mirror.subscribe()
        keeper = asyncio.create_task(self.leases.keep_alive(node), name=f"keepalive-{node}")
        try:
            baseline = await self._baseline(since)
            state = self.state
            current = state.node_policies(node)
            revision = state.revision
            if baseline is None:
                yield PolicyEvent(EventKind.RESET, revision)
                for ident in sorted(current):
                    yield _policy_upsert(ident, revision, current[ident])
            else:
                old = baseline.node_policies(node)
                for event in _policy_diff(old, current, old.keys() | current.keys(), revision):
                    yield event
            yield PolicyEvent(EventKind.SYNCED, revision)
            sent = current
            synced = revision
            synced_at = time.monotonic()
            heartbeat = self.settings.watch_heartbeat
            while True:
                change = await sub.next(heartbeat)
                state = self.state
                if change is None:
                    if state.revision > synced:
                        synced, synced_at = state.revision, time.monotonic()
                        yield PolicyEvent(EventKind.SYNCED, synced)
                    continue
                on_node = state.node_refs.get(node, {})
                if change.full:
                    candidates = set(sent) | set(on_node)
                else:
                    candidates = set(change.nodes.get(node, ()))
                    dirty = change.dirty
                    if len(dirty) <= len(sent) + len(on_node):
                        candidates |= {i for i in dirty if i in sent or i in on_node}
                    else:
                        candidates |= {i for i in (*sent, *on_node) if i in dirty}
                now: dict[int, PolicyContent] = {}
                for ident in candidates:
                    if ident in on_node:
                        content = state.resolver.content(ident)
                        if content is not None:
                            now[ident] = content
                events = _policy_diff(
                    {i: sent[i] for i in candidates if i in sent}, now, candidates, state.revision
                )
                for ident in candidates:
                    if ident in now:
                        sent[ident] = now[ident]
                    else:
                        sent.pop(ident, None)
                for event in events:
                    yield event
                # A SYNCED also after a change of the node's references with
                # nothing to send (a reference count went up): whoever waits
                # for the revision of an allocation sees it.
                if events or node in change.nodes or time.monotonic() - synced_at >= heartbeat:
                    synced, synced_at = state.revision, time.monotonic()
                    yield PolicyEvent(EventKind.SYNCED, synced)
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            sub.close()


def _ip_diff(
    old: dict[str, IPEntry], new: dict[str, IPEntry], candidates: Iterable[str], revision: int
) -> list[IPCacheEvent]:
    events = []
    for prefix in sorted(candidates):
        before, after = old.get(prefix), new.get(prefix)
        if after is None:
            if before is not None:
                events.append(IPCacheEvent(EventKind.DELETE, revision, prefix))
        elif after != before:
            events.append(IPCacheEvent(EventKind.UPSERT, revision, prefix, after))
    return events


def _policy_upsert(ident: int, revision: int, content: PolicyContent) -> PolicyEvent:
    return PolicyEvent(EventKind.UPSERT, revision, ident, ResolvedPolicy(ident, revision, content))


def _policy_diff(
    old: dict[int, PolicyContent],
    new: dict[int, PolicyContent],
    candidates: Iterable[int],
    revision: int,
) -> list[PolicyEvent]:
    events = []
    for ident in sorted(candidates):
        before, after = old.get(ident), new.get(ident)
        if after is None:
            if before is not None:
                events.append(PolicyEvent(EventKind.DELETE, revision, ident))
        elif before is None or (before is not after and before != after):
            events.append(_policy_upsert(ident, revision, after))
    return events
