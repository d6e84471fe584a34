"""The Kubernetes API as flagella's watchers use it: the options of a
service that follows the API server (KubeConfig), a client from
--kubeconfig (a path or 'in-cluster'), raw JSON requests (no model
objects: the kubernetes client's models are strict and slow, and the sync
layer reads JSON too), and Events on the objects a watcher reports.

The list/watch side is flagella.common.sync.kube; leader election,
flagella.common.leader.
"""

from __future__ import annotations

import datetime
import importlib
import json
import logging
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flagella.common.config import ServiceConfig, option
from flagella.common.errors import ConfigError

log = logging.getLogger(__name__)

# A cluster-scoped object's Events go here, as the API server's own do.
CLUSTER_EVENT_NAMESPACE = "default"


@dataclass(frozen=True)
class KubeConfig(ServiceConfig):
    """Options of a service that follows the Kubernetes API (with one
    leader per watcher among its replicas: flagella.common.leader)."""

    kubeconfig: str = option(
        "", "follow the Kubernetes API: a kubeconfig path, or 'in-cluster'; empty: off"
    )
    leader_election_namespace: str = option(
        "flagella", "namespace of the coordination.k8s.io Leases electing each watcher's leader"
    )
    leader_lease_duration: int = option(
        15, "seconds a leader's Lease lasts unrenewed before another replica takes over"
    )
    leader_renew_deadline: float = option(
        10.0, "seconds a leader keeps trying to renew its Lease before it stops leading"
    )
    leader_retry_period: float = option(2.0, "seconds between tries to acquire or renew a Lease")

    def validate(self) -> None:
        super().validate()
        # As client-go's leaderelection: the old leader stops before its
        # Lease can expire for the others.
        if self.leader_retry_period <= 0:
            raise ConfigError("--leader-retry-period", "must be positive")
        if self.leader_renew_deadline <= 1.2 * self.leader_retry_period:
            raise ConfigError(
                "--leader-renew-deadline", "must be more than 1.2 x --leader-retry-period"
            )
        if self.leader_lease_duration <= self.leader_renew_deadline:
            raise ConfigError(
                "--leader-lease-duration", "must be more than --leader-renew-deadline"
            )
        if not self.leader_election_namespace:
            raise ConfigError("--leader-election-namespace", "required")


def replica_identity() -> str:
    """This process among the replicas (a Lease's holderIdentity): the host
    (the pod's name in Kubernetes) and a random suffix, as client-go's
    users make it, so a restarted pod is a new holder."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


async def api_client(kubeconfig: str) -> Any:
    """A kubernetes.aio ApiClient (untyped: used through Any) for a
    kubeconfig path or 'in-cluster'. Raises whatever loading raises."""
    client: Any = importlib.import_module("kubernetes.aio.client")
    config: Any = importlib.import_module("kubernetes.aio.config")
    if kubeconfig == "in-cluster":
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)
    return await config.new_client_from_config(config_file=kubeconfig)


class KubeRequestError(Exception):
    """The API server answered a request with a status that is not 2xx."""

    def __init__(self, status: int, doc: Mapping[str, Any]) -> None:
        self.status = status
        self.reason = str(doc.get("reason") or "")
        super().__init__(f"HTTP {status} {self.reason}: {doc.get('message', '')}".strip())


async def request(
    api: Any, method: str, path: str, body: Mapping[str, Any] | None = None, *, timeout: float = 10
) -> Mapping[str, Any]:
    """One JSON request through the client's connection and credentials.
    Answers the JSON body of a 2xx; raises KubeRequestError for any other
    status, and the client's errors (aiohttp, OSError, TimeoutError) when
    the API server cannot be reached."""
    headers = {"Accept": "application/json"}
    if body is not None:
        headers["Content-Type"] = "application/json"
    params = await api.param_serialize(
        method=method,
        resource_path=path,
        header_params=headers,
        body=dict(body) if body is not None else None,
        auth_settings=["BearerToken"],
    )
    answer = await api.call_api(*params, _preload_content=False, _request_timeout=timeout)
    resp = answer.response
    try:
        raw = await resp.read()
        status = int(resp.status)
    finally:
        resp.release()
    doc: Mapping[str, Any] = json.loads(raw) if raw else {}
    if not 200 <= status < 300:
        raise KubeRequestError(status, doc)
    return doc


def now_rfc3339(micro: bool = False) -> str:
    """The time as the API writes it: Time ("...Z"), or MicroTime (six
    fractional digits, which the API server requires of a MicroTime)."""
    now = datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


class EventRecorder:
    """Creates core/v1 Events on objects (as client-go's recorder does,
    without its aggregation): what `kubectl describe` and `kubectl get
    events` show a user about the object they wrote."""

    def __init__(self, api: Any, component: str, instance: str) -> None:
        self.api = api
        self.component = component
        self.instance = instance
        self.created = 0
        self.failed = 0

    async def warning(self, obj: Mapping[str, Any], reason: str, message: str) -> bool:
        """A Warning Event on obj (as the API gave it). False when it could
        not be created (logged; an Event is best effort)."""
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace") or CLUSTER_EVENT_NAMESPACE
        now = now_rfc3339()
        involved = {
            "apiVersion": obj.get("apiVersion", ""),
            "kind": obj.get("kind", ""),
            "name": meta.get("name", ""),
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        }
        if meta.get("namespace"):
            involved["namespace"] = meta["namespace"]
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{meta.get('name', 'object')}.{uuid.uuid4().hex[:16]}"},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": "Warning",
            "source": {"component": self.component},
            "reportingComponent": self.component,
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await request(self.api, "POST", f"/api/v1/namespaces/{namespace}/events", event)
        except Exception as exc:
            self.failed += 1
            log.warning(
                "kubernetes event not created",
                extra={"object": involved, "reason": reason, "error": repr(exc)[:300]},
            )
            return False
        self.created += 1
        return True
