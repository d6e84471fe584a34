"""host-scope mode: each node's pod CIDRs are given, by RegisterNode or by
the Kubernetes Node's spec.podCIDRs (read with the kubernetes client from a
local HTTP server that speaks the Kubernetes API: no API server can run on
these machines)."""

from __future__ import annotations

import ipaddress
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from harness.etcd import EtcdServer
from harness.kube_api import KubeListWatchServer
from harness.netns import wait_until
from harness.procs import ServiceProcess
from ipam_support import V4, V6, expect_error, spawn_ipam

from flagella.api.ipam.v1 import ipam_pb2 as pb

# One client plays several roles here (docs/DEVELOPMENT.md): plaintext.
pytestmark = [pytest.mark.integration, pytest.mark.insecure]

Code = grpc.StatusCode
TOKEN = "test-token-4f2a"


def test_host_scope_takes_the_pod_cidrs_registernode_gives(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess]
) -> None:
    _, ipam = spawn_ipam(spawn, etcd, "--mode", "host-scope")
    rev = ipam.revision()
    expect_error(Code.INVALID_ARGUMENT, "pod_cidrs", lambda: ipam.register("hs-1"))
    expect_error(
        Code.INVALID_ARGUMENT,
        "pod_cidrs[1]",
        lambda: ipam.register("hs-1", pod_cidrs=["10.50.1.0/24", "10.50.2.0/24"]),
    )
    expect_error(
        Code.INVALID_ARGUMENT,
        "pod_cidrs[0]",
        lambda: ipam.register("hs-1", pod_cidrs=["10.50.1.0/31"]),
    )
    expect_error(
        Code.INVALID_ARGUMENT,
        "pod_cidrs[0]",
        lambda: ipam.register("hs-1", pod_cidrs=["10.50.1.1/24"]),
    )
    assert ipam.revision() == rev

    node = ipam.register("hs-1", pod_cidrs=["fd00:50:1::/120", "10.50.1.0/24"])
    assert list(node.pod_cidrs) == ["10.50.1.0/24", "fd00:50:1::/120"]
    got = ipam.allocate("hs-1", "c1")
    assert [a.family for a in got] == [V4, V6]
    assert ipaddress.ip_address(got[0].ip) in ipaddress.ip_network("10.50.1.0/24")
    assert ipaddress.ip_address(got[1].ip) in ipaddress.ip_network("fd00:50:1::/120")
    # Same CIDRs again: fine. Other CIDRs for a node that has some: refused.
    assert (
        ipam.register("hs-1", pod_cidrs=["10.50.1.0/24", "fd00:50:1::/120"]).pod_cidrs
        == node.pod_cidrs
    )
    expect_error(
        Code.FAILED_PRECONDITION,
        "pod_cidrs",
        lambda: ipam.register("hs-1", pod_cidrs=["10.50.9.0/24"]),
    )
    # Another node may not take (or overlap) a node's CIDR.
    expect_error(
        Code.ALREADY_EXISTS,
        "pod_cidrs[0]",
        lambda: ipam.register("hs-2", pod_cidrs=["10.50.0.0/16"]),
    )
    expect_error(
        Code.ALREADY_EXISTS,
        "pod_cidrs[0]",
        lambda: ipam.register("hs-2", pod_cidrs=["10.50.1.0/24"]),
    )
    assert "hs-2" not in ipam.nodes()
    v4only = ipam.register("hs-2", pod_cidrs=["10.50.2.0/28"])
    expect_error(Code.INVALID_ARGUMENT, "families[0]", lambda: ipam.allocate("hs-2", "c2", [V6]))
    assert [a.family for a in ipam.allocate("hs-2", "c2")] == [V4]

    status = ipam.stub.GetStatus(pb.GetStatusRequest())
    assert status.mode == pb.MODE_HOST_SCOPE
    assert list(status.cluster_cidrs) == []
    usage = {(p.node, p.cidr): (p.allocated, p.capacity) for p in status.pools}
    assert usage[("hs-2", v4only.pod_cidrs[0])] == (1, 13)
    assert usage[("hs-1", "fd00:50:1::/120")] == (1, 253)


class FakeKubeApi(ThreadingHTTPServer):
    """A local HTTP server that speaks the part of the Kubernetes API the
    client uses here: GET /api/v1/nodes/<name> with a bearer token."""

    def __init__(self, nodes: dict[str, dict[str, object]]) -> None:
        super().__init__(("127.0.0.1", 0), _KubeHandler)
        self.nodes = nodes
        self.requests: list[str] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _KubeHandler(BaseHTTPRequestHandler):
    server: FakeKubeApi

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _send(self, code: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._send(
                401, {"kind": "Status", "apiVersion": "v1", "code": 401, "reason": "Unauthorized"}
            )
            return
        prefix = "/api/v1/nodes/"
        name = self.path[len(prefix) :].split("?")[0] if self.path.startswith(prefix) else ""
        spec = self.server.nodes.get(name)
        if spec is None:
            self._send(
                404,
                {
                    "kind": "Status",
                    "apiVersion": "v1",
                    "status": "Failure",
                    "message": f'nodes "{name}" not found',
                    "reason": "NotFound",
                    "details": {"name": name, "kind": "nodes"},
                    "code": 404,
                },
            )
            return
        self._send(
            200,
            {
                "kind": "Node",
                "apiVersion": "v1",
                "metadata": {"name": name, "uid": f"uid-{name}", "resourceVersion": "7"},
                "spec": spec,
                "status": {"addresses": [{"type": "InternalIP", "address": "192.168.7.1"}]},
            },
        )


@pytest.fixture
def kube_api() -> Iterator[FakeKubeApi]:
    server = FakeKubeApi(
        {
            "k-1": {"podCIDR": "10.60.1.0/24", "podCIDRs": ["10.60.1.0/24", "fd00:60:1::/120"]},
            "k-2": {"podCIDR": "10.60.2.0/24"},
            "k-3": {},
            "k-4": {"podCIDRs": ["10.60.4.0/24"]},
        }
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def write_kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\n"
        "kind: Config\n"
        "clusters:\n"
        f"- name: local\n  cluster:\n    server: {server}\n"
        "users:\n"
        f"- name: ipam\n  user:\n    token: {TOKEN}\n"
        "contexts:\n"
        "- name: local\n  context:\n    cluster: local\n    user: ipam\n"
        "current-context: local\n"
    )
    return path


def test_host_scope_reads_pod_cidrs_from_a_local_http_server_speaking_the_kubernetes_api(
    etcd: EtcdServer,
    spawn: Callable[..., ServiceProcess],
    kube_api: FakeKubeApi,
    tmp_path: Path,
) -> None:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", kube_api.url)
    _, ipam = spawn_ipam(spawn, etcd, "--mode", "host-scope", "--kubeconfig", str(kubeconfig))

    k1 = ipam.register("k-1", datapath_address="127.0.0.1:7301")
    assert list(k1.pod_cidrs) == ["10.60.1.0/24", "fd00:60:1::/120"]
    assert "/api/v1/nodes/k-1" in kube_api.requests
    # The old single-CIDR field when podCIDRs is absent.
    assert list(ipam.register("k-2").pod_cidrs) == ["10.60.2.0/24"]
    # CIDRs in the request must agree with Kubernetes.
    assert list(ipam.register("k-4", pod_cidrs=["10.60.4.0/24"]).pod_cidrs) == ["10.60.4.0/24"]
    rev = ipam.revision()
    expect_error(
        Code.INVALID_ARGUMENT, "pod_cidrs", lambda: ipam.register("k-1", pod_cidrs=["10.60.9.0/24"])
    )
    msg = expect_error(Code.FAILED_PRECONDITION, "name", lambda: ipam.register("k-3"))
    assert "spec.podCIDRs" in msg
    msg = expect_error(Code.NOT_FOUND, "name", lambda: ipam.register("k-missing"))
    assert "Kubernetes" in msg
    assert ipam.revision() == rev

    got = ipam.allocate("k-1", "pod-a")
    assert ipaddress.ip_address(got[0].ip) in ipaddress.ip_network("10.60.1.0/24")

    kube_api.shutdown()
    kube_api.server_close()
    expect_error(Code.UNAVAILABLE, "name", lambda: ipam.register("k-1"))
    assert ipam.revision() == rev + 1  # only the allocation above


def test_host_scope_node_cidr_sources_and_annotate_node_against_the_stand_in_kubernetes_api(
    etcd: EtcdServer, spawn: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    """Cilium's order of sources (spec.podCIDRs, else the pod CIDR
    annotations, an invalid one logged and ignored) and its AnnotateNode
    write-back, retried after the API server refused it once."""
    cilium, flagella = "io.cilium.network.", "flagella.io/"
    nodes = {
        # The spec wins over annotations.
        "a-spec": ({"podCIDRs": ["10.61.1.0/24"]}, {f"{cilium}ipv4-pod-cidr": "10.99.0.0/24"}),
        # No spec: Cilium's IPv4 annotation, flagella's IPv6 one.
        "a-annot": ({}, {f"{cilium}ipv4-pod-cidr": "10.61.2.0/24",
                         f"{flagella}ipv6-pod-cidr": "fd00:61:2::/120"}),
        # Cilium's is invalid (host bits): ignored, flagella's taken.
        "a-bad": ({}, {f"{cilium}ipv4-pod-cidr": "10.61.3.1/24",
                       f"{flagella}ipv4-pod-cidr": "10.61.3.0/24"}),
        # Only an invalid one (an IPv6 CIDR under the IPv4 name): none.
        "a-none": ({}, {f"{cilium}ipv4-pod-cidr": "fd00:61:4::/120"}),
    }  # fmt: skip
    with KubeListWatchServer() as kube:
        for name, (spec, annotations) in nodes.items():
            kube.apply(
                "nodes", {"metadata": {"name": name, "annotations": annotations}, "spec": spec}
            )
        kube.refuse("PATCH", "nodes")  # the first write-back fails
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        proc, ipam = spawn_ipam(
            spawn, etcd, "--mode", "host-scope", "--kubeconfig", str(kubeconfig)
        )
        internal = pb.NodeAddress(type=pb.NodeAddress.TYPE_INTERNAL_IP, ip="192.168.61.1")
        node = ipam.register("a-spec", addresses=[internal])
        assert list(node.pod_cidrs) == ["10.61.1.0/24"]
        assert list(ipam.register("a-annot").pod_cidrs) == ["10.61.2.0/24", "fd00:61:2::/120"]
        assert list(ipam.register("a-bad").pod_cidrs) == ["10.61.3.0/24"]
        msg = expect_error(Code.FAILED_PRECONDITION, "name", lambda: ipam.register("a-none"))
        assert "annotation" in msg

        def annotations_of(name: str) -> dict[str, str]:
            obj = kube.get("nodes", "", name) or {}
            return dict(obj.get("metadata", {}).get("annotations") or {})

        # Registration did not wait for the write-back; it comes after the refusal.
        assert wait_until(lambda: f"{flagella}ipv4-pod-cidr" in annotations_of("a-spec"), 15)
        written = annotations_of("a-spec")
        assert written[f"{cilium}ipv4-pod-cidr"] == "10.61.1.0/24"
        assert written[f"{flagella}ipv4-pod-cidr"] == "10.61.1.0/24"
        assert written[f"{cilium}ipv4-health-ip"] == "192.168.61.1"
        assert written[f"{flagella}ipv4-health-ip"] == "192.168.61.1"
        assert wait_until(lambda: f"{cilium}ipv6-pod-cidr" in annotations_of("a-annot"), 15)
        assert annotations_of("a-annot")[f"{cilium}ipv6-pod-cidr"] == "fd00:61:2::/120"
        # The invalid annotation is replaced by the CIDR the node has.
        assert wait_until(lambda: f"{flagella}ipv4-pod-cidr" in annotations_of("a-bad"), 15)
        assert annotations_of("a-bad")[f"{cilium}ipv4-pod-cidr"] == "10.61.3.0/24"
        patches = [r for r in kube.requests if r.startswith("PATCH /api/v1/nodes/")]
        assert len(patches) == 4  # three nodes, one of them twice (refused once)
        logs = [json.loads(line) for line in proc.logs().splitlines() if line.startswith("{")]
        assert any("annotating Kubernetes Node" in str(e) and "retrying" in str(e) for e in logs)
        assert any(
            e.get("annotation") == f"{cilium}ipv4-pod-cidr" and e.get("node") == "a-bad"
            for e in logs
        )
        # Counted once the answers are in (just after the server stored them).
        success = 'operation="annotate_node",outcome="success"} 3.0'
        assert wait_until(lambda: success in proc.scrape(), 10)
        scraped = proc.scrape()
        assert 'operation="annotate_node",outcome="unavailable"} 1.0' in scraped
        assert 'operation="node_cidr_annotation",outcome="invalid_argument"} 2.0' in scraped
