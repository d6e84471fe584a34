"""End to end: a CIDR group (`flagella cidrgroup put`, as CiliumCIDRGroup)
named by a CiliumNetworkPolicy (`cidrGroupRef`) on a real pod made by
`flagella-cni ADD`: editing the group in place opens and closes the pod's
egress to an outside host, an except inside the group's CIDR holds, and
deleting the group closes it again (never opens it to all)."""

from __future__ import annotations

import pytest
from harness.cluster import OUTSIDE_IP, Cluster, Node, cli
from harness.cnipods import CniPod, cni_pod
from harness.netns import wait_until

from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

OUTSIDE = OUTSIDE_IP.format(n=101)  # the first node's outside host
PORT = 9000

POLICY = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: web-to-partners, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  egress:
  - toCIDRSet: [{cidrGroupRef: partners, except: [192.0.2.128/25]}]
    toPorts: [{ports: [{port: "9000", protocol: TCP}]}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    return cluster.add_node("n1")


def reaches_outside(web: CniPod, node: Node) -> bool:
    return web.ns.request("tcp", OUTSIDE, PORT, timeout=1) == f"outside {node.ip} HELLO"


def test_a_cidr_group_edited_in_place_on_a_real_pod(cluster: Cluster, node: Node) -> None:
    web = cni_pod(cluster, node, "web", {"app": "web"})
    node.outside.serve("tcp", PORT, "outside")
    assert reaches_outside(web, node)

    assert cli(cluster, "cidrgroup", "put", "partners", "192.0.2.0/24").returncode == 0
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    assert wait_until(lambda: not reaches_outside(web, node))

    # The outside host joins the group: open, on the rule's port only.
    put = cli(cluster, "cidrgroup", "put", "partners", "192.0.2.0/24", f"{OUTSIDE}/32")
    assert put.returncode == 0, put.stderr
    assert wait_until(lambda: reaches_outside(web, node))
    node.outside.serve("tcp", PORT + 1, "outside")
    assert web.ns.request("tcp", OUTSIDE, PORT + 1, timeout=1) is None
    listed = cli(cluster, "cidrgroup", "list").stdout
    assert "partners" in listed
    assert f"{OUTSIDE}/32" in listed

    # The whole outside /24 in the group, the host in an except of the rule.
    rule = POLICY.replace("192.0.2.128/25", f"{OUTSIDE}/32")
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=rule), timeout=10)
    put = cli(cluster, "cidrgroup", "put", "partners", f"{OUTSIDE.rsplit('.', 1)[0]}.0/24")
    assert put.returncode == 0, put.stderr
    assert wait_until(lambda: not reaches_outside(web, node))
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    assert wait_until(lambda: reaches_outside(web, node))

    # Deleted: the rule selects nothing through it.
    assert cli(cluster, "cidrgroup", "delete", "partners").returncode == 0
    assert wait_until(lambda: not reaches_outside(web, node))
    gone = cli(cluster, "cidrgroup", "delete", "partners")
    assert gone.returncode == 1
    assert "no CIDR group named partners" in gone.stderr
