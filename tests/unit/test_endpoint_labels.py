"""An endpoint's identity labels from its Pod and Namespace (as Cilium
builds them), the FlagellaEndpoint object of a pod, and the policy side:
the labels survive the identity label filter, and a NetworkPolicy's
namespaceSelector and a CiliumNetworkPolicy's service account selector
select the pods they name (policy resolution on the labels the endpoint
service builds); and the endpoint service's Kubernetes options."""

from __future__ import annotations

from typing import Any

import pytest
from policy_world import World

from flagella.common.config import load_config
from flagella.common.errors import ConfigError
from flagella.endpoint import flagellaendpoint as fe
from flagella.endpoint.config import EndpointConfig
from flagella.endpoint.labels import (
    NamespaceInfo,
    PodInfo,
    decode_namespace,
    decode_pod,
    identity_labels,
)
from flagella.endpoint.model import Endpoint, State
from flagella.policy.labels import Label, LabelFilter, label_set


def pod_object(namespace: str, name: str, labels: dict[str, str], sa: str = "") -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": "n1"}
    if sa:
        spec["serviceAccountName"] = sa
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "12",
            "labels": labels,
        },
        "spec": spec,
    }


def namespace_object(name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"kubernetes.io/metadata.name": name, **labels}}}


def labels_of(pod: dict[str, Any], ns: dict[str, Any]) -> dict[str, str]:
    p, n = decode_pod(pod), decode_namespace(ns)
    assert p is not None
    assert n is not None
    return identity_labels(p, n)


def test_identity_labels_are_the_pods_its_namespaces_prefixed_its_namespace_and_account() -> None:
    labels = labels_of(
        pod_object("shop", "web-0", {"app": "web", "tier": "front"}, sa="web-sa"),
        namespace_object("shop", {"team": "a"}),
    )
    assert labels == {
        "app": "web",
        "tier": "front",
        "io.cilium.k8s.namespace.labels.team": "a",
        "io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name": "shop",
        "io.kubernetes.pod.namespace": "shop",
        "io.cilium.k8s.policy.serviceaccount": "web-sa",
    }


def test_a_pod_cannot_claim_its_namespaces_labels_its_namespace_or_an_account() -> None:
    claimed = {
        "app": "web",
        "io.cilium.k8s.namespace.labels.team": "admins",
        "io.cilium.k8s.policy.serviceaccount": "admin",
        "io.cilium.k8s.policy.cluster": "other",
        "io.kubernetes.pod.namespace": "kube-system",
    }
    labels = labels_of(pod_object("shop", "web-0", claimed), namespace_object("shop", {}))
    assert labels == {
        "app": "web",
        "io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name": "shop",
        "io.kubernetes.pod.namespace": "shop",
    }


def test_decode_keeps_what_labels_and_ownership_need() -> None:
    pod = decode_pod(pod_object("shop", "web-0", {"app": "web"}, sa="sa"))
    assert pod == PodInfo("shop", "web-0", "uid-web-0", "12", {"app": "web"}, "sa", "n1")
    assert pod.key == "shop/web-0"
    assert pod.as_object()["metadata"]["uid"] == "uid-web-0"
    assert decode_pod({"metadata": {}}) is None
    assert decode_namespace({"metadata": {"name": "x"}}) == NamespaceInfo("x", {})
    # Labels that are not a string map are none (the API never sends that).
    assert decode_namespace({"metadata": {"name": "x", "labels": ["a"]}}) == NamespaceInfo("x")


def filtered(labels: dict[str, str]) -> list[str]:
    kept = LabelFilter().filter(label_set(Label.make("k8s", k, v) for k, v in labels.items()))
    return [str(label) for label in kept]


def test_policy_selects_pods_by_namespace_label_and_service_account() -> None:
    """The labels the endpoint service builds, through the policy service's
    label filter, resolved against a namespaceSelector (a namespace label
    and the namespace name) and a service account selector."""
    namespaces = {
        "alpha": namespace_object("alpha", {"team": "a"}),
        "beta": namespace_object("beta", {"team": "b"}),
        "shop": namespace_object("shop", {}),
    }
    pods = {
        "web": ("shop", {"app": "web"}, "web-sa"),
        "a-client": ("alpha", {"app": "client"}, "client-sa"),
        "b-client": ("beta", {"app": "client"}, "client-sa"),
        "a-robot": ("alpha", {"app": "robot"}, "robot-sa"),
    }
    world = World()
    for name, (ns, labels, sa) in pods.items():
        built = labels_of(pod_object(ns, name, labels, sa), namespaces[ns])
        kept = filtered(built)
        assert "k8s:io.cilium.k8s.namespace.labels.kubernetes.io/metadata.name=" + ns in kept
        assert f"k8s:io.cilium.k8s.policy.serviceaccount={sa}" in kept
        world.identity(name, *kept)
    world.rules(
        """
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-from-team-a, namespace: shop}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
  - from:
    - namespaceSelector: {matchLabels: {team: a}}
      podSelector: {matchLabels: {app: client}}
---
apiVersion: cilium.io/v2
kind: CiliumNetworkPolicy
metadata: {name: web-from-robots, namespace: shop}
spec:
  endpointSelector: {matchLabels: {app: web}}
  ingress:
  - fromEndpoints:
    - matchLabels:
        io.cilium.k8s.policy.serviceaccount: robot-sa
        io.kubernetes.pod.namespace: alpha
"""
    )
    n = world.names
    assert world.allowed(n["a-client"], n["web"])
    assert not world.allowed(n["b-client"], n["web"])
    assert world.allowed(n["a-robot"], n["web"])


def endpoint(ifname: str, state: State = State.READY, **kw: Any) -> Endpoint:
    fields: dict[str, Any] = {
        "id": 9,
        "container_id": "c1",
        "ifname": ifname,
        "netns_path": "/run/netns/p",
        "node": "n1",
        "pod_name": "web-0",
        "pod_namespace": "shop",
        "labels": {"app": "web"},
        "identity": 300,
        "addresses": ["10.0.0.5/32", "fd00::5/128"],
        "state": state,
        "policy_revision": 4,
    }
    return Endpoint(**{**fields, **kw})


POD = PodInfo("shop", "web-0", "uid-1")


def test_a_pods_flagellaendpoint_shows_its_primary_endpoint_and_every_address() -> None:
    assert fe.desired(POD, []) is None
    extra = endpoint("net1", id=10, identity=301, addresses=["10.1.0.5/32"])
    obj = fe.desired(POD, [extra, endpoint("eth0")])
    assert obj is not None
    assert obj["metadata"]["name"] == "web-0"
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "web-0", "uid": "uid-1"}
    ]
    assert fe.owned(obj)
    status = obj["status"]
    assert (status["id"], status["identity"]["id"], status["state"]) == (9, 300, "ready")
    assert status["identity"]["labels"] == ["k8s:app=web"]
    assert status["networking"]["addressing"] == [
        {"interface": "eth0", "ipv4": "10.0.0.5", "ipv6": "fd00::5"},
        {"interface": "net1", "ipv4": "10.1.0.5"},
    ]
    assert status["health"] == {"overall": "OK", "ipam": "ok", "identity": "ok", "policy": "ok"}
    pending = fe.desired(POD, [endpoint("eth0", State.REGENERATING, policy_revision=0)])
    assert pending is not None
    assert pending["status"]["health"]["overall"] == "Pending"
    failed = fe.desired(POD, [endpoint("eth0", State.NOT_READY)])
    assert failed is not None
    assert failed["status"]["health"]["overall"] == "Failure"


def test_an_update_keeps_the_stored_version_and_others_labels() -> None:
    want = fe.desired(POD, [endpoint("eth0")])
    assert want is not None
    stored = {
        **want,
        "metadata": {**want["metadata"], "resourceVersion": "41", "labels": {"x": "y"}},
    }
    assert not fe.up_to_date(stored, want)  # not marked as ours
    update = fe.update_of(stored, want)
    assert update["metadata"]["resourceVersion"] == "41"
    assert update["metadata"]["labels"] == {"x": "y", fe.MANAGED_BY[0]: fe.MANAGED_BY[1]}
    assert fe.up_to_date(update, want)
    moved = fe.desired(POD, [endpoint("eth0", identity=777)])
    assert moved is not None
    assert not fe.up_to_date(update, moved)


def test_the_endpoint_service_takes_the_kubernetes_and_leader_options() -> None:
    def load(*argv: str) -> EndpointConfig:
        return load_config(
            EndpointConfig, prog="e", env_prefix="FLAGELLA_ENDPOINT_", argv=argv, environ={}
        )

    assert load().kubeconfig == ""
    cfg = load("--kubeconfig", "in-cluster", "--leader-election-namespace", "kube-system")
    assert (cfg.kubeconfig, cfg.leader_election_namespace) == ("in-cluster", "kube-system")
    with pytest.raises(ConfigError) as err:
        load("--leader-lease-duration", "5", "--leader-renew-deadline", "6")
    assert err.value.option == "--leader-lease-duration"
