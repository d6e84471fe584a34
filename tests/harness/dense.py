"""A dense node: many endpoints on one node's real datapath, set up as the
endpoint service sets them up (harness.pods.add_pod: AllocateIdentity,
SetupEndpoint in the pod's netns, the ipcache entry, WaitForPolicy), then one
rule selecting all of them as subjects and as peers, and the time from the
rule's write until every endpoint's policy map has it. The engine of
bench/dense_node.py and of its CI test.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.datapath.v1 import datapath_pb2_grpc as dpg
from flagella.api.policy.v1 import policy_pb2
from flagella.common.tls import target_options
from harness import tls
from harness.cluster import Cluster, Node
from harness.pods import ENDPOINT, Pod, add_pod
from harness.svcbench import cpu_seconds

#: Every dense pod takes ingress on this port from every other (the rule).
PORT = 8080

RULE = f"""
apiVersion: flagella.io/v1
kind: FlagellaNetworkPolicy
metadata: {{name: dense, namespace: dense}}
spec:
  endpointSelector: {{matchLabels: {{role: dense}}}}
  ingress:
  - fromEndpoints: [{{matchLabels: {{role: dense}}}}]
    toPorts: [{{ports: [{{port: "{PORT}", protocol: TCP}}]}}]
"""


def pod_ip(i: int) -> str:
    return f"10.77.{i // 250}.{i % 250 + 2}"


@dataclass
class DenseResult:
    endpoints: int = 0
    identities: int = 0
    setup_ms: list[float] = field(default_factory=list)
    add_s: float = 0.0
    rule_to_all_ms: float = 0.0
    rule_to_first_ms: float = 0.0
    missing: list[str] = field(default_factory=list)  # endpoints whose map lacks the rule
    policy_entries: int = 0
    datapath_cpu_rule_s: float = 0.0
    policy_cpu_rule_s: float = 0.0

    def figures(self) -> dict[str, Any]:
        setup = self.setup_ms
        q = statistics.quantiles(setup, n=100, method="inclusive") if len(setup) > 1 else [0.0] * 99
        return {
            "endpoints_count": self.endpoints,
            "identities_count": self.identities,
            "setup_endpoint_p50_ms": round(q[49], 1),
            "setup_endpoint_p99_ms": round(q[98], 1),
            "setup_endpoint_max_ms": round(max(setup, default=0.0), 1),
            "add_all_s": round(self.add_s, 1),
            "rule_to_first_endpoint_ms": round(self.rule_to_first_ms, 1),
            "rule_to_all_endpoints_ms": round(self.rule_to_all_ms, 1),
            "policy_map_entries_count": self.policy_entries,
            "endpoints_missing_the_rule_count": len(self.missing),
            "datapath_cpu_rule_s": round(self.datapath_cpu_rule_s, 2),
            "policy_cpu_rule_s": round(self.policy_cpu_rule_s, 2),
        }


def add_pods(
    cluster: Cluster, node: Node, count: int, apps: int, parallel: int
) -> tuple[list[Pod], list[float]]:
    """count pods on node, `apps` distinct label sets (identities) among
    them, `parallel` ADDs at once."""
    setup_ms: list[float] = []
    tls.session().bundle(ENDPOINT)  # made once, before the threads use it
    nss = [cluster.pod(node, f"d{i}") for i in range(count)]

    def add(i: int) -> Pod:
        labels = {"role": "dense", "app": f"app-{i % apps}", "io.kubernetes.pod.namespace": "dense"}
        return add_pod(
            cluster, node, f"d{i}", i + 1, pod_ip(i), labels, ns=nss[i], setup_ms=setup_ms
        )

    with ThreadPoolExecutor(parallel) as pool:
        return list(pool.map(add, range(count))), setup_ms


async def _wait_all(node: Node, pods: list[Pod], revision: int, t0: float) -> list[float]:
    """Each endpoint's WaitForPolicy at revision, all at once: when each
    answered, in ms from t0."""
    channel = tls.session().aio_channel(node.address, ENDPOINT)
    stub = dpg.DatapathServiceStub(channel)

    async def wait(pod: Pod) -> float:
        await stub.WaitForPolicy(
            datapath_pb2.WaitForPolicyRequest(
                endpoint_id=pod.endpoint_id, min_revision=revision, timeout=Duration(seconds=60)
            ),
            timeout=90,
        )
        return (time.perf_counter() - t0) * 1e3

    try:
        return list(await asyncio.gather(*(wait(p) for p in pods)))
    finally:
        await channel.close()


def run(cluster: Cluster, node: Node, count: int, apps: int, parallel: int = 4) -> DenseResult:
    result = DenseResult(endpoints=count, identities=min(apps, count))
    t0 = time.perf_counter()
    pods, result.setup_ms = add_pods(cluster, node, count, apps, parallel)
    result.add_s = time.perf_counter() - t0
    assert node.process is not None
    policy_pid = cluster.services["policy"].pid
    cpu0 = cpu_seconds(node.process.pid), cpu_seconds(policy_pid)
    t0 = time.perf_counter()
    put = cluster.policy().PutRules(policy_pb2.PutRulesRequest(document=RULE), timeout=30)
    done = asyncio.run(_wait_all(node, pods, put.revision, t0))
    result.rule_to_all_ms, result.rule_to_first_ms = max(done), min(done)
    result.datapath_cpu_rule_s = cpu_seconds(node.process.pid) - cpu0[0]
    result.policy_cpu_rule_s = cpu_seconds(policy_pid) - cpu0[1]
    result.missing, result.policy_entries = check_maps(cluster, node, pods)
    return result


def check_maps(cluster: Cluster, node: Node, pods: list[Pod]) -> tuple[list[str], int]:
    """Every endpoint's policy map allows TCP 8080 in from every pod
    identity: the rule is in every map. Returns the endpoints
    missing a peer and the map's entry count."""
    # (the whole map: 17 MB at 250 endpoints of 250 peers)
    options = [*target_options(node.address), ("grpc.max_receive_message_length", 256 << 20)]
    with grpc.secure_channel(node.address, tls.session().credentials(), options) as channel:
        dump = dpg.DatapathServiceStub(channel).DumpMap(
            datapath_pb2.DumpMapRequest(name="policy"), timeout=120
        )
    peers: dict[int, set[int]] = defaultdict(set)
    for entry in dump.entries:
        key = entry.key
        if (key["direction"], key["protocol"], key["port"], entry.value["verdict"]) == (
            "ingress",
            "tcp",
            str(PORT),
            "allow",
        ):
            peers[int(key["endpoint_id"])].add(int(key["identity"]))
    identities = {p.identity for p in pods}
    missing = [
        f"endpoint {p.endpoint_id}: {len(identities - peers[p.endpoint_id])} peers missing"
        for p in pods
        if not identities <= peers[p.endpoint_id]
    ]
    return missing, len(dump.entries)
