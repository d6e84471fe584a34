"""A case of the ported Kubernetes NetworkPolicy suite on a flagella
cluster (tests/e2e/test_netpol_upstream.py): upstream's helpers
(CreatePolicy, UpdatePolicy, AddNamespaceLabel, AddPodLabels,
ValidateOrFail) on the stand-in API server, and the wait until what they
wrote is enforced: the rules stored in their new version (or gone), the
endpoints showing the new labels, then WaitForPolicy on every endpoint at
the policy service's revision."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf.duration_pb2 import Duration

from flagella.api.datapath.v1 import datapath_pb2
from flagella.api.endpoint.v1 import endpoint_pb2
from flagella.api.ipam.v1 import ipam_pb2
from flagella.api.policy.v1 import policy_pb2
from flagella.common import pki
from harness import netpol
from harness.cluster import Cluster, Node, kube_cluster
from harness.cni import check_result, cni, netconf
from harness.kube_api import ADMIN_POLICY_KINDS, POLICY_KINDS, KubeListWatchServer
from harness.netns import wait_until
from harness.netpol import ModelPod, Prober, Reachability

ENDPOINT = pki.service("endpoint")  # WaitForPolicy is the endpoint service's call
NAMESPACE_LABEL_PREFIX = "io.cilium.k8s.namespace.labels."
SETTLE_TIMEOUT_S = 20
RETRY_AFTER_S = 1.0


@dataclass
class Env:
    """The suite's cluster, node, stand-in API server, 9 pods and probers."""

    cluster: Cluster
    node: Node
    kube_api: KubeListWatchServer
    pods: dict[str, ModelPod]
    probers: dict[str, Prober]
    endpoint_ids: dict[str, int] = field(default_factory=dict)


def container_id(pod: str) -> str:
    return "ctr-" + pod.replace("/", "-")


def endpoint_of(env: Env, pod: str) -> endpoint_pb2.Endpoint:
    attachment = endpoint_pb2.Attachment(container_id=container_id(pod), ifname="eth0")
    return env.cluster.endpoint().GetEndpoint(
        endpoint_pb2.GetEndpointRequest(attachment=attachment), timeout=10
    )


def rule_name(policy: dict[str, Any]) -> str:
    """The rule of a policy object of any kind (NetworkPolicy when it says
    none; cluster-scoped kinds have no namespace)."""
    meta = policy["metadata"]
    kind = policy.get("kind", "NetworkPolicy")
    namespace = meta.get("namespace", "")
    return f"{kind}/{namespace}/{meta['name']}" if namespace else f"{kind}/{meta['name']}"


def resource_of(policy: dict[str, Any]) -> str:
    kind = policy.get("kind", "NetworkPolicy")
    return {**POLICY_KINDS, **ADMIN_POLICY_KINDS}[kind][0]


class Run:
    """What a case does, as upstream's helpers (CreatePolicy, UpdatePolicy,
    AddNamespaceLabel, AddPodLabels, ValidateOrFail), on the stand-in API
    server; validate waits until everything written is enforced."""

    def __init__(self, env: Env, case: str) -> None:
        self.env = env
        self.case = case
        self.policies: dict[str, dict[str, Any]] = {}  # rule name -> object
        self.rule_revisions: dict[str, int] = {}  # rule name -> revision to pass
        self.gone: set[str] = set()  # rule names to be deleted
        self.labels_changed: set[str] = set()  # namespaces and pods ("x/a")
        self.label_waits: list[Callable[[], bool]] = []
        self.rounds: list[str] = []

    # --- writes ---

    def create(self, policy: dict[str, Any]) -> None:
        name = rule_name(policy)
        self.rule_revisions[name] = self.rule_revision(name)
        self.gone.discard(name)
        self.policies[name] = policy
        self.env.kube_api.apply(resource_of(policy), policy)

    update = create

    def delete_policies(self) -> None:
        for name, policy in self.policies.items():
            meta = policy["metadata"]
            self.env.kube_api.delete(resource_of(policy), meta.get("namespace", ""), meta["name"])
            self.gone.add(name)
            self.rule_revisions.pop(name, None)
        self.policies.clear()

    def add_namespace_label(self, namespace: str, key: str, value: str) -> None:
        obj = self.env.kube_api.get("namespaces", "", namespace)
        assert obj is not None
        labels = {**obj["metadata"]["labels"], key: value}
        self.set_namespace_labels(namespace, labels)

    def set_namespace_labels(self, namespace: str, labels: dict[str, str]) -> None:
        self.labels_changed.add(namespace)
        self.env.kube_api.apply("namespaces", {"metadata": {"name": namespace, "labels": labels}})
        stored = self.env.kube_api.get("namespaces", "", namespace)
        assert stored is not None  # with the name label the API server adds
        want = {NAMESPACE_LABEL_PREFIX + k: v for k, v in stored["metadata"]["labels"].items()}
        for pod in self.env.pods:
            if pod.startswith(namespace + "/"):
                self.label_waits.append(self.shows(pod, want, NAMESPACE_LABEL_PREFIX))

    def add_pod_labels(self, pod: str, labels: dict[str, str]) -> None:
        namespace, name = pod.split("/")
        obj = self.env.kube_api.get("pods", namespace, name)
        assert obj is not None
        self.set_pod_labels(pod, {**obj["metadata"]["labels"], **labels})

    def set_pod_labels(self, pod: str, labels: dict[str, str]) -> None:
        namespace, name = pod.split("/")
        obj = self.env.kube_api.get("pods", namespace, name)
        assert obj is not None
        self.labels_changed.add(pod)
        obj["metadata"]["labels"] = labels
        self.env.kube_api.apply("pods", obj)
        self.label_waits.append(self.shows(pod, labels, ""))

    def shows(self, pod: str, labels: dict[str, str], prefix: str) -> Callable[[], bool]:
        """Whether the pod's endpoint has exactly these labels (those of
        its own, or those under prefix)."""

        def check() -> bool:
            have = endpoint_of(self.env, pod).labels
            if prefix:
                mine = {k: v for k, v in have.items() if k.startswith(prefix)}
            else:
                mine = {k: v for k, v in have.items() if "." not in k}
            return mine == labels

        return check

    def reset(self) -> None:
        """Delete the case's policies, put back the labels it changed, and
        wait until that is enforced."""
        self.delete_policies()
        for what in sorted(self.labels_changed):
            if "/" in what:
                self.set_pod_labels(what, netpol.pod_labels(what.split("/")[1]))
            else:
                self.set_namespace_labels(what, netpol.namespace_object(what)["metadata"]["labels"])
        self.labels_changed.clear()
        self.settle()

    # --- enforcement ---

    def rule_revision(self, name: str) -> int:
        rules = self.env.cluster.policy().ListRules(policy_pb2.ListRulesRequest(), timeout=10)
        return next((r.revision for r in rules.rules if r.name == name), 0)

    def rules_stored(self) -> int | None:
        """The policy service's revision once every rule written is stored
        in its new version and every deleted one is gone, else None."""
        resp = self.env.cluster.policy().ListRules(policy_pb2.ListRulesRequest(), timeout=10)
        have = {r.name: r.revision for r in resp.rules}
        if any(name in have for name in self.gone):
            return None
        if any(have.get(n, 0) <= old for n, old in self.rule_revisions.items()):
            return None
        return resp.revision

    def settle(self) -> None:
        """Until what was written is enforced on every endpoint."""
        waits, self.label_waits = self.label_waits, []
        for check in waits:
            assert wait_until(check, SETTLE_TIMEOUT_S), f"{self.case}: labels not followed"
        revision: int | None = None

        def stored() -> bool:
            nonlocal revision
            revision = self.rules_stored()
            return revision is not None

        if not wait_until(stored, SETTLE_TIMEOUT_S):
            events: list[str] = []
            for policy in self.policies.values():
                meta = policy["metadata"]
                about = self.env.kube_api.events_about(
                    policy.get("kind", "NetworkPolicy"), meta.get("namespace", ""), meta["name"]
                )
                events += [e["message"] for e in about]
            raise AssertionError(f"{self.case}: policies not stored; events: {events}")
        assert revision is not None
        self.rule_revisions = dict.fromkeys(self.rule_revisions, 0)
        self.gone.clear()
        dp = self.env.cluster.datapath(self.env.node, as_=ENDPOINT)
        for endpoint_id in self.env.endpoint_ids.values():
            req = datapath_pb2.WaitForPolicyRequest(
                endpoint_id=endpoint_id, min_revision=revision, timeout=Duration(seconds=20)
            )
            dp.WaitForPolicy(req, timeout=30)

    # --- probes ---

    def validate(self, port: int, proto: str, reach: Reachability) -> None:
        """ValidateOrFail: the 81 pairs probed on port/proto as reach says."""
        self.settle()
        t0 = time.monotonic()
        got = netpol.probe_all(self.env.probers, self.env.pods, proto, port)
        took = time.monotonic() - t0
        wrong = reach.mismatches(got.ok)
        retried = f" (retried: {len(wrong)} differed)" if wrong else ""
        if wrong:
            time.sleep(RETRY_AFTER_S)
            got = netpol.probe_all(self.env.probers, self.env.pods, proto, port)
            wrong = reach.mismatches(got.ok)
        self.rounds.append(f"{proto}/{port} {took:.2f}s{retried}")
        if wrong:
            details = "\n".join(f"  {f} -> {t}: {got.detail[(f, t)]}" for f, t in wrong)
            raise AssertionError(
                f"{self.case}: {proto}/{port}: {len(wrong)} of 72 pairs differ\n"
                f"{reach.tables(got.ok)}\n{details}"
            )


def add_pod(cluster: Cluster, node: Node, kube_api: KubeListWatchServer, pod: str) -> ModelPod:
    """The Pod on the API server, then its CNI ADD (labels read from there)."""
    namespace, name = pod.split("/")
    kube_api.apply("pods", netpol.pod_object(namespace, name, node.name, netpol.pod_labels(name)))
    ns = cluster.pod(node, f"{namespace}{name}")
    conf = netconf(node.cni_socket, kubernetes=True)
    rc, result = cni(
        "ADD", conf, container_id=container_id(pod), netns=ns.path, pod=(namespace, name)
    )
    assert rc == 0, result
    cidrs = cluster.ipam().GetNode(ipam_pb2.GetNodeRequest(name=node.name), timeout=10).pod_cidrs
    cidr = next(c for c in cidrs if ":" not in c)
    return ModelPod(pod, ns, check_result(result, netns=ns.path, ifname="eth0", pod_cidr=cidr))


@contextlib.contextmanager
def model_env(tmp: Path, namespaces: Mapping[str, dict[str, str]]) -> Iterator[tuple[Env, float]]:
    """The model's cluster (namespaces: their labels) with its 9 pods made
    through flagella-cni on one node, serving, and their probers; with the
    seconds the pods took."""
    with kube_cluster(tmp, dict(namespaces)) as (kube_api, cluster):
        node = cluster.add_node("n1")
        t0 = time.monotonic()
        pods = {p: add_pod(cluster, node, kube_api, p) for p in netpol.pod_strings()}
        for pod in pods.values():
            netpol.serve(pod)
        took = time.monotonic() - t0
        with netpol.probers(pods) as probers:
            env = Env(cluster, node, kube_api, pods, probers)
            env.endpoint_ids = {p: endpoint_of(env, p).id for p in pods}
            yield env, took
