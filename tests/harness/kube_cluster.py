"""A cluster whose policy and endpoint services follow the stand-in API
server (KubeListWatchServer), with one node: what the end-to-end tests of
Kubernetes pods share."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.cluster import Cluster, Node, standalone_cluster
from harness.kube_api import KubeListWatchServer

# Short Leases, so that a test sees a leader within a second or two.
LEADER = ["--leader-lease-duration", "2", "--leader-renew-deadline", "1.5",
          "--leader-retry-period", "0.25"]  # fmt: skip


@dataclass
class KubeEnv:
    cluster: Cluster
    node: Node
    kube_api: KubeListWatchServer


@contextlib.contextmanager
def kube_cluster(tmp: Path, namespaces: Mapping[str, Mapping[str, str]]) -> Iterator[KubeEnv]:
    """ipam, policy and endpoint (both following the API server, which has
    these namespaces with their labels) and node n1; skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    with KubeListWatchServer() as kube_api, standalone_cluster(tmp, "info") as cluster:
        for name, labels in namespaces.items():
            kube_api.apply("namespaces", {"metadata": {"name": name, "labels": dict(labels)}})
        kubeconfig = ["--kubeconfig", str(kube_api.write_kubeconfig(tmp / "kubeconfig")), *LEADER]
        cluster.start(
            services=("ipam", "policy", "endpoint"),
            extra={"policy": kubeconfig, "endpoint": kubeconfig},
        )
        yield KubeEnv(cluster, cluster.add_node("n1"), kube_api)
