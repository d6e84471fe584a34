"""Logic of the lb service (no gRPC, no etcd keys here): upsert with id
allocation, reads, delete, what the watch stream says of a change, and
Maglev tables."""

from __future__ import annotations

import asyncio
import collections
import logging
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from flagella.common.errors import (
    Aborted,
    FailedPrecondition,
    FlagellaError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from flagella.common.sync import Change, Subscription
from flagella.lb.ids import (
    BACKEND_BLOCK_MAX,
    BACKEND_BLOCK_MIN,
    SERVICE_ID_MAX,
    SERVICE_ID_MIN,
    IdSpace,
    free_in_window,
    plan_backend_ids,
)
from flagella.lb.maglev import MaglevBackend, lookup_table
from flagella.lb.model import (
    Algorithm,
    Backend,
    Frontend,
    Protocol,
    ServiceRecord,
    ServiceSpec,
    ServiceType,
    Source,
)
from flagella.lb.store import (
    BLOCK_SPACE,
    REVNAT_SPACE,
    SERVICE_SPACE,
    Committed,
    LbStore,
    SpaceKeys,
    UpsertPlan,
    node_port_space,
)
from flagella.lb.validation import Limits, in_batch

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 16
# How long a write waits to show in this replica's own table.
VISIBLE_TIMEOUT = 2.0
# Below this many slots a table is built inline rather than in a thread.
_INLINE_SLOTS = 4096


@dataclass(frozen=True)
class DeletedService:
    name: str
    id: int
    rev_nat_id: int


@dataclass(frozen=True)
class WatchItem:
    """A change of a service as the watch stream tells it: the record (or
    what identified the deleted service), its Maglev table when asked for,
    and the backend ids it no longer has (their flows are to be purged)."""

    revision: int
    record: ServiceRecord | None = None
    deleted: DeletedService | None = None
    table: Sequence[int] | None = None
    removed_backend_ids: tuple[int, ...] = ()


class TableCache:
    """Maglev tables by their inputs (size and active backends), LRU within a
    budget of slots, each built once however many watchers ask."""

    def __init__(self, seed: bytes, max_slots: int) -> None:
        self.seed = seed
        self.max_slots = max_slots
        self._tables: collections.OrderedDict[tuple[int, tuple[MaglevBackend, ...]], list[int]] = (
            collections.OrderedDict()
        )
        self._slots = 0
        self._building: dict[tuple[int, tuple[MaglevBackend, ...]], asyncio.Future[list[int]]] = {}
        self.builds = 0

    async def get(self, record: ServiceRecord) -> list[int]:
        key = (record.maglev_table_size, tuple(record.maglev_backends()))
        table = self._tables.get(key)
        if table is not None:
            self._tables.move_to_end(key)
            return table
        pending = self._building.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._building[key] = fut
        try:
            m, backends = key
            self.builds += 1
            if m <= _INLINE_SLOTS:
                table = lookup_table(backends, m, self.seed)
            else:
                table = await asyncio.to_thread(lookup_table, backends, m, self.seed)
            fut.set_result(table)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters, if any, get it too
            raise
        finally:
            del self._building[key]
        self._tables[key] = table
        self._slots += len(table)
        while self._slots > self.max_slots and len(self._tables) > 1:
            _, old = self._tables.popitem(last=False)
            self._slots -= len(old)
        return table


class LbService:
    def __init__(
        self, store: LbStore, limits: Limits, seed: bytes, *, cache_slots: int = 32 << 20
    ) -> None:
        self.store = store
        self.limits = limits
        self.tables = TableCache(seed, cache_slots)
        self._service_ids = IdSpace("service", SERVICE_ID_MIN, SERVICE_ID_MAX)
        self._rev_nat_ids = IdSpace("rev-nat", SERVICE_ID_MIN, SERVICE_ID_MAX)
        self._blocks = IdSpace("backend-block", BACKEND_BLOCK_MIN, BACKEND_BLOCK_MAX)
        self._node_ports = {
            p: IdSpace(f"node-port/{p.value}", limits.node_port_min, limits.node_port_max)
            for p in Protocol
        }
        self._space_lock = asyncio.Lock()
        self._random = random.Random()
        # Names this replica saw exist (an upsert of another name tries a
        # create first).
        self._known: set[str] = set()

    # --- id spaces ---

    def _space_keys(self, space: IdSpace) -> SpaceKeys:
        if space is self._service_ids:
            return SERVICE_SPACE
        if space is self._rev_nat_ids:
            return REVNAT_SPACE
        if space is self._blocks:
            return BLOCK_SPACE
        for proto, s in self._node_ports.items():
            if s is space:
                return node_port_space(proto)
        raise KeyError(space.name)

    async def _take(self, space: IdSpace, count: int) -> list[int]:
        if count == 0:
            return []
        if not space.initialized:
            async with self._space_lock:
                if not space.initialized:
                    space.start_after(await self.store.highest(space, self._space_keys(space)))
        return space.take(count)

    async def _skip_taken(self, space: IdSpace, count: int) -> None:
        """After a candidate was found taken (another replica allocates from
        the same point): jump a random step forward, so that replicas drift
        apart, and find count free ids from there on (wrapping) by reading
        which ids have keys, for the next take(). Raises ResourceExhausted
        when the space is full."""
        sk = self._space_keys(space)
        jitter = max(1, min(1024, space.size // 64))
        start = space.lo + (space.hint - space.lo + self._random.randrange(jitter)) % space.size
        scanned = 0
        free: list[int] = []
        page = 1024
        while scanned < space.size and len(free) < count:
            taken = await self.store.taken_from(space, sk, start, limit=page)
            end = taken[-1] if len(taken) == page else space.hi
            free += free_in_window(taken, start, end, count - len(free))
            scanned += end - start + 1
            start = end + 1 if end < space.hi else space.lo
        if not free:
            raise ResourceExhausted(f"no free {space.name} id left")
        space.offer(free)

    # --- reads ---

    async def get_by_name(self, name: str) -> ServiceRecord:
        record = await self.store.get_by_name(name)
        if record is None:
            self._known.discard(name)
            raise NotFound(f"no service {name!r}", field="name")
        self._known.add(name)
        return record

    async def get_by_id(self, service_id: int) -> ServiceRecord:
        record = await self.store.get_by_id(service_id) if service_id else None
        if record is None:
            raise NotFound(f"no service with id {service_id}", field="id")
        return record

    async def get_by_frontend(self, frontend: Frontend) -> ServiceRecord:
        owner = await self.store.frontend_owner(frontend)
        record = None if owner is None else await self.store.get_by_name(owner)
        if record is None or record.frontend != frontend:
            raise NotFound(f"no service with frontend {_fe_text(frontend)}", field="frontend")
        return record

    async def list_services(self, namespace: str = "") -> tuple[list[ServiceRecord], int]:
        records, revision = await self.store.list_services()
        self._known.update(r.name for r in records)
        if namespace:
            records = [r for r in records if r.namespace == namespace]
        records.sort(key=lambda r: r.name)
        return records, revision

    async def maglev_table(self, name: str) -> tuple[ServiceRecord, list[int]]:
        record = await self.get_by_name(name)
        if record.algorithm is not Algorithm.MAGLEV:
            raise FailedPrecondition(
                f"service {name!r} uses the {record.algorithm.value} algorithm, not maglev",
                field="name",
            )
        return record, await self.tables.get(record)

    # --- writes ---

    async def upsert(self, spec: ServiceSpec) -> tuple[ServiceRecord, bool]:
        """Create or replace the service spec.name. Returns the stored record
        and whether it was created."""
        explicit_np = _explicit_node_port(spec)
        optimistic = spec.name not in self._known
        for _ in range(MAX_ATTEMPTS):
            if optimistic:
                # A name this replica has not seen is most likely new: try
                # the create straight away (one etcd round trip); its
                # compares fail, and tell why, if the name or anything else
                # is taken.
                optimistic = False
                current: ServiceRecord | None = None
            else:
                found = await self.store.lookup(
                    spec.name, spec.frontend, explicit_np, spec.external_frontends()
                )
                current = None
                if found.name_id is not None:
                    current = await self.store.get_by_id(found.name_id)
                    if current is None or current.name != spec.name:
                        continue  # changed under us
                if current is not None and current.source is not spec.source:
                    raise FailedPrecondition(
                        f"service {spec.name!r} is managed by {current.source.value}",
                        field="service.name",
                    )
                if found.frontend_owner not in (None, spec.name):
                    raise _frontend_taken(spec.frontend, found.frontend_owner)
                if explicit_np is not None and found.node_port_owner not in (None, spec.name):
                    raise _node_port_taken(spec.node_port, found.node_port_owner)
                _check_externals(spec, found.external_owners)
                if current is not None and current.same_spec(spec):
                    self._known.add(spec.name)
                    return current, False
            plan = await self._plan(spec, current)
            (result,) = await self.store.commit([plan])
            if isinstance(result, Committed):
                self._known.add(spec.name)
                await self._visible(result.revision)
                return plan.record.with_revision(result.revision), current is None
            # Find out what was contested; reject or retry.
            log.debug(
                "upsert conflict, retrying",
                extra={
                    "service": spec.name,
                    "name_id": result.name_id,
                    "frontend_owner": result.frontend_owner,
                    "service_id_taken": result.service_id_taken,
                    "rev_nat_taken": result.rev_nat_taken,
                    "blocks_taken": result.blocks_taken,
                },
            )
            if result.name_id is not None and current is None:
                continue  # it exists: an update (the frontend may be its own)
            if result.frontend_owner not in (None, spec.name):
                raise _frontend_taken(spec.frontend, result.frontend_owner)
            if result.external_owner is not None:
                fe, owner = result.external_owner
                raise _external_taken(spec, spec.external_frontends().index(fe), owner)
            if result.node_port_owner not in (None, spec.name):
                if explicit_np is not None:
                    raise _node_port_taken(spec.node_port, result.node_port_owner)
                await self._skip_taken(self._node_ports[spec.frontend.protocol], 1)
            if result.service_id_taken:
                await self._skip_taken(self._service_ids, 1)
            if result.rev_nat_taken:
                await self._skip_taken(self._rev_nat_ids, 1)
            if result.blocks_taken:
                await self._skip_taken(self._blocks, len(plan.new_blocks))
        raise Aborted(
            f"service {spec.name!r} kept changing concurrently; retry", field="service.name"
        )

    async def upsert_many(self, specs: Sequence[ServiceSpec]) -> list[tuple[ServiceRecord, bool]]:
        """upsert() of many services (distinct names, frontends and explicit
        node ports, checked by the caller). Every one is checked against the
        store first, in a few round trips: a frontend or node port held by
        another service, or a name managed by another source, raises (its
        field under services[i]) before anything is stored. Then the new and
        changed services are committed several per transaction; a chunk
        whose transaction fails (another writer got in between) is committed
        one by one through upsert()."""
        found = await self.store.lookup_many(
            [(s.name, s.frontend, _explicit_node_port(s), s.external_frontends()) for s in specs]
        )
        currents = await self.store.get_many_by_id(
            [f.name_id for f in found if f.name_id is not None]
        )
        results: list[tuple[ServiceRecord, bool] | None] = [None] * len(specs)
        todo: list[tuple[int, ServiceSpec, ServiceRecord | None]] = []
        racing: list[int] = []
        for i, (spec, seen) in enumerate(zip(specs, found, strict=True)):
            current = currents.get(seen.name_id) if seen.name_id is not None else None
            if seen.name_id is not None and (current is None or current.name != spec.name):
                racing.append(i)  # changed between the two reads: upsert() sorts it out
                continue
            try:
                if current is not None and current.source is not spec.source:
                    raise FailedPrecondition(
                        f"service {spec.name!r} is managed by {current.source.value}",
                        field="service.name",
                    )
                if seen.frontend_owner not in (None, spec.name):
                    raise _frontend_taken(spec.frontend, seen.frontend_owner)
                if _explicit_node_port(spec) is not None and seen.node_port_owner not in (
                    None,
                    spec.name,
                ):
                    raise _node_port_taken(spec.node_port, seen.node_port_owner)
                _check_externals(spec, seen.external_owners)
            except FlagellaError as exc:
                raise in_batch(exc, i) from None
            if current is not None and current.same_spec(spec):
                self._known.add(spec.name)
                results[i] = (current, False)
            else:
                todo.append((i, spec, current))

        # Planned as the store commits (a few transactions in flight while
        # the next plans are made); a plan whose transaction was contested
        # goes through upsert() (a fresh read, then retries).
        plans: list[tuple[int, UpsertPlan]] = []

        async def planned() -> AsyncIterator[UpsertPlan]:
            for i, spec, current in todo:
                try:
                    plan = await self._plan(spec, current)
                except FlagellaError as exc:
                    raise in_batch(exc, i) from None
                plans.append((i, plan))
                yield plan

        outcomes = await self.store.commit(planned())
        for (i, plan), outcome in zip(plans, outcomes, strict=True):
            if isinstance(outcome, Committed):
                self._known.add(plan.record.name)
                results[i] = (plan.record.with_revision(outcome.revision), plan.previous is None)
            else:
                racing.append(i)
        await self._visible(
            max((o.revision for o in outcomes if isinstance(o, Committed)), default=0)
        )
        for i in sorted(racing):
            try:
                results[i] = await self.upsert(specs[i])
            except FlagellaError as exc:
                raise in_batch(exc, i) from None
        done = [r for r in results if r is not None]
        assert len(done) == len(specs), "every service of the batch has its result"
        return done

    async def _plan(self, spec: ServiceSpec, current: ServiceRecord | None) -> UpsertPlan:
        if current is None:
            service_id = (await self._take(self._service_ids, 1))[0]
            rev_nat_id = (await self._take(self._rev_nat_ids, 1))[0]
        else:
            service_id, rev_nat_id = current.id, current.rev_nat_id
        node_port = 0
        if spec.type is ServiceType.NODE_PORT:
            node_port = spec.node_port
            if not node_port and current is not None and current.node_port:
                # Keep the port it was given, as Kubernetes does.
                same_proto = current.frontend.protocol is spec.frontend.protocol
                in_range = (
                    self.limits.node_port_min <= current.node_port <= self.limits.node_port_max
                )
                if same_proto and in_range:
                    node_port = current.node_port
            if not node_port:
                node_port = (await self._take(self._node_ports[spec.frontend.protocol], 1))[0]
        ids_plan = plan_backend_ids(
            current.backends if current else (),
            current.backend_blocks if current else (),
            spec.backends,
        )
        new_blocks = tuple(await self._take(self._blocks, ids_plan.blocks_needed))
        ids, blocks = ids_plan.complete(new_blocks)
        record = ServiceRecord(
            name=spec.name,
            namespace=spec.namespace,
            id=service_id,
            rev_nat_id=rev_nat_id,
            frontend=spec.frontend,
            type=spec.type,
            node_port=node_port,
            backends=tuple(
                Backend(bid, b.address, b.port, b.weight, b.state, b.node)
                for bid, b in zip(ids, spec.backends, strict=True)
            ),
            algorithm=spec.algorithm,
            maglev_table_size=spec.maglev_table_size,
            affinity=spec.affinity,
            source_ranges=spec.source_ranges,
            source=spec.source,
            backend_blocks=blocks,
            labels=spec.labels,
            external_traffic_policy=spec.external_traffic_policy,
            external_ips=spec.external_ips,
            health_check_node_port=spec.health_check_node_port,
            # LB-IPAM's, not the spec's: an update keeps them.
            external=current.external if current is not None else (),
        )
        return UpsertPlan(record, current, new_blocks, ids_plan.release_blocks)

    async def set_external(self, name: str, addresses: tuple[str, ...]) -> None:
        """Record LB-IPAM's addresses of service name (what the datapaths
        serve); nothing when it is gone."""
        for _ in range(MAX_ATTEMPTS):
            record = await self.store.get_by_name(name)
            if record is None or record.external == addresses:
                return
            if await self.store.replace(record, replace(record, external=addresses)):
                return
        raise Aborted(f"service {name!r} changed too often meanwhile; retry")

    async def delete(self, name: str, source: Source = Source.API) -> bool:
        """Delete the service; False when there was none."""
        for _ in range(MAX_ATTEMPTS):
            record = await self.store.get_by_name(name)
            if record is None:
                return False
            if record.source is not source:
                raise FailedPrecondition(
                    f"service {name!r} is managed by {record.source.value}", field="name"
                )
            revision = await self.store.delete(record)
            if revision is not None:
                self._known.discard(name)
                await self._visible(revision)
                return True
        raise Aborted(f"service {name!r} kept changing concurrently; retry", field="name")

    async def _visible(self, revision: int) -> None:
        """Wait until this replica's table shows a write it made, so that
        a Watch or List after the write's answer sees it (read your writes).
        A mirror that lags longer is only logged: the write stands."""
        try:
            await self.store.services.wait_for(revision, VISIBLE_TIMEOUT)
        except TimeoutError:
            log.warning("lb table lags behind a write", extra={"revision": revision})

    # --- watch ---

    def subscribe(self, since_revision: int = 0) -> Subscription[int, ServiceRecord]:
        """Every service (or what changed after since_revision), then the
        changes, from this replica's table of the services."""
        return self.store.services.subscribe(since_revision)

    async def watch_item(
        self, change: Change[int, ServiceRecord], *, include_tables: bool = False
    ) -> WatchItem:
        """What the watch stream says of a change: removed backend ids are
        those the watcher held (change.prev) and the record no longer has."""
        prev, record = change.prev, change.record
        if record is None:
            assert prev is not None, "a deletion names what the watcher held"
            return WatchItem(
                change.revision,
                deleted=DeletedService(prev.name, prev.id, prev.rev_nat_id),
                removed_backend_ids=tuple(sorted(prev.backend_ids())),
            )
        removed = () if prev is None else sorted(prev.backend_ids() - record.backend_ids())
        table = None
        if include_tables and record.algorithm is Algorithm.MAGLEV:
            table = await self.tables.get(record)
        return WatchItem(change.revision, record, table=table, removed_backend_ids=tuple(removed))


def _explicit_node_port(spec: ServiceSpec) -> tuple[Protocol, int] | None:
    if spec.type is ServiceType.NODE_PORT and spec.node_port:
        return spec.frontend.protocol, spec.node_port
    return None


def _fe_text(fe: Frontend) -> str:
    host = f"[{fe.address}]" if ":" in fe.address else fe.address
    return f"{host}:{fe.port}/{fe.protocol.value}"


def _frontend_taken(fe: Frontend, owner: str | None) -> InvalidArgument:
    return InvalidArgument(
        f"{_fe_text(fe)} is already the frontend of service {owner!r} (or one of its external IPs)",
        field="service.frontend",
    )


def _external_taken(spec: ServiceSpec, index: int, owner: str) -> InvalidArgument:
    fe = spec.external_frontends()[index]
    return InvalidArgument(
        f"{_fe_text(fe)} is already served by service {owner!r}",
        field=f"service.external_ips[{index}]",
    )


def _check_externals(spec: ServiceSpec, owners: Sequence[str | None]) -> None:
    """An external IP at the service's port and protocol that another
    service serves (as its frontend or an external IP of its own) is
    refused, naming that service."""
    for i, owner in enumerate(owners):
        if owner not in (None, spec.name):
            raise _external_taken(spec, i, owner)


def _node_port_taken(port: int, owner: str | None) -> InvalidArgument:
    return InvalidArgument(
        f"node port {port} is already used by service {owner!r}", field="service.node_port"
    )
