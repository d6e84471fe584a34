"""Garbage collection of unused identities and idle node leases."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random

from flagella.common.errors import Unavailable
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.settings import Settings
from flagella.policy.state import PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)


class GarbageCollector:
    """Frees identities no node references and revokes node leases that
    hold nothing, each only once it was seen so in two rounds."""

    def __init__(
        self, store: PolicyStore, mirror: Mirror, leases: NodeLeases, settings: Settings
    ) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases
        self.settings = settings
        self._gc_marks: dict[int, int] = {}
        self._lease_marks: set[int] = set()
        self._gc_task: asyncio.Task[None] | None = None

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    def start(self) -> None:
        self._gc_task = asyncio.create_task(self._gc_loop(), name="policy-gc")

    async def stop(self) -> None:
        if self._gc_task is not None:
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gc_interval * random.uniform(0.9, 1.1))
            try:
                await self.collect_garbage()
            except Unavailable as exc:
                log.warning("garbage collection failed", extra={"reason": exc.message})

    async def collect_garbage(self) -> tuple[int, int]:
        """One round: frees identities no node referenced in this round and
        the last, and revokes node leases that held nothing but their
        record in both. Returns (identities freed, leases revoked)."""
        state = self.state
        freed = 0
        marks: dict[int, int] = {}
        for gid in state.unreferenced_identities():
            marks[gid.id] = gid.mod_revision
            if self._gc_marks.get(gid.id) != gid.mod_revision:
                continue
            index = state.labels_index.get(gid.label_string)
            if index is None or index[0] != gid.id:
                continue
            if await self.store.delete_identity(
                gid.id, gid.label_string, id_revision=gid.mod_revision, labels_revision=index[1]
            ):
                freed += 1
                log.info(
                    "identity garbage-collected",
                    extra={"identity": gid.id, "labels": gid.label_string},
                )
        self._gc_marks = marks
        revoked = 0
        mine = self.leases.current_leases()
        empty = {
            lease
            for leases in state.node_leases.values()
            for lease in leases
            if state.lease_keys.get(lease, 0) <= 1 and lease not in mine
        }
        for lease in empty & self._lease_marks:
            await self.store.revoke(lease)
            revoked += 1
        self._lease_marks = empty - self._lease_marks
        return freed, revoked
