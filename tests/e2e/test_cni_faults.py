"""Fault injection: kill -9 the endpoint service at each step of a CNI ADD,
and separately ipam, policy and the datapath in the middle of one; restart
what was killed and run CNI GC. Afterwards no IP, identity reference,
ipcache entry, veth or map entry of the interrupted ADD is left, and the pod
that was already running still works."""

from __future__ import annotations

import json
import time

import pytest
from harness.cluster import Cluster, Node
from harness.cni import cni, netconf
from harness.netns import wait_until

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

STEPS = ("ipam", "identity", "datapath", "ipcache", "policy")


@pytest.fixture
def node(cluster: Cluster) -> Node:
    # Short reservations so an ADD cut off before its record was rolled back
    # cannot hide behind a long expiry; a fast sweep of the GC.
    cluster.start(
        services=("ipam", "policy", "lb", "endpoint"),
        extra={"endpoint": ["--reservation-seconds", "60", "--policy-wait-seconds", "10"]},
    )
    return cluster.add_node("n1")


def add(
    cluster: Cluster, node: Node, name: str, labels: dict[str, str]
) -> tuple[int, dict[str, object]]:
    ns = node.pods.get(name) or cluster.pod(node, name)
    conf = netconf(cluster.cni_socket(), node.name, labels, timeout=30)
    return cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("faults", name))


def gc(cluster: Cluster, node: Node, valid: list[str]) -> None:
    conf = netconf(cluster.cni_socket(), node.name)
    conf["cni.dev/valid-attachments"] = [
        {"containerID": f"ctr-{v}", "ifname": "eth0"} for v in valid
    ]
    rc, out = cni("GC", conf)
    assert rc == 0, out


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


def test_endpoint_service_killed_at_each_step(cluster: Cluster, node: Node) -> None:
    rc, keeper = add(cluster, node, "keeper", {"app": "keeper"})
    assert rc == 0, keeper
    keeper_ip = str(keeper["ips"][0]["address"]).split("/")[0]  # type: ignore[index]
    node.pods["keeper"].serve("tcp", 8080, "keeper")
    for step in STEPS:
        cluster.restart("endpoint", ["--fault-injection", f"crash-after:{step}"])
        rc, out = add(cluster, node, f"v-{step}", {"app": f"v-{step}"})
        assert rc != 0, f"{step}: the ADD should have died with the service"
        assert out["code"] == 11, (step, out)  # try again later
        cluster.restart("endpoint")  # restore rolls the interrupted ADD back
        gc(cluster, node, ["keeper"])
        expect_only(cluster, node, {"keeper": keeper_ip})
    # The survivor still works, for a pod added after all of this.
    rc, probe = add(cluster, node, "probe", {"app": "probe"})
    assert rc == 0, probe
    assert node.pods["probe"].request("tcp", keeper_ip, 8080) is not None


@pytest.mark.parametrize(
    ("peer", "step"), [("ipam", "ipam"), ("policy", "identity"), ("datapath", "datapath")]
)
def test_peer_killed_in_the_middle_of_an_add(
    cluster: Cluster, node: Node, peer: str, step: str
) -> None:
    rc, keeper = add(cluster, node, "keeper", {"app": "keeper"})
    assert rc == 0, keeper
    keeper_ip = str(keeper["ips"][0]["address"]).split("/")[0]  # type: ignore[index]
    node.pods["keeper"].serve("tcp", 8080, "keeper")
    cluster.restart("endpoint", ["--fault-injection", f"pause-after:{step}:3"])

    import threading

    result: dict[str, object] = {}
    thread = threading.Thread(
        target=lambda: result.update(
            zip(("rc", "out"), add(cluster, node, "victim", {"app": "victim"}), strict=True)
        )
    )
    thread.start()
    time.sleep(1.5)  # the ADD is now paused right after `step`
    if peer == "datapath":
        assert node.process is not None
        node.process.kill9()
    else:
        cluster.kill9(peer)
    thread.join(120)
    assert result["rc"] != 0, result
    # Bring everything back; GC finishes what the failed rollback could not.
    if peer == "datapath":
        cluster.start_datapath(node)
    else:
        cluster.restart(peer, kill=True)
    cluster.restart("endpoint")
    gc(cluster, node, ["keeper"])
    expect_only(cluster, node, {"keeper": keeper_ip})
    rc, probe = add(cluster, node, "probe", {"app": "probe"})
    assert rc == 0, probe
    assert node.pods["probe"].request("tcp", keeper_ip, 8080) is not None
