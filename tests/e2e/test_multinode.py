"""Several nodes, end to end: three node netns on one underlay (a bridge in
its own netns), each with its own datapath process (own pin folder and state
folder), one etcd and one control plane; pods made by the real
`flagella-cni`. Pods on every pair of nodes talk (TCP, UDP, ICMP; IPv4 and
IPv6), a Kubernetes NetworkPolicy lets one cross-node client in and drops
another with its true identity, ClusterIPs whose backends are all on other
nodes are reached from every node, pods reach an outside host masqueraded to
their node's address. The same tests run for both routing modes; one
cluster per mode is shared by the module's tests (those that change the
cluster's shape run last)."""

from __future__ import annotations

import ipaddress
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from harness import tls
from harness.cluster import Cluster, Node, standalone_cluster
from harness.cni import cni, netconf
from harness.metrics import check_documented, value
from harness.netns import Netns, wait_until
from harness.underlay import Underlay

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

MODES = ["native", "tunnel"]
CIDR6 = "fd00:10:200::/104"
TCP4, UDP4, TCP6, UDP6 = 8080, 8081, 8086, 8087
LEASE_TTL = 12  # seconds a node's registration and references outlive it (a restart
# under load must fit in it: the kill -9 test)
CLI = shutil.which("flagella", path=str(Path(sys.executable).parent)) or "flagella"


def operator_cli(*args: str) -> list[str]:
    """The CLI as an operator (the session's operator certificate)."""
    return [CLI, "--tls-dir", str(tls.session().bundle(tls.OPERATOR)), *args]


# Many probes from one process: [kind, host, port] with kind tcp, udp or
# ping; prints a JSON list of answers (the server's line; "pong"), null when
# nothing came back.
PROBES = r"""
import json, socket, subprocess, sys
timeout = float(sys.argv[1])
out = []
for kind, host, port in json.loads(sys.argv[2]):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        if kind == "tcp":
            s = socket.create_connection((host, port), timeout=timeout)
            s.sendall(b"HELLO\n")
            out.append(s.recv(4096).decode().strip()); s.close()
        elif kind == "udp":
            s = socket.socket(family, socket.SOCK_DGRAM); s.settimeout(timeout)
            s.sendto(b"HELLO", (host, port))
            out.append(s.recvfrom(4096)[0].decode().strip()); s.close()
        else:
            r = subprocess.run(["ping", "-c", "1", "-W", str(int(max(timeout, 1))), host],
                               capture_output=True)
            out.append("pong" if r.returncode == 0 else None)
    except OSError:
        out.append(None)
print(json.dumps(out))
"""


@dataclass
class Pod:
    name: str
    node: Node
    ns: Netns
    ip4: str
    ip6: str
    namespace: str


@dataclass
class MultiNode:
    mode: str
    cluster: Cluster
    underlay: Underlay
    nodes: list[Node]
    pods: list[Pod] = field(default_factory=list)

    def add_pod(
        self,
        node: Node,
        name: str,
        namespace: str,
        labels: dict[str, str],
        named_ports: dict[str, int] | None = None,
    ) -> Pod:
        ns = self.cluster.pod(node, name)
        conf = netconf(node.cni_socket, labels)
        if named_ports:
            conf["args"]["cni"]["namedPorts"] = [
                {"name": n, "port": port} for n, port in named_ports.items()
            ]
        rc, result = cni(
            "ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=(namespace, name)
        )
        assert rc == 0, result
        ips = [ipaddress.ip_interface(ip["address"]).ip for ip in result["ips"]]
        ip4 = next(str(ip) for ip in ips if ip.version == 4)
        ip6 = next(str(ip) for ip in ips if ip.version == 6)
        return Pod(name, node, ns, ip4, ip6, namespace)


def probes(
    ns: Netns, targets: list[tuple[str, str, int]], timeout: float = 2.0
) -> list[str | None]:
    out = ns.run(
        sys.executable, "-c", PROBES, str(timeout), json.dumps(targets),
        timeout=len(targets) * (timeout + 1) + 30,
    )  # fmt: skip
    answers: list[str | None] = json.loads(out.stdout)
    return answers


def serve_all(pod: Pod) -> None:
    pod.ns.serve("tcp", TCP4, pod.name)
    pod.ns.serve("udp", UDP4, pod.name)
    pod.ns.serve("tcp", TCP6, pod.name, v6=True)
    pod.ns.serve("udp", UDP6, pod.name, v6=True)


def node_flags(mode: str) -> list[str]:
    return ["--routing-mode", mode, "--health-interval-seconds", "0.5"]


def node_health(mn: MultiNode) -> tuple[int, dict[str, Any]]:
    """`flagella status --nodes -o json`: (exit status, the matrix)."""
    out = subprocess.run(
        operator_cli("--ipam-address", mn.cluster.socket("ipam"), "-o", "json", "status", "--nodes"),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    data: dict[str, Any] = json.loads(out.stdout)["nodes"]
    return out.returncode, data


@pytest.fixture(scope="module", params=MODES)
def mn(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    mode: str = request.param
    tmp: Path = tmp_path_factory.mktemp(f"multinode-{mode}")
    with standalone_cluster(tmp) as cluster:
        cluster.start(
            services=("ipam", "policy", "lb", "endpoint"),
            extra={
                "ipam": ["--cluster-cidr", CIDR6, "--node-lease-ttl", str(LEASE_TTL)],
                "policy": ["--node-lease-ttl", str(LEASE_TTL)],
            },
        )
        underlay = Underlay(cluster.nss)
        nodes = [
            cluster.add_node(f"n{i}", underlay=underlay, extra=node_flags(mode)) for i in (1, 2, 3)
        ]
        mn = MultiNode(mode, cluster, underlay, nodes)
        for node in nodes:
            pod = mn.add_pod(node, f"web{node.index}", "apps", {"app": "web"})
            serve_all(pod)
            mn.pods.append(pod)
        yield mn


def test_pods_on_every_pair_of_nodes_talk(mn: MultiNode) -> None:
    for a, b in itertools.permutations(mn.pods, 2):
        targets: list[tuple[str, str, int]] = [
            ("tcp", b.ip4, TCP4), ("udp", b.ip4, UDP4), ("ping", b.ip4, 0),
            ("tcp", b.ip6, TCP6), ("udp", b.ip6, UDP6), ("ping", b.ip6, 0),
        ]  # fmt: skip
        want = [
            f"{b.name} {a.ip4} HELLO", f"{b.name} {a.ip4} HELLO", "pong",
            f"{b.name} {a.ip6} HELLO", f"{b.name} {a.ip6} HELLO", "pong",
        ]  # fmt: skip
        assert probes(a.ns, targets) == want, (a.name, b.name)


DB_FROM_TRUSTED = """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-trusted, namespace: db}
spec:
  podSelector: {matchLabels: {app: db}}
  policyTypes: [Ingress]
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: trusted}}
    ports: [{port: 8080, protocol: TCP}]
"""


def identity_of(mn: MultiNode, ip: str) -> int:
    entries = mn.cluster.policy().ListIPCache(policy_pb2.ListIPCacheRequest(), timeout=10).entries
    return next(e.identity for e in entries if e.prefix in (ip, f"{ip}/32"))


def test_namespace_policy_admits_one_cross_node_client_and_drops_another(mn: MultiNode) -> None:
    n1, n2, n3 = mn.nodes
    db = mn.add_pod(n3, "db", "db", {"app": "db"})
    db.ns.serve("tcp", TCP4, "db")
    good = mn.add_pod(n1, "good", "trusted", {"app": "client"})
    bad = mn.add_pod(n2, "bad", "other", {"app": "client"})
    for client in (good, bad):
        assert wait_until(lambda c=client: probes(c.ns, [("tcp", db.ip4, TCP4)])[0], timeout=10)

    policy = mn.cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=DB_FROM_TRUSTED), timeout=10)
    try:
        assert wait_until(lambda: probes(bad.ns, [("tcp", db.ip4, TCP4)], timeout=1) == [None])
        assert probes(good.ns, [("tcp", db.ip4, TCP4)]) == [f"db {good.ip4} HELLO"]
        flows = list(
            mn.cluster.datapath(n3).ObserveFlows(
                datapath_pb2.ObserveFlowsRequest(
                    verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=200, follow=False
                ),
                timeout=10,
            )
        )
        dropped = [f for f in flows if f.src_ip == bad.ip4 and f.dst_ip == db.ip4]
        assert dropped, flows
        assert {f.src_identity for f in dropped} == {identity_of(mn, bad.ip4)}
        assert {f.drop_reason for f in dropped} == {datapath_pb2.DROP_REASON_POLICY_L3}
        assert {f.node for f in dropped} == {n3.name}
        assert not [f for f in flows if f.src_ip == good.ip4]
    finally:
        policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="db/db-from-trusted"), timeout=10)


NAMED_PORTS = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: named, namespace: named}
spec:
  endpointSelector: {matchLabels: {app: nclient}}
  egress:
  - toEndpoints: [{matchLabels: {app: nsrv}}]
    toPorts: [{ports: [{port: web, protocol: TCP}]}]
---
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: named-srv, namespace: named}
spec:
  endpointSelector: {matchLabels: {app: nsrv}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: nclient}}]
    toPorts: [{ports: [{port: web, protocol: TCP}]}]
"""


def test_named_ports_resolve_across_nodes(mn: MultiNode) -> None:
    """The client's egress names the server's port, which only the
    server's node has from its pod: the client's node learns the number
    from the ipcache."""
    n1, _, n3 = mn.nodes
    srv = mn.add_pod(n3, "nsrv", "named", {"app": "nsrv"}, {"web": TCP4 + 10})
    client = mn.add_pod(n1, "nclient", "named", {"app": "nclient"})
    for port in (TCP4, TCP4 + 10):
        srv.ns.serve("tcp", port, "nsrv")
    targets = [("tcp", srv.ip4, TCP4 + 10), ("tcp", srv.ip4, TCP4)]
    policy = mn.cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=NAMED_PORTS), timeout=10)
    try:
        want = [f"nsrv {client.ip4} HELLO", None]
        assert wait_until(lambda: probes(client.ns, targets, timeout=1) == want, timeout=10)
    finally:
        for name in ("named/named", "named/named-srv"):
            policy.DeleteRule(policy_pb2.DeleteRuleRequest(name=name), timeout=10)


def test_cluster_ip_with_every_backend_on_other_nodes(mn: MultiNode) -> None:
    lb = mn.cluster.lb()
    for i, pod in enumerate(mn.pods):
        others = [p for p in mn.pods if p.node is not pod.node]
        for family, vip, port in ((4, f"10.96.1.{i + 1}", TCP4), (6, f"fd00:96::{i + 1}", TCP6)):
            lb.UpsertService(
                lb_pb2.UpsertServiceRequest(
                    service=lb_pb2.Service(
                        name=f"apps/far{i}-v{family}",
                        frontend=lb_pb2.Frontend(
                            address=vip, port=80, protocol=lb_pb2.PROTOCOL_TCP
                        ),
                        type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                        backends=[
                            lb_pb2.Backend(address=p.ip4 if family == 4 else p.ip6, port=port)
                            for p in others
                        ],
                    )
                ),
                timeout=10,
            )
            assert wait_until(
                lambda v=vip, p=pod: probes(p.ns, [("tcp", v, 80)], timeout=1)[0], timeout=10
            )
            answers = probes(pod.ns, [("tcp", vip, 80)] * 20)
            assert None not in answers, answers
            served = {str(a).split()[0] for a in answers}
            assert served == {p.name for p in others}, (vip, served)
            client = pod.ip4 if family == 4 else pod.ip6
            assert {str(a).split()[1] for a in answers} == {client}


def test_pods_reach_an_outside_host_masqueraded_to_their_node(mn: MultiNode) -> None:
    out = mn.underlay.outside
    out.serve("tcp", 9000, "outside")
    out.serve("tcp", 9006, "outside", v6=True)
    ul = mn.underlay
    for pod in mn.pods:
        node_ip6 = next(a for a in pod.node.args if ":" in a and a.startswith("fd00:100"))
        answers = probes(pod.ns, [("tcp", ul.outside_ip4, 9000), ("tcp", ul.outside_ip6, 9006)])
        assert answers == [f"outside {pod.node.ip} HELLO", f"outside {node_ip6} HELLO"], pod.name


# Sends n bytes on one TCP connection and reads them back (the pods' echo
# servers echo lines starting with ECHO); prints the count read back.
BULK = r"""
import socket, sys, threading
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.create_connection((host, port), timeout=20)
line = b"ECHO" + b"x" * 4091 + b"\n"
chunks = n // len(line)
def send():
    for _ in range(chunks):
        s.sendall(line)
threading.Thread(target=send, daemon=True).start()
got = 0
while got < chunks * len(line):
    data = s.recv(65536)
    if not data:
        break
    got += len(data)
print(got)
"""


def test_ten_megabytes_cross_nodes(mn: MultiNode) -> None:
    """Full-size segments both ways across nodes: the pod MTU leaves room
    for the tunnel's encapsulation (a blackholed size would stall)."""
    a, b = mn.pods[0], mn.pods[1]
    n = 10 * 1024 * 1024
    for host, port in ((b.ip4, TCP4), (b.ip6, TCP6)):
        out = a.ns.run(sys.executable, "-c", BULK, host, str(port), str(n), timeout=60)
        assert int(out.stdout) >= n - 4096, (host, out.stdout)
    mtu = int(str(a.ns.link("eth0")["mtu"]))
    assert mtu == (1450 if mn.mode == "tunnel" else 1500)


def test_the_mode_shows_in_routes_and_ipcache(mn: MultiNode) -> None:
    n1 = mn.nodes[0]
    routes = n1.netns.run("ip", "-j", "route", "show", "proto", "102").stdout
    others = [p for p in mn.pods if p.node is not n1]
    dump = mn.cluster.datapath(n1).DumpMap(datapath_pb2.DumpMapRequest(name="ipcache"), timeout=20)
    entries = {e.key["prefix"]: dict(e.value) for e in dump.entries}
    for pod in others:
        entry = entries[f"{pod.ip4}/32"]
        assert entry["identity"] == str(identity_of(mn, pod.ip4))
        assert entry["flags"] == "cluster"
        if mn.mode == "tunnel":
            assert entry["tunnel_ip"] == pod.node.ip
        else:
            assert "tunnel_ip" not in entry
    for node in mn.nodes[1:]:
        assert entries[f"{node.ip}/32"]["identity"] == "6"  # remote-node
    assert entries[f"{n1.ip}/32"]["identity"] == "1"  # host
    devices = {r.get("dev") for r in json.loads(routes)}
    gateways = {r.get("gateway") for r in json.loads(routes)}
    if mn.mode == "tunnel":
        assert devices == {"flagella_vxlan"}
        assert gateways == {None}
    else:
        assert devices == {"up0"}
        assert {n.ip for n in mn.nodes[1:]} <= gateways


GUARD = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: guard, namespace: apps}}
spec:
  endpointSelector: {{matchLabels: {{app: guard}}}}
  ingress:
  - fromEntities: [{entities}]
    toPorts: [{{ports: [{{port: "8080", protocol: TCP}}]}}]
"""


def flows_to(mn: MultiNode, node: Node, ip: str, verdict: int) -> list[datapath_pb2.Flow]:
    return [
        f
        for f in mn.cluster.datapath(node).ObserveFlows(
            datapath_pb2.ObserveFlowsRequest(verdicts=[verdict], last=500, follow=False),  # type: ignore[list-item]
            timeout=10,
        )
        if f.dst_ip == ip and f.dst_port == TCP4
    ]


def test_entities_across_nodes(mn: MultiNode) -> None:
    """The identity a pod's node sees: another node's host is remote-node,
    its own host is host, a pod of another node its own identity, an
    outside host world; fromEntities select them as in Cilium."""
    n1, n2, _ = mn.nodes
    web3 = mn.pods[2]
    guard = mn.add_pod(n1, "guard", "apps", {"app": "guard"})
    guard.ns.serve("tcp", TCP4, "guard")
    outside = mn.underlay.outside
    # The outside host routes the guard's CIDR via its node (no tunnel).
    outside.ip("route", "replace", f"{guard.ip4}/32", "via", n1.ip)
    policy = mn.cluster.policy()

    def allowed(ns: Netns) -> bool:
        return ns.request("tcp", guard.ip4, TCP4, timeout=1) is not None

    try:
        policy.PutRules(
            policy_pb2.PutRulesRequest(document=GUARD.format(entities="remote-node")), timeout=10
        )
        assert wait_until(lambda: not allowed(web3.ns))
        assert allowed(n2.netns)
        assert allowed(n1.netns)  # the local host: always (allow-host)
        assert not allowed(outside)
        fwd = flows_to(mn, n1, guard.ip4, datapath_pb2.FLOW_VERDICT_FORWARDED)
        assert {f.src_identity for f in fwd if f.src_ip == n2.ip} == {6}  # remote-node
        assert {f.src_identity for f in fwd if f.src_ip == n1.ip} == {1}  # host
        dropped = flows_to(mn, n1, guard.ip4, datapath_pb2.FLOW_VERDICT_DROPPED)
        assert {f.src_identity for f in dropped if f.src_ip == web3.ip4} == {
            identity_of(mn, web3.ip4)
        }
        assert {f.src_identity for f in dropped if f.src_ip == mn.underlay.outside_ip4} == {2}

        policy.PutRules(
            policy_pb2.PutRulesRequest(document=GUARD.format(entities="cluster")), timeout=10
        )
        assert wait_until(lambda: allowed(web3.ns))
        assert allowed(n2.netns)
        assert not allowed(outside)

        policy.PutRules(
            policy_pb2.PutRulesRequest(document=GUARD.format(entities="world")), timeout=10
        )
        assert wait_until(lambda: allowed(outside))
        assert not allowed(web3.ns)
        assert not allowed(n2.netns)
    finally:
        policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="apps/guard"), timeout=10)


def test_nodeport_on_one_node_reaches_a_backend_on_another(mn: MultiNode) -> None:
    """From the outside host to node n1's address and node port, served by
    a pod of n3 only: DNAT and SNAT to n1's address at n1 (Cilium's default
    NodePort mode), the client seeing n1 as its peer."""
    n1, n3 = mn.nodes[0], mn.nodes[2]
    web3 = mn.pods[2]
    svc = (
        mn.cluster.lb()
        .UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_pb2.Service(
                    name="apps/np",
                    frontend=lb_pb2.Frontend(
                        address="10.96.2.1", port=80, protocol=lb_pb2.PROTOCOL_TCP
                    ),
                    type=lb_pb2.SERVICE_TYPE_NODE_PORT,
                    backends=[lb_pb2.Backend(address=web3.ip4, port=TCP4)],
                )
            ),
            timeout=10,
        )
        .service
    )
    assert svc.node_port
    outside = mn.underlay.outside
    assert wait_until(
        lambda: outside.request("tcp", n1.ip, svc.node_port, timeout=1) is not None, timeout=10
    )
    answers = probes(outside, [("tcp", n1.ip, svc.node_port)] * 10)
    # The backend on n3 saw n1's address (SNAT), and answered.
    assert answers == [f"web3 {n1.ip} HELLO"] * 10
    assert n3 is web3.node


def test_external_traffic_policy_local_and_cluster(mn: MultiNode) -> None:
    """A LoadBalancer address (LB-IPAM's) and an external IP of a service
    whose one backend is on n3, reached from the outside host routing both
    via one node at a time. externalTrafficPolicy Local: via n3 the backend
    sees the client's own address; via n1 and n2, which have no backend of
    it, the packets are dropped, each node's flows showing the reason
    (SERVICE_BACKEND_NOT_FOUND, Cilium's DROP_NO_SERVICE); a pod of n1 still
    reaches the backend by the ClusterIP and by the LoadBalancer address
    (in-cluster traffic is not external). Cluster: every node answers, n1
    and n2 with the source translated to their own address."""
    n1, n2, n3 = mn.nodes
    web1, web3 = mn.pods[0], mn.pods[2]
    assert web3.node is n3
    lb = mn.cluster.lb()
    lb.UpsertLbIpPool(
        lb_pb2.UpsertLbIpPoolRequest(
            pool=lb_pb2.LbIpPool(name="etp", blocks=[lb_pb2.LbIpBlock(cidr="198.51.100.64/30")])
        ),
        timeout=10,
    )
    external_ip = "203.0.113.50"
    svc = lb_pb2.Service(
        name="apps/etp",
        frontend=lb_pb2.Frontend(address="10.96.2.9", port=80, protocol=lb_pb2.PROTOCOL_TCP),
        type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
        backends=[lb_pb2.Backend(address=web3.ip4, port=TCP4, node=n3.name)],
        external_ips=[external_ip],
        external_traffic_policy=lb_pb2.TRAFFIC_POLICY_LOCAL,
    )
    svc.load_balancer.SetInParent()
    got = lb.UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10).service
    assert got.load_balancer.condition.satisfied, got.load_balancer
    (lb_ip,) = got.load_balancer.ingress
    # The same over IPv6: an external IP of an IPv6 service.
    external_ip6 = "2001:db8:50::1"
    lb.UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_pb2.Service(
                name="apps/etp6",
                frontend=lb_pb2.Frontend(
                    address="fd00:96::9", port=80, protocol=lb_pb2.PROTOCOL_TCP
                ),
                backends=[lb_pb2.Backend(address=web3.ip6, port=TCP6, node=n3.name)],
                external_ips=[external_ip6],
                external_traffic_policy=lb_pb2.TRAFFIC_POLICY_LOCAL,
            )
        ),
        timeout=10,
    )
    outside = mn.underlay.outside
    client = mn.underlay.outside_ip4

    def via(node: Node) -> list[str | None]:
        for prefix in (f"{lb_ip}/32", f"{external_ip}/32"):
            outside.ip("route", "replace", prefix, "via", node.ip)
        outside.ip(
            "-6", "route", "replace", f"{external_ip6}/128", "via", f"fd00:100::{node.index}"
        )
        return probes(
            outside,
            [("tcp", lb_ip, 80), ("tcp", external_ip, 80), ("tcp", external_ip6, 80)],
            timeout=0.5,
        )

    want_local = [f"web3 {client} HELLO"] * 2 + [f"web3 {mn.underlay.outside_ip6} HELLO"]
    assert wait_until(lambda: via(n3) == want_local, timeout=10)
    for node in (n1, n2):
        assert via(node) == [None, None, None], node.name

        def dropped(node: Node = node) -> set[str]:
            return {
                f.dst_ip
                for f in mn.cluster.datapath(node).ObserveFlows(
                    datapath_pb2.ObserveFlowsRequest(
                        verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=500, follow=False
                    ),
                    timeout=10,
                )
                if f.drop_reason == datapath_pb2.DROP_REASON_NO_BACKEND
                and f.src_ip in (client, mn.underlay.outside_ip6)
                and f.dst_port == 80
            }

        assert wait_until(lambda: dropped() == {lb_ip, external_ip, external_ip6}, timeout=10), (
            node.name
        )
    # In-cluster traffic keeps every backend (ClusterIP, and the address).
    assert (
        probes(web1.ns, [("tcp", "10.96.2.9", 80), ("tcp", lb_ip, 80)])
        == [f"web3 {web1.ip4} HELLO"] * 2
    )

    lb.DeleteService(lb_pb2.DeleteServiceRequest(name="apps/etp6"), timeout=10)

    svc.external_traffic_policy = lb_pb2.TRAFFIC_POLICY_CLUSTER
    lb.UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)
    for node in (n1, n2):
        want = [f"web3 {node.ip} HELLO"] * 2 + [None]  # SNAT to the node towards n3
        assert wait_until(lambda node=node, want=want: via(node) == want, timeout=10), node.name
    assert via(n3) == [*want_local[:2], None]
    # loadBalancerSourceRanges hold for both addresses: a client outside them
    # is dropped with its reason.
    svc.source_ranges.append("10.0.0.0/8")
    lb.UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)
    assert wait_until(lambda: via(n1) == [None] * 3, timeout=10)
    reasons = {
        f.dst_ip
        for f in mn.cluster.datapath(n1).ObserveFlows(
            datapath_pb2.ObserveFlowsRequest(
                verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=500, follow=False
            ),
            timeout=10,
        )
        if f.drop_reason == datapath_pb2.DROP_REASON_SOURCE_RANGE and f.src_ip == client
    }
    assert reasons == {lb_ip, external_ip}
    lb.DeleteService(lb_pb2.DeleteServiceRequest(name="apps/etp"), timeout=10)
    for prefix in (f"{lb_ip}/32", f"{external_ip}/32"):
        outside.ip("route", "del", prefix)
    outside.ip("-6", "route", "del", f"{external_ip6}/128")
    lb.DeleteLbIpPool(lb_pb2.DeleteLbIpPoolRequest(name="etp"), timeout=10)


# One UDP datagram of n bytes to each [host, port]: prints a JSON list of
# [server name, payload length of its answer] (the answer echoes the
# payload) or null.
BIG_UDP = r"""
import json, socket, sys
n, timeout = int(sys.argv[1]), float(sys.argv[2])
out = []
for host, port in json.loads(sys.argv[3]):
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(timeout)
    try:
        s.sendto(b"X" * n, (host, port))
        words = s.recvfrom(65536)[0].decode().split()
        out.append([words[0], len(words[-1])])
    except OSError:
        out.append(None)
print(json.dumps(out))
"""

FRAG_POLICY = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: frag, namespace: apps}
spec:
  endpointSelector: {matchLabels: {app: frag}}
  ingress:
  - fromEntities: [cluster]
    toPorts: [{ports: [{port: "8081", protocol: UDP}, {port: "8087", protocol: UDP}]}]
"""


def test_fragmented_datagrams_cross_nodes_and_services(mn: MultiNode) -> None:
    """A UDP datagram larger than the MTU (IPv4 and IPv6 fragments) reaches
    a pod of another node, directly and as a ClusterIP backend, under a
    policy that allows its port: later fragments get the first one's ports
    (verdict, conntrack, service translation, tunnel); the answer, as large,
    comes back fragmented too."""
    web1 = mn.pods[0]
    frag = mn.add_pod(mn.nodes[1], "frag", "apps", {"app": "frag"})
    frag.ns.serve("udp", UDP4, "frag")
    frag.ns.serve("udp", UDP6, "frag", v6=True)
    lb = mn.cluster.lb()
    for vip, ip, port in (("10.96.3.1", frag.ip4, UDP4), ("fd00:96::3:1", frag.ip6, UDP6)):
        lb.UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_pb2.Service(
                    name=f"apps/frag-{port}",
                    frontend=lb_pb2.Frontend(address=vip, port=53, protocol=lb_pb2.PROTOCOL_UDP),
                    type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                    backends=[lb_pb2.Backend(address=ip, port=port)],
                )
            ),
            timeout=10,
        )
    policy = mn.cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=FRAG_POLICY), timeout=10)
    targets = [[frag.ip4, UDP4], [frag.ip6, UDP6], ["10.96.3.1", 53], ["fd00:96::3:1", 53]]

    def big(n: int) -> list[list[object] | None]:
        out = web1.ns.run(sys.executable, "-c", BIG_UDP, str(n), "2", json.dumps(targets))
        answers: list[list[object] | None] = json.loads(out.stdout)
        return answers

    try:
        assert wait_until(lambda: None not in big(100), timeout=10)
        assert big(4000) == [["frag", 4000]] * 4
        # Each node remembered the first fragments' ports.
        for node in (web1.node, frag.node):
            dump = mn.cluster.datapath(node).DumpMap(
                datapath_pb2.DumpMapRequest(name="frags"), timeout=20
            )
            assert {e.key["proto"] for e in dump.entries} == {"17"}, node.name
        # The policy still decides: a port it does not allow gets nothing.
        out = web1.ns.run(
            sys.executable, "-c", BIG_UDP, "4000", "1", json.dumps([[frag.ip4, 9999]])
        )
        assert json.loads(out.stdout) == [None]
    finally:
        policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="apps/frag"), timeout=10)


def test_forwarding_decrements_the_ttl_as_routers_do(mn: MultiNode) -> None:
    """A pod of another node is two hops away in both modes (each node one
    router), a pod of the same node one: where the datapath forwards past
    the stack (local delivery, into and out of the tunnel) it decrements
    the TTL / hop limit as the stack does where it forwards."""
    web1, web2 = mn.pods[0], mn.pods[1]
    near = mn.add_pod(web1.node, "near", "apps", {"app": "near"})

    def reaches(ttl: int, ip: str) -> bool:
        out = web1.ns.run("ping", "-c", "1", "-W", "1", "-t", str(ttl), ip, check=False)
        return out.returncode == 0

    for ip in (web2.ip4, web2.ip6):
        assert wait_until(lambda ip=ip: reaches(3, ip), timeout=10)
        assert not reaches(2, ip)
    for ip in (near.ip4, near.ip6):
        assert wait_until(lambda ip=ip: reaches(2, ip), timeout=10)
        assert not reaches(1, ip)


def test_every_node_probes_the_others(mn: MultiNode) -> None:
    """`flagella status --nodes` finds every datapath through the node
    registry and shows how each node reaches the others."""

    def all_probed() -> bool:
        rc, data = node_health(mn)
        return rc == 0 and all(len(e["peers"]) == len(mn.nodes) - 1 for e in data.values())

    assert wait_until(all_probed, timeout=10)
    _, data = node_health(mn)
    names = {n.name for n in mn.nodes}
    assert set(data) == names
    for name, entry in data.items():
        assert set(entry["peers"]) == names - {name}
        for peer in entry["peers"].values():
            assert peer["reachable"] is True
            assert 0 < peer["latency_ms"] < 1000
    table = subprocess.run(
        operator_cli("--ipam-address", mn.cluster.socket("ipam"), "status", "--nodes"),
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert table.splitlines()[0].split() == ["FROM", "\\", "TO", *sorted(names)]
    # The same probes on each datapath's /metrics, per peer node.
    for node in mn.nodes:
        assert node.process is not None
        scraped = node.process.scrape()
        check_documented(scraped)
        for peer in names - {node.name}:
            status = "flagella_node_health_connectivity_status"
            assert value(scraped, status, target_node_name=peer) == 1
            latency = "flagella_node_health_connectivity_latency_seconds"
            assert 0 < value(scraped, latency, target_node_name=peer) < 1


# --- the cluster's shape changes: these run last ---


def test_kill9_of_a_datapath_under_a_cross_node_stream(mn: MultiNode) -> None:
    """The datapath of the stream's client node dies and comes back: the
    stream never fails (maps pinned, programs attached, the tunnel device
    kept), and pods of the other nodes keep talking meanwhile."""
    web1, web2, web3 = mn.pods
    stream = web1.ns.stream(web2.ip4, TCP4, 0.05)
    assert stream.stdout is not None
    assert stream.stdout.readline().startswith("ok")
    node = web1.node
    assert node.process is not None
    node.process.kill9()
    assert probes(web2.ns, [("tcp", web3.ip4, TCP4), ("tcp", web3.ip6, TCP6)]) == [
        f"web3 {web2.ip4} HELLO",
        f"web3 {web2.ip6} HELLO",
    ]
    time.sleep(1.0)
    mn.cluster.start_datapath(node)
    assert probes(web1.ns, [("tcp", web3.ip4, TCP4)]) == [f"web3 {web1.ip4} HELLO"]
    time.sleep(1.0)
    stream.kill()
    lines = stream.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == [], lines
    assert sum(line.startswith("ok ") for line in lines) > 20, lines


# Connects to host:port every 50 ms until it answers; prints the wall-clock
# time of the first answer.
FIRST_CONTACT = r"""
import socket, sys, time
host, port, deadline = sys.argv[1], int(sys.argv[2]), time.time() + float(sys.argv[3])
while time.time() < deadline:
    try:
        s = socket.create_connection((host, port), timeout=0.2)
        s.sendall(b"HELLO\n"); s.recv(100); print(time.time()); sys.exit(0)
    except OSError:
        time.sleep(0.05)
sys.exit(1)
"""


def test_a_node_added_later_reaches_existing_pods_within_2s(mn: MultiNode) -> None:
    web1 = mn.pods[0]
    n4 = mn.cluster.add_node("n4", underlay=mn.underlay, extra=node_flags(mn.mode), start=False)
    contact = n4.netns.popen(sys.executable, "-c", FIRST_CONTACT, web1.ip4, str(TCP4), "60")
    mn.cluster.start_datapath(n4)
    assert contact.wait(60) == 0
    assert contact.stdout is not None
    reached = float(contact.stdout.read().split()[-1])
    node = mn.cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name="n4"), timeout=10)
    registered = node.registered_at.ToNanoseconds() / 1e9
    assert 0 <= reached - registered <= 2.0, reached - registered
    # A pod of the new node reaches the pods of every other node.
    web4 = mn.add_pod(n4, "web4", "apps", {"app": "web"})
    targets = [("tcp", p.ip4, TCP4) for p in mn.pods] + [("tcp", p.ip6, TCP6) for p in mn.pods]
    want = [f"{p.name} {web4.ip4} HELLO" for p in mn.pods]
    want += [f"{p.name} {web4.ip6} HELLO" for p in mn.pods]
    assert probes(web4.ns, targets) == want


def test_a_node_stopped_for_good_is_gone_from_the_others_after_its_lease(mn: MultiNode) -> None:
    n1, _, n3 = mn.nodes[:3]
    web3 = mn.pods[2]
    cidrs = list(
        mn.cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=n3.name), timeout=10).pod_cidrs
    )
    assert n3.process is not None
    n3.process.stop()
    # Its peers report it unreachable while it is still in their tables.
    assert wait_until(lambda: node_health(mn)[1][n1.name]["peers"][n3.name]["reachable"] is False)
    assert "error" in node_health(mn)[1][n3.name]
    assert n1.process is not None
    scraped = n1.process.scrape()
    reachable = "flagella_node_health_connectivity_status"
    assert value(scraped, reachable, target_node_name=n3.name) == 0
    assert value(scraped, reachable, target_node_name=mn.nodes[1].name) == 1

    def gone() -> bool:
        dump = mn.cluster.datapath(n1).DumpMap(
            datapath_pb2.DumpMapRequest(name="ipcache"), timeout=20
        )
        prefixes = {e.key["prefix"] for e in dump.entries}
        routes = n1.netns.run("ip", "-j", "route", "show", "proto", "102").stdout
        routes += n1.netns.run("ip", "-j", "-6", "route", "show", "proto", "102").stdout
        left[:] = [
            *(prefixes & {f"{n3.ip}/32", f"{web3.ip4}/32", f"{web3.ip6}/128", *cidrs}),
            *(c for c in cidrs if c.split("/")[0] in routes),
        ]
        return not left

    left: list[str] = []
    assert not gone()
    assert wait_until(gone, timeout=2 * LEASE_TTL + 20, interval=0.5), left
