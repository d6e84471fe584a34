"""End to end: the runtime configuration applied live by a running datapath
(no restart) on real pods set up by `flagella-cni ADD`: the flow
aggregation level turns policy-verdict events on; an invalid value or an
immutable option is refused and changes nothing; policy audit mode lets
through what a default-deny policy drops, reported as AUDIT flows naming the
rule; audit switched off drops the same traffic within a second, the
connection audit let through included."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from harness.cluster import Cluster, Node
from harness.cnipods import CniPod, cni_pod
from harness.netns import wait_until

from flagella.api.datapath.v1 import datapath_pb2 as dp
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

# Selects the server for ingress and allows a peer no pod is: default deny.
DENY = """
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: server-deny, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: server}}
  ingress:
  - fromEndpoints: [{matchLabels: {app: nobody}}]
"""
SYN, ACK = 0x02, 0x10


@pytest.fixture
def node(cluster: Cluster) -> Node:
    cluster.start(services=("ipam", "policy", "lb", "endpoint"))
    return cluster.add_node("n1", extra=["--verdict-events", "none"])


def test_runtime_config_and_audit_mode_on_real_pods(cluster: Cluster, node: Node) -> None:
    server = cni_pod(cluster, node, "server", {"app": "server"})
    client = cni_pod(cluster, node, "client", {"app": "client"})
    server.ns.serve("tcp", 8080, "server")
    datapath = cluster.datapath(node)
    policy = cluster.policy()
    assert node.process is not None
    pid = node.process.pid

    def flows_since(since: Timestamp) -> list[dp.Flow]:
        request = dp.ObserveFlowsRequest(last=4096, follow=False, since=since, port=8080)
        return list(datapath.ObserveFlows(request, timeout=10))

    def now() -> Timestamp:
        ts = Timestamp()
        ts.GetCurrentTime()
        return ts

    def reaches(c: CniPod, timeout: float = 1.0) -> bool:
        return c.ns.request("tcp", server.ip4, 8080, timeout=timeout) is not None

    def verdict_flows(since: Timestamp, verdict: int) -> list[dp.Flow]:
        return [
            f
            for f in flows_since(since)
            if f.type == dp.FLOW_TYPE_POLICY_VERDICT and f.verdict == verdict
        ]

    # --verdict-events none: an allowed new connection emits no verdict.
    t = now()
    assert reaches(client)
    assert not verdict_flows(t, dp.FLOW_VERDICT_FORWARDED)
    # Flow aggregation low (every allowed new connection), live.
    patched = policy.PatchConfig(
        policy_pb2.PatchConfigRequest(set={"monitor-aggregation": "low"}), timeout=10
    )
    t = now()
    assert wait_until(
        lambda: reaches(client) and verdict_flows(t, dp.FLOW_VERDICT_FORWARDED), timeout=10
    )

    # Refused, naming the option, and nothing changes.
    for values, field in [
        ({"policy-audit-mode": "on"}, "set[policy-audit-mode]"),
        ({"routing-mode": "tunnel"}, "set[routing-mode]"),
    ]:
        with pytest.raises(grpc.RpcError) as err:
            policy.PatchConfig(policy_pb2.PatchConfigRequest(set=values), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (err.value.details() or "").startswith(f"{field}:")
    same = policy.GetConfig(policy_pb2.GetConfigRequest(node="n1"), timeout=10)
    assert same.cluster_revision == patched.cluster_revision
    assert dict(same.cluster) == {"monitor-aggregation": "low"}

    # A default-deny policy drops the client.
    policy.PutRules(policy_pb2.PutRulesRequest(document=DENY), timeout=10)
    assert wait_until(lambda: not reaches(client, 0.5))

    # Audit mode: let through, reported as AUDIT naming the rule.
    t = now()
    policy.PatchConfig(policy_pb2.PatchConfigRequest(set={"policy-audit-mode": "true"}), timeout=10)
    assert wait_until(lambda: reaches(client), timeout=10)
    audits = verdict_flows(t, dp.FLOW_VERDICT_AUDIT)
    assert audits, "no AUDIT flow"
    audit = audits[-1]
    assert audit.direction == dp.FLOW_DIRECTION_INGRESS
    assert (audit.src_ip, audit.dst_ip) == (client.ip4, server.ip4)
    assert audit.drop_reason == dp.DROP_REASON_POLICY_L3
    assert list(audit.denied_by) == ["shop/server-deny"]
    # A connection only audit lets through, kept open.
    stream = client.ns.stream(server.ip4, 8080, 0.05)
    assert stream.stdout is not None
    assert stream.stdout.readline().startswith("ok")

    # Audit off: the same traffic dropped within a second, the open
    # connection too (its next packet is judged again and dropped).
    off = now()
    started = time.monotonic()
    policy.PatchConfig(policy_pb2.PatchConfigRequest(reset=["policy-audit-mode"]), timeout=10)
    while reaches(client, 0.2):
        assert time.monotonic() - started < 1.0, "still let through after 1 s"

    def established_dropped() -> list[dp.Flow]:
        return [
            f
            for f in flows_since(off)
            if f.verdict == dp.FLOW_VERDICT_DROPPED
            and f.tcp_flags & ACK
            and not f.tcp_flags & SYN
            and f.src_ip == client.ip4
        ]

    assert wait_until(established_dropped, timeout=5)
    assert list(established_dropped()[0].denied_by) == ["shop/server-deny"]
    stream.kill()
    # All of it without a restart.
    assert node.process.pid == pid
    assert node.process.proc is not None
    assert node.process.proc.poll() is None
