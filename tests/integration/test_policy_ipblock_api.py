"""Kubernetes ipBlocks through the policy API of a real process: CIDRs
with host bits accepted, masked and warned about in PutRules' answer
(naming the field), bad ones INVALID_ARGUMENT with the field and nothing
stored; the resolved policy's prefix entries in both --k8s-ipblock-mode
settings."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.procs import ServiceProcess
from policy_client import RULES_PREFIX, etcd_keys, pod_labels, stub

from flagella.api.policy.v1 import policy_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Spawn = Callable[..., ServiceProcess]

UPSTREAM = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: allow-client-a-via-cidr-egress-rule, namespace: x}
spec:
  podSelector: {matchLabels: {pod: a}}
  policyTypes: [Egress]
  egress:
  - to:
    - ipBlock: {cidr: 10.244.0.108/4, except: [10.244.1.7/24]}
"""

BAD = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: bad, namespace: x}
spec:
  podSelector: {}
  ingress: [{from: [{ipBlock: {cidr: 10.244.0.0/16, except: [10.244.0.300/24]}}]}]
"""


def _entries(policy: pb.ResolvedPolicy) -> set[tuple[str, int, tuple[tuple[int, int, int], ...]]]:
    return {
        (e.prefix, e.direction, tuple((p.port, p.end_port, p.protocol) for p in e.ports))
        for e in policy.prefix_entries
    }


@pytest.mark.parametrize("mode", ["kubernetes", "cilium", None])
async def test_host_bits_warned_and_prefix_entries_per_mode(
    etcd: EtcdServer, spawn: Spawn, mode: str | None
) -> None:
    args = ["--k8s-ipblock-mode", mode] if mode else []
    proc = spawn("policy", "--etcd-endpoints", etcd.endpoint, *args)
    channel, s = stub(proc.address)
    try:
        put = await s.PutRules(pb.PutRulesRequest(document=UPSTREAM))
        assert list(put.names) == ["x/allow-client-a-via-cidr-egress-rule"]
        assert list(put.warnings) == [
            "spec.egress[0].to[0].ipBlock.cidr: 10.244.0.108/4 has host bits set; "
            "read as 0.0.0.0/4",
            "spec.egress[0].to[0].ipBlock.except[0]: 10.244.1.7/24 has host bits set; "
            "read as 10.244.1.0/24",
        ]
        rule = await s.GetRule(pb.GetRuleRequest(name="x/allow-client-a-via-cidr-egress-rule"))
        (cidr,) = rule.egress[0].cidrs
        assert (cidr.cidr, list(getattr(cidr, "except"))) == ("0.0.0.0/4", ["10.244.1.0/24"])

        ident = await s.AllocateIdentity(
            pb.AllocateIdentityRequest(labels=pod_labels("x", pod="a"), node="n1")
        )
        resolved = await s.ResolvePolicy(pb.ResolvePolicyRequest(identity=ident.identity.id))
        assert resolved.egress_enforced
        if mode == "cilium":
            assert _entries(resolved) == set()
        else:  # kubernetes, the default
            assert _entries(resolved) == {
                ("0.0.0.0/4", pb.DIRECTION_EGRESS, ((0, 0, pb.PROTOCOL_ANY),)),
                ("10.244.1.0/24", pb.DIRECTION_EGRESS, ()),
            }
            assert list(resolved.prefix_entries[0].derived_from) == [
                "x/allow-client-a-via-cidr-egress-rule"
            ]

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await s.PutRules(pb.PutRulesRequest(document=BAD))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (info.value.details() or "").startswith(
            "spec.ingress[0].from[0].ipBlock.except[0]: "
        )
        assert set(await etcd_keys(etcd, RULES_PREFIX)) == {
            RULES_PREFIX + "x/allow-client-a-via-cidr-egress-rule"
        }
    finally:
        await channel.close()


async def test_bad_mode_is_refused(etcd: EtcdServer, spawn: Spawn) -> None:
    with pytest.raises(Exception, match="k8s-ipblock-mode"):
        spawn("policy", "--etcd-endpoints", etcd.endpoint, "--k8s-ipblock-mode", "calico")
