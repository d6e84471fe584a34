"""IPCache operations: upsert, delete and list entries (IP/prefix ->
identity, node, host IP)."""

from __future__ import annotations

import logging
from dataclasses import replace

from flagella.common.errors import NotFound, Unavailable
from flagella.policy.identities import is_global
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
from flagella.policy.outcomes import IPEntryStored
from flagella.policy.state import IPEntry, PolicyState
from flagella.policy.store import MAX_ATTEMPTS, PolicyStore

log = logging.getLogger(__name__)


class IPCache:
    """The ipcache: IP/prefix -> identity entries, on the node's lease when
    they name a node."""

    def __init__(self, store: PolicyStore, mirror: Mirror, leases: NodeLeases) -> None:
        self.store = store
        self.mirror = mirror
        self.leases = leases

    @property
    def state(self) -> PolicyState:
        return self.mirror.state

    async def upsert_ipcache(self, entry: IPEntry) -> IPEntry:
        """Puts entry (its prefix normalized: see validation.check_prefix), on
        the lease of its node if it names one. The identity must exist."""
        if self.state.info(entry.identity) is None:
            stored = (
                await self.store.get_identity(entry.identity) if is_global(entry.identity) else None
            )
            if stored is None:
                raise NotFound(f"identity {entry.identity} does not exist", field="entry.identity")
        entry = replace(entry, source=entry.source or "endpoint")
        for _ in range(MAX_ATTEMPTS):
            lease = None
            if entry.node:
                self.leases.touch(entry.node)
                lease = await self.leases.lease_for(entry.node)
            put = await self.store.put_ip(entry, lease)
            if isinstance(put, IPEntryStored):
                if lease is not None and entry.prefix not in self.state.ip:
                    self.leases.attached(lease)
                await self.mirror.wait_for(put.revision)
                return replace(entry, revision=put.revision)
            if lease is not None:
                self.leases.lost(lease)
        raise Unavailable("ipcache update kept conflicting; retry", field="entry")

    async def delete_ipcache(self, prefix: str, expected_identity: int) -> bool:
        """Deletes the entry of prefix (normalized: see validation.check_prefix),
        only if it maps to expected_identity when that is given."""
        for _ in range(MAX_ATTEMPTS):
            current = await self.store.get_ip(prefix)
            if current is None:
                return False
            if expected_identity and current.identity != expected_identity:
                return False
            revision = await self.store.delete_ip(prefix, revision=current.revision)
            if revision is not None:
                await self.mirror.wait_for(revision)
                return True
        raise Unavailable("ipcache delete kept conflicting; retry", field="prefix")

    def list_ipcache(self) -> tuple[list[IPEntry], int]:
        state = self.state
        view = state.ipcache()
        return [view[p] for p in sorted(view)], state.revision
