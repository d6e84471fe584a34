"""The etcd leases a node's identity references and ipcache entries hang on.

Part of the store layer: the service asks for "a lease for node N" and
hands the NodeLease it gets to the store's writes; only this module and
flagella.policy.store handle etcd lease ids."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import Protocol

from flagella.common.errors import Unavailable
from flagella.common.tasks import TaskGroup
from flagella.policy.outcomes import NodeLease
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)


class LeaseView(Protocol):
    """What the leases read of a replica's mirror of etcd
    (flagella.policy.state.PolicyState)."""

    @property
    def revision(self) -> int: ...

    @property
    def node_leases(self) -> Mapping[str, Mapping[int, int]]:
        """node -> lease -> mod revision of its record."""

    @property
    def lease_keys(self) -> Mapping[int, int]:
        """lease -> mirrored keys attached to it (its record among them)."""


class NodeLeases:
    """The etcd leases a node's references and ipcache entries hang on.

    Each replica attaches new keys to its own current lease per node and
    takes a fresh one after keys_per_lease keys (etcd's cost per lease grows
    with its keys). Every lease of a node is recorded under
    nodes/<node>/<lease>, so whichever replica serves the node's WatchPolicy
    stream (or a call naming the node) keeps all of them alive: a replica
    dying loses nothing, and a node that shows no sign of life for the TTL
    loses its references."""

    def __init__(
        self,
        store: PolicyStore,
        view: Callable[[], LeaseView],
        tasks: TaskGroup,
        *,
        ttl: int,
        keys_per_lease: int,
    ) -> None:
        self.store = store
        self.view = view
        self.tasks = tasks
        self.ttl = ttl
        self.cap = keys_per_lease
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self._current: dict[str, NodeLease] = {}
        self._attached: dict[int, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refreshed: dict[str, float] = {}
        self._idle_marks: set[int] = set()

    def _alive(self, lease: NodeLease) -> bool:
        state = self.view()
        if lease.record_revision > state.revision:
            return True  # granted after what the mirror has seen
        return lease.lease in state.node_leases.get(lease.node, {})

    def _usable(self, node: str) -> NodeLease | None:
        """The node's current lease, if alive and not full."""
        lease = self._current.get(node)
        if (
            lease is not None
            and self._attached.get(lease.lease, 0) < self.cap
            and self._alive(lease)
        ):
            return lease
        return None

    async def lease_for(self, node: str) -> NodeLease:
        lease = self._usable(node)
        if lease is not None:
            return lease
        lock = self._locks.setdefault(node, asyncio.Lock())
        async with lock:
            lease = self._usable(node)
            if lease is not None:
                return lease
            lease = await self.store.grant_node_lease(node, self.ttl, self.replica)
            self._current[node] = lease
            self._attached[lease.lease] = 1
            self._refreshed[node] = time.monotonic()
            log.info("node lease granted", extra={"node": node, "lease": f"{lease.lease:x}"})
            return lease

    def attached(self, lease: NodeLease) -> None:
        self._attached[lease.lease] = self._attached.get(lease.lease, 0) + 1

    def lost(self, lease: NodeLease) -> None:
        if self._current.get(lease.node) == lease:
            del self._current[lease.node]
        self._attached.pop(lease.lease, None)

    async def refresh(self, node: str) -> None:
        """Keeps every lease of node alive for another TTL."""
        self._refreshed[node] = time.monotonic()
        for lease in list(self.view().node_leases.get(node, {})):
            try:
                await self.store.keepalive(lease)
            except Unavailable as exc:
                log.warning(
                    "node lease keep-alive failed", extra={"node": node, "reason": exc.message}
                )
                return

    def touch(self, node: str) -> None:
        """A sign of life from node: refresh its leases if this replica has
        not for a third of the TTL (in the background)."""
        if time.monotonic() - self._refreshed.get(node, 0.0) < self.ttl / 3:
            return
        self._refreshed[node] = time.monotonic()
        self.tasks.spawn(f"refresh-{node}", self.refresh(node))

    async def keep_alive(self, node: str) -> None:
        """While running (a WatchPolicy stream of node is open), keeps the
        node's leases alive."""
        while True:
            await self.refresh(node)
            await asyncio.sleep(max(self.ttl / 3, 0.5))

    async def revoke_idle(self) -> int:
        """One round of lease garbage collection: revokes the leases that
        held nothing but their record in this round and the last (except
        this replica's current ones, which new keys may be joining).
        Returns how many."""
        state = self.view()
        mine = {lease.lease for lease in self._current.values()}
        idle = {
            lease
            for leases in state.node_leases.values()
            for lease in leases
            if state.lease_keys.get(lease, 0) <= 1 and lease not in mine
        }
        revoked = 0
        for lease in idle & self._idle_marks:
            await self.store.revoke(lease)
            revoked += 1
        self._idle_marks = idle - self._idle_marks
        return revoked
