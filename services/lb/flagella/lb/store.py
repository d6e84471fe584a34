"""etcd state of the lb service, under flagella/lb/v1/:

    services/<id:05d>              the service record (JSON), keyed by service id
    names/<namespace/name>         -> service id (name index)
    frontends/<PROTO>/<addr>/<port> -> service name (one service per frontend;
                                   an external IP at the service's port is
                                   one too)
    nodeports/<PROTO>/<port:05d>   -> service name (one service per node port)
    ids/revnat/<id:05d>            -> service name (rev-NAT id allocation)
    ids/backend-blocks/<b:08d>     -> service name (backend ids b*64 .. b*64+63)
    config/maglev-hash-seed        the cluster's Maglev seed (all replicas agree)

A service id is allocated by creating its record key; every other id and
index by creating its key; all in the one transaction that writes the
record, with create-if-absent compares, so two replicas can never hand out
the same id or frontend, and a rejected or failed request stores nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import aetcd.rpc as etcd_rpc

from flagella.common.errors import Unavailable
from flagella.common.etcd import (
    Compacted,
    Etcd,
    KeyValue,
    absent,
    delete_op,
    get_op,
    mod_revision_is,
    prefix_end,
    put_op,
)
from flagella.common.sync import EtcdSource, Table
from flagella.common.sync.table import WATCH_LOG_SIZE
from flagella.lb.ids import IdSpace
from flagella.lb.model import Frontend, Protocol, ServiceRecord

PREFIX = "flagella/lb/v1/"
SERVICES = PREFIX + "services/"
NAMES = PREFIX + "names/"
FRONTENDS = PREFIX + "frontends/"
NODEPORTS = PREFIX + "nodeports/"
REVNAT_IDS = PREFIX + "ids/revnat/"
BACKEND_BLOCKS = PREFIX + "ids/backend-blocks/"
SEED_KEY = PREFIX + "config/maglev-hash-seed"
# Services read per etcd request (a record is ~0.3-100 KiB).
PAGE_SIZE = 500
# etcd's default --max-txn-ops: compares, and writes, per transaction.
MAX_TXN_OPS = 128
# Transactions of one commit() in flight at once (etcd commits concurrent
# ones together).
COMMITS_IN_FLIGHT = 4

T = TypeVar("T")

log = logging.getLogger(__name__)


class SeedMismatch(Exception):
    """This replica's Maglev seed differs from the one the cluster uses."""


def service_key(service_id: int) -> str:
    return f"{SERVICES}{service_id:05d}"


def name_key(name: str) -> str:
    return NAMES + name


def frontend_key(fe: Frontend) -> str:
    return f"{FRONTENDS}{fe.protocol.value}/{fe.address}/{fe.port}"


def node_port_key(protocol: Protocol, port: int) -> str:
    return f"{NODEPORTS}{protocol.value}/{port:05d}"


def revnat_key(rev_nat_id: int) -> str:
    return f"{REVNAT_IDS}{rev_nat_id:05d}"


def block_key(block: int) -> str:
    return f"{BACKEND_BLOCKS}{block:08d}"


@dataclass(frozen=True)
class SpaceKeys:
    """How the ids of an IdSpace appear as etcd keys."""

    prefix: str
    digits: int

    def key(self, value: int) -> str:
        return f"{self.prefix}{value:0{self.digits}d}"

    def parse(self, key: str) -> int:
        return int(key[len(self.prefix) :])


SERVICE_SPACE = SpaceKeys(SERVICES, 5)
REVNAT_SPACE = SpaceKeys(REVNAT_IDS, 5)
BLOCK_SPACE = SpaceKeys(BACKEND_BLOCKS, 8)


def node_port_space(protocol: Protocol) -> SpaceKeys:
    return SpaceKeys(f"{NODEPORTS}{protocol.value}/", 5)


@dataclass(frozen=True)
class Lookup:
    """Who holds the keys an upsert cares about, read in one round trip."""

    name_id: int | None
    frontend_owner: str | None
    node_port_owner: str | None
    revision: int
    # Who holds each external IP's frontend (in the spec's order).
    external_owners: tuple[str | None, ...] = ()


@dataclass
class UpsertPlan:
    record: ServiceRecord
    previous: ServiceRecord | None
    new_blocks: tuple[int, ...] = ()
    release_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class Committed:
    """The plan is stored, at revision."""

    revision: int


@dataclass(frozen=True)
class Conflict:
    """The plan is not stored: another writer got in first. What the keys
    it contested hold now."""

    revision: int
    # The service id the name belongs to now (None: no service has it).
    name_id: int | None = None
    frontend_owner: str | None = None
    node_port_owner: str | None = None
    service_id_taken: bool = False
    rev_nat_taken: bool = False
    blocks_taken: tuple[int, ...] = ()
    # An external IP's frontend another service holds: (it, the holder).
    external_owner: tuple[Frontend, str] | None = None


Outcome = Committed | Conflict


class ServiceCodec:
    """services/<id> -> the ServiceRecord (a table's Codec). A record this
    replica is writing is expected: when its value comes back on the watch,
    the record is taken as it is instead of being parsed again (the same
    bytes are the same record; a bulk of 10,000 services spent a tenth of
    the lb's CPU parsing its own writes). At most `expected_max` are held:
    the oldest, and any whose write failed, go."""

    def __init__(self, expected_max: int = 8192) -> None:
        self.expected_max = expected_max
        self._expected: dict[bytes, ServiceRecord] = {}

    def expect(self, value: bytes, record: ServiceRecord) -> None:
        expected = self._expected
        expected[value] = record
        if len(expected) > self.expected_max:
            del expected[next(iter(expected))]

    def key(self, key: str) -> int | None:
        if not key.startswith(SERVICES):
            return None
        try:
            return SERVICE_SPACE.parse(key)
        except ValueError:
            log.warning("not a service key, skipped", extra={"key": key})
            return None

    def decode(self, key: int, kv: KeyValue) -> ServiceRecord | None:
        record = self._expected.pop(kv.value, None)
        if record is not None and record.id == key:
            return record.with_revision(kv.mod_revision)
        try:
            return ServiceRecord.from_json(kv.value, kv.mod_revision)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning(
                "service record not readable, skipped", extra={"id": key, "reason": repr(exc)}
            )
            return None


def _range_op(
    start: str, end: bytes, *, limit: int = 0, descend: bool = False, keys_only: bool = False
) -> Any:
    return etcd_rpc.RequestOp(
        request_range=etcd_rpc.RangeRequest(
            key=start.encode(),
            range_end=end,
            limit=limit,
            keys_only=keys_only,
            sort_order=(etcd_rpc.RangeRequest.DESCEND if descend else etcd_rpc.RangeRequest.ASCEND),
            sort_target=etcd_rpc.RangeRequest.KEY,
        )
    )


def _text(kvs: Sequence[KeyValue]) -> str | None:
    return kvs[0].value.decode() if kvs else None


class LbStore:
    def __init__(self, etcd: Etcd, *, watch_history: int = WATCH_LOG_SIZE) -> None:
        self.etcd = etcd
        # Every service by id, as etcd has it (what WatchServices streams):
        # one etcd watch per replica, however many watchers. Its log keeps
        # the records before each change: a watch's DELETE names the service
        # and a change the backends it lost.
        self.services: Table[int, ServiceRecord] = Table(
            "lb-services", keep_prev=True, log_size=watch_history
        )
        self.codec = ServiceCodec()
        self.source = EtcdSource(
            etcd, self.services, self.codec, prefix=SERVICES, page_size=PAGE_SIZE
        )

    async def run(self) -> None:
        """Keep the services table in step with etcd (until cancelled)."""
        await self.source.run()

    # --- reads ---

    async def lookup(
        self,
        name: str,
        frontend: Frontend,
        node_port: tuple[Protocol, int] | None,
        externals: Sequence[Frontend] = (),
    ) -> Lookup:
        ops = [get_op(name_key(name)), get_op(frontend_key(frontend))]
        if node_port is not None:
            ops.append(get_op(node_port_key(*node_port)))
        ops += [get_op(frontend_key(fe)) for fe in externals]
        result = await self.etcd.txn([], ops)
        ranges = iter(result.ranges)
        name_id = _text(next(ranges))
        frontend_owner = _text(next(ranges))
        node_port_owner = _text(next(ranges)) if node_port is not None else None
        return Lookup(
            name_id=None if name_id is None else int(name_id),
            frontend_owner=frontend_owner,
            node_port_owner=node_port_owner,
            revision=result.revision,
            external_owners=tuple(_text(next(ranges)) for _ in externals),
        )

    async def get_by_id(self, service_id: int) -> ServiceRecord | None:
        kv = await self.etcd.get(service_key(service_id))
        return None if kv is None else ServiceRecord.from_json(kv.value, kv.mod_revision)

    async def get_by_name(self, name: str) -> ServiceRecord | None:
        kv = await self.etcd.get(name_key(name))
        if kv is None:
            return None
        record = await self.get_by_id(int(kv.value))
        return record if record is not None and record.name == name else None

    async def frontend_owner(self, frontend: Frontend) -> str | None:
        kv = await self.etcd.get(frontend_key(frontend))
        return None if kv is None else kv.value.decode()

    async def list_services(self) -> tuple[list[ServiceRecord], int]:
        """Every service, read from etcd in pages at one revision, and that
        revision. Raises Unavailable."""
        try:
            records, revision = await self.source.read()
        except Compacted as exc:
            raise Unavailable("the listing's revision was compacted meanwhile; retry") from exc
        return [record for _, record, _ in records], revision

    def pages(
        self, prefix: str, page_size: int = PAGE_SIZE
    ) -> AsyncIterator[tuple[list[KeyValue], int]]:
        """Every key under prefix, page by page at one revision (see
        Etcd.range_pages)."""
        return self.etcd.range_pages(prefix, prefix_end(prefix), page_size=page_size)

    # --- id spaces ---

    async def highest(self, space: IdSpace, keys: SpaceKeys) -> int | None:
        """The highest id of space that has a key, if any."""
        result = await self.etcd.txn(
            [],
            [
                _range_op(
                    keys.key(space.lo),
                    keys.key(space.hi + 1).encode(),
                    limit=1,
                    descend=True,
                    keys_only=True,
                )
            ],
        )
        kvs = result.ranges[0]
        return keys.parse(kvs[0].key) if kvs else None

    async def taken_from(
        self, space: IdSpace, keys: SpaceKeys, start: int, limit: int
    ) -> list[int]:
        """Ids of space at or above start that have a key, ascending, at most
        limit of them."""
        result = await self.etcd.txn(
            [],
            [
                _range_op(
                    keys.key(start), keys.key(space.hi + 1).encode(), limit=limit, keys_only=True
                )
            ],
        )
        return [keys.parse(kv.key) for kv in result.ranges[0]]

    # --- writes ---

    async def commit(
        self,
        plans: Iterable[UpsertPlan] | AsyncIterable[UpsertPlan],
        *,
        in_flight: int = COMMITS_IN_FLIGHT,
    ) -> list[Outcome]:
        """Store the plans, one outcome each, in order: as many plans per
        transaction as etcd takes (each transaction all or none), up to
        in_flight transactions at once while the next plans are still being
        made (an async iterable is consumed as it yields). A transaction of
        several plans that fails is committed again plan by plan, so that
        each gets its own outcome. An exception (from plans, or Unavailable)
        is raised once the transactions in flight have ended."""
        outcomes: list[Outcome | None] = []
        commits: set[asyncio.Task[None]] = set()
        error: BaseException | None = None

        async def settle(limit: int) -> None:
            nonlocal commits, error
            while len(commits) > limit:
                done, commits = await asyncio.wait(commits, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if error is None and task.exception() is not None:
                        error = task.exception()

        def send(chunk: list[tuple[int, UpsertPlan, CommitOps]]) -> None:
            commits.add(asyncio.create_task(self._commit_chunk(chunk, outcomes)))

        chunk: list[tuple[int, UpsertPlan, CommitOps]] = []
        ops = 0
        try:
            async for plan in _each(plans):
                value = plan.record.to_json()
                self.codec.expect(value, plan.record)
                plan_ops = commit_ops(plan, value)
                size = max(len(plan_ops[0]), len(plan_ops[1]))
                if chunk and ops + size > MAX_TXN_OPS:
                    send(chunk)
                    chunk, ops = [], 0
                    await settle(in_flight - 1)
                    if error is not None:
                        break
                chunk.append((len(outcomes), plan, plan_ops))
                outcomes.append(None)
                ops += size
            else:
                if chunk:
                    send(chunk)
        finally:
            await settle(0)
        if error is not None:
            raise error
        done = [o for o in outcomes if o is not None]
        assert len(done) == len(outcomes), "every plan has its outcome"
        return done

    async def _commit_chunk(
        self, chunk: list[tuple[int, UpsertPlan, CommitOps]], outcomes: list[Outcome | None]
    ) -> None:
        if len(chunk) > 1:
            compare: list[Any] = []
            success: list[Any] = []
            for _, _, (c, s) in chunk:
                compare += c
                success += s
            result = await self.etcd.txn(compare, success, [])
            if result.succeeded:
                for i, _, _ in chunk:
                    outcomes[i] = Committed(result.revision)
                return
            log.info(
                "batch chunk contested, committing its services one by one",
                extra={"services": len(chunk)},
            )
        for i, plan, ops in chunk:
            outcomes[i] = await self._commit_one(plan, ops)

    async def _commit_one(self, plan: UpsertPlan, ops: CommitOps) -> Outcome:
        """One plan in its own transaction; when it fails, the same
        transaction reads what the contested keys hold."""
        rec, prev = plan.record, plan.previous
        compare, success = ops
        failure: list[Any] = [get_op(name_key(rec.name)), get_op(frontend_key(rec.frontend))]
        if prev is None:
            failure.append(get_op(service_key(rec.id)))
        if prev is None or prev.rev_nat_id != rec.rev_nat_id:
            failure.append(get_op(revnat_key(rec.rev_nat_id)))
        new_np = _node_port(rec)
        if new_np is not None:
            failure.append(get_op(node_port_key(*new_np)))
        failure += [get_op(block_key(block)) for block in plan.new_blocks]
        taken = _new_externals(plan)
        failure += [get_op(frontend_key(fe)) for fe in taken]

        result = await self.etcd.txn(compare, success, failure)
        if result.succeeded:
            return Committed(result.revision)
        ranges = iter(result.ranges)
        name_id = _text(next(ranges))
        frontend_owner = _text(next(ranges))
        service_id_taken = bool(next(ranges)) if prev is None else False
        rev_nat_taken = (
            bool(next(ranges)) if prev is None or prev.rev_nat_id != rec.rev_nat_id else False
        )
        node_port_owner = _text(next(ranges)) if new_np is not None else None
        blocks_taken = tuple(block for block in plan.new_blocks if next(ranges))
        external_owner = None
        for fe in taken:
            owner = _text(next(ranges))
            if owner not in (None, rec.name) and external_owner is None:
                external_owner = (fe, owner)
        return Conflict(
            result.revision,
            name_id=None if name_id is None else int(name_id),
            frontend_owner=frontend_owner,
            node_port_owner=node_port_owner,
            service_id_taken=service_id_taken,
            rev_nat_taken=rev_nat_taken,
            blocks_taken=blocks_taken,
            external_owner=external_owner,
        )

    async def lookup_many(self, wanted: Sequence[Wanted]) -> list[Lookup]:
        """lookup() of many services, in as few transactions as the etcd
        transaction limit allows, sent together."""

        async def one(chunk: Sequence[Wanted]) -> list[Lookup]:
            ops: list[Any] = []
            for name, frontend, node_port, externals in chunk:
                ops += [get_op(name_key(name)), get_op(frontend_key(frontend))]
                if node_port is not None:
                    ops.append(get_op(node_port_key(*node_port)))
                ops += [get_op(frontend_key(fe)) for fe in externals]
            result = await self.etcd.txn([], ops)
            ranges = iter(result.ranges)
            out: list[Lookup] = []
            for _, _, node_port, externals in chunk:
                name_id = _text(next(ranges))
                frontend_owner = _text(next(ranges))
                node_port_owner = _text(next(ranges)) if node_port is not None else None
                out.append(
                    Lookup(
                        name_id=None if name_id is None else int(name_id),
                        frontend_owner=frontend_owner,
                        node_port_owner=node_port_owner,
                        revision=result.revision,
                        external_owners=tuple(_text(next(ranges)) for _ in externals),
                    )
                )
            return out

        parts = await asyncio.gather(*(one(c) for c in _lookup_chunks(wanted)))
        return [lookup for part in parts for lookup in part]

    async def get_many_by_id(self, service_ids: Sequence[int]) -> dict[int, ServiceRecord]:
        """The records of these ids (those that exist), the transactions sent
        together."""
        results = await asyncio.gather(
            *(
                self.etcd.txn([], [get_op(service_key(i)) for i in chunk])
                for chunk in _chunks(service_ids, MAX_TXN_OPS)
            )
        )
        out: dict[int, ServiceRecord] = {}
        for result in results:
            for kvs in result.ranges:
                if kvs:
                    rec = ServiceRecord.from_json(kvs[0].value, kvs[0].mod_revision)
                    out[rec.id] = rec
        return out

    async def replace(self, record: ServiceRecord, new: ServiceRecord) -> int | None:
        """Write new (same id, name and indexes) over record if it is still
        at its revision. The write's revision; None when it changed."""
        result = await self.etcd.txn(
            [mod_revision_is(service_key(record.id), record.revision)],
            [put_op(service_key(new.id), new.to_json())],
        )
        return result.revision if result.succeeded else None

    async def delete(self, record: ServiceRecord) -> int | None:
        """Delete the service and free its ids, if it is still at its
        revision. Returns the deletion's revision; None when it changed
        meanwhile."""
        ops = [
            delete_op(service_key(record.id)),
            delete_op(name_key(record.name)),
            delete_op(frontend_key(record.frontend)),
            delete_op(revnat_key(record.rev_nat_id)),
            *(delete_op(block_key(b)) for b in record.backend_blocks),
            *(delete_op(frontend_key(fe)) for fe in record.external_frontends()),
        ]
        np = _node_port(record)
        if np is not None:
            ops.append(delete_op(node_port_key(*np)))
        result = await self.etcd.txn(
            [mod_revision_is(service_key(record.id), record.revision)], ops
        )
        return result.revision if result.succeeded else None

    async def ensure_seed(self, seed: str) -> None:
        """Record the cluster's Maglev seed on first start; refuse a replica
        configured with another one (its tables would differ)."""
        result = await self.etcd.txn(
            [absent(SEED_KEY)], [put_op(SEED_KEY, seed.encode())], [get_op(SEED_KEY)]
        )
        if result.succeeded:
            return
        stored = _text(result.ranges[0])
        if stored is not None and stored != seed:
            raise SeedMismatch(
                f"the cluster's Maglev hash seed in etcd ({SEED_KEY}) differs from "
                "--maglev-hash-seed: every lb replica must use the same seed"
            )


# The compares and the writes of one plan.
CommitOps = tuple[list[Any], list[Any]]


def commit_ops(plan: UpsertPlan, value: bytes | None = None) -> CommitOps:
    """The compares and writes that store a plan (value: the record's JSON,
    when made already): ids and keys it newly takes must be absent, the
    record it replaces unchanged."""
    rec, prev = plan.record, plan.previous
    owner = rec.name.encode()
    compare: list[Any] = []
    success: list[Any] = [put_op(service_key(rec.id), value or rec.to_json())]
    if prev is None:
        compare += [absent(name_key(rec.name)), absent(service_key(rec.id))]
        success.append(put_op(name_key(rec.name), str(rec.id).encode()))
    else:
        compare.append(mod_revision_is(service_key(prev.id), prev.revision))
    if prev is None or prev.rev_nat_id != rec.rev_nat_id:
        compare.append(absent(revnat_key(rec.rev_nat_id)))
        success.append(put_op(revnat_key(rec.rev_nat_id), owner))
    # The frontend and the external IPs' frontends: the keys newly held
    # must be free, those no longer held go.
    before = _held_frontends(prev)
    after = _held_frontends(rec)
    for fe in after:
        if fe not in before:
            compare.append(absent(frontend_key(fe)))
            success.append(put_op(frontend_key(fe), owner))
    success += [delete_op(frontend_key(fe)) for fe in before if fe not in after]
    new_np = _node_port(rec)
    old_np = _node_port(prev) if prev is not None else None
    if new_np != old_np:
        if new_np is not None:
            compare.append(absent(node_port_key(*new_np)))
            success.append(put_op(node_port_key(*new_np), owner))
        if old_np is not None:
            success.append(delete_op(node_port_key(*old_np)))
    for block in plan.new_blocks:
        compare.append(absent(block_key(block)))
        success.append(put_op(block_key(block), owner))
    success += [delete_op(block_key(b)) for b in plan.release_blocks]
    return compare, success


def _held_frontends(record: ServiceRecord | None) -> list[Frontend]:
    """The frontend index keys a record holds: its frontend, then its
    external IPs'."""
    if record is None:
        return []
    return [record.frontend, *record.external_frontends()]


def _new_externals(plan: UpsertPlan) -> list[Frontend]:
    """The external IPs' frontends the plan takes that its previous record
    did not hold."""
    held = set(_held_frontends(plan.previous))
    return [fe for fe in plan.record.external_frontends() if fe not in held]


# What lookup_many() reads of one service: its name, frontend, explicit
# node port and external IPs' frontends.
Wanted = tuple[str, Frontend, tuple[Protocol, int] | None, Sequence[Frontend]]


def _lookup_chunks(wanted: Sequence[Wanted]) -> Iterator[Sequence[Wanted]]:
    """Services whose reads fit one transaction's operations."""
    chunk: list[Wanted] = []
    ops = 0
    for item in wanted:
        size = 3 + len(item[3])
        if chunk and ops + size > MAX_TXN_OPS:
            yield chunk
            chunk, ops = [], 0
        chunk.append(item)
        ops += size
    if chunk:
        yield chunk


async def _each(items: Iterable[T] | AsyncIterable[T]) -> AsyncIterator[T]:
    if isinstance(items, AsyncIterable):
        async for item in items:
            yield item
    else:
        for item in items:
            yield item


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


def _node_port(record: ServiceRecord | None) -> tuple[Protocol, int] | None:
    if record is None or not record.node_port:
        return None
    return (record.frontend.protocol, record.node_port)
