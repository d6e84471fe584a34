"""Identity references per (identity, node, owner) against real policy
processes on a real etcd: idempotent allocation and exact release by owner,
owners mixed with the anonymous count, one owner on two identities, garbage
collection, and several replicas (one killed with SIGKILL) with clients
retrying."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import IDENT_PREFIX, etcd_keys, pod_labels, stub, watch_policy

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.policy import keys

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}

A = "9b1f0c3e5d7a2b4c6e8f0a1b3c5d7e9f1a2b3c4d5e6f708192a3b4c5d6e7f809/eth0"
B = "0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6e7f8a9b0c1d/eth0"


async def references(etcd: EtcdServer) -> dict[tuple[int, str], list[str]]:
    """What etcd holds: (identity, node) -> its owners, sorted ("" for the
    anonymous count, once per reference it counts)."""
    out: dict[tuple[int, str], list[str]] = defaultdict(list)
    for key, value in (await etcd_keys(etcd, IDENT_PREFIX + "value/")).items():
        parsed = keys.parse_key(key)
        assert parsed.kind == "ref", key
        if parsed.c:
            assert set(value) == {"id"}, value
            out[(value["id"], parsed.b)].append(parsed.c)
        else:
            out[(value["id"], parsed.b)] += [""] * value["refs"]
    return {k: sorted(v) for k, v in out.items()}


async def global_ids(etcd: EtcdServer) -> set[int]:
    state = await etcd_keys(etcd, IDENT_PREFIX + "id/")
    return {int(k.rsplit("/", 1)[1]) for k in state}


async def seen(s: pbg.PolicyServiceStub) -> int:
    """The revision the replica's state is at (it includes its own writes)."""
    return int((await s.ListIdentities(pb.ListIdentitiesRequest())).revision)


class Client:
    def __init__(self, s: pbg.PolicyServiceStub) -> None:
        self.s = s

    async def allocate(self, labels: list[pb.Label], node: str, owner: str = "") -> Any:
        return await self.s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=labels, node=node, owner=owner)
        )

    async def release(self, ident: int, node: str, owner: str = "") -> bool:
        resp = await self.s.ReleaseIdentity(
            pb.ReleaseIdentityRequest(id=ident, node=node, owner=owner)
        )
        return bool(resp.released)


async def test_owned_references_are_idempotent_and_exact(etcd: EtcdServer, spawn: Spawn) -> None:
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    ch, s = stub(proc.address)
    c = Client(s)
    web = pod_labels("shop", app="web")
    try:
        # a repeated allocation by one owner keeps one reference, and answers
        # the revision of the write that took it
        first = await c.allocate(web, "n1", A)
        assert first.created
        ident = first.identity.id
        again = await c.allocate(web, "n1", A)
        assert not again.created
        assert again.identity.id == ident
        assert again.identity.revision == first.identity.revision
        assert list(again.identity.referenced_by) == ["n1"]
        assert await references(etcd) == {(ident, "n1"): [A]}
        stream = watch_policy(s, "n1")
        await stream.until_synced(again.identity.revision)
        assert set(stream.state) == {ident}

        # two owners, released one by one: released only at the last; a
        # release of an owner holding nothing is a no-op
        second = await c.allocate(web, "n1", B)
        assert second.identity.revision > first.identity.revision
        assert await references(etcd) == {(ident, "n1"): sorted([A, B])}
        assert await c.release(ident, "n1", "nobody/eth0") is False
        assert await c.release(ident, "n1", A) is False
        assert await c.release(ident, "n1", A) is False
        assert await references(etcd) == {(ident, "n1"): [B]}
        assert await c.release(ident, "n1", B) is True
        assert await c.release(ident, "n1", B) is False
        assert await references(etcd) == {}
        await stream.until_synced(await seen(s))
        assert set(stream.state) == set()

        # anonymous and owned references mixed, released in either order
        for order in ((A, ""), ("", A)):
            await c.allocate(web, "n1")
            await c.allocate(web, "n1", A)
            await c.allocate(web, "n1", A)
            assert await references(etcd) == {(ident, "n1"): ["", A]}
            got = await s.GetIdentity(pb.GetIdentityRequest(id=ident))
            assert list(got.referenced_by) == ["n1"]
            # an owner that holds nothing releases nothing, not the anonymous one
            assert await c.release(ident, "n1", B) is False
            assert await c.release(ident, "n1", order[0]) is False
            assert await c.release(ident, "n1", order[1]) is True
            assert await references(etcd) == {}

        # one owner on two identities (an endpoint changing labels)
        web2 = pod_labels("shop", app="web", version="2")
        old = await c.allocate(web, "n1", A)
        new = await c.allocate(web2, "n1", A)
        assert new.identity.id != old.identity.id
        await stream.until_synced(new.identity.revision)
        assert set(stream.state) == {ident, new.identity.id}
        assert await c.release(ident, "n1", A) is True  # the node's last on the old one
        assert await references(etcd) == {(new.identity.id, "n1"): [A]}
        again = await c.allocate(web2, "n1", A)
        assert again.identity.revision == new.identity.revision
        await stream.until_synced(await seen(s))
        assert set(stream.state) == {new.identity.id}

        # the same owner name on another node is another reference
        other = await c.allocate(web2, "n2", A)
        assert sorted(other.identity.referenced_by) == ["n1", "n2"]
        assert await c.release(new.identity.id, "n2", A) is True
        assert await c.release(new.identity.id, "n1", A) is True
        stream.cancel()

        # reserved identities take owners too
        init = [pb.Label(source="reserved", key="init")]
        r1 = await c.allocate(init, "n3", A)
        r2 = await c.allocate(init, "n3", A)
        assert r1.identity.id == r2.identity.id == 5
        assert r1.identity.revision == r2.identity.revision
        assert await references(etcd) == {(5, "n3"): [A]}
        assert await c.release(5, "n3", A) is True

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.allocate(web, "n1", "x" * 300)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith("owner: ")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await c.release(ident, "n1", "a\nb")
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await ch.close()


async def test_owner_sequences_across_replicas(etcd: EtcdServer, spawn: Spawn) -> None:
    """Allocate, release and allocate again by one owner, each call on the
    other replica (whose mirror may not have seen the last write yet): the
    reference is there exactly when the last call says so."""
    args = ("--etcd-endpoints", etcd.endpoint)
    replicas = [spawn("policy", *args) for _ in range(2)]
    channels, stubs = zip(*(stub(r.address) for r in replicas), strict=True)
    web = pod_labels("shop", app="web")
    try:
        for i in range(15):
            one, two = Client(stubs[i % 2]), Client(stubs[(i + 1) % 2])
            owner = f"c{i % 3}/eth0"
            got = await one.allocate(web, "n1", owner)
            ident = got.identity.id
            assert await two.release(ident, "n1", owner) is True
            again = await one.allocate(web, "n1", owner)
            assert again.identity.id == ident
            assert again.identity.revision > got.identity.revision  # a new reference
            assert await two.allocate(web, "n1", owner) == again
            assert await references(etcd) == {(ident, "n1"): [owner]}
            assert await one.release(ident, "n1", owner) is True
            assert await two.release(ident, "n1", owner) is False
    finally:
        for ch in channels:
            await ch.close()


async def _until(check: Callable[[], Awaitable[bool]], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            pytest.fail(what)
        await asyncio.sleep(0.2)


async def test_gc_waits_for_every_owner_and_the_anonymous_count(
    etcd: EtcdServer, spawn: Spawn
) -> None:
    proc = spawn(
        "policy",
        "--etcd-endpoints",
        etcd.endpoint,
        "--identity-gc-interval",
        "0.3",
        "--node-lease-ttl",
        "3",
    )
    ch, s = stub(proc.address)
    c = Client(s)
    web = pod_labels("shop", app="web")
    gone = pod_labels("shop", app="gone")
    try:
        # n1 and n2 stay alive (their WatchPolicy streams keep their leases)
        streams = [watch_policy(s, node) for node in ("n1", "n2")]
        for stream in streams:
            await stream.until_synced(await seen(s))
        ident = (await c.allocate(web, "n1")).identity.id
        await c.allocate(web, "n1", A)
        await c.allocate(web, "n1", A)  # a retry: still one reference of A
        await c.allocate(web, "n2", B)
        # a node with nothing but an owner's reference, that dies
        dead = (await c.allocate(gone, "dead", A)).identity.id

        async def exists(i: int) -> bool:
            return i in await global_ids(etcd)

        async def dead_freed() -> bool:
            return not await exists(dead)

        await _until(dead_freed, "an owned reference outlived its node's lease")

        for owner, node in (("", "n1"), (A, "n1")):
            assert await c.release(ident, node, owner) is (owner == A)
            await asyncio.sleep(1.5)  # several GC rounds
            assert await exists(ident), f"freed while {B} on n2 holds it"
        assert await c.release(ident, "n2", B) is True

        async def freed() -> bool:
            return not await exists(ident)

        await _until(freed, "the identity was never garbage-collected")
        assert await references(etcd) == {}
        for stream in streams:
            stream.cancel()
    finally:
        await ch.close()


async def test_owners_across_replicas_and_a_kill9_lose_nothing(
    etcd: EtcdServer, spawn: Spawn
) -> None:
    """12 clients, each the endpoints of one node-worth of owners, allocate
    (every call made twice, as a client whose answer was lost would) and
    release half again, through 3 replicas, one killed with SIGKILL mid-run,
    retrying on the others. Then etcd holds exactly one reference per owner
    still holding one, nothing else, and identities nobody holds are
    garbage-collected."""
    args = ("--etcd-endpoints", etcd.endpoint, "--identity-gc-interval", "0.5")
    replicas = [spawn("policy", *args) for _ in range(3)]
    channels, stubs = zip(*(stub(r.address) for r in replicas), strict=True)
    label_sets = [pod_labels(f"ns-{i % 3}", app=f"app-{i}") for i in range(30)]
    alive = [True, True, True]
    expected: dict[tuple[int, str], set[str]] = defaultdict(set)
    calls = 0
    halfway = asyncio.Event()
    total = 12 * 40 * 2 + 12 * 20

    async def call(k: int, fn: Callable[[pbg.PolicyServiceStub], Awaitable[Any]]) -> Any:
        nonlocal calls
        while True:
            if not alive[k]:
                k = (k + 1) % 3
                continue
            try:
                resp = await fn(stubs[k])
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRY:
                    raise
                k = (k + 1) % 3
        calls += 1
        if calls >= total // 2:
            halfway.set()
        return resp

    async def client(c: int) -> None:
        rng = random.Random(c)
        node = f"node-{c % 4}"
        mine = [(f"ctr-{c}-{j}/eth0", rng.randrange(len(label_sets))) for j in range(40)]
        got: dict[str, int] = {}
        for owner, i in mine:
            request = pb.AllocateIdentityRequest(labels=label_sets[i], node=node, owner=owner)
            answers = []
            for _ in range(2):
                resp = await call(rng.randrange(3), lambda s, r=request: s.AllocateIdentity(r))
                answers.append((resp.identity.id, resp.identity.revision))
            assert answers[0] == answers[1]  # the repeat took nothing
            got[owner] = answers[0][0]
            expected[(got[owner], node)].add(owner)
        for owner, _ in mine[::2]:
            release = pb.ReleaseIdentityRequest(id=got[owner], node=node, owner=owner)
            await call(rng.randrange(3), lambda s, r=release: s.ReleaseIdentity(r))
            expected[(got[owner], node)].discard(owner)

    try:
        tasks = [asyncio.create_task(client(c)) for c in range(12)]
        await asyncio.wait_for(halfway.wait(), 60)
        assert calls < total, "the kill must happen mid-run"
        alive[1] = False
        replicas[1].kill9()
        await asyncio.gather(*tasks)

        held = {k: sorted(v) for k, v in expected.items() if v}
        assert await references(etcd) == held
        # identities nobody holds any more are freed, the others kept
        wanted = {ident for ident, _ in held}

        async def collected() -> bool:
            return await global_ids(etcd) == wanted

        await _until(collected, "identities without references were not garbage-collected")

        # the surviving replica agrees, identities and streams
        s = stubs[0]
        listed = await s.ListIdentities(pb.ListIdentitiesRequest())
        by_id = {i.id: sorted(i.referenced_by) for i in listed.identities if not i.reserved}
        nodes_of: dict[int, set[str]] = defaultdict(set)
        for ident, node in held:
            nodes_of[ident].add(node)
        assert by_id == {i: sorted(n) for i, n in nodes_of.items()}
        stream = watch_policy(s, "node-0")
        await stream.until_synced(await seen(s))
        assert set(stream.state) == {ident for ident, node in held if node == "node-0"}
        stream.cancel()
    finally:
        for ch in channels:
            await ch.close()
