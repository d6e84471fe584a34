"""End to end: toServices (CiliumNetworkPolicy egress) on real pods made by
`flagella-cni ADD`, real traffic through the datapath's service
translation.

- A client whose egress allows only `toServices` of a ClusterIP service
  reaches the service (through its ClusterIP) and its backend pod, and no
  other pod.
- The backend replaced by another pod (in lb, the rule unchanged): the new
  pod is reachable within a second, the old one no longer.
- `k8sServiceSelector`: a service selected by its labels; relabelled, it is
  selected (and its backend reachable) or not any more.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.cluster import Cluster, Node, standalone_cluster
from harness.cnipods import CniPod, cni_pod
from harness.lb import service
from harness.netns import at_once, wait_until
from harness.probe import Pod, probing, settle

from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

PORT = 9000
VIP = "10.96.9.1"  # the ClusterIP of shop/db, port 80

BY_NAME = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-to-db, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toServices: [{k8sService: {serviceName: db}}]
    toPorts: [{ports: [{port: "9000", protocol: TCP}]}]
"""

BY_LABEL = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: client-to-data, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: client}}
  egress:
  - toServices: [{k8sServiceSelector: {selector: {matchLabels: {tier: data}}}}]
"""


@dataclass
class World:
    cluster: Cluster
    node: Node
    client: CniPod
    db1: CniPod
    db2: CniPod
    other: CniPod


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    tmp: Path = tmp_path_factory.mktemp("to-services")
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"))
        node = cluster.add_node("n1")
        pods = [
            cni_pod(cluster, node, "client", {"app": "client"}),
            cni_pod(cluster, node, "db1", {"app": "db"}),
            cni_pod(cluster, node, "db2", {"app": "db"}),
            cni_pod(cluster, node, "other", {"app": "other"}),
        ]
        for pod in pods[1:]:
            pod.ns.serve("tcp", PORT, pod.name)
        yield World(cluster, node, *pods)


def upsert(w: World, name: str, vip: str, backend: CniPod, **labels: str) -> None:
    svc = service(f"shop/{name}", vip, 80, [(backend.ip4, PORT)], labels=labels)
    w.cluster.lb().UpsertService(lb_pb2.UpsertServiceRequest(service=svc), timeout=10)


def put(w: World, document: str) -> None:
    w.cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=document), timeout=10)


def delete(w: World, name: str) -> None:
    w.cluster.policy().DeleteRule(policy_pb2.DeleteRuleRequest(name=name), timeout=10)


def answer(w: World, host: str, port: int = PORT) -> str | None:
    """The name of the server that answered the client, or None."""
    reply = w.client.ns.request("tcp", host, port, timeout=0.5)
    return reply.split()[0] if reply else None


def reach(w: World) -> dict[str, bool]:
    return at_once(
        {
            "db via ClusterIP": lambda: answer(w, VIP, 80) is not None,
            "db1": lambda: answer(w, w.db1.ip4) == "db1",
            "db2": lambda: answer(w, w.db2.ip4) == "db2",
            "other": lambda: answer(w, w.other.ip4) == "other",
        }
    )


def reach_some(w: World, want: dict[str, bool]) -> bool:
    got = reach(w)
    return {k: got[k] for k in want} == want


def pod(p: CniPod) -> Pod:
    return Pod(p.name, p.ns, p.ip4)


def test_to_services_by_name_follows_the_backend(world: World) -> None:
    w = world
    upsert(w, "db", VIP, w.db1)
    assert wait_until(lambda: all(reach(w).values()))
    put(w, BY_NAME)
    try:
        want = {"db via ClusterIP": True, "db1": True, "db2": False, "other": False}
        assert wait_until(lambda: reach(w) == want), reach(w)
        assert answer(w, VIP, 80) == "db1"

        client = pod(w.client)
        pairs = {"db1": (client, pod(w.db1)), "db2": (client, pod(w.db2))}
        with probing(pairs, PORT) as probes:
            assert wait_until(lambda: probes["db1"].settled(time.time() - 1, True) is not None)
            since = time.time()
            upsert(w, "db", VIP, w.db2)  # the backend replaced, the rule unchanged
            settle(
                probes,
                since,
                {"db2": True, "db1": False},
                "the new backend reachable, the old one not",
                within=1.0,
            )
        assert answer(w, VIP, 80) == "db2"
        assert answer(w, w.other.ip4) is None

        # The service deleted: nothing (never every peer).
        w.cluster.lb().DeleteService(lb_pb2.DeleteServiceRequest(name="shop/db"), timeout=10)
        assert wait_until(lambda: not any(reach(w).values())), reach(w)
    finally:
        delete(w, "shop/client-to-db")


def test_to_services_by_label(world: World) -> None:
    w = world
    upsert(w, "data", "10.96.9.2", w.db1, tier="data")
    upsert(w, "front", "10.96.9.3", w.other, tier="front")
    put(w, BY_LABEL)
    try:
        want = {"db1": True, "db2": False, "other": False}
        assert wait_until(lambda: reach_some(w, want)), reach(w)
        assert answer(w, "10.96.9.2", 80) == "db1"
        assert answer(w, "10.96.9.3", 80) is None
        # Relabelled: front is selected, data no longer.
        upsert(w, "front", "10.96.9.3", w.other, tier="data")
        upsert(w, "data", "10.96.9.2", w.db1, tier="cold")
        want = {"db1": False, "db2": False, "other": True}
        assert wait_until(lambda: reach_some(w, want)), reach(w)
        assert answer(w, "10.96.9.3", 80) == "other"
    finally:
        delete(w, "shop/client-to-data")
