"""End to end: a real Prometheus (Debian's binary) scraping the five services
and the flow relay as processes, configured from the shipped deploy/prometheus/prometheus.yml
(its jobs; this test's addresses; 1 s scrapes). Pods come from `flagella-cni
ADD` on a node netns, a policy drops one's traffic, and Prometheus's HTTP API
shows every target up, the gRPC calls just made, the drop counter rising,
and every metric the Grafana dashboard reads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from harness.cluster import Cluster, Node
from harness.cnipods import cni_pod
from harness.netns import wait_until
from harness.prometheus import MetricsLink, PrometheusServer, dashboard_queries, metric_names

from flagella.api.datapath.v1.datapath_pb2 import ListMapsRequest
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

JOBS = ("ipam", "policy", "endpoint", "lb", "relay", "datapath")

# Only app=frontend may reach the backend: `other` is dropped (POLICY_L3).
POLICY = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: backend-from-frontend-only, namespace: shop}
spec: {endpointSelector: {matchLabels: {app: backend}},
       ingress: [{fromEndpoints: [{matchLabels: {app: frontend}}]}]}
"""

# What Prometheus must find (> 0) once the pods are up and a drop happened:
# one line per acceptance query of issue 17.
QUERIES = {
    "CNI ADDs": 'grpc_server_handled_total{job="endpoint",grpc_method="Cni",grpc_code="OK"}',
    "ipam's etcd operations": 'flagella_kvstore_operations_duration_seconds_count{job="ipam"}',
    "forwards": 'flagella_forward_count_total{job="datapath"}',
    "a CNI ADD latency histogram": (
        'flagella_cni_operation_duration_seconds_count{job="endpoint",command="ADD",'
        'outcome="success"}'
    ),
    "IPAM capacity of node n1": 'flagella_ipam_capacity{job="ipam",node="n1"}',
    "the relay's node n1 connected": 'flagella_relay_nodes{job="relay",state="connected"}',
}
# Maps without a pressure series (docs/metrics.md): arrays with a slot per
# thing cannot fill up; the flow events' ring buffer is not a map of entries
# (what it had no room for is flagella_flow_events_lost_total).
NO_PRESSURE = {"config", "metrics", "events"}


@pytest.fixture
def node(cluster: Cluster) -> Iterator[tuple[Node, MetricsLink]]:
    """The control plane and node n1, whose datapath serves metrics on a
    link the host reaches (its netns has no other way to this host)."""
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    node = cluster.add_node("n1", start=False)
    link = MetricsLink(node.netns)
    node.args += ["--metrics-listen", f"{link.node_ip}:9965"]
    try:
        cluster.start_datapath(node)
        yield node, link
    finally:
        link.cleanup()


@pytest.fixture
def prometheus(
    tmp_path: Path, cluster: Cluster, node: tuple[Node, MetricsLink]
) -> Iterator[PrometheusServer]:
    relay = cluster.spawn(
        "relay", "--ipam-address", cluster.services["ipam"].address, "--node-probe-interval", "1"
    )
    targets = {svc: cluster.services[svc].metrics_listen for svc in JOBS[:4]}
    targets["relay"] = relay.metrics_listen
    targets["datapath"] = f"{node[1].node_ip}:9965"
    server = PrometheusServer(tmp_path, targets).start()
    try:
        yield server
    finally:
        server.stop()


def test_prometheus_scrapes_every_service_and_sees_the_calls_and_a_policy_drop(
    cluster: Cluster, node: tuple[Node, MetricsLink], prometheus: PrometheusServer
) -> None:
    n1, _ = node
    assert wait_until(lambda: prometheus.health() == dict.fromkeys(JOBS, "up")), (
        prometheus.health(),
        prometheus.api("targets")["activeTargets"],
    )
    backend = cni_pod(cluster, n1, "backend", {"app": "backend"})
    other = cni_pod(cluster, n1, "other", {"app": "other"})
    backend.ns.serve("tcp", 8080, "backend")
    assert other.ns.request("tcp", backend.ip4, 8080) == f"backend {other.ip4} HELLO"

    l3 = 'sum(flagella_drop_count_total{job="datapath",reason="POLICY_L3",direction="INGRESS"})'
    # What Prometheus holds before the drop, from a scrape after the pods were up.
    assert wait_until(lambda: prometheus.value('flagella_endpoint_count{job="datapath"}') == 2)
    before = prometheus.value(l3)
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=POLICY), timeout=10)
    assert wait_until(lambda: other.ns.request("tcp", backend.ip4, 8080, timeout=1) is None)
    assert wait_until(lambda: prometheus.value(l3) > before), prometheus.query(l3)

    put_rules = 'grpc_server_handled_total{job="policy",grpc_method="PutRules",grpc_code="OK"}'
    assert wait_until(lambda: prometheus.value(put_rules) == 1), prometheus.query(put_rules)
    per_job = 'sum by (job) (grpc_server_handled_total{grpc_code="OK"})'
    assert {labels["job"] for labels, v in prometheus.query(per_job) if v > 0} == set(JOBS)
    for what, expr in QUERIES.items():
        assert wait_until(lambda e=expr: prometheus.value(e) > 0), (what, prometheus.query(expr))

    # Map pressure for every map the datapath lists that can fill up, n1's
    # endpoints among the entries counted.
    maps = {m.name: m for m in cluster.datapath(n1).ListMaps(ListMapsRequest(), timeout=10).maps}
    pressure = 'flagella_bpf_map_pressure{job="datapath"}'
    assert wait_until(
        lambda: (
            {labels["map_name"] for labels, _ in prometheus.query(pressure)}
            == set(maps) - NO_PRESSURE
        )
    ), (sorted(maps), prometheus.query(pressure))
    endpoints = maps["endpoints"]
    assert wait_until(
        lambda: (
            prometheus.value(f'{pressure[:-1]},map_name="endpoints"}}') >= 2 / endpoints.max_entries
        )
    )

    # Every metric a dashboard panel reads is one the services export.
    stored = prometheus.names()
    for panel, exprs in dashboard_queries().items():
        for expr in exprs:
            assert metric_names(expr) <= stored, (panel, metric_names(expr) - stored)
