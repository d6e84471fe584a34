"""etcd state of the endpoint service.

    flagella/endpoint/v1/endpoints/<container id>/<ifname>  -> Endpoint JSON
    flagella/endpoint/v1/ids/<endpoint id>                   -> "<container id>/<ifname>"
    flagella/endpoint/v1/next-id                             -> next id to try

An endpoint and its id are created in one transaction (the id is claimed
create-if-absent), so two replicas never hand out one id and a crash never
leaves an id without its endpoint.
"""

from __future__ import annotations

from flagella.common import etcd as e
from flagella.common.errors import Aborted
from flagella.endpoint.model import Endpoint

PREFIX = "flagella/endpoint/v1/"
ENDPOINTS = PREFIX + "endpoints/"
IDS = PREFIX + "ids/"
NEXT_ID = PREFIX + "next-id"
# Host veths are named lxc<id in hex>; IFNAMSIZ leaves 12 hex digits.
MAX_ID = 16**12 - 1


def endpoint_key(container_id: str, ifname: str) -> str:
    return f"{ENDPOINTS}{container_id}/{ifname}"


class EndpointStore:
    def __init__(self, etcd: e.Etcd) -> None:
        self.etcd = etcd

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

    async def create(self, ep: Endpoint) -> Endpoint | None:
        """Store a new endpoint with a fresh id. None if the attachment
        already has an endpoint (a concurrent ADD won)."""
        key = endpoint_key(ep.container_id, ep.ifname)
        for _ in range(64):
            kv = await self.etcd.get(NEXT_ID)
            candidate = int(kv.value) if kv is not None else 1
            if candidate > MAX_ID:
                candidate = 1
            counter_guard = e.mod_revision_is(NEXT_ID, kv.mod_revision if kv else 0)
            ep.id = candidate
            res = await self.etcd.txn(
                [e.absent(key), e.absent(f"{IDS}{candidate}"), counter_guard],
                [
                    e.put_op(key, ep.to_json()),
                    e.put_op(f"{IDS}{candidate}", f"{ep.container_id}/{ep.ifname}".encode()),
                    e.put_op(NEXT_ID, str(candidate + 1).encode()),
                ],
                [e.get_op(key), e.get_op(f"{IDS}{candidate}")],
            )
            if res.succeeded:
                return ep
            existing, id_taken = res.ranges
            if existing:
                return None
            if id_taken:
                # A wrapped-around counter met a live id: step past it.
                await self.etcd.txn(
                    [counter_guard], [e.put_op(NEXT_ID, str(candidate + 1).encode())]
                )
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
