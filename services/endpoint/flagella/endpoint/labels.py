"""An endpoint's identity labels from its Pod and Namespace, as Cilium
builds them (pkg/k8s/utils SanitizePodLabels):

- the pod's labels, less those only Cilium may set: io.cilium.k8s.policy.*
  (a pod cannot name its own service account), and, as Cilium strips them
  on pod updates, io.cilium.k8s.namespace.labels.* and
  io.kubernetes.pod.namespace (a pod cannot claim its namespace's labels);
- each label of its namespace as io.cilium.k8s.namespace.labels.<key>
  (kubernetes.io/metadata.name, which the API server gives every
  namespace, included);
- io.kubernetes.pod.namespace=<namespace>;
- io.cilium.k8s.policy.serviceaccount=<spec.serviceAccountName>, when set.

Cilium also adds io.cilium.k8s.policy.cluster=<cluster name>; flagella has
no cluster name (no cluster mesh), so it does not.

Pods and Namespaces are kept as the few fields used here (PodInfo,
NamespaceInfo): a cluster's pods in full would cost a replica far more
memory. One function builds the labels for CNI ADD (the objects read from
the API server) and for the watchers (the objects in their tables).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flagella.common.portnames import NamedPort, check_named_ports

NAMESPACE_LABEL = "io.kubernetes.pod.namespace"
NAMESPACE_LABELS_PREFIX = "io.cilium.k8s.namespace.labels."
POLICY_LABELS_PREFIX = "io.cilium.k8s.policy."
SERVICE_ACCOUNT_LABEL = POLICY_LABELS_PREFIX + "serviceaccount"


@dataclass(frozen=True, slots=True)
class PodInfo:
    namespace: str
    name: str
    uid: str
    resource_version: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    service_account: str = ""
    node: str = ""
    # The named ports of its containers (spec.containers[].ports[]).
    named_ports: tuple[NamedPort, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def as_object(self) -> dict[str, Any]:
        """Enough of the Pod to name it (an Event's involvedObject, an
        ownerReference)."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "namespace": self.namespace,
                "name": self.name,
                "uid": self.uid,
                "resourceVersion": self.resource_version,
            },
        }


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def _string_map(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items()}


def decode_pod(obj: Mapping[str, Any]) -> PodInfo | None:
    """The PodInfo of a Pod as the API gives it; None without a name."""
    meta = _metadata(obj)
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    if not meta.get("name"):
        return None
    return PodInfo(
        namespace=str(meta.get("namespace") or "default"),
        name=str(meta["name"]),
        uid=str(meta.get("uid") or ""),
        resource_version=str(meta.get("resourceVersion") or ""),
        labels=_string_map(meta.get("labels")),
        service_account=str(spec.get("serviceAccountName") or ""),
        node=str(spec.get("nodeName") or ""),
        named_ports=_named_ports(spec.get("containers")),
    )


def _named_ports(containers: Any) -> tuple[NamedPort, ...]:
    """The containers' ports that have a name, as the API server validated
    them (the first of a name twice); an entry that is not valid anyway is
    left out (a rule naming it then selects no port: closed, not open)."""
    items: list[tuple[str, int, str]] = []
    names: set[str] = set()
    for container in containers if isinstance(containers, list) else ():
        ports = container.get("ports") if isinstance(container, Mapping) else None
        for port in ports if isinstance(ports, list) else ():
            if not isinstance(port, Mapping) or not port.get("name"):
                continue
            number = port.get("containerPort")
            if not isinstance(number, int) or port["name"] in names:
                continue
            item = (str(port["name"]), number, str(port.get("protocol") or ""))
            if check_named_ports([item])[1]:
                continue
            names.add(item[0])
            items.append(item)
    ports_, _, _ = check_named_ports(items)
    return tuple(ports_)


def decode_namespace(obj: Mapping[str, Any]) -> NamespaceInfo | None:
    meta = _metadata(obj)
    if not meta.get("name"):
        return None
    return NamespaceInfo(str(meta["name"]), _string_map(meta.get("labels")))


def _reserved(key: str) -> bool:
    """A key only Cilium's (and flagella's) own code may set on an endpoint."""
    return (
        key.startswith(POLICY_LABELS_PREFIX)
        or key.startswith(NAMESPACE_LABELS_PREFIX)
        or key == NAMESPACE_LABEL
    )


def identity_labels(pod: PodInfo, namespace: NamespaceInfo) -> dict[str, str]:
    """The identity labels of the pod's endpoints (see the module's doc)."""
    labels = {k: v for k, v in pod.labels.items() if not _reserved(k)}
    for key, value in namespace.labels.items():
        labels[NAMESPACE_LABELS_PREFIX + key] = value
    labels[NAMESPACE_LABEL] = pod.namespace
    if pod.service_account:
        labels[SERVICE_ACCOUNT_LABEL] = pod.service_account
    return labels
