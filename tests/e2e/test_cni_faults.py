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
from harness.leaks import held, holds_only
from harness.netns import wait_until

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
    conf = netconf(node.cni_socket, labels, timeout=30)
    return cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("faults", name))


def gc(cluster: Cluster, node: Node, valid: list[str]) -> None:
    conf = netconf(node.cni_socket)
    conf["cni.dev/valid-attachments"] = [
        {"containerID": f"ctr-{v}", "ifname": "eth0"} for v in valid
    ]
    rc, out = cni("GC", conf)
    assert rc == 0, out


def expect_only(cluster: Cluster, node: Node, alive: dict[str, str]) -> None:
    """alive: pod name -> its IP. Polls briefly: GC and the datapath's
    stream catch up asynchronously."""

    def ok() -> bool:
        by_ctr = {f"ctr-{p}": ip for p, ip in alive.items()}
        return holds_only(held(cluster, node), by_ctr, {f"ctr-{p}": p for p in alive})

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
