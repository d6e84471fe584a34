"""NodePort from outside the node with real traffic through the real control
plane (etcd, policy and lb processes, the node's datapath process): a client
in the node's outside netns reaches node_ip:node_port, local backends by
DNAT (the client's address kept, the backend's ingress policy applied with
identity world), a remote backend by DNAT + SNAT; the client always sees the
node address and node port as its peer. And 500 Maglev services programmed
and serving."""

from __future__ import annotations

import collections
import json
import sys
import time

import pytest
from harness.cluster import Cluster, Node
from harness.netns import Netns, wait_until
from harness.pods import Pod, add_pod

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.datapath.bpf import maglev_slot

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

# Requests from fixed or free source ports; per request [server's answer,
# peer address, peer port] or null. The peer is what the client's kernel
# says: getpeername() of the TCP socket (a connection only completes when
# the replies come from where the SYN went), the sender of the UDP answer
# (an unconnected socket takes answers from anyone).
PEER_CLIENT = r"""
import json, socket, sys
proto, host, port, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
kind, _, what = sys.argv[5].partition(":")
sports = [int(p) for p in what.split(",")] if kind == "ports" else [0] * int(what)
out = []
for sport in sports:
    try:
        if proto == "tcp":
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.settimeout(timeout)
            s.bind(("", sport))
            s.connect((host, port))
            s.sendall(b"HELLO\n")
            answer = s.recv(4096).decode().strip()
            peer = s.getpeername()
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(timeout)
            s.bind(("", sport))
            s.sendto(b"HELLO", (host, port))
            data, peer = s.recvfrom(4096)
            answer = data.decode().strip()
        s.close()
        out.append([answer, peer[0], peer[1]])
    except OSError:
        out.append(None)
print(json.dumps(out))
"""

Answer = list[object] | None

OUTSIDE_IP = "192.168.101.254"  # the client: the node's outside netns (node index 1)

WEB_FROM_FRONTEND = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web-ingress}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""
WEB_FROM_FRONTEND_AND_WORLD = (
    WEB_FROM_FRONTEND
    + """  - fromEntities: [world]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""
)


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("policy", "lb"))
    node = cluster.add_node("n1")
    assert node.ip == "192.168.101.1"
    return node


def peer_requests(
    ns: Netns, proto: str, host: str, port: int, n_or_ports: int | list[int], timeout: float = 2.0
) -> list[Answer]:
    """n requests from free source ports, or one per given source port."""
    if isinstance(n_or_ports, list):
        arg, count = "ports:" + ",".join(map(str, n_or_ports)), len(n_or_ports)
    else:
        arg, count = f"count:{n_or_ports}", n_or_ports
    out = ns.run(
        sys.executable,
        "-c",
        PEER_CLIENT,
        proto,
        host,
        str(port),
        str(timeout),
        arg,
        timeout=count * (timeout + 1) + 30,
    )
    answers: list[Answer] = json.loads(out.stdout)
    return answers


def backends_up(cluster: Cluster, node: Node, n: int = 3, udp: bool = False) -> list[Pod]:
    pods = [
        add_pod(cluster, node, f"b{i}", 10 + i, f"10.200.3.{10 + i}", {"app": "web"})
        for i in range(n)
    ]
    for i, p in enumerate(pods):
        p.ns.serve("tcp", 8080, f"b{i}")
        if udp:
            p.ns.serve("udp", 5353, f"b{i}")
    return pods


def nodeport_service(
    name: str,
    addresses: list[str],
    *,
    vip: str = "10.96.0.40",
    protocol: int = lb_pb2.PROTOCOL_TCP,
    port: int = 8080,
    algorithm: int = lb_pb2.ALGORITHM_RANDOM,
) -> lb_pb2.Service:
    return lb_pb2.Service(
        name=name,
        frontend=lb_pb2.Frontend(address=vip, port=80, protocol=protocol),  # type: ignore[arg-type]
        type=lb_pb2.SERVICE_TYPE_NODE_PORT,
        backends=[lb_pb2.Backend(address=a, port=port) for a in addresses],
        algorithm=algorithm,  # type: ignore[arg-type]
    )


def upsert(cluster: Cluster, svc: lb_pb2.Service) -> lb_pb2.Service:
    resp = cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)
    assert resp.service.node_port, resp.service
    return resp.service


def test_nodeport_from_outside_reaches_every_local_backend(cluster: Cluster, node: Node) -> None:
    pods = backends_up(cluster, node, udp=True)
    tcp = upsert(cluster, nodeport_service("default/web", [p.ip for p in pods]))
    udp = upsert(
        cluster,
        nodeport_service(
            "default/dns",
            [p.ip for p in pods],
            vip="10.96.0.41",
            protocol=lb_pb2.PROTOCOL_UDP,
            port=5353,
        ),
    )
    outside = node.outside
    assert wait_until(lambda: outside.request("tcp", node.ip, tcp.node_port, timeout=1) is not None)

    # A connection held open while many others are balanced: conntrack
    # keeps it on its backend.
    hold = outside.stream(node.ip, tcp.node_port, hello=True)
    assert hold.stdout is not None
    held_by = hold.stdout.readline().strip()
    assert held_by in {"b0", "b1", "b2"}

    answers = peer_requests(outside, "tcp", node.ip, tcp.node_port, 90)
    assert None not in answers, answers
    served = collections.Counter(str(a[0]).split()[0] for a in answers if a)
    assert set(served) == {"b0", "b1", "b2"}, served
    assert min(served.values()) >= 10, served
    # The backends saw the outside client's own address (no SNAT for a
    # local backend); the client's peer was the node address and node port.
    assert {str(a[0]).split()[1] for a in answers if a} == {OUTSIDE_IP}
    assert {(a[1], a[2]) for a in answers if a} == {(node.ip, tcp.node_port)}

    udp_answers = peer_requests(outside, "udp", node.ip, udp.node_port, 30)
    assert None not in udp_answers, udp_answers
    assert {(a[1], a[2]) for a in udp_answers if a} == {(node.ip, udp.node_port)}
    assert len({str(a[0]).split()[0] for a in udp_answers if a}) > 1
    assert {str(a[0]).split()[1] for a in udp_answers if a} == {OUTSIDE_IP}

    time.sleep(0.5)
    hold.kill()
    lines = hold.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == []
    assert sum(line.startswith("ok ") for line in lines) > 10

    # The datapath's view: NodePort conntrack entries for the outside client.
    dp = cluster.datapath(node)
    ct = dp.DumpMap(datapath_pb2.DumpMapRequest(name="ct"), timeout=20).entries
    nodeport_ct = [e for e in ct if e.key["scope"] == "nodeport"]
    assert nodeport_ct
    assert {e.key["src"] for e in nodeport_ct} == {OUTSIDE_IP}
    assert {e.key["dst"] for e in nodeport_ct} == {p.ip for p in pods}


def test_backend_ingress_policy_applies_to_outside_clients_as_world(
    cluster: Cluster, node: Node
) -> None:
    pods = backends_up(cluster, node, n=2)
    svc = upsert(cluster, nodeport_service("default/web", [p.ip for p in pods]))
    outside = node.outside
    assert wait_until(lambda: outside.request("tcp", node.ip, svc.node_port, timeout=1) is not None)

    policy = cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=WEB_FROM_FRONTEND), timeout=10)
    assert wait_until(lambda: outside.request("tcp", node.ip, svc.node_port, timeout=1) is None)
    assert peer_requests(outside, "tcp", node.ip, svc.node_port, 5, timeout=1) == [None] * 5
    flows = list(
        cluster.datapath(node).ObserveFlows(
            datapath_pb2.ObserveFlowsRequest(
                verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=100, follow=False
            ),
            timeout=10,
        )
    )
    denied = [f for f in flows if f.src_ip == OUTSIDE_IP and f.dst_port == 8080]
    assert denied, flows
    assert {f.src_identity for f in denied} == {2}  # world
    assert {f.drop_reason for f in denied} == {datapath_pb2.DROP_REASON_POLICY_L3}
    assert {f.dst_ip for f in denied} <= {p.ip for p in pods}

    policy.PutRules(policy_pb2.PutRulesRequest(document=WEB_FROM_FRONTEND_AND_WORLD), timeout=10)
    assert wait_until(lambda: outside.request("tcp", node.ip, svc.node_port, timeout=1) is not None)
    answers = peer_requests(outside, "tcp", node.ip, svc.node_port, 20)
    assert None not in answers


def test_remote_backend_is_reached_with_the_node_address(cluster: Cluster, node: Node) -> None:
    """The outside netns also plays a remote backend (another node's pod):
    10.250.0.10 on its loopback, routed via the outside from the node. The
    node SNATs to its address and forwards through the FIB."""
    (local,) = backends_up(cluster, node, n=1)
    remote_ip = "10.250.0.10"
    node.outside.ip("addr", "add", f"{remote_ip}/32", "dev", "lo")
    node.netns.ip("route", "add", "10.250.0.0/24", "via", OUTSIDE_IP)
    node.outside.serve("tcp", 8080, "remote")
    svc = upsert(cluster, nodeport_service("default/web", [local.ip, remote_ip]))
    outside = node.outside
    assert wait_until(lambda: outside.request("tcp", node.ip, svc.node_port, timeout=1) is not None)

    answers = peer_requests(outside, "tcp", node.ip, svc.node_port, 60)
    assert None not in answers, answers
    seen_by = {str(a[0]).split()[0]: str(a[0]).split()[1] for a in answers if a}
    # The local backend sees the client; the remote one the node (SNAT).
    assert seen_by == {"b0": OUTSIDE_IP, "remote": node.ip}
    assert {(a[1], a[2]) for a in answers if a} == {(node.ip, svc.node_port)}
    snat = cluster.datapath(node).DumpMap(datapath_pb2.DumpMapRequest(name="snat"), timeout=20)
    assert {e.value["flags"] for e in snat.entries} == {"nodeport"}
    assert {e.key["dst"] for e in snat.entries if e.key["direction"] == "out"} == {remote_ip}


def test_five_hundred_maglev_services(cluster: Cluster, node: Node) -> None:
    """More Maglev services at M = 16381 than the old flat table held (64):
    all programmed, each serving by the lb service's own table."""
    pods = backends_up(cluster, node)
    n = 500
    services = [
        upsert(
            cluster,
            nodeport_service(
                f"maglev/s{i}",
                [p.ip for p in pods],
                vip=f"10.97.{i // 250}.{i % 250 + 1}",
                algorithm=lb_pb2.ALGORITHM_MAGLEV,
            ),
        )
        for i in range(n)
    ]
    assert {s.maglev_table_size for s in services} == {16381}
    dp = cluster.datapath(node)

    def maglev_entries() -> int:
        maps = dp.ListMaps(datapath_pb2.ListMapsRequest(), timeout=20).maps
        return next(m.entries for m in maps if m.name == "maglev")

    assert wait_until(lambda: maglev_entries() == n, timeout=120, interval=1.0)
    rows = dp.DumpMap(datapath_pb2.DumpMapRequest(name="maglev"), timeout=60).entries
    assert len(rows) == n
    assert {r.value["size"] for r in rows} == {"16381"}

    name_of = {p.ip: f"b{i}" for i, p in enumerate(pods)}
    lb = cluster.lb()
    outside = node.outside
    for svc in services[:: n // 10]:
        table = lb.GetMaglevTable(lb_pb2.GetMaglevTableRequest(name=svc.name), timeout=20)
        assert table.size == 16381
        address_of = {b.id: b.address for b in svc.backends}
        sports = list(range(42000, 42030))
        answers = peer_requests(outside, "tcp", node.ip, svc.node_port, sports)
        assert None not in answers, (svc.name, answers)
        for sport, answer in zip(sports, answers, strict=True):
            assert answer is not None
            slot = maglev_slot(OUTSIDE_IP, node.ip, sport, svc.node_port, 6, size=table.size)
            want = name_of[address_of[table.backend_ids[slot]]]
            assert str(answer[0]).split()[0] == want, (svc.name, sport, slot)
        assert len({str(a[0]).split()[0] for a in answers if a}) > 1


def test_loadbalancer_address_from_outside(cluster: Cluster, node: Node) -> None:
    """LB-IPAM gives the service an address of a pool; the outside client
    (routing the pool via the node, as a router would) reaches the local
    backends at that address and the service's port, its own address kept,
    the answers coming from the LoadBalancer address; gone with the service."""
    pods = backends_up(cluster, node, n=2)
    lb = cluster.lb()
    lb.UpsertLbIpPool(
        lb_pb2.UpsertLbIpPoolRequest(
            pool=lb_pb2.LbIpPool(name="outside", blocks=[lb_pb2.LbIpBlock(cidr="198.51.100.8/30")])
        ),
        timeout=10,
    )
    svc = nodeport_service("default/web-lb", [p.ip for p in pods])
    svc.load_balancer.SetInParent()
    got = upsert(cluster, svc)
    assert got.load_balancer.condition.satisfied, got.load_balancer
    lb_ip = got.load_balancer.ingress[0]
    assert lb_ip == "198.51.100.8"
    outside = node.outside
    outside.ip("route", "add", "198.51.100.8/30", "via", node.ip)
    assert wait_until(lambda: outside.request("tcp", lb_ip, 80, timeout=1) is not None)
    answers = peer_requests(outside, "tcp", lb_ip, 80, 20)
    assert None not in answers, answers
    assert {str(a[0]).split()[0] for a in answers if a} == {"b0", "b1"}
    assert {str(a[0]).split()[1] for a in answers if a} == {OUTSIDE_IP}
    assert {(a[1], a[2]) for a in answers if a} == {(lb_ip, 80)}
    # The node port still answers; the address goes with the service.
    assert outside.request("tcp", node.ip, got.node_port, timeout=2) is not None
    lb.DeleteService(lb_pb2.DeleteServiceRequest(name="default/web-lb"), timeout=10)
    assert wait_until(lambda: outside.request("tcp", lb_ip, 80, timeout=1) is None)


# GET http://host:port/ -> [status, JSON body] or null.
HEALTH_GET = r"""
import http.client, json, sys
try:
    c = http.client.HTTPConnection(sys.argv[1], int(sys.argv[2]), timeout=2)
    c.request("GET", "/healthz")
    r = c.getresponse()
    print(json.dumps([r.status, json.loads(r.read())]))
except OSError:
    print("null")
"""


def health(ns: Netns, host: str, port: int) -> list[object] | None:
    out = ns.run(sys.executable, "-c", HEALTH_GET, host, str(port), timeout=30)
    answer: list[object] | None = json.loads(out.stdout)
    return answer


def test_local_traffic_policy_and_its_health_check_node_port(cluster: Cluster, node: Node) -> None:
    """externalTrafficPolicy Local on a NodePort: with its backends on this
    node the client's address is seen; the health check node port answers
    200 with the local endpoint count. Backends elsewhere: the node port
    drops and the health check says 503 with 0; the port closes with the
    service."""
    pods = backends_up(cluster, node, n=2)
    svc = nodeport_service("default/web-hc", [p.ip for p in pods])
    for b in svc.backends:
        b.node = "n1"
    svc.external_traffic_policy = lb_pb2.TRAFFIC_POLICY_LOCAL
    svc.health_check_node_port = 31500
    got = upsert(cluster, svc)
    outside = node.outside
    assert wait_until(lambda: outside.request("tcp", node.ip, got.node_port, timeout=1) is not None)
    answers = peer_requests(outside, "tcp", node.ip, got.node_port, 10)
    assert None not in answers, answers
    assert {str(a[0]).split()[1] for a in answers if a} == {OUTSIDE_IP}, answers
    want = [
        200,
        {
            "service": {"namespace": "default", "name": "web-hc"},
            "localEndpoints": 2,
            "serviceProxyHealthy": True,
        },
    ]
    assert wait_until(lambda: health(outside, node.ip, 31500) == want)

    for b in svc.backends:
        b.node = "n2"
    upsert(cluster, svc)
    want = [
        503,
        {
            "service": {"namespace": "default", "name": "web-hc"},
            "localEndpoints": 0,
            "serviceProxyHealthy": True,
        },
    ]
    assert wait_until(lambda: health(outside, node.ip, 31500) == want)
    assert outside.request("tcp", node.ip, got.node_port, timeout=1) is None

    cluster.lb().DeleteService(lb_pb2.DeleteServiceRequest(name="default/web-hc"), timeout=10)
    assert wait_until(lambda: health(outside, node.ip, 31500) is None)
