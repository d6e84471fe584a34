"""The etcd leases a node's identity references and ipcache entries hang on
(the store layer: the service asks for "a lease for node N")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time

from flagella.common.errors import Unavailable
from flagella.policy.mirror import Mirror
from flagella.policy.settings import Settings
from flagella.policy.store import NodeLease, PolicyStore

log = logging.getLogger(__name__)


class NodeLeases:
    """The etcd leases a node's references and ipcache entries hang on.

    Each replica attaches new keys to its own current lease per node and
    takes a fresh one after keys_per_lease keys (etcd's cost per lease grows
    with its keys). Every lease of a node is recorded under
    nodes/<node>/<lease>, so whichever replica serves the node's WatchPolicy
    stream (or a call naming the node) keeps all of them alive: a replica
    dying loses nothing, and a node that shows no sign of life for the TTL
    loses its references."""

    def __init__(self, store: PolicyStore, mirror: Mirror, settings: Settings) -> None:
        self.store = store
        self.mirror = mirror
        self.ttl = settings.node_lease_ttl
        self.cap = settings.keys_per_lease
        self.replica = f"{socket.gethostname()}:{os.getpid()}"
        self._current: dict[str, NodeLease] = {}
        self._attached: dict[int, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._refreshed: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def current_leases(self) -> set[int]:
        return {lease.lease for lease in self._current.values()}

    def _alive(self, lease: NodeLease) -> bool:
        state = self.mirror.state
        if lease.record_revision > state.revision:
            return True  # granted after what the mirror has seen
        return lease.lease in state.node_leases.get(lease.node, {})

    async def lease_for(self, node: str) -> NodeLease:
        lease = self._current.get(node)
        if (
            lease is not None
            and self._attached.get(lease.lease, 0) < self.cap
            and self._alive(lease)
        ):
            return lease
        lock = self._locks.setdefault(node, asyncio.Lock())
        async with lock:
            lease = self._current.get(node)
            if (
                lease is not None
                and self._attached.get(lease.lease, 0) < self.cap
                and self._alive(lease)
            ):
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
        for lease in list(self.mirror.state.node_leases.get(node, {})):
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
        task = asyncio.create_task(self.refresh(node), name=f"refresh-{node}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def keep_alive(self, node: str) -> None:
        """While running (a WatchPolicy stream of node is open), keeps the
        node's leases alive."""
        while True:
            await self.refresh(node)
            await asyncio.sleep(max(self.ttl / 3, 0.5))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task
