"""Logic of the datapath service (no gRPC here): endpoint plumbing, the BPF
maps fed from the control plane through reconcilers, restore after restart,
flow events and status.

Every BPF map operation runs on one dedicated thread (MapWriter): map
writes stay ordered and a burst (a 16k-entry policy) never blocks the event
loop. Desired state per map lives in a Reconciler (flagella.common), fed
from the control plane's streams through typed tables (handlers.py,
routes.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import ipaddress
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry

from flagella.common.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from flagella.common.locks import KeyedLocks
from flagella.common.portnames import NamedPort
from flagella.common.reconcile import Reconciler, ReconcilerStatus
from flagella.common.runtimeconfig import RuntimeOptions
from flagella.common.tasks import TaskGroup
from flagella.datapath import cgroups, namedports, netdev, tunnel
from flagella.datapath.bpf import (
    Datapath,
    MapSizes,
    MapStatus,
    NodeConfig,
    PolicyBudgetExceeded,
)
from flagella.datapath.bpf import Service as BpfService
from flagella.datapath.bpf import layout as L
from flagella.datapath.bpf.layout import CT_SCOPE_EGRESS, CT_SCOPE_SERVICE
from flagella.datapath.bpf.mapevents import MapEvent
from flagella.datapath.bpf.policy import PolicyEntry
from flagella.datapath.bpf.prefilter import runs_prefilter
from flagella.datapath.bpf.prefixpolicy import PrefixRule
from flagella.datapath.bpf.tables import ct_key
from flagella.datapath.config import DatapathConfig
from flagella.datapath.dnsproxy.server import Asker
from flagella.datapath.flows import FlowFilter, FlowHub, FlowRecord
from flagella.datapath.health import NodeHealth
from flagella.datapath.ipcache import IPCacheOps, IPCacheView
from flagella.datapath.prefilter import Prefilter
from flagella.datapath.routes import RouteOps
from flagella.datapath.state import EndpointRecord, HostPolicyState, StateDir
from flagella.datapath.telemetry import DatapathMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")


class MapWriter:
    """Runs BPF map operations on one thread, in order."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="bpf-maps")

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class IdentityPolicy:
    """The resolved policy of one identity, as the policy service sent it."""

    identity: int
    revision: int
    ingress_enforced: bool
    egress_enforced: bool
    entries: tuple[PolicyEntry, ...]
    # Entries name ports (resolved per endpoint); the peers of named egress
    # entries (whose endpoints' ports they resolve against; 0: any).
    named: bool = False
    named_egress: frozenset[int] = frozenset()
    # Kubernetes ipBlocks over peer addresses.
    prefixes: tuple[PrefixRule, ...] = ()
    # When the policy service committed this revision (Unix time; 0: not
    # a live change): the start of its implementation delay.
    revision_time: float = dataclasses.field(default=0.0, compare=False)
    # The policy service sent it fail-closed (over its own budget): why.
    error: str = ""
    # The rules enforcing each direction (what AUDIT and policy drops name).
    ingress_rules: tuple[str, ...] = ()
    egress_rules: tuple[str, ...] = ()
    # Policy audit mode for the endpoint (runtime configuration; set per
    # endpoint by DatapathService._for_endpoint, never by the stream).
    audit: bool = False

    # Egress toFQDNs select it: its DNS goes through the node's DNS proxy.
    dns_proxy: bool = False
    # rules.dns: the names it may look up there (empty: any).
    dns_rules: tuple[str, ...] = ()


# The drop reasons of a policy verdict.
_POLICY_DROPS = frozenset(
    {L.DropReason.POLICY_L3, L.DropReason.POLICY_L4, L.DropReason.POLICY_DENY}
)


def _with_runtime(pol: IdentityPolicy, opts: RuntimeOptions) -> IdentityPolicy:
    """The policy as the runtime configuration enforces it. always: both
    directions enforced, without the allow-all a direction no rule selects
    gets (deny all there); never: nothing enforced. Audit never on a
    policy the policy service sent fail-closed."""
    if opts.enforcement == "never":
        pol = dataclasses.replace(pol, ingress_enforced=False, egress_enforced=False)
    elif opts.enforcement == "always":
        enforced = {
            L.Direction.INGRESS: pol.ingress_enforced,
            L.Direction.EGRESS: pol.egress_enforced,
        }
        open_dirs = {d for d, on in enforced.items() if not on}
        if open_dirs:
            pol = dataclasses.replace(
                pol,
                ingress_enforced=True,
                egress_enforced=True,
                entries=tuple(e for e in pol.entries if e.direction not in open_dirs),
            )
    if opts.audit and not pol.error:
        pol = dataclasses.replace(pol, audit=True)
    return pol


@dataclass(frozen=True)
class PolicyMapState:
    """What an endpoint's policy occupies in the policy map, and why it is
    locked down (overflow; empty: its full policy is enforced)."""

    entries: int
    desired: int
    overflow: str = ""


@dataclass(frozen=True)
class DecodedMapEvent:
    """A map event with its key and value decoded as DumpMap decodes them."""

    event: MapEvent
    key: dict[str, str]
    value: dict[str, str]


@dataclass(frozen=True)
class SetupRequest:
    endpoint_id: int
    container_id: str
    netns_path: str
    ifname: str
    addresses: tuple[str, ...]
    mtu: int
    identity: int
    pod_cidrs: tuple[str, ...] = ()
    named_ports: tuple[NamedPort, ...] = ()
    # Per-endpoint runtime options (option -> value).
    options: tuple[tuple[str, str], ...] = ()


# --- reconciler operations on the BPF maps ---


class PolicyOps:
    """key: endpoint id; value: the policy of its identity."""

    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc

    async def update(self, key: int, value: IdentityPolicy) -> None:
        dp = self.svc.bpf
        telemetry = self.svc.telemetry
        dns_proxy = value.dns_proxy and bool(self.svc.config.dns_proxy_port)
        record = self.svc.endpoints.get(key)
        if dns_proxy and record is not None:
            # The filter first: the flag makes from_container pass DNS on to it.
            await self.svc.writer.run(dp.attach_proxy, record.host_ifindex)
        try:
            with telemetry.regenerating("policy"):
                entries = await self.svc.writer.run(
                    dp.policy.apply,
                    key,
                    value.entries,
                    value.revision,
                    ingress_enforced=value.ingress_enforced,
                    egress_enforced=value.egress_enforced,
                    prefixes=value.prefixes,
                    audit=value.audit,
                    dns_proxy=dns_proxy,
                )
            state = PolicyMapState(entries, entries, value.error)
        except PolicyBudgetExceeded as exc:
            # Nothing of it was written. Neither a part of it nor the
            # previous policy (which may allow what a new deny forbids):
            # deny all until the policy fits again, as the policy service
            # does at its own budget (docs/policy.md, policy-map budget).
            await self.svc.writer.run(dp.policy.lockdown, key, value.revision)
            state = PolicyMapState(0, exc.needed, f"{exc}: locked down (deny all)")
        if not dns_proxy and record is not None and key in self.svc.dns_proxied:
            # After the flag is cleared (a stale filter passes nothing on).
            await self.svc.writer.run(dp.detach_proxy, record.host_ifindex)
        if dns_proxy:
            self.svc.dns_proxied.add(key)
        else:
            self.svc.dns_proxied.discard(key)
        self.svc.policy_map_state(key, state)
        if value.revision_time and not state.overflow:
            telemetry.policy_implemented(value.revision_time)
        await self.svc.policy_realized(key, value.revision)

    async def delete(self, key: int) -> None:
        await self.svc.writer.run(self.svc.bpf.policy.clear_endpoint, key)
        self.svc.policy_maps.pop(key, None)
        self.svc.dns_proxied.discard(key)

    async def list_actual(self) -> Iterable[int]:
        states = await self.svc.writer.run(self.svc.bpf.endpoints.all)
        return {s.endpoint_id for s in states if s.policy_ready}


class ServiceOps:
    """key: service id; value: what the maps need of the service."""

    def __init__(self, svc: DatapathService) -> None:
        self.svc = svc
        self.applied: dict[int, BpfService] = {}

    async def update(self, key: int, value: BpfService) -> None:
        await self.svc.writer.run(self.svc.bpf.upsert_service, value)
        self.applied[key] = value

    async def delete(self, key: int) -> None:
        old = self.applied.pop(key, None)
        rev_nat_ids = [fe.rev_nat_id for fe in old.frontends] if old else []
        await self.svc.writer.run(self.svc.bpf.delete_service, key, rev_nat_ids)

    async def apply_batch(
        self, changes: Sequence[tuple[int, BpfService | None]]
    ) -> Sequence[BaseException | None]:
        """Every change of a reconciler pass in one trip to the map thread
        (Datapath.apply_services: backends and rev-NAT entries of all in a
        few batch syscalls). A deleted service's rev-NAT ids are removed
        unless a service written in the same batch uses them (ids freed and
        taken again between two passes)."""
        written = {fe.rev_nat_id for _, svc in changes if svc is not None for fe in svc.frontends}
        work: list[tuple[int, BpfService | None, list[int]]] = []
        for key, svc in changes:
            if svc is None:
                old = self.applied.get(key)
                gone = [fe.rev_nat_id for fe in old.frontends] if old else []
                work.append((key, None, [r for r in gone if r not in written]))
            else:
                work.append((key, svc, []))
        outcomes = await self.svc.writer.run(self.svc.bpf.apply_services, work)
        for (key, svc, _), outcome in zip(work, outcomes, strict=True):
            if outcome is not None:
                continue
            if svc is None:
                self.applied.pop(key, None)
            else:
                self.applied[key] = svc
        return outcomes

    async def list_actual(self) -> Iterable[int]:
        def service_ids() -> set[int]:
            # A prune follows a full sync: read the map itself, not the index.
            self.svc.bpf.services.reindex()
            return self.svc.bpf.services.service_ids()

        return await self.svc.writer.run(service_ids)


class DatapathService:
    def __init__(self, config: DatapathConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.telemetry = DatapathMetrics(registry or CollectorRegistry())
        self.writer = MapWriter()
        self.state = StateDir(config.state_dir)
        self.flows = FlowHub(config.flow_buffer_capacity)
        self._bpf: Datapath | None = None
        self.endpoints: dict[int, EndpointRecord] = {}
        # Set whenever an endpoint comes, goes or changes identity (local
        # redirect policies pick their backends among them: lrp.py).
        self.endpoints_changed = asyncio.Event()
        self.identity_policies: dict[int, IdentityPolicy] = {}
        # Named ports of every endpoint of the cluster, by identity (from the
        # ipcache): what egress entries naming a port resolve against.
        self.peer_ports = namedports.PeerPorts(self._peer_ports_changed)
        self.realized: dict[int, int] = {}
        # Per endpoint: its policy-map use and lockdown (PolicyOps).
        self.policy_maps: dict[int, PolicyMapState] = {}
        # Revision of the last SYNCED of this node's policy stream.
        self.policy_synced_revision = 0
        self._realized_changed = asyncio.Condition()
        # Each stream's last revision in the maps (stream_applied).
        self.applied: dict[str, int] = {}
        # Endpoints whose veth has the to_proxy filter (their DNS goes to
        # the DNS proxy).
        self.dns_proxied: set[int] = set()
        self.ipcache = Reconciler("ipcache", IPCacheOps(self))
        # The policy's ipcache and the node registry, merged into the map.
        self.ipcache_view = IPCacheView(self.ipcache, config.node_name, tunnel=config.tunnel)
        self.policy = Reconciler("policy", PolicyOps(self))
        self.service_ops = ServiceOps(self)
        self.services = Reconciler("services", self.service_ops)
        self.routes = Reconciler("routes", RouteOps())
        self.pod_cidrs: list[str] = []
        self.streams_synced: dict[str, bool] = {}
        # The runtime configuration in force (the policy service's
        # WatchConfig; the defaults until it answers).
        self.runtime = RuntimeOptions()
        # The host firewall's state (flagella.datapath.hostfw keeps it).
        self.host_policy = HostPolicyState()
        self._locks = KeyedLocks()
        self._reader: Any = None
        self.uplink_ifindex = 0
        self.tunnel_ifindex = 0
        self.prefilter = Prefilter(config.state_dir, self.writer.run)
        # Tunnel mode: pods' MTU leaves room for the encapsulation.
        self.pod_mtu = 65535
        self.health = NodeHealth(
            config.node_name,
            lambda: self.ipcache_view.nodes,
            port=config.health_port,
            interval=config.health_interval_seconds,
        )

    @property
    def loaded(self) -> Datapath | None:
        """The datapath once start() loaded it (None before)."""
        return self._bpf

    @property
    def bpf(self) -> Datapath:
        if self._bpf is None:
            raise Unavailable("the BPF datapath is not loaded yet")
        return self._bpf

    def reconcilers(self) -> list[Reconciler[Any, Any]]:
        return [self.ipcache, self.policy, self.services, self.routes]

    # --- start-up and restore ---

    async def start(
        self,
        tasks: TaskGroup,
        phase: Callable[[str], contextlib.AbstractContextManager[None]],
    ) -> None:
        """Load the programs and pinned maps, restore the endpoints this node
        had, reattach, then start the reconcilers in tasks (the runtime's,
        which stops them). Before SERVING. phase times the start-up phases
        `maps` (open or create and pin the maps, compile or take the cached
        programs and load them) and `restore` (Runtime.phase)."""
        cfg = self.config
        if cfg.enable_ip_forward:
            await netdev.write_sysctls(
                None,
                {"net.ipv4.ip_forward": "1", "net.ipv6.conf.all.forwarding": "1"},
                cfg.proc_sys,
            )
        with phase("maps"):
            self._bpf = await self.writer.run(
                functools.partial(
                    Datapath.load,
                    cfg.bpf_root,
                    program_cache=cfg.bpf_cache_dir,
                    sizes=MapSizes(policy_per_endpoint=cfg.policy_map_max_entries),
                    map_event_history=cfg.map_event_history,
                )
            )
        log.info(
            "BPF datapath loaded",
            extra={"folder": str(self.bpf.folder), "restored": not self.bpf.created},
        )
        await self._setup_routing_mode()
        await self._write_node_config()
        if cfg.uplink:
            links = await netdev.links([cfg.uplink])
            if cfg.uplink not in links:
                raise FailedPrecondition(f"uplink {cfg.uplink} not found", field="uplink")
            self.uplink_ifindex = links[cfg.uplink]
            await self.writer.run(self.bpf.attach_netdev, self.uplink_ifindex)
        await self._start_prefilter()
        with phase("restore"):
            await self._restore()
        for rec in self.reconcilers():
            rec.start(tasks)
        if cfg.health_port:
            tasks.supervise("health-listener", self.health.serve)
            tasks.supervise("health-probes", self.health.run)
        self._start_events()

    async def _start_prefilter(self) -> None:
        """The saved prefilter list into its maps, its program on each
        prefilter device (--prefilter-devices, else the uplink)."""
        names = self.config.prefilter_device_names
        found = await netdev.links(names)
        for name in names:
            if name not in found:
                raise FailedPrecondition(
                    f"prefilter device {name} not found", field="prefilter_devices"
                )
        bpf = self.bpf

        async def detach(name: str) -> None:
            ifindex = (await netdev.links([name])).get(name)
            if ifindex is not None and await self.writer.run(runs_prefilter, ifindex):
                log.info("XDP prefilter taken off a device", extra={"device": name})
                await self.writer.run(bpf.detach_prefilter, ifindex)

        await self.prefilter.start(
            bpf.prefilter, bpf.attach_prefilter, bpf.prefilter_attached, found, detach
        )

    async def _setup_routing_mode(self) -> None:
        """Tunnel mode: the VXLAN device with its programs, an MTU below the
        uplink's by the encapsulation. Native: no tunnel device."""
        cfg = self.config
        if not cfg.tunnel:
            if await tunnel.remove_tunnel():
                log.info("tunnel device removed (native routing)")
            return
        uplink_mtu = (await netdev.link_mtu(cfg.uplink) if cfg.uplink else None) or 1500
        mtu = uplink_mtu - tunnel.VXLAN_OVERHEAD
        self.tunnel_ifindex = await tunnel.ensure_tunnel(cfg.tunnel_port, mtu, cfg.proc_sys)
        await self.writer.run(self.bpf.attach_tunnel, self.tunnel_ifindex)
        self.pod_mtu = mtu
        log.info("tunnel mode", extra={"device": tunnel.TUNNEL_DEVICE, "mtu": mtu})

    async def _write_node_config(self) -> None:
        ips = [ipaddress.ip_address(ip) for ip in self.config.node_ip]
        v4 = next((str(ip) for ip in ips if ip.version == 4), "")
        v6 = next((str(ip) for ip in ips if ip.version == 6), "")
        # The host policy pinned with the maps stays enforced across a
        # restart until the policy service says otherwise.
        current = await self.writer.run(self.bpf.config.read)
        await self.writer.run(
            self.bpf.config.write,
            NodeConfig(
                node_ip4=v4,
                node_ip6=v6,
                masquerade4=self.config.masquerade and bool(v4),
                masquerade6=self.config.masquerade and bool(v6),
                verdict_events=self._verdict_events() != "none",
                verdict_enforced_only=self._verdict_events() == "enforced",
                tunnel_ifindex=self.tunnel_ifindex,
                tunnel_port=self.config.tunnel_port if self.tunnel_ifindex else 0,
                host_policy=current.host_policy,
                host_ingress=current.host_ingress,
                host_egress=current.host_egress,
                dns_proxy_port=self.config.dns_proxy_port,
            ),
        )

    def _verdict_events(self) -> str:
        return self.runtime.verdict_events or self.config.verdict_events

    async def apply_runtime(self, opts: RuntimeOptions) -> None:
        """A new runtime configuration, applied live: the verdict events in
        the node config, the log level, and (enforcement or audit changed)
        every endpoint's policy written again, with a new generation, so
        established connections are judged again at once."""
        before, self.runtime = self.runtime, opts
        if opts == before:
            return
        log.info("runtime configuration", extra={"options": dataclasses.asdict(opts)})
        logging.getLogger("flagella").setLevel(logging.DEBUG if opts.debug else logging.NOTSET)
        if opts.verdict_events != before.verdict_events:
            level = self._verdict_events()

            def set_events() -> None:
                config = self.bpf.config
                config.write(
                    dataclasses.replace(
                        config.read(),
                        verdict_events=level != "none",
                        verdict_enforced_only=level == "enforced",
                    )
                )

            await self.writer.run(set_events)
        if (opts.enforcement, opts.audit) != (before.enforcement, before.audit):
            self.resync_policies(self.identity_policies)

    async def _restore(self) -> None:
        """Endpoints from the state folder: those whose host veth still
        exists keep everything (maps were pinned) and get the programs of
        this process attached; the others (pod gone while we were down) are
        removed. Map entries and veths with no record are removed too."""
        records = {r.endpoint_id: r for r in self.state.load_all()}
        links = await netdev.host_links()
        for rec in records.values():
            if links.get(rec.host_ifname) == rec.host_ifindex:
                if not await self.writer.run(self.bpf.endpoints.by_id, rec.endpoint_id):
                    # New maps (a new layout version): the endpoint is written
                    # again from its record, not ready until its policy is
                    # applied again (fail closed).
                    log.info("endpoint rewritten", extra={"endpoint": rec.endpoint_id})
                    await self.writer.run(
                        self.bpf.endpoints.upsert,
                        rec.endpoint_id,
                        rec.addresses,
                        ifindex=rec.host_ifindex,
                        identity=rec.identity,
                        mac=rec.mac,
                        node_mac=rec.host_mac,
                    )
                await self.writer.run(self.bpf.attach, rec.host_ifindex)
                self.endpoints[rec.endpoint_id] = rec
                revision = await self.writer.run(
                    self.bpf.endpoints.realized_revision, rec.endpoint_id
                )
                if revision is not None:
                    self.realized[rec.endpoint_id] = revision
            else:
                log.info("endpoint gone while down", extra={"endpoint": rec.endpoint_id})
                await self._forget(rec)
        in_maps = {s.endpoint_id for s in await self.writer.run(self.bpf.endpoints.all)}
        for stray in in_maps - set(self.endpoints):
            await self.writer.run(self.bpf.remove_endpoint, stray)
        owned = {rec.host_ifname for rec in self.endpoints.values()}
        for name in set(links) - owned:
            log.info("removing a veth with no endpoint", extra={"link": name})
            await netdev.delete_link(name)
        log.info("endpoints restored", extra={"endpoints": sorted(self.endpoints)})
        self.endpoints_changed.set()
        # Every hook now runs this layout's programs: the maps of other
        # layout versions (an older datapath's) are no longer used.
        for folder in Datapath.stale_layouts(self.config.bpf_root):
            log.info("removing the pinned maps of another layout", extra={"folder": str(folder)})
            await self.writer.run(shutil.rmtree, folder, True)

    async def _forget(self, rec: EndpointRecord) -> None:
        self.endpoints_changed.set()
        await self.writer.run(self.bpf.remove_endpoint, rec.endpoint_id)
        await self.writer.run(self._purge_conntrack, rec.addresses)
        self.state.remove(rec.endpoint_id)
        self.realized.pop(rec.endpoint_id, None)
        self.policy_maps.pop(rec.endpoint_id, None)

    def _purge_conntrack(self, addresses: Iterable[str]) -> int:
        """Conntrack entries to or from the endpoint's addresses (runs on
        the map thread)."""
        ips = {a.split("/")[0] for a in addresses}
        ct = self.bpf.conntrack
        doomed = [
            ct_key(t, scope)
            for t, scope, _ in ct.entries()
            if (t.src in ips or t.dst in ips) and scope != CT_SCOPE_SERVICE
        ] + [ct_key(t, scope) for t, scope, e in ct.entries(CT_SCOPE_SERVICE) if t.src in ips]
        return ct.delete_many(doomed)

    async def stop(self) -> None:
        """After the runtime's tasks (the reconcilers among them) stopped."""
        if self._reader is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._reader.fileno())
            self._reader.close()
            self._reader = None
        if self._bpf is not None:
            # Maps stay pinned and programs attached: traffic goes on.
            await self.writer.run(self._bpf.close)
        self.writer.close()

    # --- flows ---

    def _start_events(self) -> None:
        self._reader = self.bpf.events()
        loop = asyncio.get_running_loop()

        def readable() -> None:
            for ev in self._reader.read():
                self.flows.publish(
                    FlowRecord(
                        time=ev.time_ns / 1e9,
                        type=int(ev.type),
                        verdict=int(ev.verdict),
                        drop_reason=ev.drop_reason,
                        direction=int(ev.direction),
                        src_ip=ev.src_ip,
                        dst_ip=ev.dst_ip,
                        src_port=ev.src_port,
                        dst_port=ev.dst_port,
                        protocol=ev.protocol,
                        src_identity=ev.src_identity,
                        dst_identity=ev.dst_identity,
                        endpoint_id=ev.endpoint_id,
                        ifindex=ev.ifindex,
                        tcp_flags=ev.tcp_flags,
                        icmp_type=ev.icmp_type,
                        denied_by=self._denied_by(ev),
                    )
                )

        loop.add_reader(self._reader.fileno(), readable)

    def _denied_by(self, ev: Any) -> tuple[str, ...]:
        """The rules enforcing the endpoint's policy in an AUDIT or policy
        drop event's direction (none for others, and for the host's)."""
        if ev.verdict != L.FlowVerdict.AUDIT and ev.drop_reason not in _POLICY_DROPS:
            return ()
        record = self.endpoints.get(ev.endpoint_id)
        pol = self.identity_policies.get(record.identity) if record is not None else None
        if pol is None:
            return ()
        return pol.ingress_rules if ev.direction == L.Direction.INGRESS else pol.egress_rules

    def observe(self, flt: FlowFilter, last: int, follow: bool) -> tuple[list[FlowRecord], Any]:
        """Buffered flows first, then (follow) a live iterator."""
        return self.flows.recent(flt, last), (self.flows.follow(flt) if follow else None)

    async def prune_vanished(self) -> list[int]:
        """Endpoints whose host veth is gone (their netns was deleted, which
        destroys the pair): forget them, maps and conntrack included. The
        endpoint service's sweep then releases their IPs and identity."""
        links = await netdev.host_links()
        gone = [
            rec
            for rec in list(self.endpoints.values())
            if links.get(rec.host_ifname) != rec.host_ifindex
        ]
        for rec in gone:
            async with self._lock(rec.endpoint_id):
                if self.endpoints.get(rec.endpoint_id) is not rec:
                    continue
                log.info("endpoint's veth vanished", extra={"endpoint": rec.endpoint_id})
                self.endpoints.pop(rec.endpoint_id, None)
                self.policy.delete(rec.endpoint_id)
                await self._forget(rec)
        return [rec.endpoint_id for rec in gone]

    async def gc_once(self) -> tuple[int, int]:
        start = time.perf_counter()
        try:
            stats = await self.writer.run(self.bpf.gc)
        except BaseException:
            self.telemetry.gc_failed(time.perf_counter() - start)
            raise
        self.telemetry.gc_done(time.perf_counter() - start, stats.ct_alive, stats.ct_deleted)
        return stats.conntrack, stats.nat

    # --- endpoints ---

    def _lock(self, endpoint_id: int) -> contextlib.AbstractAsyncContextManager[None]:
        return self._locks(endpoint_id)

    async def setup_endpoint(self, req: SetupRequest) -> tuple[netdev.VethResult, EndpointRecord]:
        if req.mtu > self.pod_mtu:
            req = dataclasses.replace(req, mtu=self.pod_mtu)
        if not os.path.exists(req.netns_path):
            raise NotFound(f"netns {req.netns_path} does not exist", field="netns_path")
        async with self._regenerating(req.endpoint_id):
            existing = self.endpoints.get(req.endpoint_id)
            if existing is not None and (
                existing.container_id != req.container_id or existing.ifname != req.ifname
            ):
                raise FailedPrecondition(
                    f"endpoint {req.endpoint_id} belongs to {existing.container_id}/"
                    f"{existing.ifname}",
                    field="endpoint_id",
                )
            host_name = netdev.host_ifname(req.endpoint_id)
            # The record first: a crash from here on leaves something that
            # restore can match against the kernel and clean up.
            record = EndpointRecord(
                endpoint_id=req.endpoint_id,
                container_id=req.container_id,
                netns_path=req.netns_path,
                ifname=req.ifname,
                host_ifname=host_name,
                host_ifindex=existing.host_ifindex if existing else 0,
                host_mac=existing.host_mac if existing else "",
                mac=existing.mac if existing else "",
                addresses=list(req.addresses),
                identity=req.identity,
                mtu=req.mtu,
                pod_cidrs=list(req.pod_cidrs),
                named_ports=sorted(req.named_ports),
                options=dict(req.options),
            )
            # Durable (fsync) before going on; in a thread, so that other
            # endpoints' calls are not held up meanwhile.
            await asyncio.to_thread(self.state.save, record)
            try:
                with self.telemetry.regenerating("veth"):
                    result = await netdev.setup_veth(
                        netdev.VethSpec(
                            req.endpoint_id,
                            req.netns_path,
                            req.ifname,
                            req.addresses,
                            req.mtu,
                            self.config.proc_sys,
                        )
                    )
            except netdev.NetdevError as exc:
                if existing is None:
                    self.state.remove(req.endpoint_id)
                raise FailedPrecondition(str(exc)) from exc
            record.host_ifindex = result.host.ifindex
            record.host_mac = result.host.mac
            record.mac = result.container.mac
            await asyncio.to_thread(self.state.save, record)
            with self.telemetry.regenerating("maps"):
                await self.writer.run(
                    self.bpf.endpoints.upsert,
                    req.endpoint_id,
                    list(result.addresses),
                    ifindex=result.host.ifindex,
                    identity=req.identity,
                    mac=result.container.mac,
                    node_mac=result.host.mac,
                )
            with self.telemetry.regenerating("attach"):
                await self.writer.run(self.bpf.attach, result.host.ifindex)
            self.endpoints[req.endpoint_id] = record
            self._want_policy(record)
            self.endpoints_changed.set()
            return result, record

    @contextlib.asynccontextmanager
    async def _regenerating(self, endpoint_id: int) -> AsyncIterator[None]:
        """The endpoint's lock, its wait and the whole ADD timed."""
        telemetry = self.telemetry
        with telemetry.regenerating("total"):
            waiting = time.perf_counter()
            async with self._lock(endpoint_id):
                telemetry.regeneration.labels("lock").observe(time.perf_counter() - waiting)
                yield

    def _want_policy(self, record: EndpointRecord) -> None:
        """Desire the policy of the endpoint's identity; until it arrives the
        endpoint stays not ready (its traffic is dropped)."""
        pol = self.identity_policies.get(record.identity)
        if pol is not None:
            self.policy.upsert(record.endpoint_id, self._for_endpoint(record, pol))

    def _for_endpoint(
        self, record: EndpointRecord, pol: IdentityPolicy, *, live: bool = False
    ) -> IdentityPolicy:
        """The identity's policy as this endpoint's map holds it: named
        ports resolved (flagella.datapath.namedports). Its revision time
        only when live (the stream's change reaching an endpoint that has
        it; not a new endpoint, a resync or a port change)."""
        if not live and pol.revision_time:
            pol = dataclasses.replace(pol, revision_time=0.0)
        pol = _with_runtime(pol, self.runtime.for_endpoint(record.options))
        if not pol.named:
            return pol
        entries = namedports.resolve(pol.entries, record.named_ports, self.peer_ports)
        return dataclasses.replace(pol, entries=entries)

    def _peer_ports_changed(self, identities: set[int]) -> None:
        """Endpoints of other identities changed the numbers of their named
        ports: the endpoints whose egress names a port of one of them."""
        for record in self.endpoints.values():
            pol = self.identity_policies.get(record.identity)
            if pol is None or not pol.named_egress:
                continue
            if 0 in pol.named_egress or pol.named_egress & identities:
                self.policy.upsert(record.endpoint_id, self._for_endpoint(record, pol))

    async def update_named_ports(
        self, endpoint_id: int, named_ports: list[NamedPort]
    ) -> EndpointRecord:
        """The pod's named ports changed: its ingress entries naming a port
        are written again (others' egress follows the ipcache)."""
        async with self._lock(endpoint_id):
            record = self.endpoints.get(endpoint_id)
            if record is None:
                raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")
            want = sorted(named_ports)
            if record.named_ports != want:
                record.named_ports = want
                await asyncio.to_thread(self.state.save, record)
                self._want_policy(record)
            return record

    async def update_options(self, endpoint_id: int, options: dict[str, str]) -> EndpointRecord:
        """The endpoint's runtime options changed (its audit mode, its
        enforcement): its policy is written again as they make it."""
        async with self._lock(endpoint_id):
            record = self.endpoints.get(endpoint_id)
            if record is None:
                raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")
            if record.options != options:
                record.options = dict(options)
                await asyncio.to_thread(self.state.save, record)
                self._want_policy(record)
            return record

    async def teardown_endpoint(self, endpoint_id: int, netns_path: str, ifname: str) -> bool:
        async with self._lock(endpoint_id):
            record = self.endpoints.pop(endpoint_id, None)
            rev = self.policy.delete(endpoint_id)
            with contextlib.suppress(TimeoutError):
                await self.policy.wait_until_reconciled(rev, timeout=5)
            removed = await netdev.teardown_veth(
                endpoint_id,
                netns_path or (record.netns_path if record else ""),
                ifname or (record.ifname if record else ""),
            )
            if record is not None:
                await self._forget(record)
            else:
                await self.writer.run(self.bpf.remove_endpoint, endpoint_id)
                self.state.remove(endpoint_id)
            return removed or record is not None

    async def update_identity(self, endpoint_id: int, identity: int) -> EndpointRecord:
        async with self._lock(endpoint_id):
            record = self.endpoints.get(endpoint_id)
            if record is None:
                raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")
            if record.identity == identity:
                return record
            record.identity = identity
            self.endpoints_changed.set()
            self.state.save(record)
            await self.writer.run(
                self.bpf.endpoints.upsert,
                endpoint_id,
                record.addresses,
                ifindex=record.host_ifindex,
                identity=identity,
                mac=record.mac,
                node_mac=record.host_mac,
            )
            pol = self.identity_policies.get(identity)
            if pol is None:
                # The new identity's policy is not known yet: drop rather
                # than enforce the old identity's policy.
                self.policy.delete(endpoint_id)
                self.realized.pop(endpoint_id, None)
                await self.writer.run(self.bpf.endpoints.set_not_ready, endpoint_id)
            else:
                self.policy.upsert(endpoint_id, self._for_endpoint(record, pol))
            return record

    def get_endpoint(self, endpoint_id: int) -> EndpointRecord:
        record = self.endpoints.get(endpoint_id)
        if record is None:
            raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")
        return record

    async def attached(self, record: EndpointRecord) -> bool:
        att = await self.writer.run(self.bpf.attachment, record.host_ifindex)
        return bool(att.current)

    # --- policy ---

    async def policy_realized(self, endpoint_id: int, revision: int) -> None:
        """The endpoint's policy is in the maps. It is the identity's policy
        as of the stream's last SYNCED, so it is realized at that revision
        even when the policy itself was computed earlier."""
        async with self._realized_changed:
            self.realized[endpoint_id] = max(revision, self.policy_synced_revision)
            self._realized_changed.notify_all()

    def policy_map_state(self, endpoint_id: int, state: PolicyMapState) -> None:
        """Record (and log the change of) the endpoint's lockdown."""
        before = self.policy_maps.get(endpoint_id)
        self.policy_maps[endpoint_id] = state
        was = before.overflow if before else ""
        if state.overflow and state.overflow != was:
            log.warning(
                "endpoint locked down: its policy is over the policy-map budget",
                extra={"endpoint": endpoint_id, "reason": state.overflow},
            )
        elif was and not state.overflow:
            log.info("endpoint's full policy applied again", extra={"endpoint": endpoint_id})

    def overflowing(self) -> list[int]:
        """Endpoints locked down by an over-budget policy."""
        return sorted(ep for ep, st in self.policy_maps.items() if st.overflow)

    async def policy_synced(self, revision: int) -> None:
        """The policy stream is complete up to revision: once the maps hold
        what it delivered, every endpoint with a policy is realized there
        (what the endpoint service waits for after taking an identity
        reference at some revision)."""
        self.policy_synced_revision = max(self.policy_synced_revision, revision)
        try:
            await self.policy.wait_until_reconciled(timeout=30)
        except TimeoutError:
            log.warning("policy not fully applied at SYNCED", extra={"revision": revision})
        applied = await self.writer.run(self.bpf.endpoints.all)
        ready = {s.endpoint_id for s in applied if s.policy_ready}
        async with self._realized_changed:
            for endpoint_id in ready & set(self.realized):
                self.realized[endpoint_id] = max(self.realized[endpoint_id], revision)
            self._realized_changed.notify_all()

    async def stream_applied(self, name: str, revision: int) -> None:
        """A stream's batch at revision is in the maps."""
        async with self._realized_changed:
            self.applied[name] = max(self.applied.get(name, 0), revision)
            self._realized_changed.notify_all()

    async def wait_applied(self, endpoint_id: int, revision: int, timeout: float) -> bool:
        """Whether, within timeout, the ipcache and the endpoint's policy
        reached revision (what a DNS answer waits for: the DNS proxy)."""

        def done() -> bool:
            return (
                self.applied.get("ipcache", 0) >= revision
                and self.realized.get(endpoint_id, -1) >= revision
            )

        async def wait() -> None:
            async with self._realized_changed:
                await self._realized_changed.wait_for(done)

        try:
            await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def live_peers(self) -> set[str]:
        """The destinations of this node's live (unexpired) egress
        connections, from the conntrack map."""

        def read() -> set[str]:
            now = time.monotonic_ns()
            return {
                t.dst for t, _, v in self.bpf.conntrack.entries(CT_SCOPE_EGRESS) if v.expires > now
            }

        return await self.writer.run(read)

    def has_identity(self, ip: str) -> bool:
        """The policy's ipcache gives the address an identity of its own."""
        ids = self.ipcache_view.identities
        return f"{ip}/{128 if ':' in ip else 32}" in ids or ip in ids

    def dns_asker(self, ip: str) -> Asker | None:
        """The local endpoint with address ip, as the DNS proxy sees it."""
        for record in self.endpoints.values():
            if any(a.partition("/")[0] == ip for a in record.addresses):
                pol = self.identity_policies.get(record.identity)
                rules = pol.dns_rules if pol is not None else ()
                return Asker(record.endpoint_id, record.identity, rules)
        return None

    async def wait_for_policy(self, endpoint_id: int, min_revision: int, timeout: float) -> int:
        if endpoint_id not in self.endpoints:
            raise NotFound(f"no endpoint {endpoint_id} on this node", field="endpoint_id")

        def done() -> bool:
            return self.realized.get(endpoint_id, -1) >= min_revision

        async def wait() -> int:
            async with self._realized_changed:
                await self._realized_changed.wait_for(done)
                return self.realized[endpoint_id]

        try:
            return await asyncio.wait_for(wait(), timeout)
        except TimeoutError:
            have = self.realized.get(endpoint_id)
            raise DeadlineExceeded(
                f"endpoint {endpoint_id}: policy revision {min_revision} not realized within "
                f"{timeout:g}s (have {'none' if have is None else have})"
            ) from None

    def set_identity_policy(self, pol: IdentityPolicy | None, identity: int) -> None:
        """A resolved policy arrived (or was withdrawn): update the desired
        policy of every local endpoint with that identity."""
        if pol is None:
            self.identity_policies.pop(identity, None)
        else:
            self.identity_policies[identity] = pol
        for record in self.endpoints.values():
            if record.identity != identity:
                continue
            if pol is None:
                self.policy.delete(record.endpoint_id)
            else:
                self.policy.upsert(record.endpoint_id, self._for_endpoint(record, pol, live=True))

    def resync_policies(self, policies: dict[int, IdentityPolicy]) -> None:
        """A full policy snapshot: exactly these, then prune."""
        self.identity_policies = dict(policies)
        self.policy.replace_all(
            {
                rec.endpoint_id: self._for_endpoint(rec, policies[rec.identity])
                for rec in self.endpoints.values()
                if rec.identity in policies
            }
        )

    async def set_node(self, node: Any) -> None:
        """The node registry's view of this node (an ipam.v1.Node)."""
        self.pod_cidrs = list(node.pod_cidrs)

    # --- status ---

    async def map_status(self) -> list[MapStatus]:
        return await self.writer.run(self.bpf.map_status)

    async def _entry_map(self, name: str, what: str) -> MapStatus:
        """The status of pinned map `name`, one with entries (not the
        events ring, which ObserveFlows reads)."""
        statuses = {m.name: m for m in await self.map_status()}
        if name not in statuses:
            raise NotFound(f"no map {name!r}; maps: {', '.join(sorted(statuses))}", field="name")
        if name not in self.bpf.maps:
            raise FailedPrecondition(f"{name!r} is a {statuses[name].type}: {what}", field="name")
        return statuses[name]

    async def dump_map(self, name: str, limit: int) -> tuple[MapStatus, list[Any]]:
        status = await self._entry_map(name, "nothing to dump")
        entries = await self.writer.run(self.bpf.dump, name, limit)
        return status, entries

    async def map_events(self, name: str, follow: bool) -> AsyncIterator[DecodedMapEvent]:
        """The writes kept of map `name`, oldest first, decoded; with follow,
        then every new one as it is made (until the caller stops)."""
        await self._entry_map(name, "no writes of this process to show")
        m = self.bpf.maps[name]
        ring = m.events
        if ring is None:
            raise FailedPrecondition(
                "no map events are kept (--map-event-history is 0)", field="name"
            )
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def woken() -> None:  # on the map-writer thread
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
                loop.call_soon_threadsafe(wake.set)

        stop = self.bpf.map_events.listen(name, woken) if follow else None
        last = 0
        try:
            while True:
                wake.clear()
                for ev in ring.after(last):
                    last = ev.seq
                    key, value = m.decode_raw(ev.key, ev.value)
                    yield DecodedMapEvent(ev, key, value)
                if stop is None:
                    return
                await wake.wait()
        finally:
            if stop is not None:
                stop()

    async def cgroups(self) -> tuple[str, list[cgroups.PodCgroups]]:
        """The cgroup v2 root and each endpoint's cgroups (a /proc walk, on
        a thread of its own: not the map writer's)."""
        pods = [
            cgroups.PodRef(r.endpoint_id, r.container_id, r.netns_path, tuple(r.addresses))
            for r in sorted(self.endpoints.values(), key=lambda r: r.endpoint_id)
        ]
        return await asyncio.to_thread(cgroups.dump, pods)

    def reconciler_status(self) -> list[ReconcilerStatus]:
        return [rec.status() for rec in self.reconcilers()]

    @staticmethod
    def check_endpoint_id(endpoint_id: int) -> None:
        """An id an endpoint can have: positive, short enough to name its veth."""
        if endpoint_id <= 0:
            raise InvalidArgument("must be positive", field="endpoint_id")
        try:
            netdev.host_ifname(endpoint_id)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="endpoint_id") from None

    def check_endpoint_spec(self, req: SetupRequest) -> None:
        """Validation of a SetupEndpoint request (field paths as the proto)."""
        self.check_endpoint_id(req.endpoint_id)
        if not req.container_id:
            raise InvalidArgument("is required", field="container_id")
        if not req.netns_path.startswith("/"):
            raise InvalidArgument(f"{req.netns_path!r} is not an absolute path", field="netns_path")
        if not req.ifname or len(req.ifname) > 15 or "/" in req.ifname or " " in req.ifname:
            raise InvalidArgument(f"{req.ifname!r} is not an interface name", field="ifname")
        if not req.addresses:
            raise InvalidArgument("at least one address is required", field="addresses")
        for i, address in enumerate(req.addresses):
            try:
                ipaddress.ip_interface(address)
            except ValueError:
                raise InvalidArgument(
                    f"{address!r} is not an address", field=f"addresses[{i}]"
                ) from None
        if not 576 <= req.mtu <= 65535:
            raise InvalidArgument(f"{req.mtu} is not in 576..65535", field="mtu")
