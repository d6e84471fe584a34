"""Service load balancing with real traffic through the real control plane:
ClientIP affinity, a terminating backend, and an lb restart that keeps every
id without interrupting traffic."""

from __future__ import annotations

import collections
import sys
import time

import pytest
from google.protobuf.duration_pb2 import Duration
from harness.cluster import Cluster, Node
from harness.netns import wait_until
from harness.pods import Pod, add_pod

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

VIP = "10.96.0.30"


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("policy", "lb"))
    return cluster.add_node("n1")


def service(
    backends: list[Pod], *, states: dict[int, int] | None = None, affinity_s: int = 0
) -> lb_pb2.Service:
    states = states or {}
    return lb_pb2.Service(
        name="default/svc",
        frontend=lb_pb2.Frontend(address=VIP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
        type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
        backends=[
            lb_pb2.Backend(
                address=b.ip, port=8080, state=states.get(i, lb_pb2.BACKEND_STATE_ACTIVE)
            )  # type: ignore[arg-type]
            for i, b in enumerate(backends)
        ],
        session_affinity=lb_pb2.SessionAffinity(
            type=lb_pb2.SessionAffinity.TYPE_CLIENT_IP, timeout=Duration(seconds=affinity_s)
        )
        if affinity_s
        else None,
    )


def backends_up(cluster: Cluster, node: Node, n: int = 3) -> list[Pod]:
    pods = [
        add_pod(cluster, node, f"b{i}", 10 + i, f"10.200.2.{10 + i}", {"app": "web"})
        for i in range(n)
    ]
    for i, p in enumerate(pods):
        p.ns.serve("tcp", 8080, f"b{i}")
    return pods


def test_client_ip_affinity_sticks_until_timeout(cluster: Cluster, node: Node) -> None:
    client = add_pod(cluster, node, "cl", 1, "10.200.2.2", {"app": "client"})
    pods = backends_up(cluster, node)
    lb = cluster.lb()
    lb.UpsertService(lb_pb2.UpsertServiceRequest(service=service(pods, affinity_s=2)), timeout=10)
    assert wait_until(lambda: client.ns.request("tcp", VIP, 80, timeout=1) is not None)
    answers = client.ns.requests(VIP, 80, 30)
    assert len({a.split()[0] for a in answers if a}) == 1, answers
    assert None not in answers
    # After the timeout the choice is made afresh: over rounds spaced by more
    # than the timeout, more than one backend shows up.
    chosen = set()
    for _ in range(8):
        time.sleep(3.0)
        answer = client.ns.request("tcp", VIP, 80)
        assert answer is not None
        chosen.add(answer.split()[0])
        if len(chosen) > 1:
            break  # a fresh choice was made: what the test is after
    assert len(chosen) > 1, chosen


def test_terminating_backend_keeps_established_gets_no_new(cluster: Cluster, node: Node) -> None:
    client = add_pod(cluster, node, "cl", 1, "10.200.2.3", {"app": "client"})
    pods = backends_up(cluster, node)
    lb = cluster.lb()
    lb.UpsertService(lb_pb2.UpsertServiceRequest(service=service(pods)), timeout=10)
    assert wait_until(lambda: client.ns.request("tcp", VIP, 80, timeout=1) is not None)

    hold = client.ns.stream(VIP, 80, hello=True)
    assert hold.stdout is not None
    held_by = hold.stdout.readline().strip()
    assert held_by in {"b0", "b1", "b2"}
    index = int(held_by[1:])
    lb.UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=service(pods, states={index: lb_pb2.BACKEND_STATE_TERMINATING})
        ),
        timeout=10,
    )

    def no_new_to_terminating() -> bool:
        answers = client.ns.requests(VIP, 80, 20)
        return None not in answers and held_by not in {a.split()[0] for a in answers if a}

    assert wait_until(no_new_to_terminating, timeout=20)
    answers = client.ns.requests(VIP, 80, 40)
    served = collections.Counter(a.split()[0] for a in answers if a)
    assert held_by not in served
    assert len(served) == 2
    time.sleep(1.5)  # the held connection keeps echoing on the terminating backend
    hold.kill()
    lines = hold.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == []
    assert sum(line.startswith("ok ") for line in lines) > 20


def test_lb_restart_keeps_ids_and_traffic(cluster: Cluster, node: Node) -> None:
    client = add_pod(cluster, node, "cl", 1, "10.200.2.4", {"app": "client"})
    pods = backends_up(cluster, node)
    lb = cluster.lb()
    before = lb.UpsertService(
        lb_pb2.UpsertServiceRequest(service=service(pods)), timeout=10
    ).service
    assert wait_until(lambda: client.ns.request("tcp", VIP, 80, timeout=1) is not None)
    hold = client.ns.stream(VIP, 80, hello=True)
    assert hold.stdout is not None
    hold.stdout.readline()

    cluster.restart("lb", kill=True)
    after = cluster.lb().GetService(lb_pb2.GetServiceRequest(name="default/svc"), timeout=10)
    assert (after.id, after.rev_nat_id) == (before.id, before.rev_nat_id)
    assert [b.id for b in after.backends] == [b.id for b in before.backends]
    # New connections work during and after the restart.
    answers = client.ns.requests(VIP, 80, 20)
    assert None not in answers
    # Re-upserting the same service after the restart changes no id.
    again = cluster.lb().UpsertService(
        lb_pb2.UpsertServiceRequest(service=service(pods)), timeout=10
    )
    assert again.service.id == before.id
    assert [b.id for b in again.service.backends] == [b.id for b in before.backends]
    time.sleep(1.0)
    hold.kill()
    lines = hold.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == []
    assert sum(line.startswith("ok ") for line in lines) > 10


ONLY_CLIENTS = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: web-from-clients}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: client}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""

SPOOF = r"""
import socket, sys
s = socket.socket()
s.bind(("169.254.42.1", 0))
s.settimeout(1)
try:
    s.connect((sys.argv[1], 8080))
except OSError:
    sys.exit(1)
"""


def test_a_pod_reaches_itself_through_its_service_and_the_hairpin_address_is_not_a_pass(
    cluster: Cluster, node: Node
) -> None:
    (web,) = backends_up(cluster, node, 1)
    client = add_pod(cluster, node, "cl", 1, "10.200.2.5", {"app": "client"})
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=ONLY_CLIENTS), timeout=10)
    lb = cluster.lb()
    lb.UpsertService(lb_pb2.UpsertServiceRequest(service=service([web])), timeout=10)
    assert wait_until(lambda: client.ns.request("tcp", VIP, 80, timeout=1) is not None)
    # The only backend is the pod itself (Kubernetes' hairpin test): it
    # answers, seeing the hairpin address as its client; no policy stops a
    # pod reaching itself.
    answers = web.ns.requests(VIP, 80, 5)
    assert answers == ["b0 169.254.42.1 HELLO"] * 5, answers
    # From anywhere else, the hairpin address is an address like any other:
    # the outside host sending from it gets policy (world: dropped).
    out = node.outside
    out.ip("addr", "add", "169.254.42.1/32", "dev", "eth0")
    out.ip("route", "add", "10.200.0.0/16", "via", node.ip)
    assert out.run(sys.executable, "-c", SPOOF, web.ip, check=False).returncode == 1
    flows = list(
        cluster.datapath(node).ObserveFlows(
            datapath_pb2.ObserveFlowsRequest(
                verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=200, follow=False
            ),
            timeout=10,
        )
    )
    spoofed = [f for f in flows if f.src_ip == "169.254.42.1" and f.dst_ip == web.ip]
    assert spoofed, flows
    assert spoofed[-1].drop_reason == datapath_pb2.DROP_REASON_POLICY_L3
