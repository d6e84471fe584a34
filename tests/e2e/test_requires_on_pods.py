"""End to end: fromRequires / toRequires on real pods (`flagella-cni ADD`),
imported as CiliumNetworkPolicy documents: a requirement in one rule
narrows what another rule allows, for new TCP connections, in both
directions, and lifting it restores the traffic."""

from __future__ import annotations

import pytest
from harness.cluster import Cluster, Node
from harness.cnipods import CniPod, cni_pod
from harness.netns import wait_until

from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

PORT = 8080

ALLOW = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: web-from-clients, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: clients-to-web, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toEndpoints: [{matchLabels: {app: web}}]
"""

REQUIRE = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: prod-only, namespace: shop}
spec:
  endpointSelector: {matchLabels: {env: prod}}
  ingress:
  - fromRequires: [{matchLabels: {env: prod}}]
  egress:
  - toRequires: [{matchLabels: {env: prod}}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    return cluster.add_node("n1")


def reaches(client: CniPod, server: CniPod) -> bool:
    answer = client.ns.request("tcp", server.ip4, PORT, timeout=1)
    return answer == f"{server.name} {client.ip4} HELLO"


def test_requirements_narrow_other_rules_on_real_pods(cluster: Cluster, node: Node) -> None:
    web = cni_pod(cluster, node, "web", {"app": "web", "env": "prod"})
    web_dev = cni_pod(cluster, node, "web-dev", {"app": "web", "env": "dev"})
    prod = cni_pod(cluster, node, "client-prod", {"app": "client", "env": "prod"})
    dev = cni_pod(cluster, node, "client-dev", {"app": "client", "env": "dev"})
    for server in (web, web_dev):
        server.ns.serve("tcp", PORT, server.name)
    rules = cluster.policy()
    rules.PutRules(policy_pb2.PutRulesRequest(document=ALLOW), timeout=10)
    assert wait_until(lambda: reaches(dev, web))
    assert reaches(prod, web)
    assert reaches(prod, web_dev)

    rules.PutRules(policy_pb2.PutRulesRequest(document=REQUIRE), timeout=10)
    # Ingress of web (prod) now requires prod peers: dev is out.
    assert wait_until(lambda: not reaches(dev, web))
    assert reaches(prod, web)
    # Egress of client-prod requires prod destinations: web-dev is out,
    # while client-dev (not selected by the requiring rule) still reaches it.
    assert wait_until(lambda: not reaches(prod, web_dev))
    assert reaches(dev, web_dev)

    rules.DeleteRule(policy_pb2.DeleteRuleRequest(name="shop/prod-only"), timeout=10)
    assert wait_until(lambda: reaches(dev, web))
    assert wait_until(lambda: reaches(prod, web_dev))
