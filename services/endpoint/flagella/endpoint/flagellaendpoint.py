"""The FlagellaEndpoint object of a pod (flagella.io/v1, namespaced, named
as the pod), as CiliumEndpoint shows a pod's endpoint: its node, IPs,
identity (id and labels), state, the policy revision its datapath enforces
and its health. All of it is in `status` (no spec: nobody but the endpoint
service writes it; the CRD has no status subresource, so one create or
update writes the whole object). Its ownerReference is the Pod (by uid), so Kubernetes'
garbage collector deletes it with the pod; the label
app.kubernetes.io/managed-by=flagella-endpoint marks the objects the
endpoint service owns (and may delete when stale).

A pod with several endpoints (one per CNI attachment: ifname) has one
object: the identity, state and health of its primary endpoint (eth0, or
the first by interface name), the addresses of each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flagella.endpoint.labels import PodInfo
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.service import record_health

GROUP = "flagella.io"
VERSION = "v1"
PLURAL = "flagellaendpoints"
KIND = "FlagellaEndpoint"
API_VERSION = f"{GROUP}/{VERSION}"
MANAGED_BY = ("app.kubernetes.io/managed-by", "flagella-endpoint")
PRIMARY_IFNAME = "eth0"
# States of an endpoint on its way to ready (health "Pending", not "Failure").
SETTING_UP = (State.WAITING_FOR_IDENTITY, State.REGENERATING, State.RESTORING)


def collection_path(namespace: str) -> str:
    return f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"


def object_path(namespace: str, name: str) -> str:
    return f"{collection_path(namespace)}/{name}"


def primary(endpoints: Sequence[Endpoint]) -> Endpoint:
    return min(endpoints, key=lambda ep: (ep.ifname != PRIMARY_IFNAME, ep.ifname))


def health(ep: Endpoint) -> dict[str, str]:
    components = record_health(ep)
    if ep.state is State.READY and all(v == "ok" for v in components.values()):
        overall = "OK"
    elif ep.state in SETTING_UP:
        overall = "Pending"
    else:
        overall = "Failure"
    return {"overall": overall, **components}


def _addressing(ep: Endpoint) -> dict[str, str]:
    pair = {"interface": ep.ifname}
    for address in ep.addresses:
        ip = address.split("/")[0]
        pair.setdefault("ipv6" if ":" in ip else "ipv4", ip)
    return pair


def desired(pod: PodInfo, endpoints: Sequence[Endpoint]) -> dict[str, Any] | None:
    """The object the pod's endpoints should have; None: none (no endpoint)."""
    if not endpoints:
        return None
    ep = primary(endpoints)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {
            "name": pod.name,
            "namespace": pod.namespace,
            "labels": dict([MANAGED_BY]),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Pod", "name": pod.name, "uid": pod.uid}
            ],
        },
        "status": {
            "id": ep.id,
            "containerID": ep.container_id,
            "state": ep.state.value,
            "node": ep.node,
            "identity": {
                "id": ep.identity,
                "labels": sorted(f"k8s:{k}={v}" for k, v in ep.labels.items()),
            },
            "networking": {
                "addressing": [_addressing(e) for e in sorted(endpoints, key=lambda e: e.ifname)]
            },
            "policyRevision": ep.policy_revision,
            "health": health(ep),
        },
    }


def owned(obj: Mapping[str, Any]) -> bool:
    """Whether the endpoint service manages this object."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return bool(labels.get(MANAGED_BY[0]) == MANAGED_BY[1])


def up_to_date(stored: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    """Whether the stored object says what want says (what the endpoint
    service writes: its labels, owner and status)."""
    meta, want_meta = stored.get("metadata") or {}, want["metadata"]
    return bool(
        stored.get("status") == want["status"]
        and owned(stored)
        and meta.get("ownerReferences") == want_meta["ownerReferences"]
    )


def update_of(stored: Mapping[str, Any], want: Mapping[str, Any]) -> dict[str, Any]:
    """want as an update of stored (its resourceVersion, so the API server
    refuses it if the object changed meanwhile; the labels others set kept)."""
    meta = dict(stored.get("metadata") or {})
    meta["labels"] = {**(meta.get("labels") or {}), **want["metadata"]["labels"]}
    meta["ownerReferences"] = want["metadata"]["ownerReferences"]
    return {**want, "metadata": meta}
