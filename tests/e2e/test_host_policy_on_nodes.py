"""Host policies on real nodes: two node netns on one underlay (native
routing), each with its datapath (n1 labelled role=edge, n2 role=core), one
etcd and one control plane, an SSH-like listener on port 2222 in each node's
netns, and two outside hosts on the underlay. A cluster-wide host policy
selecting role=edge allows 2222 only from one outside address and from
pods labelled app=admin: the admitted outside host connects, the other is
dropped (a drop flow with the host as the endpoint), pods reach the host as
the policy says, while n1 keeps its control plane (streams synced, a CNI ADD
works, the other node's health probes still reach it, a push stream from
its etcd endpoint keeps flowing), n2 is unaffected, and deleting the
policy restores access within a second. One cluster for the module."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from harness.cluster import Cluster, Node, standalone_cluster
from harness.cni import add_pod as cni_add_pod
from harness.netns import Netns, wait_until
from harness.underlay import Underlay

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

SSH = 2222
ETCD_PORT = 2379
ADMIN_HOST = 254  # the underlay's outside host: the one admitted
STRANGER_HOST = 253
HOST_EP_ID = 2**64 - 1

HOST_POLICY = """
apiVersion: cilium.io/v2
kind: CiliumClusterwideNetworkPolicy
metadata: {name: ssh-from-admins}
spec:
  nodeSelector: {matchLabels: {role: edge}}
  ingress:
  - fromCIDR: [192.168.100.254/32]
    toPorts: [{ports: [{port: "2222", protocol: TCP}]}]
  - fromEndpoints: [{matchLabels: {app: admin}}]
    toPorts: [{ports: [{port: "2222", protocol: TCP}]}]
"""

# A server that pushes a line every 0.1 s to whoever connects (a watch
# stream: after the policy, the first packet of the connection comes from
# the server), and its client, which prints each line with the time.
PUSH_SERVER = r"""
import socket, sys, threading, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8); print("ready", flush=True)
def push(c):
    n = 0
    try:
        while True:
            c.sendall(f"tick {n}\n".encode()); n += 1; time.sleep(0.1)
    except OSError:
        c.close()
while True:
    c, _ = s.accept(); threading.Thread(target=push, args=(c,), daemon=True).start()
"""
PUSH_CLIENT = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
s.settimeout(None)
f = s.makefile()
for line in f:
    print(time.time(), line.strip(), flush=True)
"""


@dataclass
class HostCluster:
    cluster: Cluster
    underlay: Underlay
    edge: Node
    core: Node
    stranger: Netns
    stranger_ip: str


def add_pod(c: Cluster, node: Node, name: str, labels: dict[str, str]) -> Netns:
    ns = c.pod(node, name)
    cni_add_pod(node.cni_socket, ns.path, name, "apps", labels)
    return ns


@pytest.fixture(scope="module")
def hc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCluster]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    tmp: Path = tmp_path_factory.mktemp("hostpolicy")
    with standalone_cluster(tmp) as cluster:
        cluster.start(services=("ipam", "policy", "lb", "endpoint"))
        underlay = Underlay(cluster.nss)
        outside_etcd = f"{underlay.outside_ip4}:{ETCD_PORT}"
        common = ["--routing-mode", "native", "--health-interval-seconds", "0.3"]
        edge = cluster.add_node(
            "n1",
            underlay=underlay,
            extra=[*common, "--node-labels", "role=edge", "--etcd-endpoints", outside_etcd],
        )
        core = cluster.add_node(
            "n2", underlay=underlay, extra=[*common, "--node-labels", "role=core"]
        )
        stranger = cluster.nss.new("out2")
        stranger_ip, _ = underlay.plug(stranger, STRANGER_HOST, "eth0")
        for node in (edge, core):
            node.netns.serve("tcp", SSH, f"{node.name}-ssh")
        yield HostCluster(cluster, underlay, edge, core, stranger, stranger_ip)


def status(hc: HostCluster, node: Node) -> datapath_pb2.DatapathStatus:
    resp: datapath_pb2.DatapathStatus = hc.cluster.datapath(node).GetStatus(
        datapath_pb2.GetStatusRequest(), timeout=10
    )
    return resp


def ssh(ns: Netns, node: Node) -> str | None:
    return ns.request("tcp", node.ip, SSH, timeout=0.5)


def test_host_policy_on_the_selected_node_only(hc: HostCluster) -> None:
    c, edge, core = hc.cluster, hc.edge, hc.core
    admin_host, stranger = hc.underlay.outside, hc.stranger
    web = add_pod(c, edge, "web", {"app": "web"})
    # Before: everyone reaches both nodes.
    for ns in (admin_host, stranger, web):
        assert ssh(ns, edge) is not None
    # A push stream from the node's etcd endpoint, opened before the policy.
    server = hc.underlay.outside.popen(sys.executable, "-c", PUSH_SERVER, str(ETCD_PORT))
    assert server.stdout is not None
    assert server.stdout.readline().strip() == "ready"
    stream = subprocess.Popen(
        edge.netns.cmd(sys.executable, "-c", PUSH_CLIENT, hc.underlay.outside_ip4, str(ETCD_PORT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert stream.stdout is not None
        assert "tick 0" in stream.stdout.readline()

        resp = c.policy().PutRules(policy_pb2.PutRulesRequest(document=HOST_POLICY), timeout=10)
        assert wait_until(lambda: status(hc, edge).host_policy.revision >= resp.revision, 5)
        applied = time.time()
        host = status(hc, edge).host_policy
        assert host.present
        assert host.ingress_enforced
        assert not host.egress_enforced
        assert list(host.rules) == ["ssh-from-admins"]
        assert dict(host.node_labels) == {"role": "edge"}
        assert host.safety_entries > 0
        assert not status(hc, core).host_policy.present

        # Only the admins' address gets in; the stranger is dropped.
        assert (ssh(admin_host, edge) or "").startswith("n1-ssh")
        assert ssh(stranger, edge) is None
        drops = list(
            c.datapath(edge).ObserveFlows(
                datapath_pb2.ObserveFlowsRequest(
                    endpoint_ids=[HOST_EP_ID],
                    verdicts=[datapath_pb2.FLOW_VERDICT_DROPPED],
                    last=100,
                ),
                timeout=10,
            )
        )
        assert any(
            f.src_ip == hc.stranger_ip and f.dst_port == SSH and f.dst_identity == 1 for f in drops
        ), drops
        # Pods of the node: as the policy says (a new admin pod: CNI ADD works).
        admin_pod = add_pod(c, edge, "admin", {"app": "admin"})
        assert (ssh(admin_pod, edge) or "").startswith("n1-ssh")
        assert ssh(web, edge) is None
        # The node whose labels do not match is unaffected.
        assert ssh(stranger, core) is not None
        assert ssh(web, core) is not None

        # The control plane: streams synced, the other node's health probes
        # get through (safety set), the etcd push stream still flows.
        st = status(hc, edge)
        assert st.streams_synced["host-policy"]
        assert all(st.streams_synced.values()), dict(st.streams_synced)

        def probed_after_policy() -> bool:
            peers = {p.node: p for p in status(hc, core).peers}
            p = peers.get("n1")
            return bool(p and p.reachable and p.probed_at.ToNanoseconds() / 1e9 > applied + 0.5)

        assert wait_until(probed_after_policy, 5)
        time.sleep(0.5)
    finally:
        stream.terminate()
        out, _ = stream.communicate(timeout=10)
    ticks_after = [float(line.split()[0]) for line in out.splitlines() if line.strip()]
    assert any(t > applied + 0.3 for t in ticks_after), out[-500:]

    # Deleting the policy restores access within a second.
    c.policy().DeleteRule(policy_pb2.DeleteRuleRequest(name="ssh-from-admins"), timeout=10)
    start = time.monotonic()
    assert wait_until(
        lambda: stranger.request("tcp", edge.ip, SSH, timeout=0.2) is not None, 1.0, interval=0.02
    )
    assert time.monotonic() - start < 1.0
    assert ssh(web, edge) is not None
    assert not status(hc, edge).host_policy.present
