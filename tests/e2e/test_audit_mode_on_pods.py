"""End to end: the runtime configuration applied live by a running datapath
(no restart) on real pods set up by `flagella-cni ADD`: the flow
aggregation level turns policy-verdict events on; an invalid value or an
immutable option is refused and changes nothing; policy audit mode lets
through what a default-deny policy drops, reported as AUDIT flows naming the
rule; audit switched off drops the same traffic within a second, the
connection audit let through included. Per endpoint: audit for one pod
(its endpoint's configuration, reaching its datapath); its labels by source
(identity, info, custom, disabled), a disabled and a custom label moving it
to another identity."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from harness.cluster import Cluster, Node
from harness.cnipods import CniPod, cni_pod
from harness.netns import wait_until

from flagella.api.datapath.v1 import datapath_pb2 as dp
from flagella.api.endpoint.v1 import endpoint_pb2 as ep_pb
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
    server = cni_pod(cluster, node, "server", {"app": "server", "pod-template-hash": "5d4f"})
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

    # Per endpoint: audit for the server alone, kept with its endpoint.
    endpoints = cluster.endpoint()
    listed = endpoints.ListEndpoints(ep_pb.ListEndpointsRequest(pod_namespace="shop"), timeout=10)
    sid = next(e.id for e in listed.endpoints if e.pod_name == "server")
    cfg = endpoints.PatchEndpointConfig(
        ep_pb.PatchEndpointConfigRequest(id=sid, set={"policy-audit-mode": "true"}), timeout=30
    )
    assert dict(cfg.options) == {"policy-audit-mode": "true"}
    assert wait_until(lambda: reaches(client), timeout=10)
    on_node = datapath.GetEndpoint(dp.GetEndpointRequest(endpoint_id=sid), timeout=10)
    assert dict(on_node.options) == {"policy-audit-mode": "true"}
    with pytest.raises(grpc.RpcError) as err:
        endpoints.PatchEndpointConfig(
            ep_pb.PatchEndpointConfigRequest(id=sid, set={"debug": "true"}), timeout=10
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.value.details() or "").startswith("set[debug]:")
    endpoints.PatchEndpointConfig(
        ep_pb.PatchEndpointConfigRequest(id=sid, reset=["policy-audit-mode"]), timeout=30
    )
    assert wait_until(lambda: not reaches(client, 0.5))
    got = endpoints.GetEndpointConfig(ep_pb.GetEndpointConfigRequest(id=sid), timeout=10)
    assert not got.options

    # Labels by source: pod-template-hash is not relevant to identity.
    def sources(which: ep_pb.EndpointLabels) -> dict[str, set[str]]:
        return {
            kind: {f"{lb.source}:{lb.key}={lb.value}" for lb in getattr(which, kind)}
            for kind in ("orchestration_identity", "orchestration_info", "custom", "disabled")
        }

    labels = endpoints.GetEndpointLabels(ep_pb.GetEndpointLabelsRequest(id=sid), timeout=10)
    assert sources(labels) == {
        "orchestration_identity": {"k8s:app=server", "k8s:io.kubernetes.pod.namespace=shop"},
        "orchestration_info": {"k8s:pod-template-hash=5d4f"},
        "custom": set(),
        "disabled": set(),
    }
    # app disabled, a custom label added: another identity, which the
    # policy no longer selects (the client gets in), app still shown.
    endpoints.PatchEndpointLabels(
        ep_pb.PatchEndpointLabelsRequest(
            id=sid, add_custom={"container:tier": "db"}, disable=["k8s:app"]
        ),
        timeout=30,
    )
    labels = endpoints.GetEndpointLabels(ep_pb.GetEndpointLabelsRequest(id=sid), timeout=10)
    assert sources(labels) == {
        "orchestration_identity": {"k8s:io.kubernetes.pod.namespace=shop"},
        "orchestration_info": {"k8s:pod-template-hash=5d4f"},
        "custom": {"container:tier=db"},
        "disabled": {"k8s:app=server"},
    }
    identity = policy.GetIdentity(policy_pb2.GetIdentityRequest(id=labels.identity), timeout=10)
    assert {f"{lb.source}:{lb.key}" for lb in identity.labels} == {
        "container:tier",
        "k8s:io.kubernetes.pod.namespace",
    }
    assert wait_until(lambda: reaches(client), timeout=10)
