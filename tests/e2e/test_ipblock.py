"""End to end: Kubernetes NetworkPolicy ipBlocks as Kubernetes means them,
on real pods made by `flagella-cni` (one node on an underlay, with an
outside host on it), real traffic, IPv4 and IPv6.

- An ipBlock over the pods' addresses with an except: two pods of one
  identity, one inside the block and one in the except, are treated
  differently, for ingress (source address) and egress (destination
  address); the outside host is matched by the same policies.
- The policy service's `--k8s-ipblock-mode=cilium` restores Cilium's
  semantics (an ipBlock over pods matches no pod; outside addresses still).
- A CiliumNetworkPolicy fromCIDR over the pods' CIDR keeps Cilium's
  semantics (no pod matched), whatever the mode.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.cluster import Cluster, Node, standalone_cluster
from harness.cni import add_pod as cni_add_pod
from harness.lb import service
from harness.netns import Netns, at_once, wait_until
from harness.underlay import SUBNET6, Underlay

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

CIDR6 = "fd00:10:200::/104"
TCP4, TCP6 = 8080, 8086
NS = "x"


@dataclass
class Pod:
    name: str
    ns: Netns
    ip4: str
    ip6: str


@dataclass
class World:
    cluster: Cluster
    node: Node
    underlay: Underlay
    server: Pod  # app=server
    a1: Pod  # pod=a, inside the blocks
    a2: Pod  # pod=a (same identity), in the excepts
    b1: Pod  # app=server2 (servers for the egress cases), inside
    b2: Pod  # app=server2, in the except


def add_pod(cluster: Cluster, node: Node, name: str, labels: dict[str, str]) -> Pod:
    ns = cluster.pod(node, name)
    ip4, ip6 = cni_add_pod(node.cni_socket, ns.path, name, NS, labels)
    for port, v6 in ((TCP4, False), (TCP6, True)):
        ns.serve("tcp", port, name, v6=v6)
    return Pod(name, ns, ip4, ip6)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    tmp: Path = tmp_path_factory.mktemp("ipblock")
    with standalone_cluster(tmp) as cluster:
        cluster.start(
            services=("ipam", "policy", "lb", "endpoint"),
            extra={"ipam": ["--cluster-cidr", CIDR6]},
        )
        underlay = Underlay(cluster.nss)
        node = cluster.add_node("n1", underlay=underlay)
        pods = [
            add_pod(cluster, node, "server", {"app": "server"}),
            add_pod(cluster, node, "a1", {"pod": "a"}),
            add_pod(cluster, node, "a2", {"pod": "a"}),
            add_pod(cluster, node, "b1", {"app": "server2"}),
            add_pod(cluster, node, "b2", {"app": "server2"}),
        ]
        # The outside host reaches the pods through the node (no masquerade
        # on the way in: the pods see its address).
        out = underlay.outside
        out.serve("tcp", TCP4, "outside")
        out.serve("tcp", TCP6, "outside", v6=True)
        for pod in pods:
            out.ip("route", "replace", f"{pod.ip4}/32", "via", node.ip)
            out.ip("-6", "route", "replace", f"{pod.ip6}/128", "via", SUBNET6.format(n=node.index))
        yield World(cluster, node, underlay, *pods)


def reach(src: Netns, dst: str, v6: bool = False) -> bool:
    port = TCP6 if v6 else TCP4
    return src.request("tcp", dst, port, timeout=1) is not None


def put(w: World, document: str) -> policy_pb2.PutRulesResponse:
    resp: policy_pb2.PutRulesResponse = w.cluster.policy().PutRules(
        policy_pb2.PutRulesRequest(document=document), timeout=10
    )
    return resp


def delete(w: World, name: str) -> None:
    w.cluster.policy().DeleteRule(policy_pb2.DeleteRuleRequest(name=name), timeout=10)


def network_policy(w: World, direction: str) -> str:
    """A NetworkPolicy whose one rule takes ipBlocks over the pods' CIDRs
    (written with host bits, as upstream does) except one pod, and the
    outside host's addresses: ingress of the server (a2 excepted), or
    egress of the pod=a pods (b2 excepted)."""
    ingress = direction == "Ingress"
    name, selector, excepted = (
        ("server-ipblock", "app: server", w.a2) if ingress else ("a-egress-ipblock", "pod: a", w.b2)
    )
    ports = "\n    ports: [{port: 8080}, {port: 8086}]" if ingress else ""
    ul = w.underlay
    return f"""
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {{name: {name}, namespace: x}}
spec:
  podSelector: {{matchLabels: {{{selector}}}}}
  policyTypes: [{direction}]
  {direction.lower()}:
  - {"from" if ingress else "to"}:
    - ipBlock: {{cidr: {w.a1.ip4}/16, except: [{excepted.ip4}/32]}}
    - ipBlock: {{cidr: "{w.a1.ip6}/64", except: ["{excepted.ip6}/128"]}}
    - ipBlock: {{cidr: {ul.outside_ip4}/32}}
    - ipBlock: {{cidr: "{ul.outside_ip6}/128"}}{ports}
"""


def cilium_policy(w: World) -> str:
    """A CiliumNetworkPolicy: the server takes ingress fromCIDR the pods'
    CIDRs and the outside host."""
    return f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: server-cidr, namespace: x}}
spec:
  endpointSelector: {{matchLabels: {{app: server}}}}
  ingress:
  - fromCIDR: [{w.a1.ip4}/16, "{w.a1.ip6}/64", {w.underlay.outside_ip4}/32]
"""


Matrix = dict[str, bool]


def settle(probe: Callable[[], Matrix], want: Matrix, timeout: float = 20.0) -> None:
    """probe() turns to want within timeout (policy reaching the datapath)."""
    last: Matrix = {}

    def ok() -> bool:
        nonlocal last
        last = probe()
        return last == want

    assert wait_until(ok, timeout=timeout), f"want {want}, got {last}"


def into_server(w: World) -> Matrix:
    s, out = w.server, w.underlay.outside
    return at_once(
        {
            "a1 v4": lambda: reach(w.a1.ns, s.ip4),
            "a1 v6": lambda: reach(w.a1.ns, s.ip6, v6=True),
            "a2 v4": lambda: reach(w.a2.ns, s.ip4),
            "a2 v6": lambda: reach(w.a2.ns, s.ip6, v6=True),
            "b1 v4": lambda: reach(w.b1.ns, s.ip4),
            "outside v4": lambda: reach(out, s.ip4),
            "outside v6": lambda: reach(out, s.ip6, v6=True),
        }
    )


VIP_B1, VIP_B2 = "10.96.7.1", "10.96.7.2"  # ClusterIPs of b1 and b2 (port 80)


def out_of_a(w: World) -> Matrix:
    ul = w.underlay

    def via(vip: str) -> bool:
        return w.a1.ns.request("tcp", vip, 80, timeout=1) is not None

    return at_once(
        {
            # Policy applies to the backend's address, after translation.
            "a1 to b1 via ClusterIP": lambda: via(VIP_B1),
            "a1 to b2 via ClusterIP": lambda: via(VIP_B2),
            "a1 to b1 v4": lambda: reach(w.a1.ns, w.b1.ip4),
            "a1 to b1 v6": lambda: reach(w.a1.ns, w.b1.ip6, v6=True),
            "a1 to b2 v4": lambda: reach(w.a1.ns, w.b2.ip4),
            "a1 to b2 v6": lambda: reach(w.a1.ns, w.b2.ip6, v6=True),
            "a2 to b2 v4": lambda: reach(w.a2.ns, w.b2.ip4),
            "a1 to outside v4": lambda: reach(w.a1.ns, ul.outside_ip4),
            "a1 to outside v6": lambda: reach(w.a1.ns, ul.outside_ip6, v6=True),
            "server to b2 v4": lambda: reach(w.server.ns, w.b2.ip4),  # not selected: open
        }
    )


ALL_IN = dict.fromkeys(
    ["a1 v4", "a1 v6", "a2 v4", "a2 v6", "b1 v4", "outside v4", "outside v6"], True
)
ALL_OUT = dict.fromkeys(
    [
        *("a1 to b1 v4", "a1 to b1 v6", "a1 to b2 v4", "a1 to b2 v6", "a2 to b2 v4"),
        *("a1 to outside v4", "a1 to outside v6", "server to b2 v4"),
        *("a1 to b1 via ClusterIP", "a1 to b2 via ClusterIP"),
    ],
    True,
)


@pytest.fixture
def clean(world: World) -> Iterator[World]:
    """Everything open before and after each test."""
    settle(lambda: into_server(world), ALL_IN)
    yield world
    for name in ("x/server-ipblock", "x/a-egress-ipblock", "x/server-cidr"):
        delete(world, name)


def test_ingress_ipblock_with_except_over_pods_and_an_outside_host(clean: World) -> None:
    w = clean
    resp = put(w, network_policy(w, "Ingress"))
    assert [x.split(":")[0] for x in resp.warnings] == [
        "spec.ingress[0].from[0].ipBlock.cidr",
        "spec.ingress[0].from[1].ipBlock.cidr",
    ]
    # a1 and a2 share one identity; a2's address is in the except.
    settle(
        lambda: into_server(w),
        {**ALL_IN, "a2 v4": False, "a2 v6": False},
    )


def test_egress_ipblock_with_except_over_pods_and_an_outside_host(clean: World) -> None:
    w = clean
    lb = w.cluster.lb()
    for name, vip, pod in (("b1", VIP_B1, w.b1), ("b2", VIP_B2, w.b2)):
        svc = service(f"{NS}/{name}", vip, 80, [(pod.ip4, TCP4)])
        lb.UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)
    settle(lambda: out_of_a(w), ALL_OUT)
    put(w, network_policy(w, "Egress"))
    # b1 and b2 share one identity; b2's address is in the except (the
    # ClusterIPs are outside the blocks: the backend's address decides).
    settle(
        lambda: out_of_a(w),
        {
            **ALL_OUT,
            "a1 to b2 v4": False,
            "a1 to b2 v6": False,
            "a2 to b2 v4": False,
            "a1 to b2 via ClusterIP": False,
        },
    )


def test_cilium_mode_and_cilium_policies_keep_ciliums_semantics(clean: World) -> None:
    w = clean
    # A CiliumNetworkPolicy fromCIDR over the pods' CIDR selects no pod.
    put(w, cilium_policy(w))
    settle(
        lambda: into_server(w),
        {**dict.fromkeys(ALL_IN, False), "outside v4": True},
    )
    delete(w, "x/server-cidr")
    settle(lambda: into_server(w), ALL_IN)

    # --k8s-ipblock-mode=cilium: the NetworkPolicy's ipBlocks match no pod
    # either; the outside host still (CIDR identities).
    w.cluster.restart("policy", ["--k8s-ipblock-mode", "cilium"])
    try:
        put(w, network_policy(w, "Ingress"))
        settle(
            lambda: into_server(w),
            {**dict.fromkeys(ALL_IN, False), "outside v4": True, "outside v6": True},
        )
    finally:
        w.cluster.restart("policy")
    # Back to the default mode, the policy unchanged: the datapath resumes
    # its stream and gets Kubernetes' meaning again.
    settle(lambda: into_server(w), {**ALL_IN, "a2 v4": False, "a2 v6": False})
