"""Named ports in the policy API over gRPC against a real process: rules
naming ports (documents and protos) resolved symbolic, their errors with
the field, and the endpoints' named ports on ipcache entries (stored in
etcd, listed and streamed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import IP_PREFIX, etcd_keys, pod_labels, stub

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

RULES = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: client}}}]
    ports: [{port: serve-80-tcp}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toEndpoints: [{matchLabels: {app: web}}]
    toPorts: [{ports: [{port: serve-80-tcp, protocol: TCP}]}]
  egressDeny:
  - toEndpoints: [{matchLabels: {app: web}}]
    toPorts: [{ports: [{port: admin, protocol: TCP}]}]
"""


@pytest.fixture
async def api(etcd: EtcdServer, spawn: Spawn) -> AsyncIterator[pbg.PolicyServiceStub]:
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    channel, s = stub(proc.address)
    yield s
    await channel.close()


async def _invalid(call: object, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    details = info.value.details() or ""
    assert details.startswith(f"{field}: "), details
    return details


async def test_rules_naming_ports_resolve_symbolic(api: pbg.PolicyServiceStub) -> None:
    await api.PutRules(pb.PutRulesRequest(document=RULES))
    web = (await api.AllocateIdentity(pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1"))).identity.id  # fmt: skip
    client = (await api.AllocateIdentity(pb.AllocateIdentityRequest(labels=pod_labels("shop", app="client"), node="n1"))).identity.id  # fmt: skip
    got = await api.ResolvePolicy(pb.ResolvePolicyRequest(identity=web))
    named = {(e.identity, e.port, e.port_name, e.protocol, e.verdict) for e in got.entries if e.port_name}  # fmt: skip
    assert named == {(client, 0, "serve-80-tcp", pb.PROTOCOL_TCP, pb.VERDICT_ALLOW)}
    got = await api.ResolvePolicy(pb.ResolvePolicyRequest(identity=client))
    named = {(e.identity, e.port_name, e.direction, e.verdict) for e in got.entries if e.port_name}
    assert named == {
        (web, "serve-80-tcp", pb.DIRECTION_EGRESS, pb.VERDICT_ALLOW),
        (web, "admin", pb.DIRECTION_EGRESS, pb.VERDICT_DENY),
    }
    # The rule reads back with its name.
    rule = await api.GetRule(pb.GetRuleRequest(name="shop/web"))  # fmt: skip
    assert rule.ingress[0].to_ports[0].ports[0].name == "serve-80-tcp"


async def test_malformed_named_ports_are_invalid_argument_naming_the_field(
    api: pbg.PolicyServiceStub,
) -> None:
    bad = RULES.replace("ports: [{port: serve-80-tcp}]", "ports: [{port: Serve_80}]")
    await _invalid(
        api.PutRules(pb.PutRulesRequest(document=bad)), "[0].spec.ingress[0].ports[0].port"
    )
    ranged = RULES.replace("ports: [{port: serve-80-tcp}]", "ports: [{port: web, endPort: 90}]")
    await _invalid(
        api.PutRules(pb.PutRulesRequest(document=ranged)), "[0].spec.ingress[0].ports[0].endPort"
    )
    rule = pb.Rule(
        name="p",
        namespace="shop",
        endpoint_selector=pb.EndpointSelector(),
        egress=[pb.PeerRule(to_ports=[pb.PortRule(ports=[pb.PortProtocol(name="a--b")])])],
    )
    await _invalid(
        api.PutRules(pb.PutRulesRequest(rules=pb.RuleList(rules=[rule]))),
        "rules.rules[0].egress[0].to_ports[0].ports[0].port",
    )
    # Nothing was stored.
    assert not (await api.ListRules(pb.ListRulesRequest())).rules


async def test_ipcache_entries_carry_named_ports(
    api: pbg.PolicyServiceStub, etcd: EtcdServer
) -> None:
    web = (await api.AllocateIdentity(pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1"))).identity.id  # fmt: skip
    ports = [
        pb.NamedPort(name="serve-80-tcp", port=8080, protocol=pb.PROTOCOL_TCP),
        pb.NamedPort(name="dns", port=53, protocol=pb.PROTOCOL_UDP),
    ]
    entry = pb.IPCacheEntry(prefix="10.244.0.7", identity=web, source="endpoint", named_ports=ports)
    call = api.WatchIPCache(pb.WatchIPCacheRequest())
    it = call.__aiter__()
    while (await it.__anext__()).kind != pb.EVENT_KIND_SYNCED:
        pass
    await api.UpsertIPCache(pb.UpsertIPCacheRequest(entry=entry))
    while True:
        ev = await it.__anext__()
        if ev.kind == pb.EVENT_KIND_UPSERT and ev.entry.prefix == "10.244.0.7":
            break
    call.cancel()
    # Sorted by name, streamed, listed and in etcd.
    want = [("dns", 53, pb.PROTOCOL_UDP), ("serve-80-tcp", 8080, pb.PROTOCOL_TCP)]
    assert [(p.name, p.port, p.protocol) for p in ev.entry.named_ports] == want
    listed = (await api.ListIPCache(pb.ListIPCacheRequest())).entries
    (mine,) = [e for e in listed if e.prefix == "10.244.0.7"]
    assert [(p.name, p.port, p.protocol) for p in mine.named_ports] == want
    stored = await etcd_keys(etcd, IP_PREFIX)
    assert stored[IP_PREFIX + "10.244.0.7"]["namedPorts"] == [
        ["dns", 53, 17],
        ["serve-80-tcp", 8080, 6],
    ]
    # A malformed one is refused, naming it.
    bad = pb.IPCacheEntry(
        prefix="10.244.0.8",
        identity=web,
        named_ports=[pb.NamedPort(name="ok", port=80), pb.NamedPort(name="x", port=0)],
    )
    await _invalid(
        api.UpsertIPCache(pb.UpsertIPCacheRequest(entry=bad)), "entry.named_ports[1].port"
    )
