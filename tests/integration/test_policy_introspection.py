"""What the policy service tells about its own state, through a real
process (real etcd, mutual TLS, per-RPC authorization), for a small scripted
cluster: the selectors in use with what each selects and the rules using
it, and the identities referenced on each node with their counts and owners
(gRPC and the CLI)."""

from __future__ import annotations

import json
from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import cli, pod_labels

from flagella.api.policy.v1 import policy_pb2 as pb
from flagella.api.policy.v1 import policy_pb2_grpc as pbg
from flagella.common import pki

pytestmark = pytest.mark.integration


RULES = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: db-from-web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: db}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: web}}]
  - fromCIDR: [192.0.2.0/24]
"""


async def test_selectors_and_identity_endpoints(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    policy = spawn("policy", "--etcd-endpoints", etcd.endpoint)
    channels = [
        policy.aio_channel(),
        policy.aio_channel(pki.service("endpoint")),
        policy.aio_channel(pki.node("n1")),
    ]
    s, ep, n1 = (pbg.PolicyServiceStub(c) for c in channels)
    try:
        await s.PutRules(pb.PutRulesRequest(document=RULES))

        async def allocate(app: str, node: str, owner: str) -> int:
            got = await ep.AllocateIdentity(
                pb.AllocateIdentityRequest(
                    labels=pod_labels("shop", app=app), node=node, owner=owner
                )
            )
            return int(got.identity.id)

        db = await allocate("db", "n1", "c1/eth0")
        assert await allocate("db", "n1", "c2/eth0") == db
        web = await allocate("web", "n1", "c3/eth0")
        assert await allocate("web", "n2", "c4/eth0") == web
        await ep.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("shop", app="web"), node="n2")
        )  # anonymous: counted, no owner

        sels = await n1.GetPolicySelectors(pb.GetPolicySelectorsRequest())
        by = {(x.selector, x.role): x for x in sels.selectors}
        subject = by[("{k8s:app=db, k8s:io.kubernetes.pod.namespace=shop}", "subject")]
        assert list(subject.identities) == [db]
        assert list(subject.rules) == ["shop/db-from-web"]
        peer = by[("{k8s:app=web, k8s:io.kubernetes.pod.namespace=shop}", "peer")]
        assert list(peer.identities) == [web]
        cidr = by[("cidr:192.0.2.0/24", "peer")]
        assert len(cidr.identities) == 1
        assert cidr.identities[0] > 1 << 24  # a local CIDR identity
        assert len(sels.selectors) == 3

        mine = await n1.GetIdentityEndpoints(pb.GetIdentityEndpointsRequest(node="n1"))
        assert [(u.identity, u.node, u.ref_count, list(u.owners)) for u in mine.identities] == [
            (db, "n1", 2, ["c1/eth0", "c2/eth0"]),
            (web, "n1", 1, ["c3/eth0"]),
        ]
        assert {(lb.key, lb.value) for lb in mine.identities[0].labels} >= {("app", "db")}
        everyone = await s.GetIdentityEndpoints(pb.GetIdentityEndpointsRequest())
        assert [(u.identity, u.node, u.ref_count, list(u.owners)) for u in everyone.identities][
            2:
        ] == [(web, "n2", 2, ["c4/eth0"])]
        # A node asks about itself only; a bad node name is named.
        for request, code in [
            (pb.GetIdentityEndpointsRequest(node="n2"), grpc.StatusCode.PERMISSION_DENIED),
            (pb.GetIdentityEndpointsRequest(), grpc.StatusCode.PERMISSION_DENIED),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await n1.GetIdentityEndpoints(request)
            assert err.value.code() == code
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await s.GetIdentityEndpoints(pb.GetIdentityEndpointsRequest(node="bad name"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith("node:")

        # The CLI shows the same.
        shown = json.loads(cli(policy, "-o", "json", "identity", "endpoints", "--node", "n2"))
        assert isinstance(shown, list)
        assert [(u["identity"], u["ref_count"], u["owners"]) for u in shown] == [
            (web, 2, ["c4/eth0"])
        ]
        selectors = json.loads(cli(policy, "-o", "json", "policy", "selectors"))
        assert isinstance(selectors, list)
        assert {(x["selector"], x["role"]) for x in selectors} == set(by)

        # A released reference and a deleted rule are gone from both.
        await ep.ReleaseIdentity(pb.ReleaseIdentityRequest(id=db, node="n1", owner="c2/eth0"))
        mine = await n1.GetIdentityEndpoints(pb.GetIdentityEndpointsRequest(node="n1"))
        assert next((u.identity, u.ref_count, list(u.owners)) for u in mine.identities) == (
            db,
            1,
            ["c1/eth0"],
        )
        await s.DeleteRule(pb.DeleteRuleRequest(name="shop/db-from-web"))
        assert not (await s.GetPolicySelectors(pb.GetPolicySelectorsRequest())).selectors
    finally:
        for c in channels:
            await c.close()
