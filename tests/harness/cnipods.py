"""Pods made as a container runtime makes them: a netns of the node and
`flagella-cni ADD` with the pod's labels in the CNI arguments."""

from __future__ import annotations

from dataclasses import dataclass

from harness.cluster import Cluster, Node
from harness.cni import add_pod
from harness.netns import Netns


@dataclass
class CniPod:
    name: str
    ns: Netns
    ip4: str
    ip6: str | None  # None when the cluster has no IPv6 pool


def cni_pod(
    cluster: Cluster, node: Node, name: str, labels: dict[str, str], namespace: str = "shop"
) -> CniPod:
    ns = cluster.pod(node, name)
    ip4, ip6 = add_pod(node.cni_socket, ns.path, name, namespace, labels)
    return CniPod(name, ns, ip4, ip6 or None)
