"""Local redirect policies on three nodes (the multi-node harness of
test_multinode: node netns on one underlay, a datapath each, pods made by
the real `flagella-cni`), created and deleted with the CLI from
CiliumLocalRedirectPolicy documents:

- a serviceMatcher (the ClusterIP service apps/web) and an addressMatcher
  (a pod's address, two named ports, TCP and UDP, to other backend ports)
  take a pod's traffic to the local backend of its own node, never to one
  on another node (every answer of many connections names its server);
- on the node with no local backend, the service keeps its own backends
  and the address is reached as it is (Cilium's fallback);
- deleting the policies gives the service its backends back and the
  address its pod, on every node.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e.test_multinode import CIDR6, MultiNode, Pod, node_flags, operator_cli, probes
from harness.cluster import standalone_cluster
from harness.netns import wait_until
from harness.underlay import Underlay

from flagella.api.lb.v1 import lb_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

CLUSTER_IP = "10.96.77.7"
WEB, LOCAL_TCP, LOCAL_UDP, ORIG = 8080, 9090, 9091, 53
ROUNDS = 12

POLICIES = f"""
apiVersion: cilium.io/v2
kind: CiliumLocalRedirectPolicy
metadata:
  name: web-local
  namespace: apps
spec:
  redirectFrontend:
    serviceMatcher:
      serviceName: web
      namespace: apps
      toPorts:
        - port: "80"
          protocol: TCP
  redirectBackend:
    localEndpointSelector:
      matchLabels:
        role: local
    toPorts:
      - port: "{LOCAL_TCP}"
        protocol: TCP
---
apiVersion: cilium.io/v2
kind: CiliumLocalRedirectPolicy
metadata:
  name: orig-local
  namespace: apps
spec:
  redirectFrontend:
    addressMatcher:
      ip: "ORIG_IP"
      toPorts:
        - {{name: dns, port: "{ORIG}", protocol: UDP}}
        - {{name: dns-tcp, port: "{ORIG}", protocol: TCP}}
  redirectBackend:
    localEndpointSelector:
      matchExpressions:
        - {{key: role, operator: In, values: [local]}}
    toPorts:
      - {{name: dns, port: "{LOCAL_UDP}", protocol: UDP}}
      - {{name: dns-tcp, port: "{LOCAL_TCP}", protocol: TCP}}
"""


@pytest.fixture(scope="module")
def mn(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiNode]:
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    tmp: Path = tmp_path_factory.mktemp("lrp")
    with standalone_cluster(tmp) as cluster:
        cluster.start(
            services=("ipam", "policy", "lb", "endpoint"),
            extra={"ipam": ["--cluster-cidr", CIDR6]},  # the harness's pods have both families
        )
        underlay = Underlay(cluster.nss)
        nodes = [
            cluster.add_node(f"n{i}", underlay=underlay, extra=node_flags("native"))
            for i in (1, 2, 3)
        ]
        yield MultiNode("native", cluster, underlay, nodes)


def cli(mn: MultiNode, *args: str, stdin: str = "") -> str:
    out = subprocess.run(
        operator_cli("--lb-address", mn.cluster.socket("lb"), "-o", "json", *args),
        input=stdin, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout


def servers(answers: list[str | None]) -> collections.Counter[str | None]:
    """Who answered each probe (the server's name, None: nobody)."""
    return collections.Counter(a.split()[0] if a else None for a in answers)


def test_local_redirect_policies_across_nodes(mn: MultiNode) -> None:
    n1, n2, n3 = mn.nodes
    # Clients that are the service's backends too; a local backend on n1
    # and n2; on n3 none, and the pod whose address the policy redirects.
    web = [mn.add_pod(n, f"web{n.index}", "apps", {"app": "web"}) for n in (n1, n2, n3)]
    local = {n.name: mn.add_pod(n, f"loc{n.index}", "apps", {"role": "local"}) for n in (n1, n2)}
    orig = mn.add_pod(n3, "orig", "apps", {"app": "orig"})
    for pod in web:
        pod.ns.serve("tcp", WEB, pod.name)
    for pod in local.values():
        pod.ns.serve("tcp", LOCAL_TCP, pod.name)
        pod.ns.serve("udp", LOCAL_UDP, pod.name)
    orig.ns.serve("tcp", ORIG, orig.name)
    orig.ns.serve("udp", ORIG, orig.name)
    mn.cluster.lb().UpsertService(
        lb_pb2.UpsertServiceRequest(
            service=lb_pb2.Service(
                name="apps/web",
                frontend=lb_pb2.Frontend(address=CLUSTER_IP, port=80, protocol=lb_pb2.PROTOCOL_TCP),
                backends=[lb_pb2.Backend(address=p.ip4, port=WEB) for p in web],
            )
        ),
        timeout=10,
    )
    targets = [("tcp", CLUSTER_IP, 80), ("tcp", orig.ip4, ORIG), ("udp", orig.ip4, ORIG)]

    def answers(pod: Pod) -> list[collections.Counter[str | None]]:
        """Who answered each target over ROUNDS connections each."""
        got = probes(pod.ns, targets * ROUNDS)
        return [servers(got[i :: len(targets)]) for i in range(len(targets))]

    web_names = {p.name for p in web}
    assert wait_until(lambda: set(answers(web[0])[0]) == web_names, timeout=20)

    created = json.loads(
        cli(mn, "lrp", "create", "-f", "-", stdin=POLICIES.replace("ORIG_IP", orig.ip4))
    )
    assert [r["created"] for r in created] == [True, True]
    listed = json.loads(cli(mn, "lrp", "list"))
    assert sorted(p["name"] for p in listed) == ["orig-local", "web-local"]

    # Each node with a local backend: every connection, to the service and
    # to the address, to the backend on its own node, none elsewhere.
    for pod in web[:2]:
        want = [{local[pod.node.name].name: ROUNDS}] * 3
        assert wait_until(lambda p=pod, w=want: answers(p) == w, timeout=20), (
            pod.name,
            answers(pod),
        )
    # No local backend on n3: the service's own backends, the address as it is.
    svc, tcp, udp = answers(web[2])
    assert set(svc) <= web_names, svc
    assert sum(svc.values()) == ROUNDS, svc
    assert tcp == udp == {"orig": ROUNDS}

    # Deleted: the service and the address as before, on every node.
    cli(mn, "lrp", "delete", "apps/web-local")
    cli(mn, "lrp", "delete", "orig-local", "-n", "apps")
    assert json.loads(cli(mn, "lrp", "list")) == []

    def restored(pod: Pod) -> bool:
        svc, tcp, udp = answers(pod)
        return set(svc) <= web_names and tcp == udp == {"orig": ROUNDS}

    for pod in web:
        assert wait_until(lambda p=pod: restored(p), timeout=10), (pod.name, answers(pod))
