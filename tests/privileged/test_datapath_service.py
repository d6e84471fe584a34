"""The datapath service through the real control plane: etcd, the policy and
lb services as processes, a node netns running the datapath process, pods as
netns set up with SetupEndpoint. Real traffic, real kernel."""

from __future__ import annotations

import collections
import time
from pathlib import Path

import pytest
from harness.cluster import Cluster, Node
from harness.metrics import check_documented, samples, value
from harness.netns import wait_until
from harness.pods import Pod, add_pod
from prometheus_client.parser import text_string_to_metric_families

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.lb.v1 import lb_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("policy", "lb"))
    # A GC pass every 2 s: closed connections' entries (10 s) go during a test.
    return cluster.add_node("n1", extra=["--gc-interval-seconds", "2"])


ALLOW_FRONTEND = """
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {name: backend-ingress}
spec:
  endpointSelector: {matchLabels: {app: backend}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: frontend}}]
    toPorts: [{ports: [{port: "8080", protocol: TCP}]}]
"""

ALLOW_FRONTEND_AND_OTHER = ALLOW_FRONTEND.replace(
    "[{matchLabels: {app: frontend}}]",
    "[{matchLabels: {app: frontend}}, {matchLabels: {app: other}}]",
)


def test_pods_talk_and_policy_changes_take_effect_at_runtime(cluster: Cluster, node: Node) -> None:
    fe = add_pod(cluster, node, "fe", 1, "10.200.1.10", {"app": "frontend"})
    be = add_pod(cluster, node, "be", 2, "10.200.1.11", {"app": "backend"})
    other = add_pod(cluster, node, "ot", 3, "10.200.1.12", {"app": "other"})
    be.ns.serve("tcp", 8080, "be")
    be.ns.serve("udp", 5353, "be")

    # No rule selects the backend: everything is allowed.
    assert fe.ns.request("tcp", be.ip, 8080) == f"be {fe.ip} HELLO"
    assert fe.ns.request("udp", be.ip, 5353) == f"be {fe.ip} HELLO"
    assert fe.ns.ping(be.ip)
    assert other.ns.request("tcp", be.ip, 8080) == f"be {other.ip} HELLO"

    policy = cluster.policy()
    policy.PutRules(policy_pb2.PutRulesRequest(document=ALLOW_FRONTEND), timeout=10)
    assert wait_until(lambda: other.ns.request("tcp", be.ip, 8080, timeout=1) is None)
    assert fe.ns.request("tcp", be.ip, 8080) == f"be {fe.ip} HELLO"
    assert fe.ns.request("udp", be.ip, 5353, timeout=1) is None
    assert not fe.ns.ping(be.ip, timeout=1)

    # ObserveFlows reports the denials with their reasons and identities.
    flows = list(
        cluster.datapath(node).ObserveFlows(
            datapath_pb2.ObserveFlowsRequest(
                verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED], last=200, follow=False
            ),
            timeout=10,
        )
    )
    l3 = [f for f in flows if f.src_identity == other.identity and f.dst_port == 8080]
    assert l3, flows
    assert l3[-1].drop_reason == datapath_pb2.DROP_REASON_POLICY_L3
    assert l3[-1].dst_identity == be.identity
    assert l3[-1].direction == datapath_pb2.FLOW_DIRECTION_INGRESS
    assert (l3[-1].src_ip, l3[-1].dst_ip, l3[-1].node) == (other.ip, be.ip, "n1")
    l4 = [f for f in flows if f.src_identity == fe.identity and f.dst_port == 5353]
    assert l4
    assert l4[-1].drop_reason == datapath_pb2.DROP_REASON_POLICY_L4

    # The same drops, counted on the datapath's /metrics (drops, forwards).
    assert node.process is not None
    scraped = node.process.scrape()
    check_documented(scraped)
    families = {f.name: f for f in text_string_to_metric_families(scraped)}
    drops = {
        (sample.labels["reason"], sample.labels["direction"]): sample.value
        for sample in families["flagella_drop_count"].samples
    }
    assert drops[("POLICY_L3", "INGRESS")] >= 1
    assert drops[("POLICY_L4", "INGRESS")] >= 1
    forwards = {s.labels["direction"]: s.value for s in families["flagella_forward_count"].samples}
    assert forwards["EGRESS"] > 0
    assert forwards["INGRESS"] > 0
    [endpoints] = families["flagella_endpoint_count"].samples
    assert endpoints.value == 3
    check_map_figures(scraped)
    for phase in ("maps", "restore"):  # start-up phases, once each
        count = value(scraped, "flagella_bootstrap_seconds_count", phase=phase, outcome="success")
        assert count == 1, phase
    delays = value(scraped, "flagella_policy_implementation_delay_count")
    assert delays >= 1  # the backend's policy, once the rule was put

    # Changed at runtime, no reload.
    policy.PutRules(policy_pb2.PutRulesRequest(document=ALLOW_FRONTEND_AND_OTHER), timeout=10)
    assert wait_until(lambda: other.ns.request("tcp", be.ip, 8080, timeout=1) is not None)
    # Removed: default allow again.
    policy.DeleteRule(policy_pb2.DeleteRuleRequest(name="backend-ingress"), timeout=10)
    assert wait_until(lambda: fe.ns.request("udp", be.ip, 5353, timeout=1) is not None)
    assert fe.ns.ping(be.ip)

    # Each policy change reached the backend's maps: two more delays, each
    # the time from the policy service's commit to the maps (same clock).
    scraped = node.process.scrape()
    assert value(scraped, "flagella_policy_implementation_delay_count") >= delays + 2
    assert 0 < value(scraped, "flagella_policy_implementation_delay_sum") < 10 * (delays + 2)
    assert (
        value(scraped, "flagella_endpoint_regeneration_time_stats_seconds_count", scope="policy")
        >= 3
    )

    # The closed connections' conntrack entries expire (10 s) and a GC pass
    # deletes them; the UDP ones (60 s) stay alive.
    def gc_deleted() -> str | None:
        text = node.process.scrape()  # type: ignore[union-attr]
        gone = value(
            text, "flagella_datapath_conntrack_gc_entries", family="ipv4", status="deleted"
        )
        return text if gone > 0 else None

    assert wait_until(gc_deleted, timeout=30, interval=0.3)
    scraped = gc_deleted() or node.process.scrape()
    check_documented(scraped)
    assert value(scraped, "flagella_datapath_conntrack_gc_runs_total", status="completed") >= 1
    assert value(scraped, "flagella_datapath_conntrack_gc_duration_seconds_count") >= 1
    alive = value(scraped, "flagella_datapath_conntrack_gc_entries", family="ipv4", status="alive")
    assert alive >= 1
    assert value(scraped, "flagella_bpf_map_ops_total", map_name="ct", operation="delete") >= 1


def check_map_figures(scraped: str) -> None:
    """Map pressure and operations after three endpoints and a policy:
    every map that can fill up has a pressure, from the writers' counts;
    the arrays (full by design) have none."""
    pressure = {
        dict(labels)["map_name"]: v
        for (name, labels), v in samples(scraped).items()
        if name == "flagella_bpf_map_pressure"
    }
    assert set(pressure) == {
        "endpoints", "ipcache", "policy", "prefix_policy", "services", "backends", "revnat",
        "maglev", "affinity", "srcrange", "ct", "snat", "frags", "host_safe",
    }  # fmt: skip
    assert pressure["endpoints"] == 3 / 4096  # one address each
    assert 0 < pressure["policy"] < 1
    assert 0 < pressure["ipcache"] < 1
    assert value(scraped, "flagella_bpf_map_ops_total", map_name="endpoints", operation="update", outcome="success") >= 3  # fmt: skip
    assert value(scraped, "flagella_bpf_map_ops_total", map_name="policy", operation="update", outcome="success") >= 1  # fmt: skip
    assert value(scraped, "flagella_bpf_map_ops_total", outcome="fail") == 0
    # Three ADDs, each timed whole and by scope; policies written.
    for scope in ("lock", "veth", "maps", "attach", "total"):
        count = value(
            scraped, "flagella_endpoint_regeneration_time_stats_seconds_count", scope=scope
        )
        assert count == 3, scope
    total = value(scraped, "flagella_endpoint_regeneration_time_stats_seconds_sum", scope="total")
    veth = value(scraped, "flagella_endpoint_regeneration_time_stats_seconds_sum", scope="veth")
    assert 0 < veth < total < 30
    assert (
        value(scraped, "flagella_endpoint_regeneration_time_stats_seconds_count", scope="policy")
        >= 3
    )


def upsert_service(cluster: Cluster, backends: list[Pod], algorithm: int) -> lb_pb2.Service:
    return (
        cluster.lb()
        .UpsertService(
            lb_pb2.UpsertServiceRequest(
                service=lb_pb2.Service(
                    name="default/web",
                    frontend=lb_pb2.Frontend(
                        address="10.96.0.10", port=80, protocol=lb_pb2.PROTOCOL_TCP
                    ),
                    type=lb_pb2.SERVICE_TYPE_CLUSTER_IP,
                    backends=[lb_pb2.Backend(address=b.ip, port=8080) for b in backends],
                    algorithm=algorithm,  # type: ignore[arg-type]
                )
            ),
            timeout=10,
        )
        .service
    )


@pytest.mark.parametrize("algorithm", [lb_pb2.ALGORITHM_RANDOM, lb_pb2.ALGORITHM_MAGLEV])
def test_cluster_ip_reaches_every_backend(cluster: Cluster, node: Node, algorithm: int) -> None:
    client = add_pod(cluster, node, "cl", 1, "10.200.1.20", {"app": "client"})
    backends = [
        add_pod(cluster, node, f"b{i}", 10 + i, f"10.200.1.{30 + i}", {"app": "web"})
        for i in range(3)
    ]
    for i, b in enumerate(backends):
        b.ns.serve("tcp", 8080, f"b{i}")
    upsert_service(cluster, backends, algorithm)
    assert wait_until(lambda: client.ns.request("tcp", "10.96.0.10", 80, timeout=1) is not None)

    answers = client.ns.requests("10.96.0.10", 80, 90)
    assert None not in answers
    served = collections.Counter(a.split()[0] for a in answers if a)
    assert set(served) == {"b0", "b1", "b2"}, served
    # Backends see the client's own address (no SNAT inside the cluster) and
    # the client talked to the service address throughout (its connections
    # to 10.96.0.10 completed, so replies came back from there).
    assert {a.split()[1] for a in answers if a} == {client.ip}
    assert min(served.values()) >= 10, served


def test_outside_host_is_reached_with_masquerade(cluster: Cluster, node: Node) -> None:
    pod = add_pod(cluster, node, "p", 1, "10.200.1.40", {"app": "egress"})
    outside_ip = "192.168.101.254"
    node.outside.serve("tcp", 9000, "outside")
    answer = pod.ns.request("tcp", outside_ip, 9000)
    # The outside host sees the node's address, not the pod's.
    assert answer == f"outside {node.ip} HELLO"
    node.outside.serve("udp", 9001, "outside")
    assert pod.ns.request("udp", outside_ip, 9001) == f"outside {node.ip} HELLO"
    assert pod.ns.ping(outside_ip)


def test_kill9_datapath_keeps_streams_and_policy(cluster: Cluster, node: Node) -> None:
    a = add_pod(cluster, node, "a", 1, "10.200.1.50", {"app": "frontend"})
    b = add_pod(cluster, node, "b", 2, "10.200.1.51", {"app": "backend"})
    c = add_pod(cluster, node, "c", 3, "10.200.1.52", {"app": "other"})
    b.ns.serve("tcp", 8080, "b")
    cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=ALLOW_FRONTEND), timeout=10)
    assert wait_until(lambda: c.ns.request("tcp", b.ip, 8080, timeout=1) is None)

    stream = a.ns.stream(b.ip, 8080, interval=0.02)
    assert stream.stdout is not None
    assert stream.stdout.readline().startswith("ok")
    assert node.process is not None
    node.process.kill9()
    time.sleep(1.0)  # the datapath is down: traffic keeps flowing in the kernel
    assert a.ns.request("tcp", b.ip, 8080) == f"b {a.ip} HELLO"
    assert c.ns.request("tcp", b.ip, 8080, timeout=1) is None
    restarted = cluster.start_datapath(node)
    # It loaded the programs the first start compiled (--bpf-cache-dir).
    assert "BPF programs read from the cache" in restarted.logs()
    # The new process restored the endpoints and enforces the same policy.
    dp = cluster.datapath(node)
    listed = dp.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10).endpoints
    assert sorted(e.endpoint_id for e in listed) == [1, 2, 3]
    assert all(e.programs_attached for e in listed)
    assert c.ns.request("tcp", b.ip, 8080, timeout=1) is None
    assert a.ns.request("tcp", b.ip, 8080) == f"b {a.ip} HELLO"
    time.sleep(0.5)
    stream.kill()
    lines = stream.stdout.read().split("\n")
    assert [line for line in lines if line.startswith("fail")] == []
    assert sum(line.startswith("ok") for line in lines) > 50


def test_restart_onto_a_new_layout_rewrites_endpoints(cluster: Cluster, node: Node) -> None:
    """A datapath of a new layout version finds no maps of its layout (here
    the pinned folder is renamed to look like an older version's): it writes
    the restored endpoints into its new maps, their policy again, attaches
    its programs and removes the old folder."""
    a = add_pod(cluster, node, "a", 1, "10.200.1.60", {"app": "frontend"})
    b = add_pod(cluster, node, "b", 2, "10.200.1.61", {"app": "backend"})
    b.ns.serve("tcp", 8080, "b")
    assert a.ns.request("tcp", b.ip, 8080) == f"b {a.ip} HELLO"
    assert node.process is not None
    node.process.kill9()
    # The layout's folder (the prefilter's maps have a folder of their own).
    (current,) = [p for p in Path(node.bpf_root).iterdir() if p.name.startswith("v")]
    old = current.with_name("v1-0000000000")
    current.rename(old)

    cluster.start_datapath(node)
    assert wait_until(lambda: a.ns.request("tcp", b.ip, 8080, timeout=1) is not None)
    assert a.ns.request("tcp", b.ip, 8080) == f"b {a.ip} HELLO"
    assert not old.exists()
    dp = cluster.datapath(node)
    listed = dp.ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10).endpoints
    assert sorted(e.endpoint_id for e in listed) == [1, 2]
    assert all(e.programs_attached for e in listed)
    rows = dp.DumpMap(datapath_pb2.DumpMapRequest(name="endpoints"), timeout=10).entries
    assert {r.key["ip"] for r in rows} == {a.ip, b.ip}
    assert {r.value["flags"] for r in rows} == {"policy-ready"}
