"""Garbage collection of unused identities and idle node leases."""

from __future__ import annotations

import asyncio
import logging
import random

from flagella.common.errors import Unavailable
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.state import PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)


class GarbageCollector:
    """Frees identities no node references and revokes node leases that
    hold nothing, each only once it was seen so in two rounds."""

    def __init__(
        self, store: PolicyStore, mirror: Mirror, leases: NodeLeases, *, interval: float
    ) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases
        self.interval = interval
        # Identities seen unreferenced last round: id -> mod revision then.
        self._unreferenced: dict[int, int] = {}

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def run(self) -> None:
        """A round every interval, until cancelled (jittered, so that
        replicas started together spread their rounds)."""
        while True:
            await asyncio.sleep(self.interval * random.uniform(0.9, 1.1))
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
            if self._unreferenced.get(gid.id) != gid.mod_revision:
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
        self._unreferenced = marks
        return freed, await self.leases.revoke_idle()
