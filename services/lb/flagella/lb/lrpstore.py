"""etcd state of local redirect policies, under flagella/lb/v1/lrps/:

    lrps/<namespace>/<name>    the policy (JSON)

and the logic around it (no gRPC): create-or-replace with a compare on
what was read, delete, reads, and the table every WatchLrps stream of this
replica follows (one etcd watch)."""

from __future__ import annotations

import logging

from flagella.common.errors import Aborted, FailedPrecondition, Unavailable
from flagella.common.etcd import (
    Compacted,
    Etcd,
    KeyValue,
    absent,
    delete_op,
    mod_revision_is,
    put_op,
)
from flagella.common.sync import EtcdSource, Subscription, Table
from flagella.lb.lrp import Lrp
from flagella.lb.store import PREFIX

LRPS = PREFIX + "lrps/"
MAX_ATTEMPTS = 16
# How long a write waits to show in this replica's own table.
VISIBLE_TIMEOUT = 2.0

log = logging.getLogger(__name__)


def lrp_key(namespace: str, name: str) -> str:
    return f"{LRPS}{namespace}/{name}"


class LrpCodec:
    """lrps/<namespace>/<name> -> the policy (a table's Codec)."""

    def key(self, key: str) -> str | None:
        return key[len(LRPS) :] if key.startswith(LRPS) else None

    def decode(self, key: str, kv: KeyValue) -> Lrp | None:
        try:
            return Lrp.from_json(kv.value, kv.mod_revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "policy record not readable, skipped", extra={"lrp": key, "reason": repr(exc)}
            )
            return None


class LrpStore:
    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        # Every policy by namespace/name (what WatchLrps streams).
        self.table: Table[str, Lrp] = Table("lb-lrps")
        self.source = EtcdSource(etcd, self.table, LrpCodec(), prefix=LRPS)

    async def run(self) -> None:
        await self.source.run()

    async def put(self, lrp: Lrp) -> tuple[Lrp, bool]:
        """Store lrp, replacing the policy of its name. Returns it with its
        revision and whether it was created; the same policy again writes
        nothing."""
        key = lrp_key(lrp.namespace, lrp.name)
        value = lrp.to_json()
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is not None:
                stored = Lrp.from_json(kv.value, kv.mod_revision)
                _owned(stored, lrp.source, "lrp.name")
                if kv.value == value:
                    return stored, False
            compare = absent(key) if kv is None else mod_revision_is(key, kv.mod_revision)
            result = await self.etcd.txn([compare], [put_op(key, value)])
            if result.succeeded:
                await self._visible(result.revision)
                return Lrp.from_json(value, result.revision), kv is None
        raise Aborted(f"policy {lrp.key!r} kept changing concurrently; retry", field="lrp.name")

    async def delete(self, namespace: str, name: str, source: str = "api") -> bool:
        """Delete the policy (of that source: another's is refused)."""
        key = lrp_key(namespace, name)
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is None:
                return False
            _owned(Lrp.from_json(kv.value, kv.mod_revision), source, "name")
            result = await self.etcd.txn([mod_revision_is(key, kv.mod_revision)], [delete_op(key)])
            if result.succeeded:
                await self._visible(result.revision)
                return True
        raise Aborted(f"policy {namespace}/{name} kept changing concurrently; retry", field="name")

    async def get(self, namespace: str, name: str) -> Lrp | None:
        kv = await self.etcd.get(lrp_key(namespace, name))
        return None if kv is None else Lrp.from_json(kv.value, kv.mod_revision)

    async def list(self, namespace: str = "") -> tuple[list[Lrp], int]:
        """Every policy (of namespace), read from etcd at one revision."""
        try:
            records, revision = await self.source.read()
        except Compacted as exc:
            raise Unavailable("the listing's revision was compacted meanwhile; retry") from exc
        lrps = [r for _, r, _ in records if not namespace or r.namespace == namespace]
        return sorted(lrps, key=lambda r: r.key), revision

    def subscribe(self, since_revision: int = 0) -> Subscription[str, Lrp]:
        return self.table.subscribe(since_revision)

    async def _visible(self, revision: int) -> None:
        """Read your writes: a WatchLrps after the answer sees the change."""
        try:
            await self.table.wait_for(revision, VISIBLE_TIMEOUT)
        except TimeoutError:
            log.warning("lrp table lags behind a write", extra={"revision": revision})


def _owned(stored: Lrp, source: str, field: str) -> None:
    """A policy is changed only by the source that made it: the API never
    touches Kubernetes' (it would come back), the watcher never the API's."""
    if stored.source != source:
        raise FailedPrecondition(
            f"local redirect policy {stored.key!r} is managed by {stored.source}", field=field
        )
