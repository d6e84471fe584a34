"""etcd state of the endpoint service.

    flagella/endpoint/v1/endpoints/<container id>/<ifname>  -> Endpoint JSON
    flagella/endpoint/v1/ids/<endpoint id>                   -> "<container id>/<ifname>"
    flagella/endpoint/v1/next-id                             -> next id to try

An endpoint and its id are created in one transaction (the id is claimed
create-if-absent), so two replicas never hand out one id and a crash never
leaves an id without its endpoint. The counter is kept in memory between
creates (its value and mod revision, the transaction's guard); a stale copy
only costs a retry, and the failed transaction reads the current one.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

from flagella.common import etcd as e
from flagella.common.errors import Aborted
from flagella.endpoint.model import Endpoint

log = logging.getLogger(__name__)

PREFIX = "flagella/endpoint/v1/"
ENDPOINTS = PREFIX + "endpoints/"
IDS = PREFIX + "ids/"
NEXT_ID = PREFIX + "next-id"
# Host veths are named lxc<id in hex>; IFNAMSIZ leaves 12 hex digits.
MAX_ID = 16**12 - 1


def endpoint_key(container_id: str, ifname: str) -> str:
    return f"{ENDPOINTS}{container_id}/{ifname}"


class EndpointCodec:
    """The endpoints of etcd as a table (flagella.common.sync.EtcdSource):
    keyed "<container id>/<ifname>"."""

    def key(self, key: str) -> str | None:
        return key[len(ENDPOINTS) :] if key.startswith(ENDPOINTS) else None

    def decode(self, key: str, kv: e.KeyValue) -> Endpoint | None:
        try:
            return Endpoint.from_json(kv.value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("endpoint record not readable", extra={"key": key, "error": repr(exc)})
            return None


class Created(NamedTuple):
    """The outcome of create: the new endpoint (created) or the one the
    attachment already has (nothing written), with its mod revision."""

    created: bool
    endpoint: Endpoint
    revision: int


class EndpointStore:
    def __init__(self, etcd: e.Etcd) -> None:
        self.etcd = etcd
        # (next id, mod revision of the counter) as last seen; None: read it.
        self._counter: tuple[int, int] | None = None

    async def get(self, container_id: str, ifname: str) -> tuple[Endpoint, int] | None:
        """The endpoint and its mod revision (for compare-and-swap)."""
        kv = await self.etcd.get(endpoint_key(container_id, ifname))
        return None if kv is None else (Endpoint.from_json(kv.value), kv.mod_revision)

    async def get_by_id(self, endpoint_id: int) -> tuple[Endpoint, int] | None:
        kv = await self.etcd.get(f"{IDS}{endpoint_id}")
        if kv is None:
            return None
        container_id, _, ifname = kv.value.decode().rpartition("/")
        return await self.get(container_id, ifname)

    async def list_all(self) -> list[Endpoint]:
        kvs, _ = await self.etcd.get_prefix(ENDPOINTS)
        return [Endpoint.from_json(kv.value) for kv in kvs]

    async def create(self, ep: Endpoint) -> Created:
        """Store a new endpoint with a fresh id, in one transaction; or, if
        the attachment already has an endpoint, that one (read in the same
        transaction)."""
        key = endpoint_key(ep.container_id, ep.ifname)
        for _ in range(64):
            if self._counter is None:
                kv = await self.etcd.get(NEXT_ID)
                self._counter = (int(kv.value), kv.mod_revision) if kv is not None else (1, 0)
            candidate, counter_revision = self._counter
            if candidate > MAX_ID:
                candidate = 1
            counter_guard = e.mod_revision_is(NEXT_ID, counter_revision)
            ep.id = candidate
            res = await self.etcd.txn(
                [e.absent(key), e.absent(f"{IDS}{candidate}"), counter_guard],
                [
                    e.put_op(key, ep.to_json()),
                    e.put_op(f"{IDS}{candidate}", f"{ep.container_id}/{ep.ifname}".encode()),
                    e.put_op(NEXT_ID, str(candidate + 1).encode()),
                ],
                [e.get_op(key), e.get_op(f"{IDS}{candidate}"), e.get_op(NEXT_ID)],
            )
            if res.succeeded:
                self._counter = (candidate + 1, res.revision)
                return Created(True, ep, res.revision)
            existing, id_taken, counter = res.ranges
            self._counter = (int(counter[0].value), counter[0].mod_revision) if counter else (1, 0)
            if existing:
                return Created(
                    False, Endpoint.from_json(existing[0].value), existing[0].mod_revision
                )
            if id_taken and self._counter[1] == counter_revision:
                # A wrapped-around counter met a live id: step past it.
                step = await self.etcd.txn(
                    [counter_guard], [e.put_op(NEXT_ID, str(candidate + 1).encode())]
                )
                self._counter = (candidate + 1, step.revision) if step.succeeded else None
        raise Aborted("could not allocate an endpoint id: too much contention")

    async def update(self, ep: Endpoint, revision: int) -> int:
        """Compare-and-swap on the mod revision. Returns the new revision;
        raises Aborted when someone else changed the endpoint."""
        key = endpoint_key(ep.container_id, ep.ifname)
        res = await self.etcd.txn([e.mod_revision_is(key, revision)], [e.put_op(key, ep.to_json())])
        if not res.succeeded:
            raise Aborted(f"endpoint {ep.container_id}/{ep.ifname} changed concurrently")
        return res.revision

    async def delete(self, ep: Endpoint) -> None:
        await self.etcd.txn(
            [],
            [e.delete_op(endpoint_key(ep.container_id, ep.ifname)), e.delete_op(f"{IDS}{ep.id}")],
        )
