"""The endpoint service and the Kubernetes API (--kubeconfig PATH|in-cluster).

Reads:
- at CNI ADD, the pod and its namespace (two GETs, at once: KubeReader), so
  that a pod starts with its identity (flagella.endpoint.labels);
- Pods (every namespace; the service is cluster-wide, so no field selector
  on spec.nodeName), Namespaces and FlagellaEndpoints, each into a table
  through the sync layer's KubeSource (paged list, watch from the
  resourceVersion with bookmarks, relist on 410 Gone swapped in as a diff),
  and the endpoints of etcd into a table (EtcdSource), on every replica.

Writes, only while this replica holds the Lease flagella-endpoint-pods
(flagella.common.leader), per pod (level-triggered, DirtyKeys; up to
SYNC_CONCURRENCY pods at once, one pod never twice at once):
- labels: each ready endpoint whose labels came from Kubernetes and differ
  from what its Pod and Namespace now say changes identity through
  EndpointService.patch_labels (new identity, datapath endpoint, ipcache,
  policy realized, old identity released; rolled back on failure). A
  failure is retried with a backoff and reported as a Warning Event on the
  pod (reason IdentityChangeFailed);
- the pod's FlagellaEndpoint (flagella.endpoint.flagellaendpoint): created,
  updated (at the resourceVersion it has, so a concurrent writer costs a
  retry, not a lost update) or deleted when the pod's endpoints go. A term
  starts with every pod that has an endpoint and every FlagellaEndpoint,
  so objects an earlier run left behind are removed.

The API server away: endpoints keep their identities (nothing changes in
etcd or the datapaths); the health service name flagella.kubernetes
answers NOT_SERVING until the watchers have listed again, and what changed
meanwhile is synced then.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from flagella.common.backoff import Backoff
from flagella.common.errors import FlagellaError, NotFound, Unavailable
from flagella.common.etcd import Etcd
from flagella.common.kubeapi import EventRecorder, KubeRequestError, api_client, request
from flagella.common.kubestatus import StatusReport, report_liveness
from flagella.common.leader import Election, LeaderElector
from flagella.common.portnames import NamedPort
from flagella.common.sync import KubeSource, Table
from flagella.common.sync.dirty import DirtyKeys
from flagella.common.sync.kube import Obj
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.endpoint import flagellaendpoint as fe
from flagella.endpoint.labels import (
    NamespaceInfo,
    PodInfo,
    decode_namespace,
    decode_pod,
    identity_labels,
)
from flagella.endpoint.model import Endpoint, State
from flagella.endpoint.service import EndpointService

log = logging.getLogger(__name__)

LEASE_NAME = "flagella-endpoint-pods"
COMPONENT = "flagella-endpoint"
RELABEL_FAILED = "IdentityChangeFailed"
WATCH_TIMEOUT_S = 60  # the API server ends each watch call after this; we re-watch
# Pods synced at once: a namespace relabel moves all its pods' endpoints
# together, each waiting for its node to realize its new policy.
SYNC_CONCURRENCY = 16


class KubeReader:
    """CNI ADD's labels: the pod and its namespace, read from the API server
    when the ADD comes (its api is set once the service has a client)."""

    def __init__(self) -> None:
        self.api: Any = None

    async def labels(self, namespace: str, name: str) -> tuple[dict[str, str], list[NamedPort]]:
        pod_doc, ns_doc = await asyncio.gather(
            self._get(f"/api/v1/namespaces/{namespace}/pods/{name}", "pod_name"),
            self._get(f"/api/v1/namespaces/{namespace}", "pod_namespace"),
        )
        pod, ns = decode_pod(pod_doc), decode_namespace(ns_doc)
        if pod is None or ns is None:
            raise Unavailable(f"kubernetes: pod {namespace}/{name} or its namespace unreadable")
        return identity_labels(pod, ns), list(pod.named_ports)

    async def _get(self, path: str, field: str) -> Obj:
        if self.api is None:
            raise Unavailable("kubernetes: not connected yet")
        try:
            return await request(self.api, "GET", path)
        except KubeRequestError as exc:
            if exc.status == 404:
                raise NotFound(f"{path} not found in Kubernetes", field=field) from exc
            raise Unavailable(f"kubernetes: {exc}") from exc
        except Exception as exc:  # unreachable: OSError, TimeoutError, aiohttp's
            raise Unavailable(f"kubernetes: {exc!r}") from exc


def pod_key(ep: Endpoint) -> str | None:
    return f"{ep.pod_namespace}/{ep.pod_name}" if ep.pod_name else None


class EndpointWatchers:
    """A replica's tables of Pods, Namespaces, FlagellaEndpoints and
    endpoints and, while it leads, the sync of labels and FlagellaEndpoints."""

    def __init__(
        self,
        service: EndpointService,
        etcd: Etcd,
        kubeconfig: str,
        endpoints: Table[str, Endpoint],
        reader: KubeReader | None = None,
    ) -> None:
        self.service = service
        self.etcd = etcd
        self.kubeconfig = kubeconfig
        # The service's, for CNI ADD: it shares the client made by connect().
        self.reader = reader or KubeReader()
        self.pods: Table[str, PodInfo] = Table("k8s-pods", log_size=LOCAL_LOG_SIZE)
        self.namespaces: Table[str, NamespaceInfo] = Table(
            "k8s-namespaces", log_size=LOCAL_LOG_SIZE
        )
        self.objects: Table[str, Obj] = Table("k8s-flagellaendpoints", log_size=LOCAL_LOG_SIZE)
        # etcd's endpoints: the app's table (fed on every replica, with or
        # without Kubernetes).
        self.endpoints = endpoints
        # pod key -> the keys of its endpoints in self.endpoints, and back
        # (the endpoints table keeps no records before a change).
        self.by_pod: dict[str, set[str]] = {}
        self.pod_of: dict[str, str] = {}
        self.dirty = DirtyKeys()
        self.retry_backoff = Backoff(0.2, 10.0)
        self.elector: LeaderElector | None = None
        self.events: EventRecorder | None = None
        self.synced = asyncio.Event()  # set once a term's sync has written everything
        # Counters, for tests and status.
        self.relabels = 0
        self.relabel_failures = 0
        self.writes = 0
        # The objects this term wrote, until the watch shows them.
        self._written: dict[str, Obj] = {}
        # The pod resourceVersion each failure was reported at: one Event
        # per version of the pod, however often the change is retried.
        self._reported: dict[str, str] = {}

    async def connect(self) -> None:
        """The API client (raises whatever loading the kubeconfig raises)."""
        self.reader.api = await api_client(self.kubeconfig)

    def start(
        self, tasks: TaskGroup, election: Election, report: StatusReport | None = None
    ) -> None:
        api = self.reader.api
        client: Any = importlib.import_module("kubernetes.aio.client")
        core, custom = client.CoreV1Api(api), client.CustomObjectsApi(api)
        self.events = EventRecorder(api, COMPONENT, election.identity)
        sources: dict[str, KubeSource[Any]] = {
            "pods": KubeSource(
                "pods", core.list_pod_for_all_namespaces_without_preload_content, self.pods,
                decode=decode_pod, watch_timeout=WATCH_TIMEOUT_S,
            ),
            "namespaces": KubeSource(
                "namespaces", core.list_namespace_without_preload_content, self.namespaces,
                decode=decode_namespace, watch_timeout=WATCH_TIMEOUT_S,
            ),
            fe.PLURAL: KubeSource(
                fe.PLURAL,
                functools.partial(
                    custom.list_cluster_custom_object_without_preload_content,
                    fe.GROUP, fe.VERSION, fe.PLURAL,
                ),
                self.objects, watch_timeout=WATCH_TIMEOUT_S,
            ),
        }  # fmt: skip
        for name, source in sources.items():
            tasks.spawn(f"k8s-{name}", source.run())
        tasks.spawn("k8s-follow-pods", self._follow(self.pods, lambda k: {k}))
        tasks.spawn("k8s-follow-namespaces", self._follow(self.namespaces, self._pods_in))
        tasks.spawn("k8s-follow-objects", self._follow(self.objects, lambda k: {k}))
        tasks.spawn("k8s-follow-endpoints", self._follow_endpoints())
        self.elector = election.elector(api, LEASE_NAME)
        tasks.spawn("k8s-endpoint-leader", self.elector.run(self.lead))
        if report is not None:
            tables: list[tuple[str, Table[str, Any]]] = [
                ("pods", self.pods), ("namespaces", self.namespaces), (fe.PLURAL, self.objects),
            ]  # fmt: skip
            tasks.spawn("k8s-status", report_liveness(tables, report))
        log.info("following pods and namespaces", extra={"identity": election.identity})

    async def stop(self) -> None:
        """After the tasks stopped: close the client's connections."""
        if self.reader.api is not None:
            await self.reader.api.close()

    # --- what to look at ---

    def _mark(self, pods: Iterable[str]) -> None:
        # Only while leading: a term starts by looking at everything, and a
        # follower's marks would pile up with every pod the cluster runs.
        if self.elector is not None and self.elector.is_leader:
            self.dirty.mark(pods)

    def _mark_all(self) -> None:
        self._mark({*self.by_pod, *self.objects.keys()})

    async def _follow(self, table: Table[str, Any], pods: Callable[[str], Iterable[str]]) -> None:
        async for batch in table.subscribe():
            if batch.snapshot:
                # The whole table (this follower fell behind): what it
                # lacks went unseen, so look at everything.
                self._mark_all()
            for change in batch.changes:
                self._mark(pods(change.key))

    def _pods_in(self, namespace_key: str) -> set[str]:
        """The pods with endpoints in a namespace (its key "/<name>")."""
        prefix = namespace_key.lstrip("/") + "/"
        return {k for k in self.by_pod if k.startswith(prefix)}

    async def _follow_endpoints(self) -> None:
        async for batch in self.endpoints.subscribe():
            if batch.snapshot:
                self._mark_all()  # the pods whose endpoints went unseen
                self.by_pod.clear()
                self.pod_of.clear()
            for change in batch.changes:
                key = change.key
                old = self.pod_of.pop(key, None)
                if old is not None:
                    keys = self.by_pod[old]
                    keys.discard(key)
                    if not keys:
                        del self.by_pod[old]
                    self._mark([old])
                pod = pod_key(change.record) if change.record is not None else None
                if pod is not None:
                    self.pod_of[key] = pod
                    self.by_pod.setdefault(pod, set()).add(key)
                    self._mark([pod])

    def endpoints_of(self, pod: str) -> list[Endpoint]:
        found = (self.endpoints.get(k) for k in self.by_pod.get(pod, ()))
        return [ep for ep in found if ep is not None]

    # --- the leader ---

    async def lead(self) -> None:
        """Once pods, namespaces and endpoints are listed: every pod with an
        endpoint and every FlagellaEndpoint, then what changes. (Labels do
        not wait for FlagellaEndpoints: without their CRD, identities still
        follow the pods; the objects are synced once they are listed.)"""
        self.synced.clear()
        self.retry_backoff.reset()
        self._written.clear()
        self._reported.clear()
        for table in (self.pods, self.namespaces, self.endpoints):
            await table.wait_initialized()
        self._mark_all()
        log.info(
            "kubernetes endpoint sync",
            extra={"pods": len(self.by_pod), "objects": len(self.objects)},
        )
        await self.dirty.sync_forever(
            self._sync, set(), self.retry_backoff, self.synced.set, concurrency=SYNC_CONCURRENCY
        )

    async def _sync(self, key: str) -> bool:
        """The pod at key: its endpoints' labels, then its FlagellaEndpoint.
        False: to be tried again."""
        labelled = await self._sync_labels(key)
        return await self._sync_object(key) and labelled

    async def _sync_labels(self, key: str) -> bool:
        pod = self.pods.get(key)
        ns = self.namespaces.get(f"/{pod.namespace}") if pod is not None else None
        if pod is None or ns is None:
            return True  # nothing to follow (a deleted pod's endpoints go with CNI DEL)
        want = identity_labels(pod, ns)
        ok = await self._sync_named_ports(pod)
        for ep in self.endpoints_of(key):
            if not ep.labels_from_kubernetes or ep.state is not State.READY or ep.labels == want:
                continue
            try:
                moved = await self.service.patch_labels(ep.id, want, from_kubernetes=True)
            except NotFound:
                continue  # deleted meanwhile
            except FlagellaError as exc:
                ok = False
                await self._relabel_failed(pod, ep, exc)
                continue
            self.relabels += 1
            self._reported.pop(key, None)
            log.info(
                "endpoint follows its pod's labels",
                extra={"endpoint": ep.id, "pod": key, "identity": moved.identity},
            )
        return ok

    async def _sync_named_ports(self, pod: PodInfo) -> bool:
        """The named ports of the pod's endpoints follow its spec."""
        want = sorted(pod.named_ports)
        ok = True
        for ep in self.endpoints_of(pod.key):
            if not ep.labels_from_kubernetes or ep.state is not State.READY:
                continue
            if ep.named_ports == want:
                continue
            try:
                await self.service.patch_named_ports(ep.id, want)
            except NotFound:
                continue
            except FlagellaError as exc:
                ok = False
                log.warning(
                    "endpoint named ports not changed, will retry",
                    extra={"endpoint": ep.id, "pod": pod.key, "reason": exc.details},
                )
                continue
            log.info(
                "endpoint follows its pod's named ports",
                extra={"endpoint": ep.id, "pod": pod.key, "ports": [p.name for p in want]},
            )
        return ok

    async def _relabel_failed(self, pod: PodInfo, ep: Endpoint, exc: FlagellaError) -> None:
        self.relabel_failures += 1
        log.warning(
            "endpoint identity not changed, will retry",
            extra={"endpoint": ep.id, "pod": pod.key, "reason": exc.details},
        )
        if self.events is not None and self._reported.get(pod.key) != pod.resource_version:
            self._reported[pod.key] = pod.resource_version
            message = f"endpoint {ep.id} keeps identity {ep.identity}: {exc.details}"
            await self.events.warning(pod.as_object(), RELABEL_FAILED, message)

    def _stored(self, key: str) -> Obj | None:
        """The object as the table has it, or as this term last wrote it if
        the watch has not shown that yet (a later resourceVersion wins)."""
        seen, wrote = self.objects.get(key), self._written.get(key)
        if wrote is None or (seen is not None and _version(seen) >= _version(wrote)):
            return seen
        return wrote

    async def _sync_object(self, key: str) -> bool:
        if not self.objects.initialized.is_set():
            return True  # its first list marks every pod again
        namespace, _, name = key.partition("/")
        pod = self.pods.get(key)
        want = fe.desired(pod, self.endpoints_of(key)) if pod is not None else None
        stored = self._stored(key)
        try:
            if want is None:
                if stored is None or not fe.owned(stored):
                    return True
                self._written.pop(key, None)
                await self._request("DELETE", fe.object_path(namespace, name))
                log.info("flagellaendpoint deleted", extra={"pod": key})
                return True
            if stored is None:
                wrote = await self._request("POST", fe.collection_path(namespace), want)
            elif not fe.up_to_date(stored, want):
                body = fe.update_of(stored, want)
                wrote = await self._request("PUT", fe.object_path(namespace, name), body)
            else:
                return True
        except Exception as exc:  # the API server's answer, or none (unreachable)
            if isinstance(exc, KubeRequestError) and exc.status == 404 and want is None:
                return True  # gone already (with its pod, or by an earlier delete)
            # 409: someone wrote it first; the table shows it by the retry.
            self._written.pop(key, None)
            log.info(
                "flagellaendpoint not written, will retry",
                extra={"pod": key, "error": repr(exc)[:300]},
            )
            return False
        self._written[key] = wrote
        return True

    async def _request(
        self, method: str, path: str, body: Mapping[str, Any] | None = None
    ) -> Mapping[str, Any]:
        answer = await request(self.reader.api, method, path, body)
        self.writes += 1
        return answer


def _version(obj: Obj) -> int:
    version = str((obj.get("metadata") or {}).get("resourceVersion") or "")
    return int(version) if version.isdigit() else 0
