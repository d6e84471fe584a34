"""Benchmark of the endpoint service following the Kubernetes API: how long
a pod's or a namespace's relabel takes to move its endpoints to their new
identity (realized by the node's datapath), and how long after a CNI ADD
the pod's FlagellaEndpoint shows it ready. Real pods (`flagella-cni ADD`
with `kubernetes: true`), etcd, ipam, policy, endpoint and a datapath in a
node netns; KubeListWatchServer (tests/harness/kube_api.py) stands in for
the API server.

    python bench/k8s_endpoints.py [--quick] [--json]

Needs root. Creates its own etcd, processes, network namespaces and pin
folder, and removes them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import Cluster, Node, standalone_cluster  # noqa: E402
from harness.cni import cni, netconf  # noqa: E402
from harness.kube_api import KubeListWatchServer  # noqa: E402

from flagella.api.endpoint.v1 import endpoint_pb2  # noqa: E402

LEADER = ["--leader-lease-duration", "2", "--leader-renew-deadline", "1.5",
          "--leader-retry-period", "0.25"]  # fmt: skip


NAMESPACE_TEAM = "io.cilium.k8s.namespace.labels.team"


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def wait(done: Callable[[], bool], timeout: float = 30) -> float:
    """ms until done() (polled every 2 ms)."""
    start = time.perf_counter()
    while not done():
        if time.perf_counter() - start > timeout:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)
    return (time.perf_counter() - start) * 1000


def pod_object(namespace: str, name: str, labels: dict[str, str]) -> dict[str, object]:
    meta = {"namespace": namespace, "name": name, "labels": labels}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": {"nodeName": "bench"}}


def run_bench(quick: bool) -> dict[str, float]:
    n = 8 if quick else 30
    rounds = 4 if quick else 10
    tmp = Path(tempfile.mkdtemp(prefix="flbench-k8sep-"))
    figures: dict[str, float] = {}
    with KubeListWatchServer() as api, standalone_cluster(tmp) as cluster:
        api.apply("namespaces", {"metadata": {"name": "b", "labels": {"team": "t0"}}})
        kubeconfig = ["--kubeconfig", str(api.write_kubeconfig(tmp / "kubeconfig")), *LEADER]
        cluster.start(services=("ipam", "policy", "endpoint"), extra={"endpoint": kubeconfig})
        node = cluster.add_node("bench")
        stub = cluster.endpoint()

        def endpoint(i: int) -> endpoint_pb2.Endpoint:
            attachment = endpoint_pb2.Attachment(container_id=f"bench-{i}", ifname="eth0")
            return stub.GetEndpoint(endpoint_pb2.GetEndpointRequest(attachment=attachment))

        def moved(i: int, key: str, value: str) -> Callable[[], bool]:
            def done() -> bool:
                ep = endpoint(i)
                return ep.labels.get(key) == value and ep.state == endpoint_pb2.ENDPOINT_STATE_READY

            return done

        def all_moved(team: str) -> Callable[[], bool]:
            return lambda: all(moved(i, NAMESPACE_TEAM, team)() for i in range(n))

        fe_ready = add_pods(cluster, node, api, n)
        figures.update(flagellaendpoint_ready_after_add_p50_ms=statistics.median(fe_ready),
                       flagellaendpoint_ready_after_add_p99_ms=pct(fe_ready, 99))  # fmt: skip
        # One pod relabelled at a time, back and forth.
        relabels = []
        for r in range(rounds):
            for i in range(min(n, 5)):
                pod = api.get("pods", "b", f"p{i}")
                assert pod is not None
                pod["metadata"]["labels"] = {"app": "bench", "round": str(r)}
                api.apply("pods", pod)
                relabels.append(wait(moved(i, "round", str(r))))
        figures.update(pod_relabel_p50_ms=statistics.median(relabels),
                       pod_relabel_p99_ms=pct(relabels, 99))  # fmt: skip
        # The namespace relabelled: every pod of it moves.
        namespace_moves = []
        for r in range(1, rounds + 1):
            api.apply("namespaces", {"metadata": {"name": "b", "labels": {"team": f"t{r}"}}})
            namespace_moves.append(wait(all_moved(f"t{r}")))
        figures.update(namespace_relabel_all_pods_p50_ms=statistics.median(namespace_moves),
                       namespace_relabel_all_pods_max_ms=max(namespace_moves), pods=n)  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)
    return figures


def add_pods(cluster: Cluster, node: Node, api: KubeListWatchServer, n: int) -> list[float]:
    """ADD n pods; ms from each ADD's answer to its FlagellaEndpoint ready."""
    conf = netconf(node.cni_socket, kubernetes=True)
    times = []
    for i in range(n):
        api.apply("pods", pod_object("b", f"p{i}", {"app": "bench"}))
        netns = cluster.pod(node, f"p{i}")
        rc, out = cni("ADD", conf, container_id=f"bench-{i}", netns=netns.path, pod=("b", f"p{i}"))
        if rc != 0:
            raise RuntimeError(f"ADD {i}: {out}")

        def ready(name: str = f"p{i}") -> bool:
            obj = api.get("flagellaendpoints", "b", name)
            return obj is not None and obj["status"]["state"] == "ready"

        times.append(wait(ready))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer pods and rounds (under 30 s)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/k8s_endpoints.py needs root", file=sys.stderr)
        return 2
    figures = run_bench(args.quick)
    if args.json:
        print(json.dumps(figures, sort_keys=True))
        return 0
    pods = int(figures["pods"])
    rows = [
        ("pod relabel -> new identity realized, p50 ms", "pod_relabel_p50_ms"),
        ("pod relabel -> new identity realized, p99 ms", "pod_relabel_p99_ms"),
        (
            f"namespace relabel -> all {pods} pods moved, p50 ms",
            "namespace_relabel_all_pods_p50_ms",
        ),
        (
            f"namespace relabel -> all {pods} pods moved, max ms",
            "namespace_relabel_all_pods_max_ms",
        ),
        (
            "ADD answered -> FlagellaEndpoint ready, p50 ms",
            "flagellaendpoint_ready_after_add_p50_ms",
        ),
        (
            "ADD answered -> FlagellaEndpoint ready, p99 ms",
            "flagellaendpoint_ready_after_add_p99_ms",
        ),
    ]
    print(f"{'figure':<52} {'value':>8}")
    for label, key in rows:
        print(f"{label:<52} {figures[key]:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
