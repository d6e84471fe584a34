"""The datapath of one node: pinned maps, loaded programs, attachment."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf import prefilter, progcache, syscall, tc
from flagella.datapath.bpf.compiler import PROGRAM_TYPES, PROGRAMS, Programs
from flagella.datapath.bpf.events import EventReader
from flagella.datapath.bpf.lb import (
    Affinity,
    Backends,
    FrontendWrite,
    Maglev,
    RevNat,
    Service,
    Services,
    SourceRanges,
)
from flagella.datapath.bpf.mapevents import DEFAULT_MAP_EVENT_HISTORY, MapEventLog
from flagella.datapath.bpf.maps import BpfMap
from flagella.datapath.bpf.policy import Policy
from flagella.datapath.bpf.prefixpolicy import PrefixPolicy
from flagella.datapath.bpf.tables import (
    Config,
    Conntrack,
    Endpoints,
    HostSafe,
    IPCache,
    Metrics,
    Nat,
    NodeConfig,
)

DEFAULT_PIN_ROOT = "/sys/fs/bpf/flagella"
# Folders of layout versions (layout_version); others (the prefilter's) are not.
_LAYOUT_FOLDER = re.compile(r"^v\d+-")


class LayoutMismatch(RuntimeError):
    """A pinned map differs from the layout this code expects."""


@dataclass(frozen=True)
class MapStatus:
    """What MapInfo of datapath.proto reports."""

    name: str
    pin_path: str
    type: str
    key_size: int
    value_size: int
    max_entries: int
    entries: int


@dataclass(frozen=True)
class Attachment:
    ifindex: int
    ingress: tc.Filter | None
    egress: tc.Filter | None
    current: bool  # both hooks run the programs this Datapath loaded


@dataclass(frozen=True)
class GcStats:
    """One GC pass: entries deleted (conntrack, nat) and, per family
    ("ipv4"/"ipv6"), the conntrack entries deleted and alive."""

    conntrack: int
    nat: int
    ct_deleted: Mapping[str, int] = field(default_factory=dict)
    ct_alive: Mapping[str, int] = field(default_factory=dict)


# Maps no BPF program writes: the process keeps their keys (exact entries).
TRACKED_MAPS = (
    "endpoints",
    "ipcache",
    "policy",
    "prefix_policy",
    "services",
    "backends",
    "revnat",
    "maglev",
    "srcrange",
    "host_safe",
)
# Maps the BPF programs fill: counted at load and at each GC pass.
COUNTED_MAPS = ("ct", "snat", "affinity", "frags")


def _open_map(folder: Path, spec: L.MapSpec) -> tuple[int, bool]:
    """(fd, created): the pinned map, checked against spec, or a new one."""
    path = str(folder / spec.name)
    for _ in range(3):
        try:
            fd = syscall.obj_get(path)
        except syscall.BpfError as e:
            if e.errno != errno.ENOENT:
                raise
        else:
            info = syscall.map_info(fd)
            want = (spec.map_type, spec.key_size, spec.value_size, spec.max_entries, spec.flags)
            have = (info.type, info.key_size, info.value_size, info.max_entries, info.flags)
            if want != have:
                os.close(fd)
                raise LayoutMismatch(
                    f"pinned map {path}: (type, key, value, max_entries, flags) {have}, "
                    f"expected {want}: use a new pin folder"
                )
            return fd, False
        fd = _create_map(spec)
        try:
            syscall.obj_pin(fd, path)
        except syscall.BpfError as e:
            os.close(fd)
            if e.errno != errno.EEXIST:
                raise
            continue  # another process pinned it first: use theirs
        return fd, True
    raise LayoutMismatch(f"could not open or create {path}")


def _create_map(spec: L.MapSpec) -> int:
    """A new map of spec; a map-in-map gets a template of its inner maps
    (only needed during the creation)."""
    template = -1
    try:
        if spec.inner is not None:
            i = spec.inner
            template = syscall.map_create(
                i.map_type, i.key_size, i.value_size, i.max_entries, flags=i.flags, name=i.name
            )
        return syscall.map_create(
            spec.map_type,
            spec.key_size,
            spec.value_size,
            spec.max_entries,
            flags=spec.flags,
            name=spec.name,
            inner_map_fd=max(template, 0),
        )
    finally:
        if template >= 0:
            os.close(template)


class Datapath:
    """The node's datapath. Build it with Datapath.load(); maps are pinned
    under <pin_root>/<layout version>/ and reused by the next load, so
    state (endpoints, policy, conntrack ...) survives a restart."""

    def __init__(
        self,
        folder: Path,
        sizes: L.MapSizes,
        fds: Mapping[str, int],
        created: bool,
        prog_fds: Mapping[str, int],
        *,
        map_event_history: int = DEFAULT_MAP_EVENT_HISTORY,
    ) -> None:
        self.folder = folder
        self.sizes = sizes
        self.layout_version = folder.name
        self.created = created  # the maps were new (nothing to restore)
        self._fds = dict(fds)
        self._prog_fds = dict(prog_fds)
        specs = {s.name: s for s in L.map_specs(sizes)}

        def pin(name: str) -> str:
            return str(folder / name)

        self.endpoints = Endpoints(specs["endpoints"], fds["endpoints"], pin("endpoints"))
        self.ipcache = IPCache(specs["ipcache"], fds["ipcache"], pin("ipcache"))
        self.prefix_policy = PrefixPolicy(
            specs["prefix_policy"], fds["prefix_policy"], pin("prefix_policy")
        )
        self.policy = Policy(
            specs["policy"],
            fds["policy"],
            pin("policy"),
            self.endpoints,
            sizes.policy_per_endpoint,
            prefixes=self.prefix_policy,
        )
        self.services = Services(specs["services"], fds["services"], pin("services"))
        self.backends = Backends(specs["backends"], fds["backends"], pin("backends"))
        self.revnat = RevNat(specs["revnat"], fds["revnat"], pin("revnat"))
        self.maglev = Maglev(specs["maglev"], fds["maglev"], pin("maglev"))
        self.affinity = Affinity(specs["affinity"], fds["affinity"], pin("affinity"))
        self.srcrange = SourceRanges(specs["srcrange"], fds["srcrange"], pin("srcrange"))
        self.conntrack = Conntrack(specs["ct"], fds["ct"], pin("ct"))
        self.nat = Nat(specs["snat"], fds["snat"], pin("snat"))
        self.config = Config(specs["config"], fds["config"], pin("config"))
        self.host_safe = HostSafe(specs["host_safe"], fds["host_safe"], pin("host_safe"))
        self.metrics = Metrics(specs["metrics"], fds["metrics"], pin("metrics"))
        self.frags: BpfMap[L.FragKey, L.FragValue] = BpfMap(
            specs["frags"], fds["frags"], pin("frags")
        )
        # Outside the layout (its own folder): not in self.maps either.
        self.prefilter = prefilter.PrefilterMaps(folder.parent / prefilter.PIN_FOLDER, fds)
        self.maps: dict[str, BpfMap] = {  # type: ignore[type-arg]
            "endpoints": self.endpoints,
            "ipcache": self.ipcache,
            "policy": self.policy,
            "prefix_policy": self.prefix_policy,
            "services": self.services,
            "backends": self.backends,
            "revnat": self.revnat,
            "maglev": self.maglev,
            "affinity": self.affinity,
            "srcrange": self.srcrange,
            "ct": self.conntrack,
            "snat": self.nat,
            "config": self.config,
            "host_safe": self.host_safe,
            "metrics": self.metrics,
            "frags": self.frags,
        }
        for name in TRACKED_MAPS:
            self.maps[name].track()
        self.count_filled()
        self.map_events = MapEventLog(map_event_history)
        for name, m in self.maps.items():
            m.events = self.map_events.ring(name, m.spec.key_size)

    # --- lifecycle ---

    @classmethod
    def load(
        cls,
        pin_root: str | os.PathLike[str] = DEFAULT_PIN_ROOT,
        *,
        sizes: L.MapSizes | None = None,
        programs: Programs | None = None,
        load_programs: bool = True,
        program_cache: str | None = None,
        map_event_history: int = DEFAULT_MAP_EVENT_HISTORY,
    ) -> Datapath:
        """Opens (or creates and pins) every map under
        <pin_root>/<layout version>/ and loads the programs against them
        (compiling bpf/ first, through the program cache folder if given,
        unless programs is given). A new folder gets
        the default NodeConfig. Each map keeps its last map_event_history
        writes (0: none). Nothing is attached here: call attach()
        for each endpoint (replacing whatever an earlier process attached)."""
        sizes = sizes or L.MapSizes()
        folder = Path(pin_root) / L.layout_version(sizes)
        if not Path(pin_root).exists():
            os.makedirs(pin_root, exist_ok=True)
        folder.mkdir(exist_ok=True)
        fds: dict[str, int] = {}
        created_any = False
        prog_fds: dict[str, int] = {}
        try:
            for spec in L.map_specs(sizes):
                fd, created = _open_map(folder, spec)
                fds[spec.name] = fd
                if spec.name == "config" and created:
                    Config(spec, fd, str(folder / spec.name)).write(NodeConfig())
                created_any = created_any or created
            prefilter_folder = Path(pin_root) / prefilter.PIN_FOLDER
            prefilter_folder.mkdir(exist_ok=True)
            for spec in prefilter.map_specs():
                fds[spec.name] = _open_map(prefilter_folder, spec)[0]
            if load_programs:
                progs = programs or progcache.load_programs(program_cache)
                for name in PROGRAMS:
                    prog_type, flags = PROGRAM_TYPES.get(name, (syscall.PROG_TYPE_SCHED_CLS, 0))
                    prog_fds[name] = syscall.prog_load(
                        name, progs[name].instantiate(fds), prog_type, flags
                    )
        except BaseException:
            for fd in list(fds.values()) + list(prog_fds.values()):
                os.close(fd)
            raise
        return cls(folder, sizes, fds, created_any, prog_fds, map_event_history=map_event_history)

    def close(self) -> None:
        """Closes this process's descriptors. Pinned maps and attached
        programs stay."""
        for fd in list(self._fds.values()) + list(self._prog_fds.values()):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._prog_fds.clear()

    def __enter__(self) -> Datapath:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def unpin(self) -> None:
        """Removes this layout's pin folder (the maps go once no program
        or process holds them). For tests and decommissioning."""
        shutil.rmtree(self.folder, ignore_errors=True)

    @staticmethod
    def stale_layouts(
        pin_root: str | os.PathLike[str], sizes: L.MapSizes | None = None
    ) -> list[Path]:
        """Pin folders of other layout versions under pin_root (remove them
        once every endpoint runs programs of the current layout)."""
        current = L.layout_version(sizes or L.MapSizes())
        root = Path(pin_root)
        if not root.is_dir():
            return []
        return sorted(
            p
            for p in root.iterdir()
            if p.is_dir() and p.name != current and _LAYOUT_FOLDER.match(p.name)
        )

    # --- programs ---

    def prog_fd(self, name: str) -> int:
        return self._prog_fds[name]

    def prog_ids(self) -> dict[str, int]:
        return {name: syscall.prog_id(fd) for name, fd in self._prog_fds.items()}

    def attach(self, ifindex: int) -> None:
        """from_container on the tc ingress and to_container on the tc egress
        of a pod's host-side veth (current netns). Replaces atomically."""
        tc.attach_all(
            ifindex,
            [
                (self._prog_fds["from_container"], "from_container", tc.INGRESS),
                (self._prog_fds["to_container"], "to_container", tc.EGRESS),
            ],
        )

    def attach_proxy(self, ifindex: int) -> None:
        """to_proxy after from_container on a pod veth's ingress: only for
        endpoints whose DNS goes to the DNS proxy (EP_F_DNS_PROXY; attached
        before the flag is set, removed after it is cleared)."""
        tc.attach_all(
            ifindex, [(self._prog_fds["to_proxy"], "to_proxy", tc.INGRESS)], prio=tc.PRIO_PROXY
        )

    def detach_proxy(self, ifindex: int) -> None:
        tc.detach_proxy(ifindex)

    def attach_netdev(self, ifindex: int) -> None:
        """from_netdev / to_netdev on the node's uplink (masquerade)."""
        tc.attach_all(
            ifindex,
            [
                (self._prog_fds["from_netdev"], "from_netdev", tc.INGRESS),
                (self._prog_fds["to_netdev"], "to_netdev", tc.EGRESS),
            ],
        )

    def attach_tunnel(self, ifindex: int) -> None:
        """from_tunnel / to_tunnel on the node's VXLAN device (tunnel mode)."""
        tc.attach_all(
            ifindex,
            [
                (self._prog_fds["from_tunnel"], "from_tunnel", tc.INGRESS),
                (self._prog_fds["to_tunnel"], "to_tunnel", tc.EGRESS),
            ],
        )

    def attach_prefilter(self, ifindex: int) -> str:
        """xdp_prefilter on a node device; returns its XDP mode (native or
        generic)."""
        return prefilter.attach_xdp(ifindex, self._prog_fds[prefilter.PROGRAM])

    def detach_prefilter(self, ifindex: int) -> bool:
        return prefilter.detach_xdp(ifindex)

    def prefilter_attached(self, ifindex: int) -> prefilter.XdpState | None:
        """The device's XDP state when it runs this Datapath's prefilter
        program, else None."""
        state = prefilter.xdp_state(ifindex)
        mine = syscall.prog_id(self._prog_fds[prefilter.PROGRAM]) if self._prog_fds else -1
        return state if state.prog_id == mine else None

    def detach(self, ifindex: int) -> bool:
        """Removes the programs from both hooks (works for attach and
        attach_netdev); False if none was there."""
        return tc.detach(ifindex)

    def attachment(self, ifindex: int) -> Attachment:
        ing = tc.filters(ifindex, tc.INGRESS)
        eg = tc.filters(ifindex, tc.EGRESS)
        ids = set(self.prog_ids().values()) if self._prog_fds else set()
        i = ing[0] if ing else None
        e = eg[0] if eg else None
        current = bool(i and e and i.prog_id in ids and e.prog_id in ids)
        return Attachment(ifindex, i, e, current)

    def test_run(
        self, program: str, packet: bytes, repeat: int = 1, *, ifindex: int = 0
    ) -> syscall.TestRunResult:
        """BPF_PROG_TEST_RUN of one program on a packet (Ethernet frame), on
        the loopback device of the calling thread's netns, or on the device
        ifindex of that netns (a program that consults the FIB)."""
        ctx = syscall.skb_ctx(ifindex=ifindex) if ifindex else None
        return syscall.prog_test_run(self._prog_fds[program], packet, repeat, ctx)

    # --- events ---

    def events(self) -> EventReader:
        """A reader of drop and policy-verdict events (close it when done)."""
        return EventReader(self._fds["events"])

    # --- maps ---

    def count_filled(self) -> None:
        """Entries of the maps the BPF programs fill (a batch count each)."""
        for name in COUNTED_MAPS:
            self.maps[name].stats.entries = self.maps[name].count()

    def entries_in_use(self, name: str) -> int:
        """A map's entries as the writers and the last GC pass counted
        them (arrays: every slot, as the kernel holds them). No walk."""
        m = self.maps.get(name)
        if m is None:
            return 0
        if m.spec.map_type in (syscall.MAP_TYPE_ARRAY, syscall.MAP_TYPE_PERCPU_ARRAY):
            return m.max_entries
        return m.stats.entries or 0

    def map_status(self, entries: bool = True) -> list[MapStatus]:
        out = []
        for spec in L.map_specs(self.sizes):
            n = self.entries_in_use(spec.name) if entries else 0
            out.append(
                MapStatus(
                    spec.name,
                    str(self.folder / spec.name),
                    spec.type_name,
                    spec.key_size,
                    spec.value_size,
                    spec.max_entries,
                    n,
                )
            )
        return out

    def dump(self, name: str, limit: int = 0) -> list[tuple[dict[str, str], dict[str, str]]]:
        """A map's entries decoded to named fields (DumpMap)."""
        if name not in self.maps:
            raise KeyError(f"no map {name!r}; maps: {', '.join(sorted(self.maps))}")
        return self.maps[name].dump(limit)

    # --- composite operations ---

    def remove_endpoint(self, endpoint_id: int) -> int:
        """Deletes the endpoint's addresses and its policy entries."""
        n = self.endpoints.remove(endpoint_id)
        self.policy.clear_endpoint(endpoint_id)
        return n

    def apply_services(
        self, changes: Sequence[tuple[int, Service | None, Sequence[int]]]
    ) -> list[BaseException | None]:
        """Many service changes at once: (service id, the service to write,
        or None to delete it with the given rev-NAT ids). In the order of
        upsert_service, for all together: the backends and rev-NAT entries
        of every written service (batch syscalls), then deletes, Maglev
        tables and source ranges service by service, then the frontends of
        all (every backend slot, then every service entry, in batches), then
        what each service no longer has. One outcome per change: None, or
        the error that change met (the others are still applied); a failed
        batch write is retried service by service so that the error lands
        on the service that has it."""
        upserts = [svc for _, svc, _ in changes if svc is not None]
        try:
            self.backends.upsert_many(b for svc in upserts for b in svc.backends)
            self.revnat.upsert_many(
                (fe.rev_nat_id, fe.address, fe.port) for svc in upserts for fe in svc.frontends
            )
            shared_written = True
        except Exception:
            shared_written = False  # each service writes its own: errors per service
        out: list[BaseException | None] = [None] * len(changes)
        ready: list[tuple[int, Service, list[FrontendWrite]]] = []
        deleted: list[int] = []
        for pos, (service_id, svc, rev_nat_ids) in enumerate(changes):
            try:
                if svc is None:
                    self.delete_service(service_id, rev_nat_ids, purge_affinity=False)
                    deleted.append(service_id)
                else:
                    ready.append((pos, svc, self._prepare_service(svc, shared_written)))
            except Exception as exc:
                out[pos] = exc
        if deleted:
            self.affinity.purge(service_ids=deleted)
        writes = [w for _, _, ws in ready for w in ws]
        distinct = {
            (L.ip_bytes(w.frontend.address), w.frontend.port, w.frontend.protocol) for w in writes
        }
        batched = False
        if len(distinct) == len(writes):  # else: in order, the last write wins
            try:
                self.services.write_frontends(writes)
                batched = True
            except Exception:
                batched = False
        for pos, svc, ws in ready:
            try:
                if not batched:
                    self.services.write_frontends(ws)
                self._finish_service(svc)
            except Exception as exc:
                out[pos] = exc
        return out

    def upsert_service(self, svc: Service) -> None:
        """Writes a service: backends, rev-NAT, Maglev table, source ranges,
        then every frontend (slots before the service entry); frontends of
        the service that are no longer listed are removed."""
        self.services.write_frontends(self._prepare_service(svc, shared_written=False))
        self._finish_service(svc)

    def _prepare_service(self, svc: Service, shared_written: bool) -> list[FrontendWrite]:
        """What comes before a service's frontends (its backends and rev-NAT
        entries unless shared_written, its Maglev table and source ranges);
        returns the frontend writes."""
        flags = 0
        maglev_size = 0
        if svc.maglev:
            if not svc.maglev_table:
                raise ValueError(f"service {svc.service_id}: Maglev without a table")
            flags |= L.SVC_F_MAGLEV
            maglev_size = len(svc.maglev_table)
        if svc.affinity_timeout:
            flags |= L.SVC_F_AFFINITY
        if svc.source_ranges:
            flags |= L.SVC_F_SOURCE_RANGE
        if not shared_written:
            for b in svc.backends:
                self.backends.upsert(b)
            for fe in svc.frontends:
                self.revnat.upsert(fe.rev_nat_id, fe.address, fe.port)
        if svc.maglev:
            # A new table replaces the old one in one outer-map update.
            self.maglev.set_table(svc.service_id, svc.maglev_table)
        self.srcrange.set_ranges(svc.service_id, svc.source_ranges)
        active = [b.id for b in svc.backends if b.state == 1]
        local = [b.id for b in svc.backends if b.state == 1 and b.local]
        return [
            FrontendWrite(
                fe,
                svc.service_id,
                active,
                flags,
                svc.affinity_timeout,
                maglev_size,
                local if fe.local_only else None,
            )
            for fe in svc.frontends
        ]

    def _finish_service(self, svc: Service) -> None:
        """After a service's frontends are written: those it no longer lists
        go, and its Maglev table if it has none now."""
        wanted = {
            (L.bytes_ip(L.ip_bytes(fe.address)), fe.port, fe.protocol) for fe in svc.frontends
        }
        for addr, port, proto in self.services.frontends_of(svc.service_id):
            if (addr, port, proto) not in wanted:
                self.services.remove_frontend(addr, port, proto)
        if not svc.maglev:
            # After the frontends stopped pointing at it.
            self.maglev.remove_table(svc.service_id)

    def delete_service(
        self, service_id: int, rev_nat_ids: Iterable[int] = (), *, purge_affinity: bool = True
    ) -> bool:
        """Removes the service's frontends, Maglev table, source ranges,
        affinity entries (unless purge_affinity is False: the caller purges
        many services' at once) and the given rev-NAT ids (kept by default:
        replies of live connections still need them until they expire).
        Backends are removed with remove_backends() (they may serve other
        services)."""
        fronts = self.services.frontends_of(service_id)
        for addr, port, proto in fronts:
            self.services.remove_frontend(addr, port, proto)
        self.maglev.remove_table(service_id)
        self.srcrange.set_ranges(service_id, ())
        if purge_affinity:
            self.affinity.purge(service_ids=[service_id])
        for rn in rev_nat_ids:
            self.revnat.remove(rn)
        return bool(fronts)

    def remove_backends(self, backend_ids: Iterable[int]) -> int:
        """Deletes backends, their service conntrack entries and affinity
        entries (lb.v1.ServiceEvent.removed_backend_ids)."""
        ids = list(backend_ids)
        targets = []
        for bid in ids:
            v = self.backends.get(L.U32(bid))
            if v is not None:
                targets.append((L.get_addr(v.addr), L.port_host(v.port), v.proto))
            self.backends.remove(bid)
        n = self.conntrack.purge_backends(ids, targets)
        self.affinity.purge(backend_ids=ids)
        return n

    def gc(self, now_ns: int | None = None) -> GcStats:
        """Deletes expired conntrack and masquerade entries; counts what is
        alive in the maps the programs fill (their pressure)."""
        ct = self.conntrack.gc_pass(now_ns)
        nat = self.nat.gc(now_ns)
        self.conntrack.stats.entries = sum(ct.alive.values())
        for m in (self.affinity, self.frags):
            m.stats.entries = m.count()
        return GcStats(sum(ct.deleted.values()), nat, ct.deleted, ct.alive)
