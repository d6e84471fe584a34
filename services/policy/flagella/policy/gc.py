"""Garbage collection of unused identities and idle node leases."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from flagella.common.errors import Unavailable
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.state import GlobalIdentity, PolicyState
from flagella.policy.store import PolicyStore

log = logging.getLogger(__name__)

#: Identity deletes a GC round has in flight at once.
DELETES_IN_FLIGHT = 16


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
        # For the metrics: rounds run, the last one's seconds, ids freed.
        self.runs = 0
        self.last_duration = 0.0
        self.freed_total = 0

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
        started = time.perf_counter()
        state = self.state
        marks: dict[int, int] = {}
        due: list[tuple[GlobalIdentity, int]] = []
        for gid in state.unreferenced_identities():
            marks[gid.id] = gid.mod_revision
            if self._unreferenced.get(gid.id) != gid.mod_revision:
                continue
            index = state.labels_index.get(gid.label_string)
            if index is None or index[0] != gid.id:
                continue
            due.append((gid, index[1]))
        # Several deletes in flight: under churn a round has thousands, and
        # one round trip each in turn is what made GC fall behind.
        slots = asyncio.Semaphore(DELETES_IN_FLIGHT)

        async def delete(gid: GlobalIdentity, labels_revision: int) -> bool:
            async with slots:
                deleted = await self.store.delete_identity(
                    gid.id,
                    gid.label_string,
                    id_revision=gid.mod_revision,
                    labels_revision=labels_revision,
                )
            if deleted:
                log.info(
                    "identity garbage-collected",
                    extra={"identity": gid.id, "labels": gid.label_string},
                )
            return deleted

        outcomes = await asyncio.gather(
            *(delete(gid, rev) for gid, rev in due), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome  # (etcd unavailable: the round ends, as before)
        freed = sum(1 for outcome in outcomes if outcome is True)
        self._unreferenced = marks
        revoked = await self.leases.revoke_idle()
        self.runs += 1
        self.last_duration = time.perf_counter() - started
        self.freed_total += freed
        return freed, revoked
