"""End to end: pods get networking from `flagella-cni ADD`, run as a container
runtime runs it, against etcd and the five services as processes (the
datapath inside a node netns). Pods talk, a policy keeps one out, a service
is reached, and DEL/CHECK/GC behave as the CNI spec says."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import stat
from dataclasses import dataclass
from typing import Any

import pytest
from harness.cluster import Cluster, Node
from harness.cni import check_result, cni, netconf
from harness.metrics import value
from harness.netns import Netns, wait_until

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

POLICY = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: backend-from-frontend, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: backend}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""


@dataclass
class Pod:
    name: str
    ns: Netns
    container_id: str
    ip: str
    result: dict[str, Any]


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    return cluster.add_node("n1")


def pod_cidr(cluster: Cluster, node: Node) -> str:
    got = cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=node.name), timeout=10)
    return next(c for c in got.pod_cidrs if ":" not in c)


def add(cluster: Cluster, node: Node, name: str, labels: dict[str, str]) -> Pod:
    ns = cluster.pod(node, name)
    conf = netconf(node.cni_socket, labels)
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("shop", name))
    assert rc == 0, result
    ip = check_result(result, netns=ns.path, ifname="eth0", pod_cidr=pod_cidr(cluster, node))
    return Pod(name, ns, f"ctr-{name}", ip, result)


def test_pods_talk_policy_keeps_one_out_service_reached(cluster: Cluster, node: Node) -> None:
    frontend = add(cluster, node, "frontend", {"app": "frontend"})
    backend = add(cluster, node, "backend", {"app": "backend"})
    other = add(cluster, node, "other", {"app": "other"})
    assert len({frontend.ip, backend.ip, other.ip}) == 3
    backend.ns.serve("tcp", 8080, "backend")

    assert frontend.ns.request("tcp", backend.ip, 8080) == f"backend {frontend.ip} HELLO"
    assert other.ns.request("tcp", backend.ip, 8080) == f"backend {other.ip} HELLO"
    assert other.ns.ping(frontend.ip)

    policy = cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    assert wait_until(lambda: other.ns.request("tcp", backend.ip, 8080, timeout=1) is None)
    assert frontend.ns.request("tcp", backend.ip, 8080) == f"backend {frontend.ip} HELLO"
    policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="shop/backend-from-frontend"), timeout=10)
    assert wait_until(lambda: other.ns.request("tcp", backend.ip, 8080, timeout=1) is not None)

    # A ClusterIP service backed by two pods, reached from the third.
    frontend.ns.serve("tcp", 8080, "frontend")
    cluster.lb().UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_pb2.Service(
                name="shop/web",
                frontend=lb_pb2.Frontend(
                    address="10.96.0.20", port=80, protocol=lb_pb2.PROTOCOL_TCP
                ),
                type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                backends=[lb_pb2.Backend(address=p.ip, port=8080) for p in (frontend, backend)],
            )
        ),
        timeout=10,
    )
    assert wait_until(lambda: other.ns.request("tcp", "10.96.0.20", 80, timeout=1) is not None)
    answers = other.ns.requests("10.96.0.20", 80, 40)
    assert None not in answers
    assert set(collections.Counter(a.split()[0] for a in answers if a)) == {"frontend", "backend"}


def test_add_del_check_gc_as_the_spec_says(cluster: Cluster, node: Node) -> None:
    conf = netconf(node.cni_socket, {"app": "x"})
    a = add(cluster, node, "a", {"app": "x"})
    b = add(cluster, node, "b", {"app": "x"})
    c = add(cluster, node, "c", {"app": "x"})

    # ADD repeated: the same answer, nothing new.
    rc, again = cni("ADD", conf, container_id=a.container_id, netns=a.ns.path, pod=("shop", "a"))
    assert rc == 0
    assert again == a.result

    # CHECK after ADD, with the ADD's result as prevResult.
    rc, out = cni(
        "CHECK", {**conf, "prevResult": a.result}, container_id=a.container_id, netns=a.ns.path
    )
    assert (rc, out) == (0, {})
    # CHECK of an unknown container: the spec's "unknown container" code.
    rc, out = cni("CHECK", {**conf, "prevResult": a.result}, container_id="nope", netns=a.ns.path)
    assert rc != 0
    assert out["code"] == 3

    # DEL, DEL again, DEL of an unknown attachment: all succeed with no output.
    for container_id in (a.container_id, a.container_id, "never-added"):
        rc, out = cni("DEL", conf, container_id=container_id, netns=a.ns.path)
        assert (rc, out) == (0, {})
    host_veth = a.result["interfaces"][0]["name"]
    assert host_veth.startswith("lxc")
    assert host_veth not in node.netns.ip("-br", "link").stdout
    allocations = cluster.ipam().ListAllocations(
        ipam_pb2.ListAllocationsRequest(node=node.name), timeout=10
    )
    assert a.ip not in {x.ip for x in allocations.allocations}

    # GC with a partial valid list: c goes with its IP, b stays and works.
    gc_conf = {
        **conf,
        "cni.dev/valid-attachments": [{"containerID": b.container_id, "ifname": "eth0"}],
    }
    rc, out = cni("GC", gc_conf)
    assert (rc, out) == (0, {})
    allocations = cluster.ipam().ListAllocations(
        ipam_pb2.ListAllocationsRequest(node=node.name), timeout=10
    )
    assert {x.ip for x in allocations.allocations} == {b.ip}
    endpoints = (
        cluster.endpoint().ListEndpoints(endpoint_pb2.ListEndpointsRequest(), timeout=10).endpoints
    )
    assert [e.container_id for e in endpoints] == [b.container_id]
    realized = cluster.datapath(node).ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10)
    assert [e.container_id for e in realized.endpoints] == [b.container_id]
    assert not c.ns.ping(b.ip, timeout=1)
    b.ns.serve("tcp", 8080, "b")
    d = add(cluster, node, "d", {"app": "x"})
    assert d.ns.request("tcp", b.ip, 8080) == f"b {d.ip} HELLO"

    # STATUS: ready.
    rc, out = cni("STATUS", conf, ifname="")
    assert (rc, out) == (0, {})

    # The endpoint service timed each operation, by command and outcome, and
    # counts the endpoints by state (b and d: ready); ipam the addresses used.
    endpoint = cluster.services["endpoint"]
    text = endpoint.scrape()
    seconds = "flagella_cni_operation_duration_seconds_count"
    assert value(text, seconds, command="ADD", outcome="success") == 5
    assert value(text, seconds, command="ADD") == 5
    assert value(text, seconds, command="CHECK", outcome="success") == 1
    assert value(text, seconds, command="CHECK", outcome="unknown_container") == 1
    assert value(text, seconds, command="DEL", outcome="success") == 3
    assert value(text, seconds, command="GC", outcome="success") == 1
    assert value(text, seconds, command="STATUS", outcome="success") == 1
    assert wait_until(
        lambda: value(endpoint.scrape(), "flagella_endpoint_state", state="ready") == 2
    )
    allocations = cluster.ipam().ListAllocations(
        ipam_pb2.ListAllocationsRequest(node=node.name, family=ipam_pb2.FAMILY_IPV4), timeout=10
    )
    used = {"family": "IPv4", "node": node.name}
    ipam = cluster.services["ipam"]
    assert value(ipam.scrape(), "flagella_ipam_addresses", **used) == len(allocations.allocations)


def test_the_node_socket_is_the_only_way_in(cluster: Cluster, node: Node) -> None:
    """The datapath serves flagella-cni on a socket only root may open; the
    plugin has no other way to flagella."""
    info = os.stat(node.cni_socket)
    assert stat.S_ISSOCK(info.st_mode)
    assert (stat.S_IMODE(info.st_mode), info.st_uid) == (0o600, 0)
    rc, out = cni("STATUS", netconf(node.cni_socket), ifname="")
    assert (rc, out) == (0, {})
    elsewhere = netconf(f"{node.cni_socket}.not-there")
    rc, out = cni("STATUS", elsewhere, ifname="")
    assert (rc, out["code"]) == (1, 50)
    ns = cluster.pod(node, "lost")
    rc, out = cni("ADD", elsewhere, container_id="ctr-lost", netns=ns.path)
    assert (rc, out["code"]) == (1, 11)
    assert cluster.endpoint().ListEndpoints(endpoint_pb2.ListEndpointsRequest()).endpoints == []


def test_pod_whose_netns_vanished_is_swept_with_its_ip(cluster: Cluster) -> None:
    # No CNI DEL ever comes (the runtime crashed): the datapath notices the
    # veth is gone, and the endpoint service's sweep releases the rest.
    cluster.start(
        services=("ipam", "policy", "lb", "endpoint"),
        extra={"endpoint": ["--gc-interval-seconds", "1"]},
    )
    node = cluster.add_node("n1", extra=["--gc-interval-seconds", "1"])
    keep = add(cluster, node, "keep", {"app": "keep"})
    gone = add(cluster, node, "gone", {"app": "gone"})
    gone.ns.cleanup()  # deletes the netns, and with it the veth pair

    def swept() -> bool:
        eps = cluster.endpoint().ListEndpoints(endpoint_pb2.ListEndpointsRequest(), timeout=10)
        allocs = cluster.ipam().ListAllocations(
            ipam_pb2.ListAllocationsRequest(node=node.name), timeout=10
        )
        return [e.container_id for e in eps.endpoints] == [keep.container_id] and {
            a.ip for a in allocs.allocations
        } == {keep.ip}

    assert wait_until(swept, timeout=30)
    realized = cluster.datapath(node).ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10)
    assert [e.container_id for e in realized.endpoints] == [keep.container_id]


def test_four_adds_at_once_then_four_dels_leave_nothing(cluster: Cluster, node: Node) -> None:
    # As a runtime starting pods in parallel: 4 ADDs in flight at once
    # through the real plugin, then 4 DELs.
    names = [f"par{i}" for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        pods = list(pool.map(lambda name: add(cluster, node, name, {"app": "par"}), names))
    assert len({p.ip for p in pods}) == len(pods)
    assert len({p.result["interfaces"][0]["mac"] for p in pods}) == len(pods)
    assert pods[0].ns.ping(pods[3].ip)
    assert pods[3].ns.ping(pods[0].ip)
    conf = netconf(node.cni_socket, {"app": "par"})

    def delete(pod: Pod) -> tuple[int, dict[str, Any]]:
        return cni("DEL", conf, container_id=pod.container_id, netns=pod.ns.path)

    with concurrent.futures.ThreadPoolExecutor(len(pods)) as pool:
        assert list(pool.map(delete, pods)) == [(0, {})] * len(pods)
    # Nothing left: addresses, endpoints, the datapath's endpoints, veths.
    allocations = cluster.ipam().ListAllocations(
        ipam_pb2.ListAllocationsRequest(node=node.name), timeout=10
    )
    assert list(allocations.allocations) == []
    endpoints = cluster.endpoint().ListEndpoints(endpoint_pb2.ListEndpointsRequest(), timeout=10)
    assert list(endpoints.endpoints) == []
    realized = cluster.datapath(node).ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10)
    assert list(realized.endpoints) == []
    assert "lxc" not in node.netns.ip("-br", "link").stdout
