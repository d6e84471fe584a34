"""WatchPolicy and WatchIPCache against real processes: snapshot then
deltas, and a client that disconnects and resumes from its last revision
(on another replica, or after etcd compacted that revision away) ends with
exactly the state of a fresh snapshot."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import pod_labels, stub, watch_ipcache, watch_policy

from flagella.api.policy.v1 import policy_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

RULES = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}]}]
  ingressDeny:
  - fromEndpoints: [{matchLabels: {app: bad}}]
  egress:
  - toCIDRSet: [{cidr: 10.0.0.0/8, except: [10.96.0.0/12]}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: client, namespace: shop}
spec:
  podSelector: {matchLabels: {app: client}}
  policyTypes: [Egress]
  egress:
  - to: [{podSelector: {matchLabels: {app: web}}}]
"""

CHANGED = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", endPort: 8090, protocol: TCP}]}]
  egress:
  - toCIDR: [192.0.2.0/24]
"""

EXTRA = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: everyone}
spec:
  endpointSelector: {}
  egress:
  - toEntities: [world]
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
"""


async def _allocate(s: object, namespace: str, app: str, node: str) -> tuple[int, int]:
    resp = await s.AllocateIdentity(  # type: ignore[attr-defined]
        pb.AllocateIdentityRequest(labels=pod_labels(namespace, app=app), node=node)
    )
    return resp.identity.id, resp.identity.revision


async def test_policy_watch_resume_equals_fresh_snapshot(etcd: EtcdServer, spawn: Spawn) -> None:
    args = ("--etcd-endpoints", etcd.endpoint)
    r1, r2 = spawn("policy", *args), spawn("policy", *args)
    ch1, s1 = stub(r1.address)
    ch2, s2 = stub(r2.address)
    try:
        await s1.PutRules(pb.PutRulesRequest(document=RULES))
        web, _ = await _allocate(s1, "shop", "web", "n1")
        client, _ = await _allocate(s1, "shop", "client", "n1")
        _db, _ = await _allocate(s2, "shop", "db", "n2")

        a = watch_policy(s1, "n1")
        await a.until_synced()
        assert a.kinds[0] == pb.EVENT_KIND_RESET
        assert set(a.state) == {web, client}
        ingress_enforced, egress_enforced, entries, error = a.state[web]
        assert ingress_enforced
        assert egress_enforced
        assert not error
        assert (
            client,
            80,
            0,
            pb.PROTOCOL_TCP,
            pb.DIRECTION_INGRESS,
            pb.VERDICT_ALLOW,
            ("shop/web",),
        ) in entries

        # live deltas: a new peer changes web's policy, and only web's
        bad, rev = await _allocate(s2, "shop", "bad", "n2")
        before = len(a.kinds)
        await a.until_synced(rev)
        upserts = [k for k in a.kinds[before:] if k == pb.EVENT_KIND_UPSERT]
        assert len(upserts) == 1
        assert any(e[0] == bad and e[5] == pb.VERDICT_DENY for e in a.state[web][2])
        # a new identity on the node arrives with its policy
        web2, rev = await _allocate(s2, "shop", "web", "n1")
        assert web2 == web
        # a second reference changes no policy, yet its revision is SYNCED
        # (a datapath waiting for an allocation's revision is not left hanging)
        before = len(a.kinds)
        await a.until_synced(rev, timeout=5)
        # (a SYNCED for each revision the stream's batches reach; no upsert)
        assert a.kinds[before:]
        assert set(a.kinds[before:]) == {pb.EVENT_KIND_SYNCED}
        other, rev = await _allocate(s2, "other", "web", "n1")
        await a.until_synced(rev)
        assert set(a.state) == {web, client, other}
        last = a.synced
        saved = dict(a.state)
        a.cancel()

        # while the client is away
        await s1.PutRules(pb.PutRulesRequest(document=CHANGED))
        await s2.PutRules(pb.PutRulesRequest(document=EXTRA))
        await s1.DeleteRule(pb.DeleteRuleRequest(name="shop/client"))
        await s1.ReleaseIdentity(pb.ReleaseIdentityRequest(id=client, node="n1"))
        await _allocate(s1, "shop", "client", "n2")  # a peer on another node
        newcomer, _ = await _allocate(s1, "shop", "cache", "n1")
        final = (await s1.ListRules(pb.ListRulesRequest())).revision

        # resume on the other replica from the last SYNCED revision
        b = watch_policy(s2, "n1", since=last)
        b.state = dict(saved)
        await b.until_synced(final)
        assert pb.EVENT_KIND_RESET not in b.kinds
        assert client not in b.state
        assert newcomer in b.state

        fresh = watch_policy(s1, "n1")
        await fresh.until_synced(final)
        assert b.state == fresh.state
        assert b.events < fresh.events + 1

        # live again after the resume
        await s1.DeleteRule(pb.DeleteRuleRequest(name="everyone"))
        rev = (await s1.ListRules(pb.ListRulesRequest())).revision
        await b.until_synced(rev)
        await fresh.until_synced(rev)
        assert b.state == fresh.state
        b.cancel()
        last = fresh.synced
        saved = dict(fresh.state)
        fresh.cancel()

        # resume from a revision etcd compacted away: a full resync
        await _allocate(s1, "shop", "late", "n1")
        client_etcd = etcd.client()
        try:
            current = await client_etcd.current_revision()
            await client_etcd.client.compact(current)
        finally:
            await client_etcd.close()
        c = watch_policy(s2, "n1", since=last)
        c.state = saved
        await c.until_synced(current)
        assert c.kinds[0] == pb.EVENT_KIND_RESET
        again = watch_policy(s1, "n1")
        await again.until_synced(current)
        assert c.state == again.state
        c.cancel()
        again.cancel()
    finally:
        await ch1.close()
        await ch2.close()


async def test_ipcache_watch_resume_equals_fresh_snapshot(etcd: EtcdServer, spawn: Spawn) -> None:
    args = ("--etcd-endpoints", etcd.endpoint)
    r1, r2 = spawn("policy", *args), spawn("policy", *args)
    ch1, s1 = stub(r1.address)
    ch2, s2 = stub(r2.address)
    try:
        web, _ = await _allocate(s1, "shop", "web", "n1")
        db, _ = await _allocate(s1, "shop", "db", "n2")

        async def upsert(s: object, prefix: str, ident: int, node: str = "") -> int:
            r = await s.UpsertIPCache(  # type: ignore[attr-defined]
                pb.UpsertIPCacheRequest(
                    entry=pb.IPCacheEntry(
                        prefix=prefix, identity=ident, node=node, host_ip="192.168.0.1"
                    )
                )
            )
            return int(r.entry.revision)

        await upsert(s1, "10.0.1.5", web, "n1")
        await upsert(s2, "10.0.2.7/32", db, "n2")
        await s1.PutRules(pb.PutRulesRequest(document=RULES))

        a = watch_ipcache(s1)
        await a.until_synced()
        assert a.state["10.0.1.5"][:2] == (web, "n1")
        assert a.state["10.0.2.7"][:2] == (db, "n2")
        # CIDR identities of the rules are in the ipcache, from the rules
        assert a.state["10.96.0.0/12"][3] == "cidr-policy"
        assert a.state["10.0.0.0/8"][0] > 1 << 24
        rev = await upsert(s2, "10.0.1.6", web, "n1")
        await a.until_synced(rev)
        assert "10.0.1.6" in a.state
        last, saved = a.synced, dict(a.state)
        a.cancel()

        await upsert(s1, "10.0.1.5", db, "n2")  # moved
        await s2.DeleteIPCache(pb.DeleteIPCacheRequest(prefix="10.0.2.7"))
        deleted = await s2.DeleteIPCache(
            pb.DeleteIPCacheRequest(prefix="10.0.1.6", expected_identity=db)
        )
        assert not deleted.deleted  # it maps to web
        await s1.PutRules(pb.PutRulesRequest(document=CHANGED))  # CIDRs change
        final = await upsert(s1, "fd00::5", web, "n1")

        b = watch_ipcache(s2, since=last)
        b.state = saved
        await b.until_synced(final)
        assert pb.EVENT_KIND_RESET not in b.kinds
        fresh = watch_ipcache(s1)
        await fresh.until_synced(final)
        assert b.state == fresh.state
        assert "10.2.0.7" not in b.state
        assert "192.0.2.0/24" in b.state
        assert "10.96.0.0/12" not in b.state
        listed = await s2.ListIPCache(pb.ListIPCacheRequest())
        assert {e.prefix for e in listed.entries} == set(fresh.state)
        b.cancel()
        fresh.cancel()
    finally:
        await ch1.close()
        await ch2.close()


async def test_streams_survive_an_etcd_restart(etcd: EtcdServer, spawn: Spawn) -> None:
    """etcd stops and comes back on the same data: the replica's mirror
    watches again from where it was, and an open WatchPolicy stream carries
    on with what changed after."""
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    ch, s = stub(proc.address)
    try:
        await s.PutRules(pb.PutRulesRequest(document=RULES))
        web, _ = await _allocate(s, "shop", "web", "n1")
        stream = watch_policy(s, "n1")
        await stream.until_synced()
        assert set(stream.state) == {web}
        etcd.stop()
        etcd.start()
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            try:
                client, rev = await _allocate(s, "shop", "client", "n1")
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                assert asyncio.get_running_loop().time() < deadline, "etcd never came back"
                await asyncio.sleep(0.2)
        await stream.until_synced(rev)
        assert set(stream.state) == {web, client}
        assert any(e[0] == client for e in stream.state[web][2])
        assert "policy watch interrupted" in proc.logs()
        stream.cancel()
    finally:
        await ch.close()
