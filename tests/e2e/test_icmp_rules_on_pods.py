"""End to end: ICMP type rules (`icmps`) on real pods set up by
`flagella-cni ADD`, imported as a user imports them (PutRules with a
CiliumNetworkPolicy document). Echo allowed by type lets ping through while
another type (timestamp, which Linux answers) and TCP stay out; the family
decides between ICMP and ICMPv6; swapping the allowed type swaps what
passes."""

from __future__ import annotations

import sys

import pytest
from harness.cluster import Cluster, Node
from harness.cnipods import CniPod, cni_pod
from harness.netns import wait_until

from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

# An ICMP timestamp request (type 13) from a raw socket; exit 0 when a
# timestamp reply (type 14) with our id comes back within the timeout.
TIMESTAMP = r"""
import socket, struct, sys, time
host, ident = sys.argv[1], int(sys.argv[2])
def csum(b):
    s = sum(struct.unpack("!%dH" % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xFFFF); s += s >> 16
    return ~s & 0xFFFF
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(0.2)
body = struct.pack("!BBHHHIII", 13, 0, 0, ident, 1, 0, 0, 0)
s.sendto(struct.pack("!BBHHHIII", 13, 0, csum(body), ident, 1, 0, 0, 0), (host, 0))
deadline = time.monotonic() + 1.0
while time.monotonic() < deadline:
    try:
        data = s.recv(2048)
    except socket.timeout:
        continue
    icmp = data[(data[0] & 0x0F) * 4:]
    if icmp[0] == 14 and struct.unpack("!H", icmp[4:6])[0] == ident:
        sys.exit(0)
sys.exit(1)
"""


def policy(*fields: str) -> str:
    icmp_fields = ", ".join(fields)
    return f"""
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {{name: server-icmp, namespace: shop}}
spec:
  endpointSelector: {{matchLabels: {{app: server}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{app: client}}}}]
    icmps: [{{fields: [{icmp_fields}]}}]
"""


@pytest.fixture
def node(cluster: Cluster) -> Node:
    extra = {"ipam": ["--cluster-cidr", "fd00:10:210::/104"]}  # pods get IPv6 too
    cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra=extra)
    return cluster.add_node("n1")


def timestamp_answered(client: CniPod, server: CniPod, ident: int) -> bool:
    out = client.ns.run(sys.executable, "-c", TIMESTAMP, server.ip4, str(ident), check=False)
    return out.returncode == 0


def test_icmp_type_rules_on_real_pods(cluster: Cluster, node: Node) -> None:
    server = cni_pod(cluster, node, "server", {"app": "server"})
    client = cni_pod(cluster, node, "client", {"app": "client"})
    assert server.ip6 is not None
    server.ns.serve("tcp", 8080, "server")
    # Without policy all of it reaches the server (so each check below can fail).
    assert client.ns.ping(server.ip4)
    assert client.ns.ping(server.ip6)
    assert timestamp_answered(client, server, 100)
    assert client.ns.request("tcp", server.ip4, 8080) == f"server {client.ip4} HELLO"

    rules = cluster.policy()
    rules.PutRules(
        policy_pb2.PutRulesRequest(document=policy("{type: EchoRequest, family: IPv4}")),
        timeout=10,
    )
    # Only ICMPv4 echo: TCP, timestamp and ICMPv6 echo are dropped.
    assert wait_until(lambda: client.ns.request("tcp", server.ip4, 8080, timeout=1) is None)
    assert client.ns.ping(server.ip4)
    assert not timestamp_answered(client, server, 101)
    assert not client.ns.ping(server.ip6, timeout=1)

    # By number, both families: timestamp (13) and ICMPv6 echo (128), no v4 echo.
    rules.PutRules(
        policy_pb2.PutRulesRequest(document=policy("{type: 13}", "{type: 128, family: IPv6}")),
        timeout=10,
    )
    assert wait_until(lambda: timestamp_answered(client, server, 102))
    assert client.ns.ping(server.ip6)
    assert not client.ns.ping(server.ip4, timeout=1)
    assert client.ns.request("tcp", server.ip4, 8080, timeout=1) is None

    # The trace says the same as the datapath, per type.
    def labels(app: str) -> list[policy_pb2.Label]:
        return [
            policy_pb2.Label(source="k8s", key="app", value=app),
            policy_pb2.Label(source="k8s", key="io.kubernetes.pod.namespace", value="shop"),
        ]

    def trace(protocol: policy_pb2.Protocol.ValueType, icmp_type: int) -> int:
        return rules.TracePolicy(
            policy_pb2.TracePolicyRequest(
                src_labels=labels("client"),
                dst_labels=labels("server"),
                dport=icmp_type,
                protocol=protocol,
            ),
            timeout=10,
        ).ingress_verdict

    assert trace(policy_pb2.PROTOCOL_ICMP, 13) == policy_pb2.VERDICT_ALLOW
    assert trace(policy_pb2.PROTOCOL_ICMP, 8) == policy_pb2.VERDICT_DENY
    assert trace(policy_pb2.PROTOCOL_ICMPV6, 128) == policy_pb2.VERDICT_ALLOW
    assert trace(policy_pb2.PROTOCOL_ICMPV6, 13) == policy_pb2.VERDICT_DENY
