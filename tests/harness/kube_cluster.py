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

from harness import cluster as clusters
from harness.cluster import Cluster, Node
from harness.kube_api import KubeListWatchServer


@dataclass
class KubeEnv:
    cluster: Cluster
    node: Node
    kube_api: KubeListWatchServer


@contextlib.contextmanager
def kube_cluster(tmp: Path, namespaces: Mapping[str, Mapping[str, str]]) -> Iterator[KubeEnv]:
    """harness.cluster.kube_cluster with its node n1; skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (netns, veth, BPF)")
    with clusters.kube_cluster(tmp, namespaces) as (kube_api, cluster):
        yield KubeEnv(cluster, cluster.add_node("n1"), kube_api)
