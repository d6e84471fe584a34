"""Kubernetes Services and EndpointSlices into flagella services.

With --kubeconfig PATH (or 'in-cluster'), the lb service lists and then
watches Services and EndpointSlices (discovery.k8s.io/v1) with the
`kubernetes` client, and keeps one flagella service per (cluster IP, port)
of every ClusterIP, NodePort and LoadBalancer Service, as Cilium makes one
frontend per (cluster IP, port):

    name      "<namespace>/<service>:<port name or number>", with
              ":ipv6"/":ipv4" after it for the second cluster IP of a
              dual-stack Service
    type      NodePort when the port has a nodePort (NodePort, LoadBalancer)
    backends  the addresses of the Service's EndpointSlices of that family,
              on the slice port of the same name and protocol:
              ready -> active; not ready but terminating -> terminating
              (keeps its connections, gets no new ones); otherwise left out
    affinity  sessionAffinity ClientIP with its timeoutSeconds
    ranges    loadBalancerSourceRanges
    algorithm the annotation flagella.io/lb-algorithm (random or maglev), else
              the configured default

Services written this way have source "kubernetes"; the gRPC API cannot
change or delete them, and the watcher touches no other. It uses
kubernetes.aio, the asyncio client shipped in the `kubernetes` package; a
watch that breaks or expires (410 Gone) ends in a fresh list.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flagella.common.errors import FlagellaError, InvalidArgument
from flagella.common.server import FatalError
from flagella.lb.model import Algorithm, BackendState, Protocol, ServiceSpec, ServiceType, Source
from flagella.lb.service import LbService
from flagella.lb.validation import (
    MAX_BATCH,
    Limits,
    RawBackend,
    RawService,
    build_spec,
    check_batch,
)

log = logging.getLogger(__name__)

ALGORITHM_ANNOTATION = "flagella.io/lb-algorithm"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 60  # the API server ends each watch call after this; we re-watch
Obj = Mapping[str, Any]


# --- translation (pure) ---


def _key(obj: Obj) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def slice_service(slice_obj: Obj) -> str | None:
    """The namespace/name of the Service an EndpointSlice belongs to."""
    meta = slice_obj.get("metadata") or {}
    svc = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
    return f"{meta.get('namespace', '')}/{svc}" if svc else None


def _backend_state(conditions: Obj) -> BackendState | None:
    ready = conditions.get("ready")
    serving = conditions.get("serving")
    terminating = bool(conditions.get("terminating"))
    # A nil ready/serving is to be read as true (discovery.k8s.io/v1).
    if ready is None:
        ready = not terminating if serving is None else bool(serving) and not terminating
    if ready:
        return BackendState.ACTIVE
    if terminating:
        return BackendState.TERMINATING
    return None


_STATE_RANK = {BackendState.ACTIVE: 0, BackendState.TERMINATING: 1}


def translate(
    svc: Obj, slices: Iterable[Obj], default_algorithm: Algorithm | None = None
) -> list[RawService]:
    """The flagella services (unvalidated) of one Kubernetes Service and its
    EndpointSlices."""
    meta = svc.get("metadata") or {}
    spec = svc.get("spec") or {}
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    k8s_type = spec.get("type", "ClusterIP")
    if k8s_type not in ("ClusterIP", "NodePort", "LoadBalancer"):
        return []
    cluster_ips = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")]) if ip]
    if not cluster_ips or cluster_ips[0] == "None":
        return []  # headless, or no IP yet
    annotation = (meta.get("annotations") or {}).get(ALGORITHM_ANNOTATION, "")
    algorithm = default_algorithm
    if annotation in ("random", "maglev"):
        algorithm = Algorithm(annotation)
    elif annotation:
        log.warning(
            "unknown lb algorithm annotation, using the default",
            extra={"service": f"{ns}/{name}", "value": annotation},
        )
    affinity = spec.get("sessionAffinity") == "ClientIP"
    timeout = None
    if affinity:
        t = ((spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}).get("timeoutSeconds")
        timeout = (int(t), 0) if t is not None else None
    ranges = list(spec.get("loadBalancerSourceRanges") or [])
    slices = list(slices)
    out: list[RawService] = []
    ports = spec.get("ports") or []
    for p in ports:
        proto_text = p.get("protocol", "TCP")
        if proto_text not in ("TCP", "UDP"):
            continue
        protocol = Protocol(proto_text)
        port_name = p.get("name") or ""
        label = port_name or str(p.get("port"))
        node_port = int(p.get("nodePort") or 0) if k8s_type != "ClusterIP" else 0
        for index, ip in enumerate(cluster_ips):
            family = "IPv6" if ":" in ip else "IPv4"
            flagella_name = f"{ns}/{name}:{label}"
            if index > 0:
                flagella_name += f":{family.lower()}"
            out.append(
                RawService(
                    name=flagella_name,
                    frontend_address=ip,
                    frontend_port=int(p.get("port") or 0),
                    protocol=protocol,
                    type=ServiceType.NODE_PORT if node_port else ServiceType.CLUSTER_IP,
                    node_port=node_port,
                    backends=_backends(slices, family, port_name, proto_text),
                    algorithm=algorithm,
                    client_ip_affinity=affinity,
                    affinity_timeout=timeout,
                    source_ranges=ranges,
                    source=Source.KUBERNETES,
                )
            )
    return out


def _backends(slices: list[Obj], family: str, port_name: str, protocol: str) -> list[RawBackend]:
    found: dict[tuple[str, int], RawBackend] = {}
    for sl in slices:
        if sl.get("addressType", "IPv4") != family:
            continue
        port = next(
            (
                sp.get("port")
                for sp in sl.get("ports") or []
                if (sp.get("name") or "") == port_name and sp.get("protocol", "TCP") == protocol
            ),
            None,
        )
        if not port:
            continue
        for ep in sl.get("endpoints") or []:
            state = _backend_state(ep.get("conditions") or {})
            if state is None:
                continue
            for addr in ep.get("addresses") or []:
                b = RawBackend(
                    address=addr, port=int(port), state=state, node=ep.get("nodeName") or ""
                )
                old = found.get((addr, int(port)))
                if old is None or _STATE_RANK[state] < _STATE_RANK[old.state or state]:
                    found[(addr, int(port))] = b
    return list(found.values())


# --- the watcher ---


@dataclass
class _Event:
    kind: str  # "services", "slices" or "retry"
    type: str  # ADDED, MODIFIED, DELETED, RELIST; for retry: the Service's key
    obj: Obj = field(default_factory=dict)
    items: list[Obj] = field(default_factory=list)


class KubernetesWatcher:
    """Lists then watches Services and EndpointSlices (kubernetes.aio, the
    asyncio flavour of the `kubernetes` client) and keeps the flagella
    services in step."""

    def __init__(self, service: LbService, kubeconfig: str, limits: Limits) -> None:
        self.service = service
        self.kubeconfig = kubeconfig
        self.limits = limits
        self._services: dict[str, Obj] = {}
        self._slices: dict[str, Obj] = {}
        # EndpointSlice keys by the Service they belong to.
        self._slices_of: dict[str, set[str]] = {}
        # Flagella names written for each Kubernetes Service.
        self._written: dict[str, set[str]] = {}
        self._synced = {"services": False, "slices": False}
        self._queue: asyncio.Queue[_Event] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._retry: dict[str, asyncio.TimerHandle] = {}
        self._api: Any = None
        self.initial_sync = asyncio.Event()

    async def _api_client(self) -> Any:
        # The client's functions are untyped: use them through Any.
        client: Any = importlib.import_module("kubernetes.aio.client")
        config: Any = importlib.import_module("kubernetes.aio.config")
        if self.kubeconfig == "in-cluster":
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        return await config.new_client_from_config(config_file=self.kubeconfig)

    async def start(self) -> None:
        client: Any = importlib.import_module("kubernetes.aio.client")
        try:
            self._api = await self._api_client()
        except Exception as exc:
            raise FatalError(f"cannot use --kubeconfig {self.kubeconfig}: {exc}") from exc
        core = client.CoreV1Api(self._api)
        discovery = client.DiscoveryV1Api(self._api)
        self._tasks = [
            asyncio.create_task(
                self._list_watch(
                    "services",
                    core.list_service_for_all_namespaces,
                    core.list_service_for_all_namespaces_without_preload_content,
                ),
                name="k8s-services",
            ),
            asyncio.create_task(
                self._list_watch(
                    "slices",
                    discovery.list_endpoint_slice_for_all_namespaces,
                    discovery.list_endpoint_slice_for_all_namespaces_without_preload_content,
                ),
                name="k8s-slices",
            ),
            asyncio.create_task(self._run(), name="k8s-sync"),
        ]
        log.info("watching kubernetes", extra={"kubeconfig": self.kubeconfig})

    async def stop(self) -> None:
        for handle in self._retry.values():
            handle.cancel()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._api is not None:
            with contextlib.suppress(Exception):
                await self._api.close()

    async def _list_watch(
        self, kind: str, fn: Callable[..., Any], raw_list: Callable[..., Any]
    ) -> None:
        """List, then watch from the list's resourceVersion, re-watching from
        the last one seen; any error (410 Gone included) relists, with
        backoff."""
        watch: Any = importlib.import_module("kubernetes.aio.watch")
        delay = 0.2
        while True:
            try:
                resp = await raw_list(_request_timeout=30)
                try:
                    if resp.status != 200:
                        raise RuntimeError(f"list answered HTTP {resp.status}")
                    doc = json.loads(await resp.read())
                finally:
                    resp.release()
                rv = (doc.get("metadata") or {}).get("resourceVersion", "")
                await self._queue.put(_Event(kind, "RELIST", items=doc.get("items") or []))
                delay = 0.2
                while True:
                    w = watch.Watch(return_type="object")
                    async with w.stream(
                        fn,
                        resource_version=rv,
                        allow_watch_bookmarks=True,
                        timeout_seconds=WATCH_TIMEOUT_S,
                        _request_timeout=WATCH_TIMEOUT_S + 30,
                    ) as stream:
                        async for ev in stream:
                            obj = ev.get("raw_object") or {}
                            new_rv = (obj.get("metadata") or {}).get("resourceVersion")
                            if new_rv:
                                rv = new_rv
                            if ev.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                                await self._queue.put(_Event(kind, ev["type"], obj=obj))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning(
                    "kubernetes list/watch failed, relisting",
                    extra={"kind": kind, "reason": f"{exc!r} {exc}"[:300], "retry_in_s": delay},
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _run(self) -> None:
        while True:
            ev = await self._queue.get()
            try:
                await self._handle(ev)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug must not stop the sync for good: log, and let the
                # next event (or the periodic re-watch) carry on.
                log.exception("kubernetes event not handled", extra={"kind": ev.kind})

    async def _handle(self, ev: _Event) -> None:
        affected: set[str] = set()
        if ev.kind == "retry":
            affected.add(ev.type)
        elif ev.kind == "services":
            if ev.type == "RELIST":
                affected |= set(self._services)
                self._services = {_key(o): o for o in ev.items}
                affected |= set(self._services)
                self._synced["services"] = True
            elif ev.type == "DELETED":
                self._services.pop(_key(ev.obj), None)
                affected.add(_key(ev.obj))
            else:
                self._services[_key(ev.obj)] = ev.obj
                affected.add(_key(ev.obj))
        elif ev.type == "RELIST":
            affected |= set(self._slices_of)
            self._slices.clear()
            self._slices_of.clear()
            for item in ev.items:
                self._put_slice(item)
            affected |= set(self._slices_of)
            self._synced["slices"] = True
        else:
            key = _key(ev.obj)
            prev = self._slices.get(key)
            for o in (prev, ev.obj):
                owner = slice_service(o) if o is not None else None
                if owner:
                    affected.add(owner)
            self._drop_slice(key)
            if ev.type != "DELETED":
                self._put_slice(ev.obj)
        if not all(self._synced.values()):
            return
        if not self.initial_sync.is_set():
            await self._initial_sync()
            return
        for key in sorted(affected):
            await self._sync_one(key)

    def _put_slice(self, obj: Obj) -> None:
        key = _key(obj)
        self._slices[key] = obj
        owner = slice_service(obj)
        if owner:
            self._slices_of.setdefault(owner, set()).add(key)

    def _drop_slice(self, key: str) -> None:
        obj = self._slices.pop(key, None)
        owner = slice_service(obj) if obj is not None else None
        if owner and owner in self._slices_of:
            self._slices_of[owner].discard(key)
            if not self._slices_of[owner]:
                del self._slices_of[owner]

    async def _initial_sync(self) -> None:
        """After the first lists: write every Service, and delete the
        kubernetes-sourced flagella services that no longer have one."""
        try:
            records, _ = await self.service.list_services()
        except FlagellaError as exc:
            log.warning("initial kubernetes sync failed, retrying", extra={"reason": exc.details})
            await asyncio.sleep(1.0)
            await self._queue.put(_Event("services", "RELIST", items=list(self._services.values())))
            return
        await self._write_batched(sorted(self._services))
        wanted = {n for names in self._written.values() for n in names}
        for rec in records:
            if rec.source is Source.KUBERNETES and rec.name not in wanted:
                await self._delete(rec.name)
        self.initial_sync.set()
        log.info("kubernetes services synced", extra={"services": len(self._services)})

    def _specs(self, key: str) -> dict[str, ServiceSpec]:
        svc = self._services.get(key)
        if svc is None:
            return {}
        slices = [self._slices[k] for k in sorted(self._slices_of.get(key, ()))]
        specs: dict[str, ServiceSpec] = {}
        for raw in translate(svc, slices, self.limits.default_algorithm):
            try:
                specs[raw.name] = build_spec(raw, self.limits)
            except InvalidArgument as exc:
                log.warning(
                    "kubernetes service not valid here, skipped",
                    extra={"service": raw.name, "reason": exc.details},
                )
        return specs

    async def _write_batched(self, keys: list[str]) -> None:
        """The initial sync's writes, many services per UpsertServices-like
        batch (thousands of Services arrive at once); a batch that is
        rejected as a whole falls back to one Service at a time, where each
        rejection is logged and retried as usual."""
        pending: list[tuple[str, dict[str, ServiceSpec]]] = []
        count = 0

        async def flush() -> None:
            specs = [spec for _, named in pending for spec in named.values()]
            try:
                check_batch(specs)
                await self.service.upsert_many(specs)
            except FlagellaError as exc:
                log.info(
                    "kubernetes batch not written whole, one by one",
                    extra={"services": len(specs), "reason": exc.details},
                )
                for key, _ in pending:
                    await self._sync_one(key)
            else:
                for key, named in pending:
                    if named:
                        self._written[key] = set(named)

        for key in keys:
            named = self._specs(key)
            if self._written.get(key, set()) - set(named):
                await self._sync_one(key)  # has names to delete: the careful path
                continue
            if pending and count + len(named) > MAX_BATCH:
                await flush()
                pending, count = [], 0
            pending.append((key, named))
            count += len(named)
        if pending:
            await flush()

    async def _sync_one(self, key: str) -> None:
        specs = self._specs(key)
        before = self._written.get(key, set())
        ok = True
        for name in sorted(before - set(specs)):
            ok &= await self._delete(name)
        written: set[str] = set()
        for name, spec in specs.items():
            try:
                await self.service.upsert(spec)
                written.add(name)
            except InvalidArgument as exc:
                log.warning(
                    "kubernetes service rejected", extra={"service": name, "reason": exc.details}
                )
            except FlagellaError as exc:
                ok = False
                written.add(name)  # may exist; retried below
                log.warning(
                    "kubernetes service not written, will retry",
                    extra={"service": name, "reason": exc.details},
                )
        if written:
            self._written[key] = written
        else:
            self._written.pop(key, None)
        if not ok:
            self._schedule_retry(key)

    async def _delete(self, name: str) -> bool:
        try:
            await self.service.delete(name, Source.KUBERNETES)
        except FlagellaError as exc:
            log.warning(
                "kubernetes service not deleted, will retry",
                extra={"service": name, "reason": exc.details},
            )
            return False
        return True

    def _schedule_retry(self, key: str, delay: float = 1.0) -> None:
        if key in self._retry:
            return
        loop = asyncio.get_running_loop()

        def fire() -> None:
            self._retry.pop(key, None)
            self._queue.put_nowait(_Event("retry", key))

        self._retry[key] = loop.call_later(delay, fire)
