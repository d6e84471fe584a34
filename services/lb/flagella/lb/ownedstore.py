"""etcd state of named records owned by a source ("api", or "kubernetes"
for those a watcher writes from Kubernetes objects), one JSON value per
key under a prefix, and the logic around it (no gRPC): create-or-replace
with a compare on what was read, delete, the listing, and the table every
watch stream of this replica follows (one etcd watch).

A record is changed or deleted only by the source that made it: the API
never touches Kubernetes' (it would come back), the watcher never the
API's. The BGP peering policies (bgpstore.py) and the local redirect
policies (lrpstore.py) are such records."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

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
from flagella.common.sync import WATCH_LOG_SIZE, EtcdSource, Subscription, Table

MAX_ATTEMPTS = 16
# How long a write waits to show in this replica's own table.
VISIBLE_TIMEOUT = 2.0

log = logging.getLogger(__name__)


class Record(Protocol):
    @property
    def source(self) -> str: ...

    def to_json(self) -> bytes: ...


R = TypeVar("R", bound=Record)


class RecordCodec(Generic[R]):
    """<prefix><id> -> the record (a table's Codec); an unreadable one is
    logged and skipped."""

    def __init__(
        self, prefix: str, decode: Callable[[bytes, int], R], noun: str, log_key: str
    ) -> None:
        self.prefix = prefix
        self._decode = decode
        self.noun = noun
        self.log_key = log_key

    def key(self, key: str) -> str | None:
        return key[len(self.prefix) :] if key.startswith(self.prefix) else None

    def decode(self, key: str, kv: KeyValue) -> R | None:
        try:
            return self._decode(kv.value, kv.mod_revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                f"{self.noun} not readable, skipped",
                extra={self.log_key: key, "reason": repr(exc)},
            )
            return None


class OwnedStore(Generic[R]):
    """Records by id (their key under prefix, e.g. "<name>" or
    "<namespace>/<name>"). noun names a record in errors and logs ("BGP
    peering policy"); name_field is the request's field of a record's name
    ("policy.name"), named by put's errors."""

    def __init__(
        self,
        etcd: Etcd,
        *,
        prefix: str,
        table: str,
        decode: Callable[[bytes, int], R],
        record_id: Callable[[R], str],
        noun: str,
        name_field: str,
        log_key: str,
        watch_history: int = WATCH_LOG_SIZE,
    ) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.noun = noun
        self.name_field = name_field
        self._decode = decode
        self._id = record_id
        self.table: Table[str, R] = Table(table, log_size=watch_history)
        self.source = EtcdSource(
            etcd, self.table, RecordCodec(prefix, decode, noun, log_key), prefix=prefix
        )

    async def run(self) -> None:
        await self.source.run()

    async def put(self, record: R) -> tuple[R, bool]:
        """Store record, replacing the one of its id (of the same source).
        Returns it with its revision and whether it was created; the same
        record again writes nothing."""
        record_id = self._id(record)
        key = self.prefix + record_id
        value = record.to_json()
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is not None:
                stored = self._decode(kv.value, kv.mod_revision)
                self._owned(stored, record.source, self.name_field)
                if kv.value == value:
                    return stored, False
            compare = absent(key) if kv is None else mod_revision_is(key, kv.mod_revision)
            result = await self.etcd.txn([compare], [put_op(key, value)])
            if result.succeeded:
                await self._visible(result.revision)
                return self._decode(value, result.revision), kv is None
        # Both kinds of record are policies (and the message is the API's).
        raise Aborted(
            f"policy {record_id!r} kept changing concurrently; retry", field=self.name_field
        )

    async def _delete(self, record_id: str, source: str) -> bool:
        """Delete the record (of that source: another's is refused, naming
        the request's field "name")."""
        key = self.prefix + record_id
        for _ in range(MAX_ATTEMPTS):
            kv = await self.etcd.get(key)
            if kv is None:
                return False
            self._owned(self._decode(kv.value, kv.mod_revision), source, "name")
            result = await self.etcd.txn([mod_revision_is(key, kv.mod_revision)], [delete_op(key)])
            if result.succeeded:
                await self._visible(result.revision)
                return True
        raise Aborted(f"policy {record_id} kept changing concurrently; retry", field="name")

    async def _get(self, record_id: str) -> R | None:
        kv = await self.etcd.get(self.prefix + record_id)
        return None if kv is None else self._decode(kv.value, kv.mod_revision)

    async def list(self) -> tuple[list[R], int]:
        """Every record by id, read from etcd at one revision."""
        try:
            records, revision = await self.source.read()
        except Compacted as exc:
            raise Unavailable("the listing's revision was compacted meanwhile; retry") from exc
        return sorted((r for _, r, _ in records), key=self._id), revision

    def subscribe(self, since_revision: int = 0) -> Subscription[str, R]:
        return self.table.subscribe(since_revision)

    async def _visible(self, revision: int) -> None:
        """Read your writes: a watch after the answer sees the change."""
        try:
            await self.table.wait_for(revision, VISIBLE_TIMEOUT)
        except TimeoutError:
            log.warning(f"{self.noun} table lags behind a write", extra={"revision": revision})

    def _owned(self, stored: R, source: str, field: str) -> None:
        """A record is changed only by the source that made it."""
        if stored.source != source:
            raise FailedPrecondition(
                f"{self.noun} {self._id(stored)!r} is managed by {stored.source}", field=field
            )
