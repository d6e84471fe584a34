"""What flagella holds for the pods of a node, from every owner: ipam's
allocations, the endpoint service's records, the datapath's endpoints and
endpoint map, identities referenced, ipcache entries and host veths. After
a pod's DEL (or a crash and its repair) none of it may stay."""

from __future__ import annotations

from typing import Any

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2
from harness.cluster import Cluster, Node


def held(cluster: Cluster, node: Node, label_key: str = "app") -> dict[str, Any]:
    """Everything flagella holds for pods on the node, by owner (identities
    by the value of their label_key label)."""
    allocs = cluster.ipam().ListAllocations(
        ipam_pb2.ListAllocationsRequest(node=node.name), timeout=10
    )
    eps = cluster.endpoint().ListEndpoints(endpoint_pb2.ListEndpointsRequest(), timeout=10)
    realized = cluster.datapath(node).ListEndpoints(datapath_pb2.ListEndpointsRequest(), timeout=10)
    idents = cluster.policy().ListIdentities(policy_pb2.ListIdentitiesRequest(), timeout=10)
    ipcache = cluster.policy().ListIPCache(policy_pb2.ListIPCacheRequest(), timeout=10)
    endpoint_map = cluster.datapath(node).DumpMap(
        datapath_pb2.DumpMapRequest(name="endpoints"), timeout=10
    )
    links = node.netns.ip("-br", "link").stdout.split()
    return {
        "ips": sorted(a.owner.container_id for a in allocs.allocations),
        "endpoints": sorted(e.container_id for e in eps.endpoints),
        "datapath": sorted(e.container_id for e in realized.endpoints),
        "referenced_labels": sorted(
            lb.value
            for i in idents.identities
            if i.referenced_by
            for lb in i.labels
            if lb.key == label_key
        ),
        "ipcache": sorted(e.prefix for e in ipcache.entries if e.source == "endpoint"),
        "map_entries": len(endpoint_map.entries),
        "veths": sorted(name.split("@")[0] for name in links if name.startswith("lxc")),
    }


def holds_only(got: dict[str, Any], alive: dict[str, str], label_of: dict[str, str]) -> bool:
    """got (held()) is exactly what the live pods need. alive: container id
    -> the pod's IP; label_of: container id -> its label_key value."""
    want = sorted(alive)
    return (
        got["ips"] == want
        and got["endpoints"] == want
        and got["datapath"] == want
        and got["referenced_labels"] == sorted(label_of[c] for c in alive)
        and got["ipcache"] == sorted(alive.values())
        and got["map_entries"] == len(alive)
        and len(got["veths"]) == len(alive)
    )
