"""End to end: pods' labels followed from the API server, and their
endpoints' status written back to it. Real pods (network namespaces set up
by `flagella-cni ADD` with `kubernetes: true`, so the endpoint service reads
the Pod and its Namespace), the datapath's BPF programs in a node netns,
policy written to the API server too. No API server can run here: the
policy and endpoint services follow KubeListWatchServer (harness/kube_api.py),
a local HTTP server that stands in for it (list/watch, one-object reads,
FlagellaEndpoint writes, Leases, Events, ownerReference garbage collection);
the test names say so.

One cluster for the module (its services take seconds to start); each test
has its own pods and policies and removes its policies. Traffic is probed
continuously with new connections, every sample timed (harness.probe)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from grpc_health.v1 import health_pb2
from harness.cni import check_result, cni, netconf
from harness.kube_api import k8s_policy, object_path
from harness.kube_cluster import KubeEnv, kube_cluster
from harness.netns import wait_until
from harness.probe import Pod, probing, settle

from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2

pytestmark = [pytest.mark.privileged, pytest.mark.integration]

PORT = 8080
WITHIN_S = 1.0
SERVING = health_pb2.HealthCheckResponse.SERVING


Env = KubeEnv


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    namespaces = {"shop": {}, "alpha": {"team": "a"}, "beta": {"team": "b"}}
    with kube_cluster(tmp_path_factory.mktemp("k8s-endpoints"), namespaces) as env:
        yield env


def pod_object(namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": labels},
        "spec": {"nodeName": "n1", "serviceAccountName": "default"},
    }


def add_pod(env: Env, namespace: str, name: str, labels: dict[str, str]) -> Pod:
    """The Pod in the API server, then its CNI ADD (labels read from there)."""
    env.kube_api.apply("pods", pod_object(namespace, name, labels))
    ns = env.cluster.pod(env.node, f"{namespace[:2]}{name}")
    conf = netconf(env.node.cni_socket, kubernetes=True)
    rc, result = cni("ADD", conf, container_id=f"ctr-{name}", netns=ns.path, pod=(namespace, name))
    assert rc == 0, result
    pod_cidrs = env.cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=env.node.name)).pod_cidrs
    cidr = next(c for c in pod_cidrs if ":" not in c)
    return Pod(name, ns, check_result(result, netns=ns.path, ifname="eth0", pod_cidr=cidr))


def delete_pod(env: Env, namespace: str, pod: Pod) -> None:
    conf = netconf(env.node.cni_socket, kubernetes=True)
    rc, out = cni("DEL", conf, container_id=f"ctr-{pod.name}", netns=pod.ns.path)
    assert rc == 0, out
    if env.kube_api.get("pods", namespace, pod.name) is not None:
        env.kube_api.delete("pods", namespace, pod.name)


def relabel(env: Env, namespace: str, name: str, labels: dict[str, str]) -> None:
    pod = env.kube_api.get("pods", namespace, name)
    assert pod is not None
    pod["metadata"]["labels"] = labels
    env.kube_api.apply("pods", pod)


def label_namespace(env: Env, name: str, labels: dict[str, str]) -> None:
    env.kube_api.apply("namespaces", {"metadata": {"name": name, "labels": labels}})


def endpoint_of(env: Env, name: str) -> endpoint_pb2.Endpoint:
    attachment = endpoint_pb2.Attachment(container_id=f"ctr-{name}", ifname="eth0")
    return env.cluster.endpoint().GetEndpoint(
        endpoint_pb2.GetEndpointRequest(attachment=attachment)
    )


def server(env: Env, namespace: str, name: str, labels: dict[str, str]) -> Pod:
    pod = add_pod(env, namespace, name, labels)
    pod.ns.serve("tcp", PORT, name)
    return pod


def ingress_from(selector: dict[str, Any]) -> dict[str, Any]:
    """A NetworkPolicy spec: app=server pods take PORT only from selector."""
    return {
        "podSelector": {"matchLabels": {"app": "server"}},
        "ingress": [{"from": [selector], "ports": [{"port": PORT, "protocol": "TCP"}]}],
    }


def test_a_pod_relabelled_through_the_stand_in_api_server_crosses_a_policy_boundary_within_1s(
    env: Env,
) -> None:
    backend = server(env, "shop", "rl-server", {"app": "server"})
    client = add_pod(env, "shop", "rl-client", {"app": "guest"})
    before = endpoint_of(env, "rl-client")
    assert before.labels["app"] == "guest"
    assert before.labels["io.kubernetes.pod.namespace"] == "shop"
    assert before.labels["io.cilium.k8s.policy.serviceaccount"] == "default"
    policy = ingress_from({"podSelector": {"matchLabels": {"role": "frontend"}}})
    env.kube_api.apply("networkpolicies", k8s_policy("NetworkPolicy", "shop", "rl", policy))
    try:
        with probing({"client": (client, backend)}, PORT) as probes:
            t0 = time.time()
            settle(probes, t0, {"client": False}, "policy enforced", 5)
            t1 = time.time()
            relabel(env, "shop", "rl-client", {"app": "guest", "role": "frontend"})
            settle(probes, t1, {"client": True}, "relabelled into the policy", WITHIN_S)
            after = endpoint_of(env, "rl-client")
            assert after.identity != before.identity
            assert after.labels["role"] == "frontend"
            t2 = time.time()
            relabel(env, "shop", "rl-client", {"app": "guest"})
            settle(probes, t2, {"client": False}, "relabelled out of the policy", WITHIN_S)
        assert "role" not in endpoint_of(env, "rl-client").labels
    finally:
        env.kube_api.delete("networkpolicies", "shop", "rl")


def test_a_namespace_selector_and_a_namespace_label_change_on_the_stand_in_api_server(
    env: Env,
) -> None:
    """namespaceSelector {team: a} selects the client in alpha, not the ones
    in beta; relabelling the namespaces swaps them within 1 s (every pod of
    a namespace moves at once)."""
    backend = server(env, "shop", "ns-server", {"app": "server"})
    in_alpha = add_pod(env, "alpha", "ns-client-a", {"app": "client"})
    in_beta = add_pod(env, "beta", "ns-client-b", {"app": "client"})
    in_beta2 = add_pod(env, "beta", "ns-client-b2", {"app": "client"})
    peer = {"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": {}}
    env.kube_api.apply(
        "networkpolicies", k8s_policy("NetworkPolicy", "shop", "ns", ingress_from(peer))
    )
    try:
        pairs = {"alpha": (in_alpha, backend), "beta": (in_beta, backend),
                 "beta2": (in_beta2, backend)}  # fmt: skip
        with probing(pairs, PORT) as probes:
            t0 = time.time()
            settle(probes, t0, {"alpha": True, "beta": False, "beta2": False}, "selector", 5)
            t1 = time.time()
            label_namespace(env, "beta", {"team": "a"})
            both = {"alpha": True, "beta": True, "beta2": True}
            settle(probes, t1, both, "beta joins team a", WITHIN_S)
            t2 = time.time()
            label_namespace(env, "alpha", {"team": "c"})
            settle(probes, t2, {"alpha": False, "beta": True}, "alpha leaves team a", WITHIN_S)
    finally:
        env.kube_api.delete("networkpolicies", "shop", "ns")
        label_namespace(env, "alpha", {"team": "a"})
        label_namespace(env, "beta", {"team": "b"})


def flagella_endpoint(env: Env, namespace: str, name: str) -> dict[str, Any] | None:
    return env.kube_api.get("flagellaendpoints", namespace, name)


def test_flagellaendpoints_on_the_stand_in_api_server_follow_their_pods_and_vanish_with_them(
    env: Env,
) -> None:
    web = add_pod(env, "shop", "fe-web", {"app": "web"})
    ep = endpoint_of(env, "fe-web")
    pod = env.kube_api.get("pods", "shop", "fe-web")
    assert pod is not None

    def shows(identity: int) -> bool:
        """The object shows the endpoint ready with identity (it shows the
        states on the way too)."""
        obj = flagella_endpoint(env, "shop", "fe-web")
        return obj is not None and (obj["status"]["identity"]["id"], obj["status"]["state"]) == (
            identity, "ready")  # fmt: skip

    assert wait_until(lambda: shows(ep.identity), 5)
    obj = flagella_endpoint(env, "shop", "fe-web")
    assert obj is not None
    status = obj["status"]
    assert (status["id"], status["state"], status["node"]) == (ep.id, "ready", "n1")
    assert status["networking"]["addressing"][0]["ipv4"] == web.ip
    assert status["policyRevision"] == ep.policy_revision
    assert status["health"]["overall"] == "OK"
    assert "k8s:app=web" in status["identity"]["labels"]
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "fe-web", "uid": pod["metadata"]["uid"]}
    ]
    # A relabel moves it to the new identity.
    relabel(env, "shop", "fe-web", {"app": "web", "version": "2"})
    assert wait_until(lambda: endpoint_of(env, "fe-web").identity != ep.identity, 5)
    moved = endpoint_of(env, "fe-web").identity
    assert wait_until(lambda: shows(moved), 5)
    obj = flagella_endpoint(env, "shop", "fe-web")
    assert obj is not None
    assert "k8s:version=2" in obj["status"]["identity"]["labels"]
    # CNI DEL: the endpoint service deletes it.
    delete_pod(env, "shop", web)
    assert wait_until(lambda: flagella_endpoint(env, "shop", "fe-web") is None, 5)
    # The pod deleted in the API server: Kubernetes' garbage collector takes
    # its object (the stand-in does it at once), and the endpoint service
    # does not write it again for an endpoint whose pod is gone.
    gone = add_pod(env, "shop", "fe-gone", {"app": "web"})
    assert wait_until(lambda: flagella_endpoint(env, "shop", "fe-gone") is not None, 5)
    collected = env.kube_api.garbage_collected
    env.kube_api.delete("pods", "shop", "fe-gone")
    assert env.kube_api.garbage_collected == collected + 1
    time.sleep(1.0)
    assert flagella_endpoint(env, "shop", "fe-gone") is None
    delete_pod(env, "shop", gone)
    # A stale object the endpoint service owns is removed; another is not.
    for name, labels in (("stale", {"app.kubernetes.io/managed-by": "flagella-endpoint"}),
                         ("someone-elses", {})):  # fmt: skip
        env.kube_api.apply(
            "flagellaendpoints",
            {
                "apiVersion": "flagella.io/v1",
                "kind": "FlagellaEndpoint",
                "metadata": {"namespace": "shop", "name": name, "labels": labels},
                "status": {"id": 1, "state": "ready"},
            },
        )
    assert wait_until(lambda: flagella_endpoint(env, "shop", "stale") is None, 5)
    assert flagella_endpoint(env, "shop", "someone-elses") is not None
    env.kube_api.delete("flagellaendpoints", "shop", "someone-elses")
    # Nothing but FlagellaEndpoints, Leases and Events was ever written.
    written = set()
    for r in env.kube_api.requests:
        method, _, path = r.partition(" ")
        if method in ("POST", "PUT", "DELETE"):
            where = object_path(path.split("?")[0])
            written.add(where[0] if where else path)
    assert written <= {"flagellaendpoints", "leases", "events"}, written


def test_the_stand_in_api_server_away_enforcement_continues_and_the_watchers_resync_on_return(
    env: Env,
) -> None:
    backend = server(env, "shop", "away-server", {"app": "server"})
    client = add_pod(env, "shop", "away-client", {"app": "guest", "role": "frontend"})
    policy = ingress_from({"podSelector": {"matchLabels": {"role": "frontend"}}})
    env.kube_api.apply("networkpolicies", k8s_policy("NetworkPolicy", "shop", "away", policy))
    endpoint = env.cluster.services["endpoint"]
    try:
        with probing({"client": (client, backend)}, PORT) as probes:
            t0 = time.time()
            settle(probes, t0, {"client": True}, "allowed", 5)
            t1 = time.time()
            env.kube_api.down()
            # Changed while the watchers cannot see it.
            relabel(env, "shop", "away-client", {"app": "guest"})
            assert wait_until(lambda: endpoint.health("flagella.kubernetes") != SERVING, 10)
            # A pod cannot start without its labels: the ADD fails, closed.
            rc, out = cni(
                "ADD",
                netconf(env.node.cni_socket, kubernetes=True),
                container_id="ctr-away-new",
                netns=env.cluster.pod(env.node, "awnew").path,
                pod=("shop", "away-new"),
            )
            assert rc != 0
            assert "kubernetes" in str(out).lower(), out
            time.sleep(1.0)
            during = probes["client"].since(t1)
            assert len(during) > 10
            assert all(during), "enforcement changed while the API server was away"
            t2 = time.time()
            env.kube_api.up()
            assert wait_until(lambda: endpoint.health("flagella.kubernetes") == SERVING, 20)
            settle(probes, t2, {"client": False}, "the relabel seen on return", 20)
    finally:
        if env.kube_api.httpd is None:
            env.kube_api.up()
        env.kube_api.delete("networkpolicies", "shop", "away")
