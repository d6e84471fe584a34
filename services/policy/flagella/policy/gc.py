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
from flagella.policy.store import DELETES_PER_TXN, IdentityToDelete, PolicyStore

log = logging.getLogger(__name__)

#: Identity deletes a GC round has in flight at once.
DELETES_IN_FLIGHT = 2


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
        # Several transactions in flight, each of several identities: under
        # churn a round has thousands, and one round trip each in turn is
        # what made GC fall behind.
        slots = asyncio.Semaphore(DELETES_IN_FLIGHT)

        async def delete(chunk: list[IdentityToDelete]) -> list[bool]:
            async with slots:
                deleted = await self.store.delete_identities(chunk)
            for d, ok in zip(chunk, deleted, strict=True):
                if ok:
                    log.info(
                        "identity garbage-collected",
                        extra={"identity": d.id, "labels": d.labels},
                    )
            return deleted

        todo = [
            IdentityToDelete(gid.id, gid.label_string, gid.mod_revision, rev) for gid, rev in due
        ]
        chunks = [todo[i : i + DELETES_PER_TXN] for i in range(0, len(todo), DELETES_PER_TXN)]
        results = await asyncio.gather(*(delete(c) for c in chunks), return_exceptions=True)
        outcomes: list[bool] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result  # (etcd unavailable: the round ends, as before)
            outcomes += result
        freed = sum(1 for outcome in outcomes if outcome is True)
        self._unreferenced = marks
        revoked = await self.leases.revoke_idle()
        self.runs += 1
        self.last_duration = time.perf_counter() - started
        self.freed_total += freed
        return freed, revoked
