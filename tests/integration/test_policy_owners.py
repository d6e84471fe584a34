"""Identity references per owner, against real policy processes on a real
etcd: a retried allocation takes no second reference, a release is exact and
idempotent, and an identity lives while any owner or anonymous reference
does."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import IDENT_PREFIX, etcd_keys, pod_labels, stub

from flagella.api.policy.v1 import policy_pb2 as pb

pytestmark = pytest.mark.integration

Spawn = Callable[..., ServiceProcess]


async def refs(endpoint: str, node: str) -> dict[str, dict[str, object]]:
    """The node's reference records in etcd, by identity label string."""
    keys = await etcd_keys(endpoint, IDENT_PREFIX + "value/")
    return {k: v for k, v in keys.items() if k.endswith("/" + node)}


async def test_references_per_owner(etcd: EtcdServer, spawn: Spawn) -> None:
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint, "--identity-gc-interval", "0.3")
    channel, s = stub(policy.address)
    web = pod_labels("shop", app="web")

    async def alloc(owner: str, labels: list[pb.Label] = web) -> pb.AllocateIdentityResponse:
        return await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=labels, node="n1", owner=owner), timeout=10
        )

    async def release(ident: int, owner: str) -> bool:
        resp = await s.ReleaseIdentity(
            pb.ReleaseIdentityRequest(id=ident, node="n1", owner=owner), timeout=10
        )
        return resp.released

    try:
        first = await alloc("c1/eth0")
        again = await alloc("c1/eth0")  # a retry: the same answer, no second reference
        assert again.identity.id == first.identity.id
        assert not again.created
        assert again.identity.revision >= first.identity.revision
        (record,) = (await refs(etcd.endpoint, "n1")).values()
        assert record == {"id": first.identity.id, "refs": 1, "owners": ["c1/eth0"]}

        second = await alloc("c2/eth0")
        anon = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=web, node="n1"), timeout=10
        )
        assert second.identity.id == anon.identity.id == first.identity.id
        (record,) = (await refs(etcd.endpoint, "n1")).values()
        assert record == {"id": first.identity.id, "refs": 3, "owners": ["c1/eth0", "c2/eth0"]}

        ident = first.identity.id
        # An owner that holds nothing releases nothing, however often.
        assert await release(ident, "never/eth0") is False
        assert await release(ident, "c1/eth0") is False
        assert await release(ident, "c1/eth0") is False  # idempotent
        (record,) = (await refs(etcd.endpoint, "n1")).values()
        assert record == {"id": ident, "refs": 2, "owners": ["c2/eth0"]}
        # Anonymous release drops the anonymous reference, never an owned one.
        anon_release = await s.ReleaseIdentity(
            pb.ReleaseIdentityRequest(id=ident, node="n1"), timeout=10
        )
        assert anon_release.released is False
        anon_again = await s.ReleaseIdentity(
            pb.ReleaseIdentityRequest(id=ident, node="n1"), timeout=10
        )
        assert anon_again.released is False
        (record,) = (await refs(etcd.endpoint, "n1")).values()
        assert record == {"id": ident, "refs": 1, "owners": ["c2/eth0"]}

        # One owner on two identities (a label change in progress).
        other = await alloc("c2/eth0", pod_labels("shop", app="web", tier="front"))
        assert other.identity.id != ident
        assert await release(ident, "c2/eth0") is True  # the node's last on ident
        held = await refs(etcd.endpoint, "n1")
        assert [v["id"] for v in held.values()] == [other.identity.id]

        # Unreferenced, the first identity is garbage-collected; the other stays.
        async def gone() -> bool:
            try:
                await s.GetIdentity(pb.GetIdentityRequest(id=ident), timeout=5)
            except grpc.aio.AioRpcError as exc:
                return exc.code() == grpc.StatusCode.NOT_FOUND
            return False

        for _ in range(100):
            if await gone():
                break
            await asyncio.sleep(0.1)
        assert await gone()
        got = await s.GetIdentity(pb.GetIdentityRequest(id=other.identity.id), timeout=5)
        assert got.referenced_by == ["n1"]
    finally:
        await channel.close()


async def test_retries_across_a_replica_kill_count_once(etcd: EtcdServer, spawn: Spawn) -> None:
    """Many owners allocate and retry through two replicas while one is
    killed: every owner ends holding exactly one reference."""
    args = ("--etcd-endpoints", etcd.endpoint)
    replicas = [spawn("policy", *args) for _ in range(2)]
    stubs = [stub(r.address) for r in replicas]
    labels = pod_labels("shop", app="db")
    owners = [f"c{i}/eth0" for i in range(60)]
    alive = [True, True]

    async def take(i: int, owner: str) -> None:
        for attempt in range(50):
            r = (i + attempt) % 2
            if not alive[r]:
                continue
            try:
                await stubs[r][1].AllocateIdentity(
                    pb.AllocateIdentityRequest(labels=labels, node="n1", owner=owner), timeout=5
                )
                # A client that lost the answer retries: it must not count twice.
                await stubs[(r + 1) % 2][1].AllocateIdentity(
                    pb.AllocateIdentityRequest(labels=labels, node="n1", owner=owner), timeout=5
                ) if alive[(r + 1) % 2] else None
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        raise AssertionError(f"{owner} never got its reference")

    async def killer() -> None:
        await asyncio.sleep(0.3)
        alive[0] = False
        replicas[0].kill9()

    try:
        await asyncio.gather(killer(), *(take(i, o) for i, o in enumerate(owners)))
        (record,) = (await refs(etcd.endpoint, "n1")).values()
        assert record["owners"] == sorted(owners)
        assert record["refs"] == len(owners)
    finally:
        for channel, _ in stubs:
            await channel.close()
