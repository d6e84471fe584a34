"""Pods made as a container runtime makes them: a netns of the node and
`flagella-cni ADD` with the pod's labels in the CNI arguments."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
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
    conf = netconf(node.cni_socket, labels)
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=(namespace, name))
    assert rc == 0, result
    ips = [ipaddress.ip_interface(ip["address"]).ip for ip in result["ips"]]
    return CniPod(
        name,
        ns,
        next(str(ip) for ip in ips if ip.version == 4),
        next((str(ip) for ip in ips if ip.version == 6), None),
    )
