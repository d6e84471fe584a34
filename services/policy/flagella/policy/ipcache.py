"""IPCache operations: upsert, delete and list entries (IP/prefix ->
identity, node, host IP)."""

from __future__ import annotations

import logging
from dataclasses import replace

from flagella.common.errors import NotFound, Unavailable
from flagella.policy import keys
from flagella.policy.identities import is_global
from flagella.policy.leases import NodeLeases
from flagella.policy.mirror import Mirror
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
        prefix = entry.prefix
        if self.state.info(entry.identity) is None:
            kv = (
                await self.store.get_identity(entry.identity) if is_global(entry.identity) else None
            )
            if kv is None:
                raise NotFound(f"identity {entry.identity} does not exist", field="entry.identity")
        value = keys.dumps(
            {
                "identity": entry.identity,
                "node": entry.node,
                "hostIP": entry.host_ip,
                "source": entry.source or "endpoint",
            }
        )
        for _ in range(MAX_ATTEMPTS):
            lease = None
            if entry.node:
                self.leases.touch(entry.node)
                lease = await self.leases.lease_for(entry.node)
            result = await self.store.put_ip(prefix, value, lease)
            if result.succeeded:
                if lease is not None and prefix not in self.state.ip:
                    self.leases.attached(lease)
                await self.mirror.wait_for(result.revision)
                return replace(
                    entry,
                    prefix=prefix,
                    source=entry.source or "endpoint",
                    revision=result.revision,
                )
            if lease is not None:
                self.leases.lost(lease)
        raise Unavailable("ipcache update kept conflicting; retry", field="entry")

    async def delete_ipcache(self, prefix: str, expected_identity: int) -> bool:
        """Deletes the entry of prefix (normalized: see validation.check_prefix),
        only if it maps to expected_identity when that is given."""
        for _ in range(MAX_ATTEMPTS):
            kv = await self.store.get_ip(prefix)
            if kv is None:
                return False
            if expected_identity and int(keys.loads(kv.value)["identity"]) != expected_identity:
                return False
            result = await self.store.delete_ip(prefix, revision=kv.mod_revision)
            if result.succeeded:
                await self.mirror.wait_for(result.revision)
                return True
        raise Unavailable("ipcache delete kept conflicting; retry", field="prefix")

    def list_ipcache(self) -> tuple[list[IPEntry], int]:
        state = self.state
        view = state.ipcache()
        return [view[p] for p in sorted(view)], state.revision
