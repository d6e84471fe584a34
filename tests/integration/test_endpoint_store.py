"""The endpoint service's etcd store against a real etcd: ids are unique
under concurrency, updates are compare-and-swap, one endpoint per attachment."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from harness.etcd import EtcdServer

from flagella.common.errors import Aborted
from flagella.endpoint.model import Endpoint
from flagella.endpoint.store import EndpointStore

pytestmark = pytest.mark.integration


@pytest.fixture
async def stores(etcd: EtcdServer) -> AsyncIterator[list[EndpointStore]]:
    clients = [etcd.client("endpoint") for _ in range(3)]  # three "replicas", its etcd user
    for c in clients:
        await asyncio.wait_for(c.wait_connected(), 30)
    yield [EndpointStore(c) for c in clients]
    for c in clients:
        await c.close()


def new(cid: str) -> Endpoint:
    return Endpoint(id=0, container_id=cid, ifname="eth0", netns_path="/x", node="n1")


async def test_concurrent_creates_get_unique_ids(stores: list[EndpointStore]) -> None:
    created = await asyncio.gather(*(stores[i % 3].create(new(f"c{i}")) for i in range(60)))
    assert all(c.created for c in created)
    ids = [c.endpoint.id for c in created]
    assert len(ids) == 60
    assert len(set(ids)) == 60
    listed = await stores[0].list_all()
    assert sorted(ep.id for ep in listed) == sorted(ids)
    for ep in listed:
        by_id = await stores[1].get_by_id(ep.id)
        assert by_id is not None
        assert by_id[0].container_id == ep.container_id


async def test_one_endpoint_per_attachment(stores: list[EndpointStore]) -> None:
    results = await asyncio.gather(*(s.create(new("same")) for s in stores))
    assert sum(r.created for r in results) == 1
    # The others got the winner's endpoint and revision, read in their own
    # transaction.
    (winner,) = [r for r in results if r.created]
    for r in results:
        assert (r.endpoint.id, r.revision) == (winner.endpoint.id, winner.revision)
    found = await stores[0].get("same", "eth0")
    assert found is not None
    assert found[1] == winner.revision


async def test_the_id_counter_is_remembered_and_refreshed(
    stores: list[EndpointStore], etcd: EtcdServer
) -> None:
    first = await stores[0].create(new("a"))
    other = await stores[1].create(new("b"))  # moves the counter behind stores[0]'s back
    again = await stores[0].create(new("c"))  # stale copy: one retry, then the next id
    assert [first.endpoint.id, other.endpoint.id, again.endpoint.id] == [1, 2, 3]
    # A created endpoint's revision is its key's mod revision: usable for CAS.
    await stores[0].update(again.endpoint, again.revision)


async def test_update_is_compare_and_swap_and_delete_frees_the_id(
    stores: list[EndpointStore],
) -> None:
    assert (await stores[0].create(new("cas"))).created
    found = await stores[0].get("cas", "eth0")
    assert found is not None
    current, rev = found
    current.identity = 300
    new_rev = await stores[0].update(current, rev)
    current.identity = 400
    with pytest.raises(Aborted):
        await stores[1].update(current, rev)
    await stores[1].update(current, new_rev)
    got = await stores[2].get("cas", "eth0")
    assert got is not None
    assert got[0].identity == 400
    await stores[0].delete(current)
    assert await stores[0].get("cas", "eth0") is None
    assert await stores[0].get_by_id(current.id) is None
