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
    external  externalTrafficPolicy (with healthCheckNodePort), and the
              externalIPs of the frontend's family

A LoadBalancer Service (loadBalancerClass unset or io.cilium/bgp-control-plane,
as Cilium's LB-IPAM) gets an LB-IPAM claim per flagella service: the
addresses of spec.loadBalancerIP or the annotation lbipam.cilium.io/ips of
that family, the annotation lbipam.cilium.io/sharing-key (or, without one,
a key of the Service's own, so that its ports share one address); the
addresses and the condition io.cilium/lb-ipam-request-satisfied are written
back to status.loadBalancer.ingress and status.conditions, and cleared when
the address goes.

Services written this way have source "kubernetes"; the gRPC API cannot
change or delete them, and the watcher touches no other. Every replica
follows the API; only the one holding the coordination.k8s.io Lease
"flagella-lb-services" writes (flagella.common.leader), and each new term
starts with a full sync against etcd. It uses
kubernetes.aio, the asyncio client shipped in the `kubernetes` package; a
watch that breaks or expires (410 Gone) ends in a fresh list.
"""

from __future__ import annotations

import asyncio
import importlib
import ipaddress
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from flagella.common.backoff import Backoff, retry
from flagella.common.errors import FlagellaError, InvalidArgument
from flagella.common.kubeapi import api_client
from flagella.common.leader import Election, LeaderElector
from flagella.common.server import FatalError
from flagella.common.sync import Batch, KubeSource, Table
from flagella.common.sync.dirty import DirtyKeys
from flagella.common.sync.kube import Obj
from flagella.common.sync.table import LOCAL_LOG_SIZE
from flagella.common.tasks import TaskGroup
from flagella.lb.bgpk8s import BgpKubeWatcher
from flagella.lb.lbipam import CONDITION_TYPE, Claimant, LbRequest
from flagella.lb.lbipam_store import Claim, LbIpam
from flagella.lb.lbpoolk8s import PoolKubeWatcher
from flagella.lb.lrpk8s import LrpKubeWatcher
from flagella.lb.model import (
    Algorithm,
    BackendState,
    Protocol,
    ServiceSpec,
    ServiceType,
    Source,
    TrafficPolicy,
)
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

R = TypeVar("R")

ALGORITHM_ANNOTATION = "flagella.io/lb-algorithm"
IPS_ANNOTATION = "lbipam.cilium.io/ips"
SHARING_KEY_ANNOTATION = "lbipam.cilium.io/sharing-key"
# loadBalancerClass values LB-IPAM assigns to (unset too), as Cilium's.
LB_CLASSES = ("io.cilium/bgp-control-plane",)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
WATCH_TIMEOUT_S = 60  # the API server ends each watch call after this; we re-watch
# The Lease electing the replica that writes (in --leader-election-namespace).
LEASE_NAME = "flagella-lb-services"


# --- translation (pure) ---


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
    policy = (
        TrafficPolicy.LOCAL
        if spec.get("externalTrafficPolicy") == "Local"
        else TrafficPolicy.CLUSTER
    )
    external_ips = [ip for ip in spec.get("externalIPs") or [] if isinstance(ip, str)]
    load_balancer = is_lbipam_service(svc)
    # The API server gives one to LoadBalancer Services of eTP Local.
    health_check = int(spec.get("healthCheckNodePort") or 0) if policy is TrafficPolicy.LOCAL else 0
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
                    labels=dict(meta.get("labels") or {}),
                    external_traffic_policy=policy,
                    # Those of the frontend's family: each cluster IP's
                    # service serves its own.
                    external_ips=[a for a in external_ips if (":" in a) == (family == "IPv6")],
                    load_balancer=load_balancer,
                    health_check_node_port=health_check,
                )
            )
    return out


def is_lbipam_service(svc: Obj) -> bool:
    """A LoadBalancer Service whose addresses LB-IPAM gives (its class
    unset or Cilium's)."""
    spec = svc.get("spec") or {}
    lb_class = spec.get("loadBalancerClass")
    return spec.get("type") == "LoadBalancer" and (not lb_class or lb_class in LB_CLASSES)


def lb_request(svc: Obj, family: int) -> LbRequest:
    """The LB-IPAM request of one family's flagella service of a
    LoadBalancer Service: spec.loadBalancerIP and the lbipam.cilium.io/ips
    annotation's addresses of that family (others are the other family's
    service's; a word that is no address is logged and skipped), its
    sharing key or, without one, the Service's own (its ports share an
    address)."""
    meta = svc.get("metadata") or {}
    annotations = meta.get("annotations") or {}
    wanted = [a.strip() for a in str(annotations.get(IPS_ANNOTATION, "")).split(",") if a.strip()]
    lb_ip = (svc.get("spec") or {}).get("loadBalancerIP")
    if lb_ip:
        wanted.insert(0, str(lb_ip))
    requested: list[str] = []
    for text in wanted:
        try:
            addr = ipaddress.ip_address(text)
        except ValueError:
            log.warning(
                "requested LoadBalancer address is not one, ignored",
                extra={"service": f"{meta.get('namespace')}/{meta.get('name')}", "value": text},
            )
            continue
        if addr.version == family and str(addr) not in requested:
            requested.append(str(addr))
    key = str(annotations.get(SHARING_KEY_ANNOTATION) or "")
    if not key:
        key = f"service:{meta.get('namespace', '')}/{meta.get('name', '')}"
    return LbRequest(tuple(requested[:1]), key, (family,))


def lb_status(claims: Iterable[Claim | None]) -> tuple[list[str], dict[str, str] | None]:
    """status.loadBalancer.ingress addresses and the condition (type,
    status, reason, message) of a Service from its flagella services'
    claims: satisfied when every one is; else the first one's reason."""
    addresses: list[str] = []
    condition: dict[str, str] | None = None
    for claim in claims:
        if claim is None:
            continue
        for a in claim.addresses:
            if a not in addresses:
                addresses.append(a)
        c = claim.condition
        if condition is None or (condition["status"] == "True" and not c.satisfied):
            condition = {
                "type": CONDITION_TYPE,
                "status": "True" if c.satisfied else "False",
                "reason": c.reason,
                "message": c.message,
            }
    addresses.sort(key=lambda a: (":" in a, ipaddress.ip_address(a)))
    return addresses, condition


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


class KubernetesWatcher:
    """Mirrors Services and EndpointSlices into two tables (each fed by a
    KubeSource: list, watch, relist on 410 Gone) and keeps the flagella
    services in step with them."""

    def __init__(
        self,
        service: LbService,
        kubeconfig: str,
        limits: Limits,
        lrps: LrpKubeWatcher | None = None,
        *,
        ipam: LbIpam | None = None,
        pools: PoolKubeWatcher | None = None,
        bgp: BgpKubeWatcher | None = None,
    ) -> None:
        self.service = service
        self.kubeconfig = kubeconfig
        self.limits = limits
        # CiliumLocalRedirectPolicies, written under the same Lease.
        self.lrps = lrps
        # LB-IPAM: LoadBalancer Services' claims and their status; and the
        # CiliumLoadBalancerIPPools, written under the same Lease.
        self.ipam = ipam
        self.pools = pools
        self._core: Any = None
        self._claims_seen = asyncio.Event()
        # CiliumBGPPeeringPolicies, written under the same Lease.
        self.bgp = bgp
        self.services: Table[str, Obj] = Table("k8s-services", log_size=LOCAL_LOG_SIZE)
        self.slices: Table[str, Obj] = Table("k8s-endpointslices", log_size=LOCAL_LOG_SIZE)
        # EndpointSlice keys by the Service they belong to, and the reverse,
        # as of the last batch of the slices' subscription.
        self._slices_of: dict[str, set[str]] = {}
        self._owner_of: dict[str, str] = {}
        # Flagella names written for each Kubernetes Service.
        self._written: dict[str, set[str]] = {}
        self._dirty = DirtyKeys()
        # Services whose sync failed: synced again after a backoff.
        self._failed: set[str] = set()
        self.retry_backoff = Backoff(1.0, 30.0)
        self._services_listed = asyncio.Event()
        self._slices_listed = asyncio.Event()
        self._api: Any = None
        self.elector: LeaderElector | None = None
        self.initial_sync = asyncio.Event()

    async def start(self, tasks: TaskGroup, election: Election) -> None:
        """Follow Services and EndpointSlices (every replica), and write
        flagella services while this replica holds the Lease LEASE_NAME."""
        client: Any = importlib.import_module("kubernetes.aio.client")
        try:
            self._api = await api_client(self.kubeconfig)
        except Exception as exc:
            raise FatalError(f"cannot use --kubeconfig {self.kubeconfig}: {exc}") from exc
        core = self._core = client.CoreV1Api(self._api)
        discovery = client.DiscoveryV1Api(self._api)
        services = KubeSource(
            "services",
            core.list_service_for_all_namespaces_without_preload_content,
            self.services,
            watch_timeout=WATCH_TIMEOUT_S,
        )
        slices = KubeSource(
            "endpointslices",
            discovery.list_endpoint_slice_for_all_namespaces_without_preload_content,
            self.slices,
            watch_timeout=WATCH_TIMEOUT_S,
        )
        tasks.spawn("k8s-services", services.run())
        if self.lrps is not None:
            tasks.spawn("k8s-lrps", self.lrps.source(self._api).run())
        if self.bgp is not None:
            tasks.spawn("k8s-bgp-policies", self.bgp.source(self._api).run())
        if self.pools is not None:
            tasks.spawn("k8s-lbippools", self.pools.source(self._api).run())
        if self.ipam is not None:
            # A claim that changes (a pool came, another service let its
            # address go; on any replica) has its Service's status written.
            tasks.spawn("lbipam-claims", self.ipam.run_claims())
            tasks.spawn(
                "lbipam-claims-follow",
                self._follow(self.ipam.claims_table, self._claims_changed, self._claims_seen),
            )
        tasks.spawn("k8s-endpointslices", slices.run())
        tasks.spawn(
            "k8s-services-follow",
            self._follow(self.services, self._services_changed, self._services_listed),
        )
        tasks.spawn(
            "k8s-endpointslices-follow",
            self._follow(self.slices, self._slices_changed, self._slices_listed),
        )
        # Only the leader writes; a bug in its sync ends its term (logged)
        # and the replicas elect again, so it never stops syncing for good.
        self.elector = election.elector(self._api, LEASE_NAME)
        tasks.spawn("k8s-leader", self.elector.run(self._lead))
        log.info(
            "watching kubernetes",
            extra={"kubeconfig": self.kubeconfig, "identity": election.identity},
        )

    async def stop(self) -> None:
        """After the tasks stopped: close the client's connections."""
        if self._api is not None:
            await self._api.close()

    # --- which Services to sync ---

    async def _follow(
        self,
        table: Table[str, R],
        changed: Callable[[Batch[str, R]], set[str]],
        listed: asyncio.Event,
    ) -> None:
        async for batch in table.subscribe():
            self._dirty.mark(changed(batch))
            listed.set()

    def _services_changed(self, batch: Batch[str, Obj]) -> set[str]:
        keys = {c.key for c in batch.changes}
        if batch.snapshot:
            # The whole table: Services written before and absent now are gone.
            keys |= set(self._written)
        return keys

    def _slices_changed(self, batch: Batch[str, Obj]) -> set[str]:
        """The Services whose EndpointSlices changed (those a slice left and
        those it joined); keeps the index of slices by Service."""
        affected: set[str] = set()
        if batch.snapshot:
            affected |= set(self._slices_of)
            self._slices_of.clear()
            self._owner_of.clear()
        for change in batch.changes:
            old = self._owner_of.pop(change.key, None)
            if old is not None:
                affected.add(old)
                keys = self._slices_of[old]
                keys.discard(change.key)
                if not keys:
                    del self._slices_of[old]
            new = slice_service(change.record) if change.record is not None else None
            if new is not None:
                affected.add(new)
                self._owner_of[change.key] = new
                self._slices_of.setdefault(new, set()).add(change.key)
        return affected

    def _claims_changed(self, batch: Batch[str, Claim]) -> set[str]:
        """The Services whose flagella services' claims changed (only those
        this watcher writes: names with a colon)."""
        return {_service_of(c.key) for c in batch.changes if ":" in c.key}

    # --- syncing them ---

    async def _lead(self) -> None:
        """A term's jobs: the services, the local redirect policies, the
        LB-IPAM pools and the BGP peering policies."""
        jobs = [self._sync_loop()]
        if self.lrps is not None:
            jobs.append(self.lrps.lead())
        if self.pools is not None:
            jobs.append(self.pools.lead())
        if self.bgp is not None:
            jobs.append(self.bgp.lead())
        await asyncio.gather(*jobs)

    async def _sync_loop(self) -> None:
        """The leader's job: sync everything, then what changes."""
        # A new term starts from what etcd holds, not from an old term's view.
        self._written.clear()
        self._failed.clear()
        self.retry_backoff.reset()
        await self._services_listed.wait()
        await self._slices_listed.wait()
        await retry(
            self._initial_sync,
            what="initial kubernetes sync",
            retry_on=(FlagellaError,),
            backoff=Backoff(1.0, 10.0),
        )
        await self._dirty.sync_forever(self._sync_key, self._failed, self.retry_backoff)

    async def _sync_key(self, key: str) -> bool:
        await self._sync_one(key)
        return key not in self._failed

    async def _initial_sync(self) -> None:
        """After the first lists: write every Service, and delete the
        kubernetes-sourced flagella services that no longer have one."""
        records, _ = await self.service.list_services()
        # Everything is synced now: what the lists marked is covered.
        self._dirty.clear()
        # What is stored counts as written: a name no Service makes any more
        # is deleted (and retried) as for a Service that changed.
        for rec in records:
            if rec.source is Source.KUBERNETES:
                self._written.setdefault(_service_of(rec.name), set()).add(rec.name)
        await self._write_batched(sorted(set(self.services.keys()) | set(self._written)))
        self.initial_sync.set()
        log.info("kubernetes services synced", extra={"services": len(self.services)})

    def _specs(self, key: str) -> dict[str, ServiceSpec]:
        svc = self.services.get(key)
        if svc is None:
            return {}
        slices = [
            obj
            for k in sorted(self._slices_of.get(key, ()))
            # A slice that moved to another Service since the index saw it
            # is left to the batch that moves it.
            if (obj := self.slices.get(k)) is not None and slice_service(obj) == key
        ]
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
                if self.ipam is not None:
                    for spec in specs:
                        await self.ipam.check_external_ips(spec.name, spec.external_frontends())
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
                    if not await self._sync_lb(key):
                        self._failed.add(key)

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
        """Write the flagella services of one Kubernetes Service and delete
        those it no longer makes; a failure marks it for a retry."""
        try:
            ok = await self._write_one(key)
        except Exception:
            # A bug must not stop the sync for good: log, and retry it.
            log.exception("kubernetes service not synced", extra={"service": key})
            ok = False
        if not ok:
            self._failed.add(key)

    async def _write_one(self, key: str) -> bool:
        specs = self._specs(key)
        before = self._written.get(key, set())
        ok = True
        for name in sorted(before - set(specs)):
            ok &= await self._delete(name)
        written: set[str] = set()
        for name, spec in specs.items():
            try:
                if self.ipam is not None:
                    await self.ipam.check_external_ips(name, spec.external_frontends())
                await self.service.upsert(spec)
                written.add(name)
            except InvalidArgument as exc:
                log.warning(
                    "kubernetes service rejected", extra={"service": name, "reason": exc.details}
                )
            except FlagellaError as exc:
                ok = False
                written.add(name)  # may exist; retried
                log.warning(
                    "kubernetes service not written, will retry",
                    extra={"service": name, "reason": exc.details},
                )
        if not ok:
            # Names not deleted yet stay, so that the retry deletes them.
            written |= before - set(specs)
        if written:
            self._written[key] = written
        else:
            self._written.pop(key, None)
        return await self._sync_lb(key) and ok

    async def _sync_lb(self, key: str) -> bool:
        """LB-IPAM of one Service: a claim per flagella service while it is
        a LoadBalancer Service of ours (released when not), and its status
        written back. False: to be retried."""
        if self.ipam is None:
            return True
        svc = self.services.get(key)
        ours = svc is not None and is_lbipam_service(svc)
        names = self._written.get(key, set())
        if (
            not ours
            and not any(self.ipam.claims_table.get(n) is not None for n in names)
            and (svc is None or _our_condition(svc) is None)
        ):
            return True  # nothing of LB-IPAM's (most Services): no work
        specs = self._specs(key) if svc is not None else {}
        claims: list[Claim | None] = []
        try:
            for name in sorted(names & set(specs)):
                spec = specs[name]
                if ours:
                    assert svc is not None
                    ports = frozenset({(spec.frontend.protocol.value, spec.frontend.port)})
                    who = Claimant(
                        name,
                        spec.namespace,
                        dict(spec.labels),
                        ports,
                        lb_request(svc, spec.frontend.family),
                    )
                    claims.append(await self.ipam.claim(who))
                elif self.ipam.claims_table.get(name) is not None:
                    await self.ipam.release(name)
        except FlagellaError as exc:
            log.warning(
                "LB-IPAM claim of a kubernetes service not made, will retry",
                extra={"service": key, "reason": exc.details},
            )
            return False
        if svc is None:
            return True
        if ours:
            return await self._write_status(svc, *lb_status(claims))
        if _our_condition(svc) is None:
            return True
        if (svc.get("spec") or {}).get("type") != "LoadBalancer":
            return await self._write_status(svc, [], None)  # no longer one: cleared
        # Now another implementation's class: our condition goes, its
        # addresses are its own to write.
        return await self._write_status(svc, None, None)

    async def _write_status(
        self, svc: Obj, addresses: list[str] | None, condition: dict[str, str] | None
    ) -> bool:
        """Merge-patch the Service's status.loadBalancer.ingress (None: left
        as it is) and our condition in status.conditions (others kept) when
        they differ."""
        meta = svc.get("metadata") or {}
        status = svc.get("status") or {}
        ingress = (status.get("loadBalancer") or {}).get("ingress") or []
        have = [str(i.get("ip")) for i in ingress if isinstance(i, dict)]
        want = have if addresses is None else addresses
        old = _our_condition(svc)
        same_condition = (old is None and condition is None) or (
            old is not None
            and condition is not None
            and all(old.get(k) == v for k, v in condition.items())
        )
        if have == want and same_condition:
            return True
        others = [
            c
            for c in status.get("conditions") or []
            if isinstance(c, dict) and c.get("type") != CONDITION_TYPE
        ]
        if condition is not None:
            changed = old is None or old.get("status") != condition["status"]
            stamp = (
                time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                if changed
                else old.get("lastTransitionTime")
                if old is not None
                else None
            )
            others.append({**condition, "lastTransitionTime": stamp})
        body: dict[str, Any] = {"status": {"conditions": others or None}}
        if want != have:
            body["status"]["loadBalancer"] = {"ingress": [{"ip": a} for a in want] or None}
        try:
            await self._core.patch_namespaced_service_status(
                meta.get("name", ""),
                meta.get("namespace", ""),
                body,
                _content_type="application/merge-patch+json",
                _request_timeout=10,
            )
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return True  # gone meanwhile
            log.warning(
                "LoadBalancer status not written, will retry",
                extra={
                    "service": f"{meta.get('namespace')}/{meta.get('name')}",
                    "reason": str(exc)[:200],
                },
            )
            return False
        log.info(
            "LoadBalancer status written",
            extra={"service": f"{meta.get('namespace')}/{meta.get('name')}", "ingress": want},
        )
        return True

    async def _delete(self, name: str) -> bool:
        try:
            await self.service.delete(name, Source.KUBERNETES)
            if self.ipam is not None:
                await self.ipam.release(name)
        except FlagellaError as exc:
            log.warning(
                "kubernetes service not deleted, will retry",
                extra={"service": name, "reason": exc.details},
            )
            return False
        return True


def _our_condition(svc: Obj) -> dict[str, Any] | None:
    for c in (svc.get("status") or {}).get("conditions") or []:
        if isinstance(c, dict) and c.get("type") == CONDITION_TYPE:
            return c
    return None


def _service_of(name: str) -> str:
    """The Kubernetes Service ("namespace/name") of a flagella name this
    watcher writes ("namespace/name:port[:family]"; Kubernetes names have no
    colon)."""
    return name.split(":", 1)[0]
