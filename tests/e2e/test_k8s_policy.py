"""End to end: policy objects written to the API server are enforced on real
pods (network namespaces set up by `flagella-cni ADD`, the datapath's BPF
programs in a node netns) within a second of the write, for each kind:
NetworkPolicy, CiliumNetworkPolicy, CiliumClusterwideNetworkPolicy and
FlagellaNetworkPolicy. No API server can run here: the policy service
follows KubeListWatchServer (harness/kube_api.py), a local HTTP server that
stands in for it (list/watch, Leases, Events); the test names say so.

Pods are probed continuously with new TCP connections (each a new flow, so
conntrack never hides a change), and every sample is timed (harness.probe)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
from harness import probe
from harness.cni import check_result, cni, netconf
from harness.kube_api import POLICY_KINDS, KubeListWatchServer, k8s_policy
from harness.kube_cluster import KubeEnv, kube_cluster
from harness.netns import wait_until
from harness.probe import Pod, Probe

from flagella.api.ipam.v1 import ipam_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

PORT = 8080
WITHIN_S = 1.0


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEnv]:
    """One cluster for the module (its set-up is most of a test's time);
    each test leaves it with no policy (the `pods` fixture)."""
    with kube_cluster(tmp_path_factory.mktemp("k8s-policy"), {"shop": {}}) as env:
        yield env


def add_pod(env: KubeEnv, name: str) -> Pod:
    """The Pod in the API server, then its CNI ADD (labels read from there)."""
    env.kube_api.apply(
        "pods",
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"namespace": "shop", "name": name, "labels": {"app": name}},
            "spec": {"nodeName": env.node.name, "serviceAccountName": "default"},
        },
    )
    ns = env.cluster.pod(env.node, name)
    conf = netconf(env.node.cni_socket, kubernetes=True)
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=("shop", name))
    assert rc == 0, result
    cidrs = env.cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=env.node.name)).pod_cidrs
    cidr = next(c for c in cidrs if ":" not in c)
    return Pod(name, ns, check_result(result, netns=ns.path, ifname="eth0", pod_cidr=cidr))


@pytest.fixture(scope="module")
def module_pods(env: KubeEnv) -> tuple[Pod, Pod, Pod]:
    frontend, backend, other = (add_pod(env, n) for n in ("frontend", "backend", "other"))
    backend.ns.serve("tcp", PORT, "backend")
    assert wait_until(lambda: other.ns.request("tcp", backend.ip, PORT, timeout=1) is not None)
    return frontend, backend, other


@pytest.fixture
def kube_api(env: KubeEnv) -> KubeListWatchServer:
    return env.kube_api


@pytest.fixture
def pods(env: KubeEnv, module_pods: tuple[Pod, Pod, Pod]) -> Iterator[tuple[Pod, Pod, Pod]]:
    """The module's pods; after the test, every policy object it left is
    deleted and both clients reach backend again."""
    yield module_pods
    frontend, backend, other = module_pods
    for resource, _ in POLICY_KINDS.values():
        for obj in env.kube_api.list(resource):
            meta = obj["metadata"]
            env.kube_api.delete(resource, meta.get("namespace", ""), meta["name"])
    for client in (frontend, other):
        assert wait_until(
            lambda c=client: c.ns.request("tcp", backend.ip, PORT, timeout=1) is not None, 10
        ), f"{client.name} still cut off from backend after the test's policies were deleted"


def spec(kind: str, allowed: str) -> dict[str, Any]:
    """backend takes port 8080 from the pods labelled app=<allowed> only."""
    if kind == "NetworkPolicy":
        return {
            "podSelector": {"matchLabels": {"app": "backend"}},
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": {"app": allowed}}}],
                    "ports": [{"port": PORT, "protocol": "TCP"}],
                }
            ],
        }
    return {
        "endpointSelector": {"matchLabels": {"app": "backend"}},
        "ingress": [
            {
                "fromEndpoints": [{"matchLabels": {"app": allowed}}],
                "toPorts": [{"ports": [{"port": str(PORT), "protocol": "TCP"}]}],
            }
        ],
    }


def probing(
    frontend: Pod, backend: Pod, other: Pod
) -> contextlib.AbstractContextManager[dict[str, Probe]]:
    """frontend and other probing backend, for the duration."""
    return probe.probing({"frontend": (frontend, backend), "other": (other, backend)}, PORT)


def settle(probes: dict[str, Probe], since: float, want: dict[str, bool], what: str) -> None:
    """Each probe turns to want within WITHIN_S of since, and stays."""
    probe.settle(probes, since, want, what, WITHIN_S)


@pytest.mark.parametrize("kind", list(POLICY_KINDS))
def test_a_policy_written_to_the_stand_in_api_server_is_enforced_on_real_pods_within_1s(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod], kind: str
) -> None:
    frontend, backend, other = pods
    resource, _ = POLICY_KINDS[kind]
    namespace = "" if kind == "CiliumClusterwideNetworkPolicy" else "shop"
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        kube_api.apply(resource, k8s_policy(kind, namespace, "backend", spec(kind, "frontend")))
        settle(probes, t0, {"frontend": True, "other": False}, f"{kind} created")
        t1 = time.time()
        kube_api.apply(resource, k8s_policy(kind, namespace, "backend", spec(kind, "other")))
        settle(probes, t1, {"frontend": False, "other": True}, f"{kind} updated")
        t2 = time.time()
        kube_api.delete(resource, namespace, "backend")
        settle(probes, t2, {"frontend": True, "other": True}, f"{kind} deleted")


def test_an_invalid_object_on_the_stand_in_api_server_gets_an_event_and_blocks_nothing(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod]
) -> None:
    frontend, backend, other = pods
    bad = spec("NetworkPolicy", "frontend")
    bad["ingress"][0]["ports"][0]["port"] = 99999
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        kube_api.apply("networkpolicies", k8s_policy("NetworkPolicy", "shop", "bad", bad))
        assert wait_until(lambda: kube_api.events_about("NetworkPolicy", "shop", "bad"), 10)
        [event] = kube_api.events_about("NetworkPolicy", "shop", "bad")
        assert "spec.ingress[0].ports[0].port" in event["message"]
        time.sleep(1.5)
        after = [ok for t, ok in probes["other"].read() if t >= t0]
        assert len(after) > 5
        assert all(after), after
        # A valid object beside it is enforced as ever.
        t1 = time.time()
        good = k8s_policy(
            "CiliumNetworkPolicy", "shop", "good", spec("CiliumNetworkPolicy", "frontend")
        )
        kube_api.apply("ciliumnetworkpolicies", good)
        settle(probes, t1, {"frontend": True, "other": False}, "valid beside invalid")


def test_a_watch_ended_with_410_gone_by_the_stand_in_api_server_never_changes_traffic(
    kube_api: KubeListWatchServer, pods: tuple[Pod, Pod, Pod]
) -> None:
    frontend, backend, other = pods
    kube_api.apply(
        "networkpolicies",
        k8s_policy("NetworkPolicy", "shop", "backend", spec("NetworkPolicy", "frontend")),
    )
    with probing(frontend, backend, other) as probes:
        t0 = time.time()
        settle(probes, t0, {"frontend": True, "other": False}, "enforced")
        t1 = time.time()
        lists = sum("watch=" not in r and "networkpolicies" in r for r in kube_api.requests)
        gone = kube_api.gone_sent
        kube_api.expire_watches()
        kube_api.apply(
            "networkpolicies",
            k8s_policy("NetworkPolicy", "other-ns", "x", spec("NetworkPolicy", "frontend")),
        )
        assert wait_until(
            lambda: (
                sum("watch=" not in r and "networkpolicies" in r for r in kube_api.requests) > lists
            ),
            10,
        )
        time.sleep(1.0)
        assert kube_api.gone_sent > gone
        during = {k: [ok for t, ok in p.read() if t >= t1] for k, p in probes.items()}
        assert len(during["frontend"]) > 5
        assert all(during["frontend"]), during["frontend"]
        assert not any(during["other"]), during["other"]
