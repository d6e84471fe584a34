"""End to end: policy objects written to the API server are enforced on real
pods (network namespaces set up by `flagella-cni ADD`, the datapath's BPF
programs in a node netns) within a second of the write, for each kind:
NetworkPolicy, CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy and
FlagellaNetworkPolicy. No API server can run here: the policy service
follows KubeListWatchServer (harness/kube_api.py), a local HTTP server that
stands in for it (list/watch, Leases, Events); the test names say so.

Pods are probed continuously with new TCP connections (each a new flow, so
conntrack never hides a change), and every sample is timed."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from harness.cluster import Cluster, Node
from harness.cni import check_result, cni, netconf
from harness.kube_api import POLICY_KINDS, KubeListWatchServer, k8s_policy
from harness.netns import Netns, wait_until

from flagella.api.ipam.v1 import ipam_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

PORT = 8080
WITHIN_S = 1.0
# New connections, one after the other; prints "<start time> ok|fail" each.
PROBE = r"""
import socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
while True:
    t = time.time()
    try:
        s = socket.create_connection((host, port), timeout=0.3)
        s.sendall(b"HELLO\n")
        ok = bool(s.recv(4096))
        s.close()
    except OSError:
        ok = False
    print(f"{t:.3f} {'ok' if ok else 'fail'}", flush=True)
    time.sleep(0.03)
"""


@dataclass
class Pod:
    name: str
    ns: Netns
    ip: str


class Probe:
    """A client pod connecting to a server pod over and over."""

    def __init__(self, client: Pod, server: Pod) -> None:
        self.proc = client.ns.popen(sys.executable, "-u", "-c", PROBE, server.ip, str(PORT))
        assert self.proc.stdout is not None
        self._fd = self.proc.stdout.fileno()
        os.set_blocking(self._fd, False)
        self._rest = ""
        self.samples: list[tuple[float, bool]] = []

    def read(self) -> list[tuple[float, bool]]:
        """Every sample so far (reads what the probe printed)."""
        buf = self._rest
        while select.select([self._fd], [], [], 0)[0]:
            chunk = os.read(self._fd, 65536).decode()
            if not chunk:
                break
            buf += chunk
        *lines, self._rest = buf.split("\n")
        for line in lines:
            t, verdict = line.split()
            self.samples.append((float(t), verdict == "ok"))
        return self.samples

    def settled(self, since: float, ok: bool, hold: float = 0.5) -> float | None:
        """When the samples started after since turned ok (or not) for good
        (at least hold seconds of them), or None yet."""
        samples = [s for s in self.read() if s[0] >= since]
        if not samples or samples[-1][0] - since < hold:
            return None
        turned = None
        for t, verdict in samples:
            if verdict != ok:
                turned = None
            elif turned is None:
                turned = t
        if turned is None or samples[-1][0] - turned < hold:
            return None
        return turned - since


@pytest.fixture
def kube_api() -> Iterator[KubeListWatchServer]:
    with KubeListWatchServer() as server:
        yield server


@pytest.fixture
def node(cluster: Cluster, kube_api: KubeListWatchServer, tmp_path: Path) -> Node:
    kubeconfig = kube_api.write_kubeconfig(tmp_path / "kubeconfig")
    policy = ["--kubeconfig", str(kubeconfig), "--leader-lease-duration", "2",
              "--leader-renew-deadline", "1.5", "--leader-retry-period", "0.25"]  # fmt: skip
    cluster.start(services=("ipam", "policy", "lb", "endpoint"), extra={"policy": policy})
    return cluster.add_node("n1")


def add_pod(cluster: Cluster, node: Node, name: str) -> Pod:
    ns = cluster.pod(node, name)
    conf = netconf(node.cni_socket, {"app": name})
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("shop", name))
    assert rc == 0, result
    cidrs = cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=node.name), timeout=10).pod_cidrs
    cidr = next(c for c in cidrs if ":" not in c)
    return Pod(name, ns, check_result(result, netns=ns.path, ifname="eth0", pod_cidr=cidr))


def spec(kind: str, allowed: str) -> dict[str, Any]:
    """backend takes port 8080 from the pods labelled app=<allowed> only."""
    if kind == "NetworkPolicy":
        return {
            "podSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"app": allowed}}}],
                    "ports": [{"port": PORT, "protocol": "TCP"}],
                }
            ],
        }
    return {
        "endpointSelector": {"matchLabels": {"app": "backend"}},
        "ingress": [
            {
                "fromEndpoints": [{"matchLabels": {"app": allowed}}],
                "toPorts": [{"ports": [{"port": str(PORT), "protocol": "TCP"}]}],
            }
        ],
    }


@pytest.fixture
def pods(cluster: Cluster, node: Node) -> tuple[Pod, Pod, Pod]:
    frontend, backend, other = (add_pod(cluster, node, n) for n in ("frontend", "backend", "other"))
    backend.ns.serve("tcp", PORT, "backend")
    assert wait_until(lambda: other.ns.request("tcp", backend.ip, PORT, timeout=1) is not None)
    return frontend, backend, other


@contextlib.contextmanager
def probing(frontend: Pod, backend: Pod, other: Pod) -> Iterator[dict[str, Probe]]:
    """frontend and other probing backend, for the duration."""
    probes = {"frontend": Probe(frontend, backend), "other": Probe(other, backend)}
    try:
        yield probes
    finally:
        for p in probes.values():
            p.proc.kill()
            p.proc.wait(5)


def settle(probes: dict[str, Probe], since: float, want: dict[str, bool], what: str) -> None:
    """Each probe turns to want within WITHIN_S of since, and stays."""
    assert wait_until(
        lambda: all(p.settled(since, want[k]) is not None for k, p in probes.items()), 10
    ), what
    for k, p in probes.items():
        took = p.settled(since, want[k])
        assert took is not None
        assert took <= WITHIN_S, f"{what}: {k} took {took:.2f}s"


@pytest.mark.parametrize("kind", list(POLICY_KINDS))
def test_a_policy_written_to_the_stand_in_api_server_is_enforced_on_real_pods_within_1s(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod], kind: str
) -> None:
    frontend, backend, other = pods
    resource, _ = POLICY_KINDS[kind]
    namespace = "" if kind == "CiliumClusterwideNetworkPolicy" else "shop"
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        kube_api.apply(resource, k8s_policy(kind, namespace, "backend", spec(kind, "frontend")))
        settle(probes, t0, {"frontend": True, "other": False}, f"{kind} created")
        t1 = time.time()
        kube_api.apply(resource, k8s_policy(kind, namespace, "backend", spec(kind, "other")))
        settle(probes, t1, {"frontend": False, "other": True}, f"{kind} updated")
        t2 = time.time()
        kube_api.delete(resource, namespace, "backend")
        settle(probes, t2, {"frontend": True, "other": True}, f"{kind} deleted")


def test_an_invalid_object_on_the_stand_in_api_server_gets_an_event_and_blocks_nothing(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod]
) -> None:
    frontend, backend, other = pods
    bad = spec("NetworkPolicy", "frontend")
    bad["ingress"][0]["ports"][0]["port"] = 99999
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        kube_api.apply("networkpolicies", k8s_policy("NetworkPolicy", "shop", "bad", bad))
        assert wait_until(lambda: kube_api.events_about("NetworkPolicy", "shop", "bad"), 10)
        [event] = kube_api.events_about("NetworkPolicy", "shop", "bad")
        assert "spec.ingress[0].ports[0].port" in event["message"]
        time.sleep(1.5)
        after = [ok for t, ok in probes["other"].read() if t >= t0]
        assert len(after) > 5
        assert all(after), after
        # A valid object beside it is enforced as ever.
        t1 = time.time()
        good = k8s_policy(
            "CiliumNetworkPolicy", "shop", "good", spec("CiliumNetworkPolicy", "frontend")
        )
        kube_api.apply("ciliumnetworkpolicies", good)
        settle(probes, t1, {"frontend": True, "other": False}, "valid beside invalid")


def test_a_watch_ended_with_410_gone_by_the_stand_in_api_server_never_changes_traffic(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod]
) -> None:
    frontend, backend, other = pods
    kube_api.apply(
        "networkpolicies",
        k8s_policy("NetworkPolicy", "shop", "backend", spec("NetworkPolicy", "frontend")),
    )
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        settle(probes, t0, {"frontend": True, "other": False}, "enforced")
        t1 = time.time()
        lists = sum("watch=" not in r and "networkpolicies" in r for r in kube_api.requests)
        gone = kube_api.gone_sent
        kube_api.expire_watches()
        kube_api.apply(
            "networkpolicies",
            k8s_policy("NetworkPolicy", "other-ns", "x", spec("NetworkPolicy", "frontend")),
        )
        assert wait_until(
            lambda: (
                sum("watch=" not in r and "networkpolicies" in r for r in kube_api.requests) > lists
            ),
            10,
        )
        time.sleep(1.0)
        assert kube_api.gone_sent > gone
        during = {k: [ok for t, ok in p.read() if t >= t1] for k, p in probes.items()}
        assert len(during["frontend"]) > 5
        assert all(during["frontend"]), during["frontend"]
        assert not any(during["other"]), during["other"]
