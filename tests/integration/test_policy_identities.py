"""Identities across real policy processes on a real etcd: concurrent
allocation by several replicas, a replica killed mid-run, node leases,
release and garbage collection."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import IDENT_PREFIX, IP_PREFIX, etcd_keys, pod_labels, stub, watch_policy

from flagella.api.policy.v1 import policy_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


async def test_three_replicas_race_and_a_kill9_loses_nothing(
    etcd: EtcdServer, spawn: Spawn
) -> None:
    """16 clients allocate the same 1,000 label sets through 3 replicas (one
    killed with SIGKILL mid-run): exactly 1,000 identities, each label set
    one id and each id one label set, and every identity handed out is
    still there, referenced, after garbage collection has run."""
    args = ("--etcd-endpoints", etcd.endpoint, "--identity-gc-interval", "0.5")
    replicas = [spawn("policy", *args) for _ in range(3)]
    label_sets = [
        pod_labels(f"ns-{i % 10}", app=f"app-{i}", **{"pod-template-hash": f"h{i}"})
        for i in range(1000)
    ]
    channels, stubs = zip(*(stub(r.address) for r in replicas), strict=True)
    alive = [True, True, True]
    handed: dict[int, set[int]] = defaultdict(set)
    by_node: dict[str, set[int]] = defaultdict(set)
    done = 0
    created = 0
    halfway = asyncio.Event()

    async def client(c: int) -> None:
        nonlocal done, created
        rng = random.Random(c)
        order = list(range(len(label_sets)))
        rng.shuffle(order)
        node = f"node-{c % 4}"
        k = c % 3
        for i in order:
            request = pb.AllocateIdentityRequest(labels=label_sets[i], node=node)
            while True:
                if not alive[k]:
                    k = (k + 1) % 3
                    continue
                try:
                    resp = await stubs[k].AllocateIdentity(request, timeout=15)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code() not in RETRY:
                        raise
                    k = (k + 1) % 3
            handed[i].add(resp.identity.id)
            by_node[node].add(resp.identity.id)
            created += resp.created
            done += 1
            if done >= 5000:
                halfway.set()
            k = (k + 1) % 3

    try:
        tasks = [asyncio.create_task(client(c)) for c in range(16)]
        await asyncio.wait_for(halfway.wait(), 120)
        assert done < 16 * 1000, "the kill must happen mid-run"
        alive[1] = False
        replicas[1].kill9()
        await asyncio.gather(*tasks)
    finally:
        for ch in channels:
            await ch.close()

    assert done == 16 * 1000
    # each label set got one id, from every client and every replica
    assert all(len(ids) == 1 for ids in handed.values()), [
        (i, ids) for i, ids in handed.items() if len(ids) != 1
    ][:5]
    ids = {next(iter(v)) for v in handed.values()}
    assert len(ids) == 1000
    assert all(256 <= i <= 65535 for i in ids)
    assert created <= 1000

    # what etcd holds: exactly 1,000 identities, bijective, the ones handed out
    await asyncio.sleep(1.5)  # a few GC rounds
    state = await etcd_keys(etcd, IDENT_PREFIX)
    by_id = {int(k.rsplit("/", 1)[1]): v["labels"] for k, v in state.items() if "/id/" in k}
    by_labels = {k.split("/labels/", 1)[1]: v["id"] for k, v in state.items() if "/labels/" in k}
    assert set(by_id) == ids
    assert len(by_labels) == 1000
    assert sorted(by_labels.values()) == sorted(ids)
    for i, handed_ids in handed.items():
        (ident,) = handed_ids
        labels = by_id[ident]
        assert f"k8s:app=app-{i}" in labels
        assert not any("pod-template-hash" in lb for lb in labels)
    # every node still references every identity it was handed
    refs = [(k, v) for k, v in state.items() if "/value/" in k]
    for node, node_ids in by_node.items():
        held = {v["id"] for k, v in refs if k.endswith("/" + node)}
        assert held == node_ids
        # four clients per node: at least four references each (a call
        # retried after a commit it never heard of may count twice)
        assert all(v["refs"] >= 4 for k, v in refs if k.endswith("/" + node))

    # a surviving replica and a fresh one agree with etcd
    fresh = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    for proc in (replicas[0], fresh):
        ch, s = stub(proc.address)
        try:
            listed = await s.ListIdentities(pb.ListIdentitiesRequest())
            global_ids = {i.id: i for i in listed.identities if not i.reserved}
            assert set(global_ids) == ids
            assert sorted(global_ids[min(ids)].referenced_by) == sorted(by_node)
            one = await s.GetIdentity(
                pb.GetIdentityRequest(labels=pb.LabelList(labels=label_sets[7]))
            )
            assert one.id == next(iter(handed[7]))
        finally:
            await ch.close()


async def test_release_refcounts_and_reserved_identities(etcd: EtcdServer, spawn: Spawn) -> None:
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    ch, s = stub(proc.address)
    try:
        web = pod_labels("shop", app="web")
        a = await s.AllocateIdentity(pb.AllocateIdentityRequest(labels=web, node="n1"))
        b = await s.AllocateIdentity(pb.AllocateIdentityRequest(labels=web, node="n1"))
        c = await s.AllocateIdentity(pb.AllocateIdentityRequest(labels=web, node="n2"))
        assert a.created
        assert not b.created
        assert not c.created
        assert a.identity.id == b.identity.id == c.identity.id
        assert sorted(c.identity.referenced_by) == ["n1", "n2"]
        ident = a.identity.id

        async def release(node: str) -> bool:
            r = await s.ReleaseIdentity(pb.ReleaseIdentityRequest(id=ident, node=node))
            return r.released

        assert await release("n1") is False  # one of two
        assert await release("n1") is True
        assert await release("n1") is False  # nothing left: idempotent
        got = await s.GetIdentity(pb.GetIdentityRequest(id=ident))
        assert list(got.referenced_by) == ["n2"]

        # reserved label sets map to reserved ids, and are referenced too
        init = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=[pb.Label(source="reserved", key="init")], node="n3")
        )
        assert init.identity.id == 5
        assert init.identity.reserved
        assert list(init.identity.referenced_by) == ["n3"]
        stream = watch_policy(s, "n3")
        await stream.until_synced()
        assert set(stream.state) == {5}
        stream.cancel()
        assert (await s.ReleaseIdentity(pb.ReleaseIdentityRequest(id=5, node="n3"))).released
        host = await s.GetIdentity(
            pb.GetIdentityRequest(
                labels=pb.LabelList(labels=[pb.Label(source="reserved", key="host")])
            )
        )
        assert host.id == 1
        assert host.reserved
    finally:
        await ch.close()


async def test_node_lease_expiry_and_garbage_collection(etcd: EtcdServer, spawn: Spawn) -> None:
    """A node that shows no sign of life for the lease TTL loses its
    references and ipcache entries; unreferenced identities are then
    garbage-collected. A node with an open WatchPolicy stream keeps its."""
    proc = spawn(
        "policy",
        "--etcd-endpoints",
        etcd.endpoint,
        "--node-lease-ttl",
        "2",
        "--identity-gc-interval",
        "0.5",
    )
    ch, s = stub(proc.address)
    try:
        dead = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("a", app="gone"), node="dead")
        )
        live = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("a", app="kept"), node="live")
        )
        for ip, ident, node in (
            ("10.0.0.1", dead.identity.id, "dead"),
            ("10.0.0.2", live.identity.id, "live"),
        ):
            await s.UpsertIPCache(
                pb.UpsertIPCacheRequest(entry=pb.IPCacheEntry(prefix=ip, identity=ident, node=node))
            )
        stream = watch_policy(s, "live")
        await stream.until_synced()
        assert set(stream.state) == {live.identity.id}

        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            listed = await s.ListIdentities(pb.ListIdentitiesRequest())
            if dead.identity.id not in {i.id for i in listed.identities}:
                break
            await asyncio.sleep(0.2)
        else:
            pytest.fail("the dead node's identity was never garbage-collected")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.GetIdentity(pb.GetIdentityRequest(id=dead.identity.id))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        kept = await s.GetIdentity(pb.GetIdentityRequest(id=live.identity.id))
        assert list(kept.referenced_by) == ["live"]
        ipcache = await etcd_keys(etcd, IP_PREFIX)
        assert set(ipcache) == {IP_PREFIX + "10.0.0.2"}
        stream.cancel()
    finally:
        await ch.close()


async def test_gc_deletes_many_identities_per_transaction_and_spares_a_referenced_one(
    etcd: EtcdServer,
) -> None:
    """The GC frees a round's identities several per transaction; when one
    of them was referenced again meanwhile, the transaction fails and they
    go one by one: that one is kept, the others freed."""
    from flagella.policy import keys
    from flagella.policy.store import IdentityToDelete, PolicyStore

    client = etcd.client()
    store = PolicyStore(client)
    try:
        lease = await store.grant_node_lease("gc-node", 60, "test")
        due = []
        for i in range(5):
            labels = f"k8s:app=gc-batch-{i}"
            created = await store.create_identity(70_000 + i, labels, [labels], lease)
            assert created.__class__.__name__ == "IdentityCreated"
            ref = await store.get_reference(labels, "gc-node")
            assert ref is not None
            await store.drop_reference(labels, 70_000 + i, "gc-node", held=ref)
            stored = await store.get_identity(70_000 + i)
            entry = await store.get_labels(labels)
            assert stored is not None
            assert entry is not None
            due.append(IdentityToDelete(70_000 + i, labels, stored.revision, entry.revision))
        # Unreferenced and unchanged: together, in one transaction.
        assert await store.delete_identities(due[:2]) == [True, True]
        # One referenced again after it was seen unreferenced.
        again = await store.add_reference(
            due[3].labels, due[3].id, lease, held=None, labels_revision=due[3].labels_revision
        )
        assert again.__class__.__name__ == "ReferenceTaken"
        assert await store.delete_identities(due[2:]) == [True, False, True]
        left, _ = await client.get_prefix(keys.ID_PREFIX)
        assert [kv.key for kv in left if kv.key.endswith(tuple(str(d.id) for d in due))] == [
            keys.id_key(due[3].id)
        ]
    finally:
        await client.close()
