"""Pods set up through the datapath API directly (what the endpoint service
does for an ADD, step by step): identity from the policy service,
SetupEndpoint on the node's datapath, the ipcache entry, then waiting until
the node realized the pod's policy."""

from __future__ import annotations

import time
from dataclasses import dataclass

from google.protobuf.duration_pb2 import Duration

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common import pki
from harness.cluster import Cluster, Node
from harness.netns import Netns

# These calls are the endpoint service's to make.
ENDPOINT = pki.service("endpoint")


@dataclass
class Pod:
    ns: Netns
    endpoint_id: int
    ip: str
    identity: int


def add_pod(
    cluster: Cluster,
    node: Node,
    name: str,
    endpoint_id: int,
    ip: str,
    labels: dict[str, str],
    ns: Netns | None = None,
    setup_ms: list[float] | None = None,
) -> Pod:
    """What the endpoint service does for an ADD, step by step (in a netns
    of its own, or in ns when given: a pod made before the node); the
    SetupEndpoint call's milliseconds are appended to setup_ms if given."""
    ns = ns or cluster.pod(node, name)
    policy = cluster.policy(as_=ENDPOINT)
    alloc = policy.AllocateIdentity(
        policy_pb2.AllocateIdentityRequest(
            labels=[policy_pb2.Label(source="k8s", key=k, value=v) for k, v in labels.items()],
            node=node.name,
            owner=f"c-{name}/eth0",
        ),
        timeout=10,
    )
    dp = cluster.datapath(node, as_=ENDPOINT)
    started = time.perf_counter()
    resp = dp.SetupEndpoint(
        datapath_pb2.SetupEndpointRequest(
            endpoint_id=endpoint_id,
            container_id=f"c-{name}",
            netns_path=ns.path,
            ifname="eth0",
            addresses=[f"{ip}/32"],
            identity=alloc.identity.id,
            mtu=1500,
        ),
        timeout=20,
    )
    if setup_ms is not None:
        setup_ms.append((time.perf_counter() - started) * 1e3)
    assert resp.container_interface.name == "eth0"
    assert resp.gateways == ["169.254.1.1"]
    policy.UpsertIPCache(
        policy_pb2.UpsertIPCacheRequest(
            entry=policy_pb2.IPCacheEntry(
                prefix=ip,
                identity=alloc.identity.id,
                node=node.name,
                host_ip=node.ip,
                source="endpoint",
            )
        ),
        timeout=10,
    )
    dp.WaitForPolicy(
        datapath_pb2.WaitForPolicyRequest(
            endpoint_id=endpoint_id,
            min_revision=alloc.identity.revision,
            timeout=Duration(seconds=20),
        ),
        timeout=30,
    )
    return Pod(ns, endpoint_id, ip, alloc.identity.id)
