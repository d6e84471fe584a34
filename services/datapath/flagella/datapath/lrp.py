"""Local redirect policies on this node (Cilium's CiliumLocalRedirectPolicy).

The lb service streams the policies (WatchLrps) and the services
(WatchServices); this node picks its own backends: the local endpoints
whose labels (their identity's, from the policy service) the policy's
selector selects, in the policy's namespace. LocalRedirects sits between
the services table and the services reconciler and desires:

- serviceMatcher: the named service (each of its lb services
  `namespace/name` and `namespace/name:<port>`) with its backends replaced
  by the local ones, same service and rev-NAT ids (replies come from the
  ClusterIP); no local backend: the service as the lb has it;
- addressMatcher: a service of this node's own (ids from LOCAL_ID_BASE up,
  beyond every id the lb hands out) per frontend port, the address to the
  local backends; no local backend: nothing, the address is reached as it
  is.

Local backends get backend ids of this node's own (LOCAL_ID_BASE up, which
the lb never hands out); a backend no redirect uses any more is removed,
with its conntrack entries, once the maps no longer point at it.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from flagella.common.backoff import Backoff
from flagella.common.reconcile import Reconciler
from flagella.datapath.bpf import Backend, Frontend, Service
from flagella.datapath.lrpcodec import Port, Redirect, backend_port

log = logging.getLogger(__name__)

# Service, rev-NAT and backend ids of this node's own: the lb's service and
# rev-NAT ids are below 2**16 (NodePort frontends add index << 24 for
# index < 255), its backend ids below this (flagella.lb.ids).
LOCAL_ID_BASE = 0xFF000000
LOCAL_ID_MAX = 0xFFFFFFFE

FrontendKey = tuple[str, int, int]  # (address, port, protocol)
K = TypeVar("K")
V = TypeVar("V")


@dataclass(frozen=True)
class LocalEndpoint:
    addresses: tuple[str, ...]  # bare IPs
    labels: Mapping[str, str]


def _service_name(name: str) -> tuple[str, str]:
    """("namespace/service", port name) of an lb service's name: the
    Kubernetes watcher names them namespace/service:port (:ipv4/:ipv6 after
    it for a dual-stack Service's second cluster IP)."""
    base, _, port = name.partition(":")
    return base, port.partition(":")[0]


class LocalRedirects:
    """The services table's Target (services_target) and the policies
    table's (lrps_target), desiring the services reconciler's state: the
    lb's services, redirected where a policy and a local backend say so."""

    def __init__(self, target: Reconciler[int, Service]) -> None:
        self.target = target
        self.base: dict[int, Service] = {}
        # "namespace/service" -> the ids of its lb services.
        self._by_name: dict[str, set[int]] = {}
        # Frontends of the lb's services (an address matcher never takes one).
        self._frontends: dict[FrontendKey, int] = {}
        self.redirects: dict[str, Redirect] = {}
        self.endpoints: tuple[LocalEndpoint, ...] = ()
        # What the redirects desire now: lb service ids with their local
        # backends, and this node's own services.
        self.pushed: dict[int, Service] = {}
        self._local_services: dict[tuple[str, int], int] = {}
        self._local_backends: dict[tuple[str, int, int], int] = {}
        # Address matchers' frontends that a service has (logged once).
        self._blocked: set[tuple[str, FrontendKey]] = set()
        # Local backend ids no redirect uses any more, to remove.
        self.released: set[int] = set()
        self.changed = asyncio.Event()
        self.services_target = _Target(self, self.replace_services, self.set_service)
        self.lrps_target = _Target(self, self.replace_lrps, self.set_lrp)

    @property
    def revision(self) -> int:
        return self.target.revision

    # --- the lb's services ---

    def _index(self, key: int, svc: Service | None) -> None:
        old = self.base.pop(key, None)
        if old is not None:
            self._by_name.get(_service_name(old.name)[0], set()).discard(key)
            for fe in old.frontends:
                if self._frontends.get((fe.address, fe.port, fe.protocol)) == key:
                    del self._frontends[(fe.address, fe.port, fe.protocol)]
        if svc is not None:
            self.base[key] = svc
            self._by_name.setdefault(_service_name(svc.name)[0], set()).add(key)
            for fe in svc.frontends:
                self._frontends[(fe.address, fe.port, fe.protocol)] = key

    def replace_services(self, items: dict[int, Service]) -> int:
        self.base, self._by_name, self._frontends = {}, {}, {}
        for key, svc in items.items():
            self._index(key, svc)
        self._compute()
        return self.target.replace_all({**self.base, **self.pushed})

    def set_service(self, key: int, svc: Service | None) -> int:
        was = self.base.get(key)
        self._index(key, svc)
        if key in self.pushed or any(self._touches(s) for s in (was, svc) if s is not None):
            self._recompute()
        if key not in self.pushed:
            if svc is None:
                self.target.delete(key)
            else:
                self.target.upsert(key, svc)
        return self.target.revision

    def _touches(self, svc: Service) -> bool:
        """Whether a policy may redirect the service, or be kept off an
        address by one of its frontends."""
        name = _service_name(svc.name)[0]
        fronts = {(fe.address, fe.port, fe.protocol) for fe in svc.frontends}
        for r in self.redirects.values():
            if r.service and f"{r.namespace}/{r.service}" == name:
                return True
            if r.address and any(
                (r.address, p.port, p.protocol) in fronts for p in r.frontend_ports
            ):
                return True
        return False

    # --- policies and local endpoints ---

    def replace_lrps(self, items: dict[str, Redirect]) -> int:
        self.redirects = dict(items)
        self._recompute()
        return self.target.revision

    def set_lrp(self, key: str, redirect: Redirect | None) -> int:
        if redirect is None:
            self.redirects.pop(key, None)
        else:
            self.redirects[key] = redirect
        self._recompute()
        return self.target.revision

    def set_endpoints(self, endpoints: Iterable[LocalEndpoint]) -> None:
        endpoints = tuple(endpoints)
        if endpoints != self.endpoints:
            self.endpoints = endpoints
            self._recompute()

    # --- what they desire ---

    @staticmethod
    def _new_id(used: Iterable[int]) -> int:
        """The lowest local id not in used."""
        taken = set(used)
        for n in range(LOCAL_ID_BASE + 1, LOCAL_ID_MAX + 1):
            if n not in taken:
                return n
        raise OverflowError("no local id left")

    def _backends(self, r: Redirect, family: int, port: Port) -> list[Backend]:
        out = []
        for ep in self.endpoints:
            if not r.selects(ep.labels):
                continue
            for ip in ep.addresses:
                if ipaddress.ip_address(ip).version != family:
                    continue
                k = (ip, port.port, port.protocol)
                bid = self._local_backends.get(k)
                if bid is None:
                    # Not one released and still in the maps (its removal
                    # would take this one).
                    used = [*self._local_backends.values(), *self.released]
                    bid = self._local_backends[k] = self._new_id(used)
                out.append(Backend(bid, ip, port.port, port.protocol, 1, local=True))
        return sorted(out, key=lambda b: b.id)

    def _compute(self) -> set[int]:
        """What the redirects desire now into self.pushed; returns the keys
        whose desired service changed."""
        want: dict[int, Service] = {}
        used_services: set[tuple[str, int]] = set()
        claimed: dict[int, set[FrontendKey]] = {}
        blocked: set[tuple[str, FrontendKey]] = set()
        for key in sorted(self.redirects):
            r = self.redirects[key]
            if r.address:
                family = ipaddress.ip_address(r.address).version
                for fp in r.frontend_ports:
                    bp = backend_port(fp, r.backend_ports)
                    fe_key = (r.address, fp.port, fp.protocol)
                    if fe_key in self._frontends:
                        blocked.add((key, fe_key))
                        continue
                    if bp is None:
                        continue
                    backends = self._backends(r, family, bp)
                    if not backends:
                        continue  # as Cilium: the address as it is
                    if any(fe_key in taken for taken in claimed.values()):
                        continue  # another policy has it (the first by name wins)
                    sk = (key, fp.port << 8 | fp.protocol)
                    used_services.add(sk)
                    sid = self._local_services.get(sk)
                    if sid is None:
                        sid = self._local_services[sk] = self._new_id(self._local_services.values())
                    claimed[sid] = {fe_key}
                    want[sid] = Service(
                        service_id=sid,
                        frontends=(Frontend(r.address, fp.port, fp.protocol, sid),),
                        backends=tuple(backends),
                        name=f"lrp:{key}",
                    )
                continue
            for sid in sorted(self._by_name.get(f"{r.namespace}/{r.service}", ())):
                svc = self.base[sid]
                if sid in want or not svc.frontends:
                    continue
                fe = svc.frontends[0]
                port_name = _service_name(svc.name)[1]
                fp = Port(port_name, fe.port, fe.protocol)
                if r.frontend_ports:
                    chosen = [
                        p
                        for p in r.frontend_ports
                        if (p.name and p.name == port_name)
                        or (p.port, p.protocol) == (fe.port, fe.protocol)
                    ]
                    if not chosen:
                        continue
                    fp = chosen[0]
                bp = backend_port(fp, r.backend_ports)
                if bp is None or bp.protocol != fe.protocol:
                    continue
                backends = self._backends(r, ipaddress.ip_address(fe.address).version, bp)
                if backends:  # else as Cilium: the service's own backends
                    want[sid] = replace(
                        svc, backends=tuple(backends), maglev=False, maglev_table=()
                    )
        for lrp, (address, port, _) in sorted(blocked - self._blocked):
            log.warning(
                "address matcher names a service's frontend: not redirected",
                extra={"lrp": lrp, "frontend": f"{address}:{port}"},
            )
        self._blocked = blocked
        for sk in set(self._local_services) - used_services:
            del self._local_services[sk]
        in_use = {b.id for s in want.values() for b in s.backends if b.id >= LOCAL_ID_BASE}
        for k, bid in list(self._local_backends.items()):
            if bid not in in_use:
                del self._local_backends[k]
                self.released.add(bid)
        self.released -= in_use
        changed = {k for k in set(want) | set(self.pushed) if want.get(k) != self.pushed.get(k)}
        self.pushed = want
        if self.released:
            self.changed.set()
        return changed

    def _recompute(self) -> None:
        """_compute(), and the changed keys to the reconciler: an lb service
        no longer redirected goes back to what the lb says."""
        for key in sorted(self._compute()):
            svc = self.pushed.get(key) or self.base.get(key)
            if svc is None:
                self.target.delete(key)
            else:
                self.target.upsert(key, svc)

    # --- the node's side ---

    async def run(
        self,
        endpoints: Callable[[], Iterable[tuple[tuple[str, ...], int]]],
        labels_of: Callable[[int], Awaitable[Mapping[str, str]]],
        remove_backends: Callable[[list[int]], Awaitable[object]],
        endpoints_changed: asyncio.Event,
    ) -> None:
        """Forever: the local endpoints with their labels (labels_of an
        identity, cached: an identity's labels never change) into the
        redirects whenever endpoints_changed is set, and the backends they
        released removed once the maps no longer use them."""
        cache: dict[int, Mapping[str, str]] = {}
        backoff = Backoff(0.2, 5.0)
        endpoints_changed.set()
        if self.released:
            self.changed.set()  # started again after a failed removal
        while True:
            waits = [
                asyncio.ensure_future(endpoints_changed.wait()),
                asyncio.ensure_future(self.changed.wait()),
            ]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            if endpoints_changed.is_set():
                endpoints_changed.clear()
                current = list(endpoints())
                try:
                    for _, identity in current:
                        if identity not in cache:
                            cache[identity] = await labels_of(identity)
                except Exception as exc:  # retried: the policy service may be away
                    log.warning("identity labels not read", extra={"reason": str(exc)})
                    endpoints_changed.set()
                    await asyncio.sleep(backoff.next())
                    continue
                backoff.reset()
                live = {identity for _, identity in current}
                for identity in set(cache) - live:
                    del cache[identity]
                self.set_endpoints(
                    LocalEndpoint(addresses, cache[identity]) for addresses, identity in current
                )
            if self.changed.is_set():
                self.changed.clear()
                gone = sorted(self.released)
                if gone:
                    try:
                        await self.target.wait_until_reconciled(self.target.revision, timeout=10)
                    except TimeoutError:
                        # No redirect uses them: they go even if a service waits.
                        log.warning(
                            "services not applied before removing local backends",
                            extra={"backends": len(gone)},
                        )
                    await remove_backends(gone)
                    # Only now: until removed, no new backend takes their ids.
                    self.released -= set(gone)


class _Target(Generic[K, V]):
    """One table's Target onto LocalRedirects: its snapshot and changes."""

    def __init__(
        self,
        lr: LocalRedirects,
        replace: Callable[[dict[K, V]], int],
        set_one: Callable[[K, V | None], int],
    ) -> None:
        self.lr = lr
        self._replace = replace
        self._set = set_one

    @property
    def revision(self) -> int:
        return self.lr.revision

    def replace_all(self, items: dict[K, V]) -> int:
        return self._replace(items)

    def upsert(self, key: K, value: V) -> int:
        return self._set(key, value)

    def delete(self, key: K) -> int:
        return self._set(key, None)
