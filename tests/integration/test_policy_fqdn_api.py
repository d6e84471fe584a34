"""The FQDN cache through a real policy process (real etcd, mutual TLS,
per-RPC authorization): a node writes what its endpoints' names resolved to,
and once the answer comes back the ipcache stream and the node's policy
stream at that revision already hold the addresses' fqdn identities and the
allow; list and delete filter as asked; the entries hang on the node's
lease; bad input is refused naming the field and changes nothing; a node
cannot write for another."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import cli, etcd_keys, pod_labels, watch_ipcache, watch_policy

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.common import pki

pytestmark = pytest.mark.integration

Spawn = Callable[..., ServiceProcess]
FQDN_PREFIX = "flagella/state/fqdn/v1/"

RULES = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: to-api, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toFQDNs: [{matchName: api.example.test}, {matchPattern: "*.cdn.test"}]
    toPorts: [{ports: [{port: "443", protocol: TCP}]}]
"""


def entry(endpoint: str, name: str, *ips: str, ttl: int = 60) -> pb.FQDNCacheEntry:
    return pb.FQDNCacheEntry(endpoint=endpoint, name=name, ips=list(ips), ttl=ttl)


def egress_peers(policy: tuple[object, ...]) -> set[tuple[int, int]]:
    """(peer identity, port) of the allow entries of a PolicyStream state."""
    entries = policy[2]
    assert isinstance(entries, tuple)
    return {(e[0], e[1]) for e in entries if e[4] == pb.DIRECTION_EGRESS and e[5] == 1}


async def test_a_node_learns_names_and_its_streams_follow(etcd: EtcdServer, spawn: Spawn) -> None:
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    operator = policy.aio_channel()
    endpoint = policy.aio_channel(pki.service("endpoint"))
    node = policy.aio_channel(pki.node("n1"))
    other = policy.aio_channel(pki.node("n2"))
    s = pbg.PolicyServiceStub(operator)
    ep, n1, n2 = (pbg.PolicyServiceStub(c) for c in (endpoint, node, other))
    try:
        await s.PutRules(pb.PutRulesRequest(document=RULES))
        web = (
            await ep.AllocateIdentity(
                pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1")
            )
        ).identity.id
        policies = watch_policy(n1, "n1")
        ipcache = watch_ipcache(n1)
        await policies.until_synced()
        await ipcache.until_synced()
        assert egress_peers(policies.state[web]) == set()

        written = await n1.UpsertFQDNCache(
            pb.UpsertFQDNCacheRequest(
                node="n1",
                entries=[
                    entry("12", "API.example.test.", "192.0.2.10", "2001:db8::10"),
                    entry("12", "img.cdn.test", "198.51.100.7", ttl=5),
                    entry("13", "other.test", "203.0.113.9"),
                ],
            )
        )
        # At the answer's revision both streams already carry it (what the
        # proxy waits for before it releases the DNS answer).
        await policies.until_synced(written.revision)
        await ipcache.until_synced(written.revision)
        learned = {p: ipcache.state[p] for p in ("192.0.2.10", "2001:db8::10", "198.51.100.7")}
        assert all(v[3] == "fqdn" for v in learned.values()), learned
        assert "203.0.113.9" not in ipcache.state
        idents = {p: v[0] for p, v in learned.items()}
        assert egress_peers(policies.state[web]) == {(i, 443) for i in idents.values()}

        listed = await s.ListFQDNCache(pb.ListFQDNCacheRequest(node="n1"))
        assert [(e.endpoint, e.name, list(e.ips)) for e in listed.entries] == [
            ("12", "api.example.test", ["192.0.2.10", "2001:db8::10"]),
            ("12", "img.cdn.test", ["198.51.100.7"]),
            ("13", "other.test", ["203.0.113.9"]),
        ]
        short = listed.entries[1]
        assert short.expires.ToSeconds() - short.lookup.ToSeconds() == 5
        by_cidr = await s.ListFQDNCache(pb.ListFQDNCacheRequest(cidr="2001:db8::/64"))
        assert [e.name for e in by_cidr.entries] == ["api.example.test"]
        by_pattern = await s.ListFQDNCache(pb.ListFQDNCacheRequest(match_pattern="*.cdn.test"))
        assert [e.name for e in by_pattern.entries] == ["img.cdn.test"]
        by_endpoint = await s.ListFQDNCache(pb.ListFQDNCacheRequest(endpoint="13"))
        assert [e.name for e in by_endpoint.entries] == ["other.test"]

        selections = {
            (x.selector.match_name or x.selector.match_pattern): x
            for x in (await n1.ListFQDNSelectors(pb.ListFQDNSelectorsRequest())).selections
        }
        api = selections["api.example.test"]
        assert [(n.name, list(n.ips)) for n in api.names] == [
            ("api.example.test", ["192.0.2.10", "2001:db8::10"])
        ]
        assert set(api.identities) == {idents["192.0.2.10"], idents["2001:db8::10"]}
        assert list(api.rules) == ["shop/to-api"]
        assert selections["*.cdn.test"].selector.match_pattern == "*.cdn.test"

        # On the node's lease, in etcd.
        stored = await etcd_keys(etcd, FQDN_PREFIX)
        assert set(stored) == {
            f"{FQDN_PREFIX}n1/12/api.example.test",
            f"{FQDN_PREFIX}n1/12/img.cdn.test",
            f"{FQDN_PREFIX}n1/13/other.test",
        }
        client = etcd.client()
        try:
            kv = await client.get(f"{FQDN_PREFIX}n1/12/api.example.test")
            assert kv is not None
            assert kv.lease != 0
        finally:
            await client.close()

        # Bad input: the field named, nothing changed.
        revision = (await s.ListFQDNCache(pb.ListFQDNCacheRequest())).revision
        bad_requests = [
            (pb.UpsertFQDNCacheRequest(node="n1"), "entries"),
            (
                pb.UpsertFQDNCacheRequest(node="n1", entries=[entry("1", "a b", "192.0.2.1")]),
                "entries[0].name",
            ),
            (
                pb.UpsertFQDNCacheRequest(node="n1", entries=[entry("1", "a.test", "300.1.1.1")]),
                "entries[0].ips[0]",
            ),
            (
                pb.UpsertFQDNCacheRequest(node="n1", entries=[entry("1", "a.test")]),
                "entries[0].ips",
            ),
            (
                pb.UpsertFQDNCacheRequest(node="n1", entries=[entry("", "a.test", "192.0.2.1")]),
                "entries[0].endpoint",
            ),
            (
                pb.UpsertFQDNCacheRequest(
                    node="n1", entries=[entry("1", "a.test", "192.0.2.1", ttl=10**7)]
                ),
                "entries[0].ttl",
            ),
            (
                pb.UpsertFQDNCacheRequest(
                    node="n1",
                    entries=[entry("1", "a.test", "192.0.2.1"), entry("1", "A.test.", "192.0.2.2")],
                ),
                "entries[1]",
            ),
            (
                pb.UpsertFQDNCacheRequest(
                    node="n1",
                    entries=[
                        pb.FQDNCacheEntry(node="n2", endpoint="1", name="a.test", ips=["192.0.2.1"])
                    ],
                ),
                "entries[0].node",
            ),
            (
                pb.UpsertFQDNCacheRequest(
                    node="n1",
                    entries=[
                        pb.FQDNCacheEntry(
                            endpoint="1",
                            name="a.test",
                            ips=["192.0.2.1"],
                            lookup=Timestamp(seconds=-5),
                        )
                    ],
                ),
                "entries[0].lookup",
            ),
        ]
        for request, field in bad_requests:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await n1.UpsertFQDNCache(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
            assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()
        for list_request, field in [
            (pb.ListFQDNCacheRequest(cidr="10.0.0.0/33"), "cidr"),
            (pb.ListFQDNCacheRequest(match_pattern="a b"), "match_pattern"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await s.ListFQDNCache(list_request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(f"{field}:"), err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.DeleteFQDNCache(pb.DeleteFQDNCacheRequest())
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # Another node can neither write nor delete n1's entries.
        for call in (
            n2.UpsertFQDNCache(
                pb.UpsertFQDNCacheRequest(node="n1", entries=[entry("1", "x.test", "192.0.2.1")])
            ),
            n2.DeleteFQDNCache(pb.DeleteFQDNCacheRequest(node="n1", match_pattern="*")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await s.ListFQDNCache(pb.ListFQDNCacheRequest())).revision == revision
        assert set(await etcd_keys(etcd, FQDN_PREFIX)) == set(stored)

        # The CLI shows the same, and deletes by pattern: the policy
        # follows at the answer's revision.
        listed_by_cli = cli(
            policy, "-o", "json", "fqdn", "cache", "list", "--cidr", "2001:db8::/64"
        )
        assert [(e["node"], e["endpoint"], e["name"]) for e in json.loads(listed_by_cli)] == [
            ("n1", "12", "api.example.test")
        ]
        names = cli(policy, "fqdn", "names").splitlines()
        assert names[0].split() == ["SELECTOR", "NAMES", "IPS", "IDENTITIES", "RULES"]
        assert any(
            line.split()[:3] == ["*.cdn.test", "img.cdn.test", "198.51.100.7"] for line in names
        ), names
        gone_json = json.loads(
            cli(policy, "-o", "json", "fqdn", "cache", "delete", "--match-pattern", "*.cdn.test")
        )
        assert gone_json["deleted"] == 1
        gone = pb.DeleteFQDNCacheResponse(revision=int(gone_json["revision"]))
        await policies.until_synced(gone.revision)
        await ipcache.until_synced(gone.revision)
        assert "198.51.100.7" not in ipcache.state
        assert egress_peers(policies.state[web]) == {
            (idents["192.0.2.10"], 443),
            (idents["2001:db8::10"], 443),
        }
        # The node flushes its own cache.
        gone = await n1.DeleteFQDNCache(pb.DeleteFQDNCacheRequest(node="n1"))
        assert gone.deleted == 2
        await policies.until_synced(gone.revision)
        assert egress_peers(policies.state[web]) == set()
        assert await etcd_keys(etcd, FQDN_PREFIX) == {}
        policies.cancel()
        ipcache.cancel()
    finally:
        for c in (operator, endpoint, node, other):
            await c.close()
