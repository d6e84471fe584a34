"""The policy API over gRPC against a real process: rules from documents
and protos, errors with their code and field path (and nothing stored),
trace, and the per-endpoint budget."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import (
    IDENT_PREFIX,
    IP_PREFIX,
    RULES_PREFIX,
    etcd_keys,
    pod_labels,
    stub,
    watch_policy,
)

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]


@pytest.fixture
async def api(etcd: EtcdServer, spawn: Spawn) -> AsyncIterator[pbg.PolicyServiceStub]:
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint, "--policy-map-max-entries", "6")
    channel, s = stub(proc.address)
    yield s
    await channel.close()


async def _fails(call: object, code: grpc.StatusCode, field: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    details = info.value.details() or ""
    assert details.startswith(f"{field}: "), details
    return details


BAD_PORT = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "99999", protocol: TCP}]}]
"""

LIST_WITH_ONE_BAD = """
apiVersion: v1
kind: List
items:
- apiVersion: flagella.io/v1
  kind: FlagellaNetworkPolicy
  metadata: {name: good}
  spec: {endpointSelector: {}, egress: [{toEntities: [world]}]}
- apiVersion: networking.k8s.io/v1
  kind: NetworkPolicy
  metadata: {name: bad, namespace: shop}
  spec:
    podSelector: {}
    ingress: [{from: [{ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}}]}]
"""


async def test_errors_name_the_field_and_store_nothing(
    api: pbg.PolicyServiceStub, etcd: EtcdServer
) -> None:
    s = api
    details = await _fails(
        s.PutRules(pb.PutRulesRequest(document=BAD_PORT)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "spec.ingress[0].toPorts[0].ports[0].port",
    )
    assert "out of range" in details
    await _fails(
        s.PutRules(pb.PutRulesRequest(document=LIST_WITH_ONE_BAD)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "items[1].spec.ingress[0].from[0].ipBlock.except[0]",
    )
    await _fails(
        s.PutRules(
            pb.PutRulesRequest(document="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "kind",
    )
    bad_cidr = pb.Rule(
        name="web",
        namespace="shop",
        endpoint_selector=pb.EndpointSelector(match_labels={"app": "web"}),
        ingress=[pb.PeerRule(cidrs=[pb.CIDRRule(cidr="10.0.0.0/33")])],
    )
    await _fails(
        s.PutRules(pb.PutRulesRequest(rules=pb.RuleList(rules=[bad_cidr]))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "rules.rules[0].ingress[0].cidrs[0].cidr",
    )
    bad_range = pb.Rule(
        name="web",
        endpoint_selector=pb.EndpointSelector(),
        egress=[
            pb.PeerRule(
                entities=[pb.ENTITY_WORLD],
                to_ports=[
                    pb.PortRule(
                        ports=[pb.PortProtocol(port=90, end_port=80, protocol=pb.PROTOCOL_TCP)]
                    )
                ],
            )
        ],
    )
    await _fails(
        s.PutRules(pb.PutRulesRequest(rules=pb.RuleList(rules=[bad_range]))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "rules.rules[0].egress[0].to_ports[0].ports[0].end_port",
    )
    bad_selector = pb.Rule(
        name="web",
        endpoint_selector=pb.EndpointSelector(
            match_expressions=[
                pb.LabelSelectorRequirement(
                    key="app", operator=pb.LabelSelectorRequirement.OPERATOR_EXISTS, values=["x"]
                )
            ]
        ),
    )
    await _fails(
        s.PutRules(pb.PutRulesRequest(rules=pb.RuleList(rules=[bad_selector]))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "rules.rules[0].endpoint_selector.match_expressions[0].values",
    )
    listed = await s.ListRules(pb.ListRulesRequest())
    assert list(listed.rules) == []
    assert await etcd_keys(etcd, RULES_PREFIX) == {}

    await _fails(
        s.AllocateIdentity(
            pb.AllocateIdentityRequest(
                labels=[pb.Label(key="app", value="web"), pb.Label(key="bad key", value="x")],
                node="n1",
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "labels[1]",
    )
    await _fails(
        s.AllocateIdentity(pb.AllocateIdentityRequest(labels=pod_labels("a", app="web"))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "node",
    )
    await _fails(
        s.AllocateIdentity(
            pb.AllocateIdentityRequest(
                labels=[pb.Label(source="k8s", key="pod-template-hash", value="x")], node="n1"
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "labels",
    )
    assert await etcd_keys(etcd, IDENT_PREFIX) == {}

    await _fails(
        s.UpsertIPCache(
            pb.UpsertIPCacheRequest(entry=pb.IPCacheEntry(prefix="10.0.0.300", identity=2))
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "entry.prefix",
    )
    await _fails(
        s.UpsertIPCache(
            pb.UpsertIPCacheRequest(entry=pb.IPCacheEntry(prefix="10.0.0.3", identity=4242))
        ),
        grpc.StatusCode.NOT_FOUND,
        "entry.identity",
    )
    assert await etcd_keys(etcd, IP_PREFIX) == {}
    await _fails(s.GetRule(pb.GetRuleRequest(name="nope")), grpc.StatusCode.NOT_FOUND, "name")
    await _fails(
        s.ResolvePolicy(pb.ResolvePolicyRequest(identity=4242)),
        grpc.StatusCode.NOT_FOUND,
        "identity",
    )


K8S = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: backend, namespace: shop}
spec:
  podSelector: {matchLabels: {app: backend}}
  ingress:
  - from: [{podSelector: {matchLabels: {app: frontend}}}]
    ports: [{port: 8080}]
"""


async def test_kubernetes_policy_rules_and_trace(api: pbg.PolicyServiceStub) -> None:
    s = api
    put = await s.PutRules(pb.PutRulesRequest(document=K8S))
    assert list(put.names) == ["shop/backend"]
    rule = await s.GetRule(pb.GetRuleRequest(name="shop/backend"))
    assert rule.namespace == "shop"
    assert rule.enforce_ingress
    assert not rule.enforce_egress
    assert rule.revision == put.revision
    assert rule.ingress[0].to_ports[0].ports[0] == pb.PortProtocol(
        port=8080, protocol=pb.PROTOCOL_TCP
    )
    selecting = await s.ListRules(pb.ListRulesRequest(selecting=pod_labels("shop", app="backend")))
    assert [r.name for r in selecting.rules] == ["shop/backend"]
    other = await s.ListRules(pb.ListRulesRequest(selecting=pod_labels("other", app="backend")))
    assert list(other.rules) == []

    frontend = pod_labels("shop", app="frontend")
    backend = pod_labels("shop", app="backend")
    allowed = await s.TracePolicy(
        pb.TracePolicyRequest(
            src_labels=frontend, dst_labels=backend, dport=8080, protocol=pb.PROTOCOL_TCP
        )
    )
    assert allowed.verdict == pb.VERDICT_ALLOW
    assert list(allowed.matched_rules) == ["shop/backend"]
    assert any("ALLOWED" in line for line in allowed.explanation)
    denied = await s.TracePolicy(
        pb.TracePolicyRequest(
            src_labels=frontend, dst_labels=backend, dport=9090, protocol=pb.PROTOCOL_TCP
        )
    )
    assert denied.verdict == pb.VERDICT_DENY
    assert denied.ingress_verdict == pb.VERDICT_DENY
    assert denied.egress_verdict == pb.VERDICT_ALLOW
    assert any("default deny" in line for line in denied.explanation)

    # the same policy as resolved entries of the backend's identity
    be = await s.AllocateIdentity(pb.AllocateIdentityRequest(labels=backend, node="n1"))
    fe = await s.AllocateIdentity(pb.AllocateIdentityRequest(labels=frontend, node="n1"))
    resolved = await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=be.identity.id))
    assert resolved.ingress_enforced
    assert not resolved.egress_enforced
    assert resolved.revision >= fe.identity.revision
    assert pb.PolicyEntry(
        identity=fe.identity.id,
        port=8080,
        protocol=pb.PROTOCOL_TCP,
        direction=pb.DIRECTION_INGRESS,
        verdict=pb.VERDICT_ALLOW,
        derived_from=["shop/backend"],
    ) in list(resolved.entries)

    deleted = await s.DeleteRule(pb.DeleteRuleRequest(name="shop/backend"))
    assert deleted.deleted
    assert deleted.revision > put.revision
    assert not (await s.DeleteRule(pb.DeleteRuleRequest(name="shop/backend"))).deleted
    resolved = await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=be.identity.id))
    assert not resolved.ingress_enforced


async def test_budget_exceeded_is_resource_exhausted_and_fails_closed(
    api: pbg.PolicyServiceStub,
) -> None:
    s = api  # --policy-map-max-entries 6
    web = await s.AllocateIdentity(
        pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n1")
    )
    for i in range(3):
        await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("shop", app="client", i=str(i)), node="n2")
        )
    doc = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "80", protocol: TCP}, {port: "443", protocol: TCP}]}]
"""
    await s.PutRules(pb.PutRulesRequest(document=doc))
    details = await _fails(
        s.ResolvePolicy(pb.ResolvePolicyRequest(identity=web.identity.id)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "identity",
    )
    assert "budget of 6" in details
    stream = watch_policy(s, "n1")
    await stream.until_synced()
    ingress, egress, entries, error = stream.state[web.identity.id]
    assert ingress
    assert egress
    assert entries == ()
    assert "budget" in error
    stream.cancel()
