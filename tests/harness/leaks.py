"""What flagella holds for the pods of a node (IPs, endpoints, datapath
endpoints, identity references, ipcache entries, endpoint map entries,
veths), and a wait until it holds exactly what the live pods need: how a
fault test shows nothing leaked."""

from __future__ import annotations

import json

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2
from harness.cluster import Cluster, Node
from harness.netns import wait_until


def held(cluster: Cluster, node: Node) -> dict[str, object]:
    """Everything flagella holds for pods on the node, by owner."""
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
            if lb.key == "app"
        ),
        "ipcache": sorted(e.prefix for e in ipcache.entries if e.source == "endpoint"),
        "map_entries": len(endpoint_map.entries),
        "veths": sorted(name.split("@")[0] for name in links if name.startswith("lxc")),
    }


def expect_only(cluster: Cluster, node: Node, alive: dict[str, str]) -> None:
    """alive: pod name -> its IP. Polls briefly: GC and the datapath's
    stream catch up asynchronously."""

    def ok() -> bool:
        got = held(cluster, node)
        want_ctrs = sorted(f"ctr-{p}" for p in alive)
        return (
            got["ips"] == want_ctrs
            and got["endpoints"] == want_ctrs
            and got["datapath"] == want_ctrs
            and got["referenced_labels"] == sorted(alive)
            and got["ipcache"] == sorted(alive.values())
            and got["map_entries"] == len(alive)
            and len(got["veths"]) == len(alive)  # type: ignore[arg-type]
        )

    assert wait_until(ok, timeout=20), json.dumps(held(cluster, node))
